"""Entries in Redis (a single server or a Redis Cluster), shared by every process using it.

All keys carry one hash tag, so they sit in one cluster slot and the Lua scripts may change them
together: a write, its expiry sweep and its quota eviction are one atomic step for every process.
Each change is appended to a stream that the processes read to keep their indexes in step."""

from __future__ import annotations

from collections.abc import Iterator

import redis
from redis.cluster import RedisCluster

from kvgate.semantic_cache.entry import Entry, pack, unpack
from kvgate.semantic_cache.store import Change, Evidence, Store, register_store

LOG_KEEP = 100_000  # stream entries kept (roughly); a reader further behind rebuilds its index
GRACE_S = 3600.0  # Redis drops an entry's hash this long after its expiry, if no sweep did first

# Both scripts start with ARGV[1] the key prefix and ARGV[2] the log's length. drop() forgets an
# entry everywhere, from the names its hash keeps, or those given (a hash Redis expired is gone).
# Per category: lru:<category> (ZSET, every tenant's ids by last use), most:<category> (ZSET: each
# tenant's quota key, scored by its size). Per tenant and category, the quota key (ZSET, ids by last use).
DROP = """
local prefix, keep = ARGV[1], ARGV[2]
local function recount(most, quota)
  local n = redis.call('ZCARD', quota)
  if n > 0 then redis.call('ZADD', most, n, quota) else redis.call('ZREM', most, quota) end
end
local function drop(victim, category, quota)
  local key = prefix .. 'e:' .. victim
  local meta = redis.call('HMGET', key, 'category', 'tenant', 'scope', '_quota')
  category, quota = category or meta[1], quota or meta[4]
  if category then
    redis.call('ZREM', prefix .. 'lru:' .. category, victim)
    if quota then
      redis.call('ZREM', quota, victim)
      recount(prefix .. 'most:' .. category, quota)
    end
  end
  if meta[2] then redis.call('SREM', prefix .. 't:' .. meta[2], victim) end
  if meta[3] then redis.call('SREM', prefix .. 's:' .. meta[3], victim) end
  redis.call('ZREM', prefix .. 'expires', victim)
  redis.call('DEL', key)
  redis.call('XADD', prefix .. 'log', 'MAXLEN', '~', keep, '*', 'op', 'del', 'id', victim)
  return victim
end
"""

# KEYS: entry, its quota key, tenant's ids (SET), expiries (ZSET), log (STREAM), lru:<category>,
# scope's ids (SET), most:<category>. ARGV (after the two above): id, expires, last_used, quota, now,
# grace, scope, category, capacity (-1: none), then the entry's field/value pairs.
PUT = (
    DROP
    + """
local id, expires, quota, now = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[6]), tonumber(ARGV[7])
local category, capacity = ARGV[10], tonumber(ARGV[11])
if redis.call('EXISTS', KEYS[1]) == 1 then drop(id) end
redis.call('HSET', KEYS[1], '_quota', KEYS[2], unpack(ARGV, 12))
redis.call('PEXPIREAT', KEYS[1], math.floor((expires + tonumber(ARGV[8])) * 1000))
redis.call('ZADD', KEYS[2], ARGV[5], id)
recount(KEYS[8], KEYS[2])
redis.call('ZADD', KEYS[6], ARGV[5], id)
redis.call('SADD', KEYS[3], id)
redis.call('SADD', KEYS[7], id)
redis.call('ZADD', KEYS[4], expires, id)
redis.call('XADD', KEYS[5], 'MAXLEN', '~', keep, '*', 'op', 'put', 'id', id, 'scope', ARGV[9])
local dropped = {}
for _, victim in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)) do dropped[#dropped + 1] = drop(victim) end
while redis.call('ZCARD', KEYS[2]) > quota do
  dropped[#dropped + 1] = drop(redis.call('ZRANGE', KEYS[2], 0, 0)[1], category, KEYS[2])
end
while capacity >= 0 and redis.call('ZCARD', KEYS[6]) > capacity do
  local most = redis.call('ZREVRANGE', KEYS[8], 0, 0)[1]
  local victim = most and redis.call('ZRANGE', most, 0, 0)[1]
  if not victim then break end
  dropped[#dropped + 1] = drop(victim, category, most)
end
return dropped
"""
)

