"""The answered turns a later request may continue (programs without markup: agents/conversations.py),
in this process, or in Redis when `redis_url` is set, so that a turn reaching another front continues
its program there too. In Redis each turn is a key with a TTL (`ttl_s` after it was answered or last
continued), and one sorted set bounds their count (`capacity`: the least recently used go). A Redis that
does not answer finds nothing (a turn starts a new program; logged once) and never fails a request."""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, Protocol

from redis.exceptions import RedisError

from kvgate.agents.conversations import Conversations, digests
from kvgate.gateway.redis_state import REDIS_DOWN, connect

PREFIX = "kvgate:conv:"
log = logging.getLogger("kvgate.agents")
Message = dict[str, Any]
Messages = list[Message]
Tools = list[dict[str, Any]] | None


class ConversationIndex(Protocol):
    async def find(self, tenant: str, tools: Tools, messages: Messages) -> str | None:
        """The program of the longest answered history these messages begin with (and go on from)."""

    async def remember(self, tenant: str, tools: Tools, messages: Messages, answer: Message, program: str) -> None:
        """`messages` were answered with `answer` in `program`."""

    async def close(self) -> None: ...


class InProcess:
    def __init__(self, capacity: int) -> None:
        self.turns = Conversations(capacity)

    async def find(self, tenant: str, tools: Tools, messages: Messages) -> str | None:
        return self.turns.find(tenant, tools, messages)

    async def remember(self, tenant: str, tools: Tools, messages: Messages, answer: Message, program: str) -> None:
        self.turns.remember(tenant, tools, messages, answer, program)

    async def close(self) -> None:
        """Nothing to release: the turns live in this process."""


class InRedis:
    def __init__(self, url: str, capacity: int, ttl_s: float, prefix: str = PREFIX) -> None:
        self.capacity, self.ttl_s, self.prefix = capacity, ttl_s, prefix
        self.redis = connect(url)
        self.all = prefix + "all"  # every turn's key, by when it was last used
        self.failing = False

    def name(self, tenant: str, digest: bytes) -> str:
        """A tenant's turns share a hash slot (its digest in braces): a lookup is one MGET on a cluster too."""
        return f"{self.prefix}{{{hashlib.sha256(tenant.encode()).hexdigest()[:24]}}}:t:{digest.hex()}"

    async def find(self, tenant: str, tools: Tools, messages: Messages) -> str | None:
        found = digests(tenant, tools, messages[:-1])
        answered = [i for i in range(len(found) - 1, -1, -1) if messages[i].get("role") == "assistant"]
        names = [self.name(tenant, found[i]) for i in answered]
        if not names:
            return None
        try:
            programs = await self.redis.mget(names)
            name, program = next(((n, p) for n, p in zip(names, programs) if p is not None), (None, None))
            if name is not None:  # used again: kept as long again
                await self.redis.expire(name, self.ttl())
                await self.redis.zadd(self.all, {name: time.time()})
        except (*REDIS_DOWN, RedisError) as exc:
            return self.failed(exc)
        self.failing = False
        return program.decode() if program is not None else None

    async def remember(self, tenant: str, tools: Tools, messages: Messages, answer: Message, program: str) -> None:
        name = self.name(tenant, digests(tenant, tools, [*messages, answer])[-1])
        try:
            await self.redis.set(name, program, ex=self.ttl())
            await self.redis.zadd(self.all, {name: time.time()})
            over = await self.redis.zcard(self.all) - self.capacity
            if over > 0:
                gone = [n for n, _ in await self.redis.zpopmin(self.all, over)]
                await self.redis.delete(*gone)
        except (*REDIS_DOWN, RedisError) as exc:
            self.failed(exc)

    def ttl(self) -> int:
        return max(1, round(self.ttl_s))

    def failed(self, exc: Exception) -> None:
        if not self.failing:  # once per outage: every request would log it otherwise
            self.failing = True
            log.warning("redis did not answer (%s); turns start new programs until it does", type(exc).__name__)

    async def close(self) -> None:
        await self.redis.aclose()


def conversation_index(redis_url: str | None, capacity: int, ttl_s: float) -> ConversationIndex:
    """Answered turns shared through Redis at `redis_url`, else kept in this process."""
    return InRedis(redis_url, capacity, ttl_s) if redis_url else InProcess(capacity)
