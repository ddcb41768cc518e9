"""Responses kept for `previous_response_id` and GET /v1/responses/{id}, each its tenant's alone, bounded
(the least recently used go beyond `max_count`; each is gone `ttl_s` after it was written). In this process,
or in Redis when `redis_url` is set, so a turn continues through any front. Each holds its conversation as
chat messages, its input items, and the agent program of its chain.

Every input and output item of a kept response is found by its id (an `item_reference`), in one lookup
for all of a request's ids: an item belongs to the latest response that holds it (a response that refers
to an earlier one's items holds them too), and goes with that response."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from kvgate.gateway.redis_state import REDIS_DOWN, connect

MAX_COUNT = 4096
MAX_ITEMS = 65536  # in this process: the items of the responses kept, together
TTL_S = 3600.0
PREFIX = "kvgate:resp:"
log = logging.getLogger("kvgate.responses")


@dataclass
class Stored:
    response: dict[str, Any]  # the Response object as it was sent
    messages: list[dict[str, Any]]  # the conversation as chat messages: every input, then this output
    program: str | None  # the agent program of its chain: the next turn continues its KV
    inputs: list[dict[str, Any]] = field(default_factory=list)  # its input items, each with its id
    written: float = 0.0
    items: tuple[str, ...] = field(default=())  # the ids of its input and output items

    @property
    def id(self) -> str:
        return self.response["id"]

    def stamped(self, now: float) -> Stored:
        self.written = now
        self.items = tuple(i["id"] for i in self.every_item())
        return self

    def every_item(self) -> list[dict[str, Any]]:
        return [i for i in (*self.inputs, *self.response["output"]) if isinstance(i.get("id"), str)]


@dataclass(frozen=True)
class KeptItem:
    """A kept item found by its id: the response that holds it, and the program of that response's chain."""

    item: dict[str, Any]
    response: str
    program: str | None


class ResponseStore(Protocol):
    async def put(self, tenant: str, stored: Stored) -> None: ...

    async def get(self, tenant: str, response_id: str) -> Stored | None:
        """The tenant's response (None: unknown, expired, or another tenant's)."""

    async def held(self, tenant: str, item_ids: Sequence[str]) -> list[KeptItem | None]:
        """The tenant's item of each id (None: unknown, expired, or another tenant's)."""

    async def delete(self, tenant: str, response_id: str) -> bool: ...

    async def close(self) -> None: ...


class MemoryResponses:
    """The store in this process: the least recently used responses go beyond `max_count` responses or
    `max_items` items held."""

    def __init__(
        self,
        max_count: int = MAX_COUNT,
        ttl_s: float = TTL_S,
        clock: Callable[[], float] = time.monotonic,
        max_items: int = MAX_ITEMS,
    ) -> None:
        self.max_count, self.ttl_s, self.clock, self.max_items = max_count, ttl_s, clock, max_items
        self.entries: OrderedDict[tuple[str, str], Stored] = OrderedDict()
        self.holders: dict[tuple[str, str], KeptItem] = {}  # (tenant, item id) -> the item, in its latest response

    async def put(self, tenant: str, stored: Stored) -> None:
        stored.stamped(self.clock())
        self.entries[(tenant, stored.id)] = stored
        self.entries.move_to_end((tenant, stored.id))
        self.holders |= {(tenant, i["id"]): KeptItem(i, stored.id, stored.program) for i in stored.every_item()}
        while self.entries and (self.over() or self.expired(next(iter(self.entries.values())))):
            self.drop(next(iter(self.entries)))

    def over(self) -> bool:
        return len(self.entries) > self.max_count or len(self.holders) > self.max_items

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

    async def held(self, tenant: str, item_ids: Sequence[str]) -> list[KeptItem | None]:
        return [self.holding(tenant, item) for item in item_ids]

    def holding(self, tenant: str, item_id: str) -> KeptItem | None:
        """The item, if its response is kept still (a lookup is no use of the response: as in Redis)."""
        found = self.holders.get((tenant, item_id))
        stored = None if found is None else self.entries.get((tenant, found.response))
        return None if stored is None or self.expired(stored) else found

    async def delete(self, tenant: str, response_id: str) -> bool:
        if (tenant, response_id) not in self.entries:
            return False
        self.drop((tenant, response_id))
        return True

    def drop(self, key: tuple[str, str]) -> None:
        tenant, response_id = key
        stored = self.entries.pop(key)
        for item in stored.items:  # those a later response holds now stay with it
            if (found := self.holders.get((tenant, item))) is not None and found.response == response_id:
                del self.holders[(tenant, item)]

    def __len__(self) -> int:
        return len(self.entries)

    async def close(self) -> None:
        """Nothing to release: the responses live in this process."""


