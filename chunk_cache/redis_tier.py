"""Redis (a single server or a Redis Cluster): one string value per entry, read by byte range.

Every process pointed at the same Redis shares the entries and one byte budget. Next to the
values, two bookkeeping keys in one hash slot hold each entry's size (a HASH) and last use (a
ZSET); Lua scripts change both together, so a write reserves its bytes and picks the least
recently used victims atomically. Values live in their own slots, spread over a cluster.

A value and its bookkeeping cannot change in one step (different slots), so a writer that dies
halfway leaves a value nobody counts or a count with no value; `reconcile`, run now and then
by writes, adopts the first and drops the second.

A server that fails (connection error, timeout) is skipped for `retry_s`: reads miss and writes
are refused at once instead of waiting on it, then the next call connects afresh.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import ClusterDownError, RedisClusterException
from redis.retry import Retry

from kvgate.chunk_cache.byte_tier import ByteTier, Read, TierUnavailable
from kvgate.chunk_cache.entry import CorruptEntry, Header
from kvgate.chunk_cache.tier import register_tier

# Errors that mean the server is out of reach, not that one command was wrong.
OUTAGE = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, RedisClusterException, OSError)
HEAD = 64 << 10  # the first read of an entry fetches this much: header and token ids in one round trip
PIECE = 1 << 20  # redis-py parses one large reply slower than several ~1 MiB ones
SWEEP_S = 600.0  # how often writes run `reconcile`
GRACE_S = 60.0  # a count with no value is dropped once unused this long (its writer may be mid-write)

# KEYS: sizes, last use. ARGV: key, size, budget, now. Evicts least recently used entries (not
# `key`) until `size` more bytes fit, counts `key` as used now, returns the evicted keys.
RESERVE = """
local size, budget = tonumber(ARGV[2]), tonumber(ARGV[3])
local held = 0
for _, n in ipairs(redis.call('HVALS', KEYS[1])) do held = held + tonumber(n) end
held = held - tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or 0)
local evicted = {}
if held + size > budget then
  for _, victim in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
    if held + size <= budget then break end
    if victim ~= ARGV[1] then
      held = held - tonumber(redis.call('HGET', KEYS[1], victim) or 0)
      redis.call('HDEL', KEYS[1], victim)
      redis.call('ZREM', KEYS[2], victim)
      evicted[#evicted + 1] = victim
    end
  end
end
redis.call('HSET', KEYS[1], ARGV[1], size)
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
return evicted
"""

# KEYS: sizes, last use. ARGV: key, and optionally a time: forget it only if last used before then.
FORGET = """
local used = redis.call('ZSCORE', KEYS[2], ARGV[1])
if ARGV[2] and used and tonumber(used) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
return redis.call('HDEL', KEYS[1], ARGV[1])
"""

# KEYS: sizes, last use. ARGV: key, size. Counts a value nobody counted, as the first to evict.
ADOPT = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then redis.call('ZADD', KEYS[2], 'NX', 0, ARGV[1]) end
"""


@register_tier("redis")
class RedisTier(ByteTier):
    durable = True

    def __init__(
        self,
        url: str,
        budget_bytes: int,
        prefix: str = "kvgate:chunk:",
        retry_s: float = 1.0,
        timeout_s: float = 2.0,
        codec: str | None = None,
    ) -> None:
        super().__init__(budget_bytes, codec)
        if not prefix or "{" in prefix or "}" in prefix:
            raise ValueError(f"need a non-empty prefix without braces (it becomes a hash tag), got {prefix!r}")
        self.url, self.prefix, self.retry_s, self.timeout_s = url, prefix, retry_s, timeout_s
        # "{prefix}": the hash tag that keeps both in one cluster slot, as the scripts need.
        self._sizes, self._used = f"{{{prefix}}}sizes", f"{{{prefix}}}used"
        self._redis: redis.Redis | RedisCluster | None = None
        self._connect_lock = threading.Lock()
        self._retry_at = 0.0  # time.monotonic() before which the server is not tried
        self._next_sweep = 0.0
        self._last = {"bytes": 0, "entries": 0}  # what stats say while the server is down

    def value_key(self, key: str) -> str:
        """The Redis key holding `key`'s entry."""
        return self.prefix + key

    # ---- ByteTier -----------------------------------------------------------------------------

    def reader(self, key: str) -> Read | None:
        name = self.value_key(key)
        head = self._call("getrange", name, 0, HEAD - 1)
        if not head:
            if self._call("exists", name):
                raise CorruptEntry("an empty value")
            return None
        self._call("zadd", self._used, {key: time.time()}, xx=True)

        def read(start: int, stop: int) -> bytes:
            if stop <= len(head) or len(head) < HEAD:  # within the head, or the value is all head
                return head[start:stop]
            return self._range(name, start, stop)

        return read

    def write(self, key: str, data: bytes) -> bool:
        if len(data) > self.budget_bytes:
            return False
        if time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + SWEEP_S
            self.reconcile()
        evicted = self._script(RESERVE, key, len(data), self.budget_bytes, time.time())
        for victim in evicted:
            self._call("delete", self.value_key(victim.decode()))
        self.count("evictions", len(evicted))
        try:
            self._call("set", self.value_key(key), data)
        except Exception:
            try:
                self._script(FORGET, key)  # give the reserved bytes back, if the server still answers
            except Exception:
                pass  # `reconcile` drops the reservation later
            raise
        return True

    def remove(self, key: str) -> bool:
        removed = self._call("delete", self.value_key(key))
        self._script(FORGET, key)
        return removed > 0

    def __contains__(self, key: object) -> bool:
        try:
            return isinstance(key, str) and self._call("exists", self.value_key(key)) > 0
        except Exception:
            return False

    def keys(self) -> list[str]:
        try:
            return [k.decode() for k in self._call("hkeys", self._sizes)]
        except Exception:
            return []

    @property
    def nbytes(self) -> int:
        """Bytes held by every process sharing this Redis and prefix."""
        try:
            self._last["bytes"] = sum(int(n) for n in self._call("hvals", self._sizes))
        except Exception:
            pass
        return self._last["bytes"]

    def stats(self) -> dict[str, int | float]:
        try:
            self._last["entries"] = self._call("hlen", self._sizes)
        except Exception:
            pass
        return {
            **super().stats(),
            "entries": self._last["entries"],
            "available": int(time.monotonic() >= self._retry_at),
            "cluster": int(isinstance(self._redis, RedisCluster)),
        }

    def reconcile(self, grace_s: float = GRACE_S) -> None:
        """Make the bookkeeping match the values: count values nobody counts (first to be evicted),
        forget counts of values that are gone (unless used within grace_s: maybe still being written)."""
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", self.prefix) + "*"
        stored = {name.decode()[len(self.prefix) :] for name in self._call("scan_iter", match=pattern, count=1000)}
        counted = {k.decode() for k in self._call("hkeys", self._sizes)}
        counted |= {k.decode() for k in self._call("zrange", self._used, 0, -1)}
        for key in stored - counted:
            try:  # only values naming their key: not another tier's whose prefix starts with ours
                Header.parse(self._call("getrange", self.value_key(key), 0, HEAD - 1), key)
            except CorruptEntry:
                continue
            self._script(ADOPT, key, self._call("strlen", self.value_key(key)))
        for key in counted - stored:
            self._script(FORGET, key, time.time() - grace_s)

    def close(self) -> None:
        with self._connect_lock:
            client, self._redis = self._redis, None
        if client is not None:
            client.close()

    # ---- talking to Redis -----------------------------------------------------------------------

    def _call(self, command: str, *args: Any, **kwargs: Any) -> Any:
        """Run one redis-py command; after an outage, raise TierUnavailable without trying until retry_s."""
        if time.monotonic() < self._retry_at:
            raise TierUnavailable(f"redis failed; next try in {self._retry_at - time.monotonic():.1f}s")
        try:
            result = getattr(self._client(), command)(*args, **kwargs)
            # scan_iter is lazy: consume it here, where its errors are caught
            return list(result) if command == "scan_iter" else result
        except OUTAGE:
            self._retry_at = time.monotonic() + self.retry_s
            with self._connect_lock:
                self._redis = None  # reconnect from scratch, cluster detection included
            raise

    def _script(self, script: str, key: str, *args: Any) -> Any:
        return self._call("eval", script, 2, self._sizes, self._used, key, *args)

    def _range(self, name: str, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of a value, fewer where it ends; GETRANGE's end is inclusive."""
        pieces = []
        for lo in range(start, stop, PIECE):
            want = min(PIECE, stop - lo)
            pieces.append(self._call("getrange", name, lo, lo + want - 1))
            if len(pieces[-1]) < want:
                break
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def _client(self) -> redis.Redis | RedisCluster:
        with self._connect_lock:
            if self._redis is None:
                self._redis = self._connect()
            return self._redis

    def _connect(self) -> redis.Redis | RedisCluster:
        # No retries inside redis-py: a failure should surface at once and start the retry_s pause.
        options = {"socket_timeout": self.timeout_s, "socket_connect_timeout": self.timeout_s}
        single = redis.Redis.from_url(self.url, retry=Retry(NoBackoff(), 0), **options)
        try:
            clustered = single.info("cluster").get("cluster_enabled") == 1
        except redis.ResponseError:
            clustered = False  # INFO not allowed here: assume a single server
        except BaseException:
            single.close()
            raise
        if not clustered:
            return single
        single.close()
        return RedisCluster.from_url(self.url, retry=Retry(NoBackoff(), 0), **options)
