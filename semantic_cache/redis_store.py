"""Entries in Redis (a single server or a Redis Cluster), shared by every process using it.

All keys carry one hash tag, so they sit in one cluster slot and the Lua scripts may change them
together: a write, its expiry sweep and its quota eviction are one atomic step for every process.
Each change is appended to a stream that the processes read to keep their indexes in step."""

from __future__ import annotations

from collections.abc import Iterator

import redis
from redis.cluster import RedisCluster

from kvgate.semantic_cache.entry import Entry, pack, unpack
from kvgate.semantic_cache.store import Change, Store, register_store

LOG_KEEP = 100_000  # stream entries kept (roughly); a reader further behind rebuilds its index
GRACE_S = 3600.0  # Redis drops an entry's hash this long after its expiry, if no sweep did first

# KEYS: entry, category's last use (ZSET), tenant's ids (SET), expiries (ZSET), log (STREAM).
# ARGV: id, expires, last_used, quota, now, key prefix, log length, grace, then the entry's field/value pairs.
PUT = """
local id, expires, quota, now, prefix = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local function drop(victim)
  local key = prefix .. 'e:' .. victim
  local meta = redis.call('HMGET', key, 'category', 'tenant')
  if meta[1] then redis.call('ZREM', prefix .. 'lru:' .. meta[1], victim) end
  if meta[2] then redis.call('SREM', prefix .. 't:' .. meta[2], victim) end
  redis.call('ZREM', KEYS[4], victim)
  redis.call('DEL', key)
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[7], '*', 'op', 'del', 'id', victim)
  return victim
end
if redis.call('EXISTS', KEYS[1]) == 1 then drop(id) end
redis.call('HSET', KEYS[1], unpack(ARGV, 9))
redis.call('PEXPIREAT', KEYS[1], math.floor((expires + tonumber(ARGV[8])) * 1000))
redis.call('ZADD', KEYS[2], ARGV[3], id)
redis.call('SADD', KEYS[3], id)
redis.call('ZADD', KEYS[4], expires, id)
redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[7], '*', 'op', 'put', 'id', id)
local dropped = {}
for _, victim in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)) do dropped[#dropped + 1] = drop(victim) end
while redis.call('ZCARD', KEYS[2]) > quota do
  dropped[#dropped + 1] = drop(redis.call('ZRANGE', KEYS[2], 0, 0)[1])
end
return dropped
"""

# KEYS: expiries, log. ARGV: key prefix, log length, ids.
DELETE = """
local prefix, gone = ARGV[1], 0
for i = 3, #ARGV do
  local key = prefix .. 'e:' .. ARGV[i]
  local meta = redis.call('HMGET', key, 'category', 'tenant')
  if meta[1] then redis.call('ZREM', prefix .. 'lru:' .. meta[1], ARGV[i]) end
  if meta[2] then redis.call('SREM', prefix .. 't:' .. meta[2], ARGV[i]) end
  redis.call('ZREM', KEYS[1], ARGV[i])
  gone = gone + redis.call('DEL', key)
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'op', 'del', 'id', ARGV[i])
end
return gone
"""


def connect(url: str, timeout_s: float = 2.0) -> redis.Redis | RedisCluster:
    """A client for a single server, or a cluster client when the server says it is a cluster node."""
    plain = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    if plain.info("cluster").get("cluster_enabled"):
        plain.close()
        return RedisCluster.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    return plain