class RedisResponses:
    """The same store in Redis, shared by every front on it. A tenant's keys share one hash slot (its
    digest in braces), so its lookups are one round trip on a cluster too; one sorted set orders every
    response by last use, and the least recently used go beyond `max_count`. Each item is a key of its
    own (its response's id, then the item), gone with its response unless a later one holds it now.
    A response that cannot be kept (Redis down) is logged and the answer still goes out; a lookup then
    is a 503."""

    def __init__(self, url: str, max_count: int = MAX_COUNT, ttl_s: float = TTL_S, prefix: str = PREFIX) -> None:
        self.max_count, self.ttl_s, self.prefix = max_count, ttl_s, prefix
        self.redis = connect(url)
        self.used = prefix + "used"  # sorted set: "<tenant digest>:<response id>" -> last use (epoch s)
        self.forget = self.redis.register_script(FORGET)

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
            for item in stored.every_item():
                record = json.dumps({"item": item, "program": stored.program})
                pipe.set(self.item(scope, item["id"]), f"{stored.id}\n{record}", ex=ttl)
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
            if not all(
                isinstance(v, t) for v, t in ((stored.response, dict), (stored.messages, list), (stored.inputs, list))
            ):
                raise TypeError("not a response, its messages and its input items")
            return stored
        except (ValueError, TypeError) as exc:
            log.warning("a damaged response in redis is ignored: %s", exc)
            return None

    async def held(self, tenant: str, item_ids: Sequence[str]) -> list[KeptItem | None]:
        scope = self.scope(tenant)
        if not item_ids:
            return []
        return [held_of(raw) for raw in await self.redis.mget([self.item(scope, i) for i in item_ids])]

    async def delete(self, tenant: str, response_id: str) -> bool:
        scope = self.scope(tenant)
        await self.redis.zrem(self.used, f"{scope}:{response_id}")
        return await self.drop(scope, response_id)

    async def drop(self, scope: str, response_id: str) -> bool:
        stored = self.parsed(await self.redis.get(self.entry(scope, response_id)))
        if stored is not None and stored.items:
            await self.forget(keys=[self.item(scope, item) for item in stored.items], args=[f"{response_id}\n"])
        return bool(await self.redis.delete(self.entry(scope, response_id)))

    async def close(self) -> None:
        await self.redis.aclose()


# The item keys (KEYS) that the response (ARGV[1]: its id and a newline) still holds, deleted: one that a
# later response holds now stays. One script: another front may write them meanwhile.
FORGET = """
local gone = 0
for _, key in ipairs(KEYS) do
  local held = redis.call('GET', key)
  if held and string.sub(held, 1, #ARGV[1]) == ARGV[1] then
    gone = gone + redis.call('DEL', key)
  end
end
return gone
"""


def held_of(raw: bytes | None) -> KeptItem | None:
    """An item as Redis keeps it; a damaged one is none (logged)."""
    if raw is None:
        return None
    try:
        response, _, record = raw.decode().partition("\n")
        fields = json.loads(record)
        item, program = fields["item"], fields["program"]
        if not isinstance(item, dict) or not isinstance(item.get("id"), str) or not isinstance(program, str | None):
            raise TypeError("not an item and its program")
        return KeptItem(item, response, program)
    except (ValueError, TypeError, KeyError) as exc:
        log.warning("a damaged response item in redis is ignored: %s", type(exc).__name__)
        return None


def response_store(redis_url: str | None) -> ResponseStore:
    """Responses shared through Redis at `redis_url`, else kept in this process."""
    return RedisResponses(redis_url) if redis_url else MemoryResponses()
