"""Responses kept for `previous_response_id` and GET /v1/responses/{id}, each its tenant's alone, bounded
(the least recently used go beyond `max_count`; each is gone `ttl_s` after it was written). In this process,
or in Redis when `redis_url` is set, so a turn continues through any front. Each holds its conversation as
chat messages, and the agent program of its chain."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from kvgate.gateway.redis_state import REDIS_DOWN, connect

MAX_COUNT = 4096
TTL_S = 3600.0
PREFIX = "kvgate:resp:"
log = logging.getLogger("kvgate.responses")


@dataclass
class Stored:
    response: dict[str, Any]  # the Response object as it was sent
    messages: list[dict[str, Any]]  # the conversation as chat messages: every input, then this output
    program: str | None  # the agent program of its chain: the next turn continues its KV
    written: float = 0.0
    items: tuple[str, ...] = field(default=())  # its output items' ids

    @property
    def id(self) -> str:
        return self.response["id"]

    def stamped(self, now: float) -> Stored:
        self.written = now
        self.items = tuple(i["id"] for i in self.response["output"] if isinstance(i.get("id"), str))
        return self


class ResponseStore(Protocol):
    async def put(self, tenant: str, stored: Stored) -> None: ...

    async def get(self, tenant: str, response_id: str) -> Stored | None:
        """The tenant's response (None: unknown, expired, or another tenant's)."""

    async def owner(self, tenant: str, item_ids: Iterable[str]) -> Stored | None:
        """The latest of the tenant's responses that wrote one of these output items."""

    async def delete(self, tenant: str, response_id: str) -> bool: ...

    async def close(self) -> None: ...