# KEYS: expiries, log. ARGV (after the two above): ids.
DELETE = (
    DROP
    + """
local gone = 0
for i = 3, #ARGV do
  gone = gone + redis.call('EXISTS', prefix .. 'e:' .. ARGV[i])
  drop(ARGV[i])
end
return gone
"""
)


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

    def quota_key(self, tenant: str, category: str) -> str:
        return f"{self.prefix}q:{len(category)}:{category}:{tenant}"  # the length: no two pairs share a key

    def put(self, entry: Entry, quota: int, now: float, capacity: int | None = None) -> list[str]:
        fields = pack(entry)
        keys = [
            self.key(entry.id),
            self.quota_key(entry.tenant, entry.category),
            f"{self.prefix}t:{entry.tenant}",
            self.expiries,
            self.log,
            f"{self.prefix}lru:{entry.category}",
            f"{self.prefix}s:{entry.scope}",
            f"{self.prefix}most:{entry.category}",
        ]
        args: list[bytes | str | float | int] = [self.prefix, LOG_KEEP, entry.id, entry.expires]
        args += [entry.last_used or entry.created, quota, now, GRACE_S, entry.scope, entry.category]
        args.append(-1 if capacity is None else capacity)
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
        category, quota = self.redis.hmget(key, ["category", "_quota"])
        if category is None:
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(key, "last_used", repr(now))
        pipe.hincrby(key, "hits", 1)
        pipe.zadd(f"{self.prefix}lru:{category.decode()}", {entry_id: now}, xx=True)
        if quota is not None:
            pipe.zadd(quota.decode(), {entry_id: now}, xx=True)
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

    def entries(self, scope: str) -> Iterator[Entry]:
        members = f"{self.prefix}s:{scope}"
        ids = sorted(m.decode() for m in self.redis.smembers(members))
        for start in range(0, len(ids), 256):
            batch, pipe = ids[start : start + 256], self.redis.pipeline(transaction=False)
            for entry_id in batch:
                pipe.hgetall(self.key(entry_id))
            found = [(i, f, unpack(f, self.dim) if f else None) for i, f in zip(batch, pipe.execute(), strict=True)]
            if gone := [i for i, fields, _ in found if not fields]:  # hashes Redis expired before a sweep
                self.redis.srem(members, *gone)
            self.delete([i for i, fields, entry in found if fields and entry is None])  # damaged
            yield from (entry for _, _, entry in found if entry is not None)

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
        changes = [(f[b"op"].decode(), f[b"id"].decode(), f.get(b"scope", b"").decode()) for _, f in rows]
        return rows[-1][0].decode(), changes

    def evidence(self, added: Evidence) -> Evidence:
        """Per category one hash, a field per kind and bin (`right:12`), added to and read in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for category, kinds in added.items():
            for kind, counts in kinds.items():
                for b, n in enumerate(counts):
                    if n:
                        pipe.hincrbyfloat(f"{self.prefix}bound:{category}", f"{kind}:{b}", n)
        for category in added:
            pipe.hgetall(f"{self.prefix}bound:{category}")
        found = pipe.execute()[-len(added) :] if added else []
        totals: Evidence = {}
        for (category, kinds), fields in zip(added.items(), found):
            totals[category] = {kind: [0.0] * len(counts) for kind, counts in kinds.items()}
            for field, value in fields.items():
                kind, _, b = field.decode().partition(":")
                if kind in totals[category] and b.isdigit() and int(b) < len(totals[category][kind]):
                    totals[category][kind][int(b)] = float(value)
        return totals

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()


def _after(a: str, b: str) -> bool:
    """Stream id a is later than stream id b."""
    ams, aseq = (int(x) for x in a.split("-"))
    bms, bseq = (int(x) for x in b.split("-"))
    return (ams, aseq) > (bms, bseq)