@register_store("redis")
class RedisStore(Store):
    def __init__(self, url: str, dim: int, prefix: str = "kvgate:sem") -> None:
        if not prefix or "{" in prefix or "}" in prefix:
            raise ValueError(f"need a non-empty prefix without braces (it becomes a hash tag), got {prefix!r}")
        self.url, self.dim = url, dim
        self.prefix = f"{{{prefix}}}:"
        self.expiries, self.log = self.prefix + "expires", self.prefix + "log"
        self._redis: redis.Redis | RedisCluster | None = None

    @property
    def redis(self) -> redis.Redis | RedisCluster:
        """Connected on first use, so that a server down at start-up only makes misses until it is up."""
        if self._redis is None:
            self._redis = connect(self.url)
            self._put = self._redis.register_script(PUT)
            self._delete = self._redis.register_script(DELETE)
        return self._redis

    def key(self, entry_id: str) -> str:
        return f"{self.prefix}e:{entry_id}"

    def put(self, entry: Entry, quota: int, now: float) -> list[str]:
        fields = pack(entry)
        keys = [
            self.key(entry.id),
            f"{self.prefix}lru:{entry.category}",
            f"{self.prefix}t:{entry.tenant}",
            self.expiries,
            self.log,
        ]
        args: list[bytes | str | float | int] = [
            entry.id,
            entry.expires,
            entry.last_used or entry.created,
            quota,
            now,
            self.prefix,
            LOG_KEEP,
            GRACE_S,
        ]
        for name, value in fields.items():
            args += [name, value]
        self.redis  # noqa: B018 (connects, and registers the scripts)
        dropped = self._put(keys=keys, args=args)
        return [d.decode() for d in dropped]

    def get(self, entry_id: str) -> Entry | None:
        fields = self.redis.hgetall(self.key(entry_id))
        if not fields:
            return None
        entry = unpack(fields, self.dim)
        if entry is None:
            self.delete([entry_id])
        return entry

    def touch(self, entry_id: str, now: float) -> None:
        key = self.key(entry_id)
        category = self.redis.hget(key, "category")
        if category is None:
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(key, "last_used", repr(now))
        pipe.hincrby(key, "hits", 1)
        pipe.zadd(f"{self.prefix}lru:{category.decode()}", {entry_id: now}, xx=True)
        pipe.execute()

    def delete(self, entry_ids: list[str]) -> int:
        if not entry_ids:
            return 0
        client = self.redis
        return int(
            self._delete(keys=[self.expiries, self.log], args=[self.prefix, LOG_KEEP, *entry_ids], client=client)
        )

    def ids(self, tenant: str | None = None, category: str | None = None) -> list[str]:
        if tenant is not None:
            found = {m.decode() for m in self.redis.smembers(f"{self.prefix}t:{tenant}")}
        else:
            found = {m.decode() for m in self.redis.zrange(self.expiries, 0, -1)}
        if category is not None:
            found &= {m.decode() for m in self.redis.zrange(f"{self.prefix}lru:{category}", 0, -1)}
        return sorted(found)

    def entries(self) -> Iterator[Entry]:
        ids = self.ids()
        for start in range(0, len(ids), 256):
            pipe = self.redis.pipeline(transaction=False)
            for entry_id in ids[start : start + 256]:
                pipe.hgetall(self.key(entry_id))
            for fields in pipe.execute():
                entry = unpack(fields, self.dim) if fields else None
                if entry is not None:
                    yield entry

    def cursor(self) -> str:
        last = self.redis.xrevrange(self.log, count=1)
        return last[0][0].decode() if last else "0-0"

    def changes(self, since: str) -> tuple[str, list[Change]] | None:
        rows = self.redis.xrange(self.log, min=f"({since}", count=10_000)
        if since != "0-0" and rows:
            trimmed = self.redis.xinfo_stream(self.log).get("max-deleted-entry-id", b"0-0")
            if _after(trimmed.decode() if isinstance(trimmed, bytes) else str(trimmed), since):
                return None
        if not rows:
            return since, []
        changes = [(fields[b"op"].decode(), fields[b"id"].decode()) for _, fields in rows]
        return rows[-1][0].decode(), changes

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()


def _after(a: str, b: str) -> bool:
    """Stream id a is later than stream id b."""
    ams, aseq = (int(x) for x in a.split("-"))
    bms, bseq = (int(x) for x in b.split("-"))
    return (ams, aseq) > (bms, bseq)