class MemoryResponses:
    def __init__(
        self, max_count: int = MAX_COUNT, ttl_s: float = TTL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_count, self.ttl_s, self.clock = max_count, ttl_s, clock
        self.entries: OrderedDict[tuple[str, str], Stored] = OrderedDict()
        self.owners: dict[tuple[str, str], str] = {}  # (tenant, output item id) -> response id

    async def put(self, tenant: str, stored: Stored) -> None:
        stored.stamped(self.clock())
        self.entries[(tenant, stored.id)] = stored
        self.entries.move_to_end((tenant, stored.id))
        self.owners |= {(tenant, item): stored.id for item in stored.items}
        while self.entries and (len(self.entries) > self.max_count or self.expired(next(iter(self.entries.values())))):
            self.drop(next(iter(self.entries)))

    async def get(self, tenant: str, response_id: str) -> Stored | None:
        key = (tenant, response_id)
        stored = self.entries.get(key)
        if stored is None:
            return None
        if self.expired(stored):
            self.drop(key)
            return None
        self.entries.move_to_end(key)
        return stored

    def expired(self, stored: Stored) -> bool:
        return self.clock() - stored.written > self.ttl_s

    async def owner(self, tenant: str, item_ids: Iterable[str]) -> Stored | None:
        for item in reversed(list(item_ids)):
            response_id = self.owners.get((tenant, item))
            if response_id is not None and (found := await self.get(tenant, response_id)) is not None:
                return found
        return None

    async def delete(self, tenant: str, response_id: str) -> bool:
        if (tenant, response_id) not in self.entries:
            return False
        self.drop((tenant, response_id))
        return True

    def drop(self, key: tuple[str, str]) -> None:
        stored = self.entries.pop(key)
        for item in stored.items:
            self.owners.pop((key[0], item), None)

    def __len__(self) -> int:
        return len(self.entries)

    async def close(self) -> None:
        """Nothing to release: the responses live in this process."""


class RedisResponses:
    """The same store in Redis, shared by every front on it. A tenant's keys share one hash slot (its
    digest in braces), so its lookups are one round trip on a cluster too; one sorted set orders every
    response by last use, and the least recently used go beyond `max_count`. A response that cannot be
    kept (Redis down) is logged and the answer still goes out; a lookup then is a 503."""

    def __init__(self, url: str, max_count: int = MAX_COUNT, ttl_s: float = TTL_S, prefix: str = PREFIX) -> None:
        self.max_count, self.ttl_s, self.prefix = max_count, ttl_s, prefix
        self.redis = connect(url)
        self.used = prefix + "used"  # sorted set: "<tenant digest>:<response id>" -> last use (epoch s)

    def scope(self, tenant: str) -> str:
        return hashlib.sha256(tenant.encode()).hexdigest()[:24]

    def entry(self, scope: str, response_id: str) -> str:
        return f"{self.prefix}{{{scope}}}:r:{response_id}"

    def item(self, scope: str, item_id: str) -> str:
        return f"{self.prefix}{{{scope}}}:i:{item_id}"

    async def put(self, tenant: str, stored: Stored) -> None:
        stored.stamped(time.time())
        scope, ttl = self.scope(tenant), max(1, round(self.ttl_s))
        try:
            pipe = self.redis.pipeline(transaction=False)  # one round trip, however many items
            pipe.set(self.entry(scope, stored.id), json.dumps(asdict(stored)), ex=ttl)
            for item in stored.items:
                pipe.set(self.item(scope, item), stored.id, ex=ttl)
            pipe.zadd(self.used, {f"{scope}:{stored.id}": stored.written})
            pipe.zcard(self.used)
            over = (await pipe.execute())[-1] - self.max_count
            if over > 0:
                for member, _ in await self.redis.zpopmin(self.used, over):
                    await self.drop(*member.decode().split(":", 1))
        except REDIS_DOWN as exc:
            log.warning("response %s not kept: redis did not answer (%s)", stored.id, type(exc).__name__)

    async def get(self, tenant: str, response_id: str) -> Stored | None:
        scope = self.scope(tenant)
        raw = await self.redis.get(self.entry(scope, response_id))
        stored = self.parsed(raw)
        if stored is None:
            await self.redis.zrem(self.used, f"{scope}:{response_id}")  # gone: expired, dropped or damaged
            return None
        await self.redis.zadd(self.used, {f"{scope}:{response_id}": time.time()}, xx=True)
        return stored

    def parsed(self, raw: bytes | None) -> Stored | None:
        """A kept response; a damaged one is none (logged)."""
        if raw is None:
            return None
        try:
            fields = json.loads(raw)
            stored = Stored(**{**fields, "items": tuple(fields.get("items", ()))})
            if not isinstance(stored.response, dict) or not isinstance(stored.messages, list):
                raise TypeError("not a response and its messages")
            return stored
        except (ValueError, TypeError) as exc:
            log.warning("a damaged response in redis is ignored: %s", exc)
            return None

    async def owner(self, tenant: str, item_ids: Iterable[str]) -> Stored | None:
        scope, wanted = self.scope(tenant), list(item_ids)[::-1]
        if not wanted:
            return None
        for response_id in await self.redis.mget([self.item(scope, i) for i in wanted]):
            if response_id is not None and (found := await self.get(tenant, response_id.decode())) is not None:
                return found
        return None

    async def delete(self, tenant: str, response_id: str) -> bool:
        scope = self.scope(tenant)
        await self.redis.zrem(self.used, f"{scope}:{response_id}")
        return await self.drop(scope, response_id)

    async def drop(self, scope: str, response_id: str) -> bool:
        stored = self.parsed(await self.redis.get(self.entry(scope, response_id)))
        names = [self.item(scope, item) for item in stored.items] if stored else []
        return bool(await self.redis.delete(self.entry(scope, response_id), *names))

    async def close(self) -> None:
        await self.redis.aclose()


def response_store(redis_url: str | None) -> ResponseStore:
    """Responses shared through Redis at `redis_url`, else kept in this process."""
    return RedisResponses(redis_url) if redis_url else MemoryResponses()
