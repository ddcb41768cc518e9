"""Where each conversation's KV lives: the replica that served its latest turn, so that every front sends
the next turn there. In this process, or in Redis when `redis_url` is set (every front on it agrees).
A placement expires `ttl_s` after its latest turn; at most `max_count` are kept (the least recently
placed go). Routing never waits on an outage: a Redis that does not answer is no placement (logged once)."""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from redis.exceptions import RedisError

from kvgate.gateway.redis_state import REDIS_DOWN, connect

MAX_COUNT = 65536
TTL_S = 600.0
PREFIX = "kvgate:place:"
log = logging.getLogger("kvgate.routing")
T = TypeVar("T")


class Placements(Protocol):
    async def where(self, key: str) -> str | None:
        """The replica holding `key`'s conversation; None: none (new, expired or forgotten)."""

    async def place(self, key: str, replica: str) -> None:
        """`key`'s latest turn was served by `replica`."""

    async def live(self, replicas: Sequence[str]) -> dict[str, int]:
        """How many unexpired conversations each replica holds."""

    async def close(self) -> None: ...


class MemoryPlacements:
    def __init__(
        self, max_count: int = MAX_COUNT, ttl_s: float = TTL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_count, self.ttl_s, self.clock = max_count, ttl_s, clock
        self.entries: OrderedDict[str, tuple[str, float]] = OrderedDict()  # key -> (replica, expires), oldest first

    def prune(self) -> None:
        now = self.clock()
        while self.entries and (len(self.entries) > self.max_count or next(iter(self.entries.values()))[1] <= now):
            self.entries.popitem(last=False)

    async def where(self, key: str) -> str | None:
        self.prune()
        found = self.entries.get(key)
        return found[0] if found else None

    async def place(self, key: str, replica: str) -> None:
        self.entries[key] = (replica, self.clock() + self.ttl_s)
        self.entries.move_to_end(key)
        self.prune()

    async def live(self, replicas: Sequence[str]) -> dict[str, int]:
        self.prune()
        held = Counter(replica for replica, _ in self.entries.values())
        return {r: held[r] for r in replicas}

    def __len__(self) -> int:
        return len(self.entries)

    async def close(self) -> None:
        """Nothing to release: the placements live in this process."""


class RedisPlacements:
    """Each placement is a key with its TTL; each replica's conversations are a sorted set by expiry, and
    one sorted set of every placement by expiry bounds their count."""

    def __init__(self, url: str, max_count: int = MAX_COUNT, ttl_s: float = TTL_S, prefix: str = PREFIX) -> None:
        self.max_count, self.ttl_s, self.prefix = max_count, ttl_s, prefix
        self.redis = connect(url)
        self.all = prefix + "all"
        self.failing = False

    def name(self, key: str) -> str:
        return f"{self.prefix}k:{key}"

    def held(self, replica: str) -> str:
        return f"{self.prefix}on:{replica}"

    async def where(self, key: str) -> str | None:
        try:
            found = await self.redis.get(self.name(key))
        except (*REDIS_DOWN, RedisError) as exc:
            return self.failed(exc, None)
        self.failing = False
        return found.decode() if found else None

    async def place(self, key: str, replica: str) -> None:
        expires = time.time() + self.ttl_s
        try:
            pipe = self.redis.pipeline(transaction=False)  # one round trip on every request's way
            pipe.set(self.name(key), replica, ex=max(1, round(self.ttl_s)), get=True)
            pipe.zadd(self.held(replica), {key: expires})
            pipe.zadd(self.all, {key: expires})
            pipe.zcard(self.all)
            before, _, _, count = await pipe.execute()
            if before is not None and before.decode() != replica:
                await self.redis.zrem(self.held(before.decode()), key)
            if count > self.max_count:
                for gone, _ in await self.redis.zpopmin(self.all, count - self.max_count):
                    forgotten = await self.redis.getdel(self.name(gone.decode()))
                    if forgotten is not None:
                        await self.redis.zrem(self.held(forgotten.decode()), gone)
        except (*REDIS_DOWN, RedisError) as exc:
            self.failed(exc, None)

    async def live(self, replicas: Sequence[str]) -> dict[str, int]:
        now = time.time()
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.zremrangebyscore(self.all, "-inf", now)
            for replica in replicas:
                pipe.zremrangebyscore(self.held(replica), "-inf", now)
                pipe.zcard(self.held(replica))
            found = await pipe.execute()
        except (*REDIS_DOWN, RedisError) as exc:
            return self.failed(exc, dict.fromkeys(replicas, 0))
        return dict(zip(replicas, found[2::2]))

    def failed(self, exc: Exception, instead: T) -> T:
        if not self.failing:  # once per outage: every request would log it otherwise
            self.failing = True
            log.warning("redis did not answer (%s); requests are routed without placements", type(exc).__name__)
        return instead

    async def close(self) -> None:
        await self.redis.aclose()


def placements(redis_url: str | None, max_count: int = MAX_COUNT, ttl_s: float = TTL_S) -> Placements:
    """Placements shared through Redis at `redis_url`, else kept in this process."""
    return RedisPlacements(redis_url, max_count, ttl_s) if redis_url else MemoryPlacements(max_count, ttl_s)
