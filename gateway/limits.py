"""Per-API-key rate limits as OpenAI has them: requests per minute (rpm) and tokens per minute (tpm).

The window is a sliding-window counter: counts of the current fixed 60 s window plus the previous
window's, weighted by the share of it still inside the last minute. That costs two counters per
budget and approximates a true rolling minute closely when traffic is steady.

A request is refused when counting it would put the requests in the window over rpm, or when the
tokens already spent in the window are at least tpm: tokens are only known once a response is
done (`spend`), so a request that goes over tpm refuses the next ones, as OpenAI does. A refused
request is not counted.

`MemoryLimiter` counts in one process. `RedisLimiter` counts in Redis (a single server or a
cluster), shared by every process using it: one Lua script reads, decides and counts atomically,
on the Redis server's clock, and each key's counts expire once idle for two windows. A Redis that
fails does not fail requests: they are allowed (fail open), with a warning in the log.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import redis.asyncio as redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ClusterDownError, RedisClusterException

from kvgate.gateway.logs import redacted

log = logging.getLogger("kvgate.limits")

WINDOW_S = 60
# Errors that mean Redis is out of reach, not that one command was wrong.
OUTAGE = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, RedisClusterException, OSError)


@dataclass(frozen=True)
class Limits:
    rpm: int | None = None  # None: unlimited
    tpm: int | None = None

    def __post_init__(self) -> None:
        for name, value in (("rpm", self.rpm), ("tpm", self.tpm)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 or None (unlimited), got {value}")

    @property
    def unlimited(self) -> bool:
        return self.rpm is None and self.tpm is None


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    retry_after_s: float  # 0 when allowed; else seconds until a request would be admitted
    headers: dict[str, str]  # OpenAI's x-ratelimit-*, for the limits that are set


ALLOW = Verdict(True, 0.0, {})


@dataclass(frozen=True)
class Counts:
    """One key's counts in its current fixed window (`window`: start time // WINDOW_S) and the one before."""

    window: int
    requests: int = 0
    tokens: int = 0
    last_requests: int = 0
    last_tokens: int = 0

    def at(self, window: int) -> Counts:
        """These counts as seen from `window`: a later window starts empty and its previous one is ours."""
        if window == self.window:
            return self
        if window == self.window + 1:
            return Counts(window, last_requests=self.requests, last_tokens=self.tokens)
        return Counts(window)


class Limiter(ABC):
    @abstractmethod
    async def admit(self, key: str, limits: Limits) -> Verdict:
        """Whether `key` may send a request now; counts it when allowed."""

    @abstractmethod
    async def spend(self, key: str, limits: Limits, tokens: int) -> None:
        """Count the tokens a finished request of `key` used."""

    @abstractmethod
    async def close(self) -> None:
        """Let go of connections."""


class MemoryLimiter(Limiter):
    """Counts in this process only; `clock` gives the time in seconds (tests move it)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._counts: dict[str, Counts] = {}
        self._swept = 0

    async def admit(self, key: str, limits: Limits) -> Verdict:
        if limits.unlimited:
            return ALLOW
        now = self.clock()
        counts = self._get(key, now)
        allowed = fits(counts, now, limits)
        if allowed:
            counts = self._counts[key] = replace(counts, requests=counts.requests + 1)
        return judge(allowed, counts, now, limits)

    async def spend(self, key: str, limits: Limits, tokens: int) -> None:
        if limits.tpm is None or tokens <= 0:
            return
        counts = self._get(key, self.clock())
        self._counts[key] = replace(counts, tokens=counts.tokens + tokens)

    async def close(self) -> None:
        self._counts.clear()

    def _get(self, key: str, now: float) -> Counts:
        window = int(now // WINDOW_S)
        if window != self._swept:  # once a window: forget keys idle for two windows
            self._counts = {k: c for k, c in self._counts.items() if c.window >= window - 1}
            self._swept = window
        return self._counts.get(key, Counts(window)).at(window)


# KEYS[1]: the key's counts (a hash). ARGV: 'admit' or 'spend', rpm and tpm (0: unlimited), tokens,
# WINDOW_S, expiry in seconds. Mirrors Counts.at and fits; returns the verdict, the server's TIME
# and the counts after.
SCRIPT = """
local time = redis.call('TIME')
local now = tonumber(time[1]) + tonumber(time[2]) / 1000000
local size = tonumber(ARGV[5])
local window = math.floor(now / size)
local c = redis.call('HMGET', KEYS[1], 'w', 'r', 't', 'lr', 'lt')
local w = tonumber(c[1]) or window
local r, t, lr, lt = tonumber(c[2]) or 0, tonumber(c[3]) or 0, tonumber(c[4]) or 0, tonumber(c[5]) or 0
if w == window - 1 then
  r, t, lr, lt = 0, 0, r, t
elseif w ~= window then
  r, t, lr, lt = 0, 0, 0, 0
end
local weight = 1 - (now - window * size) / size
local rpm, tpm = tonumber(ARGV[2]), tonumber(ARGV[3])
local allowed = 1
if ARGV[1] == 'spend' then
  t = t + tonumber(ARGV[4])
elseif (rpm > 0 and lr * weight + r + 1 > rpm) or (tpm > 0 and lt * weight + t >= tpm) then
  allowed = 0
else
  r = r + 1
end
if allowed == 1 then
  redis.call('HSET', KEYS[1], 'w', window, 'r', r, 't', t, 'lr', lr, 'lt', lt)
  redis.call('EXPIRE', KEYS[1], ARGV[6])
end
return {allowed, time[1], time[2], window, r, t, lr, lt}
"""


class RedisLimiter(Limiter):
    """Counts in Redis at `url`, shared by every process using it; fails open when Redis does.

    After a connection failure Redis is not tried again for `retry_s`, so an outage costs no
    request a timeout. Keys are `prefix` plus a hash of the API key: no key is stored in the clear.
    """

    def __init__(self, url: str, prefix: str = "kvgate:rl:", timeout_s: float = 0.5, retry_s: float = 1.0) -> None:
        self.url, self.prefix, self.timeout_s, self.retry_s = url, prefix, timeout_s, retry_s
        self._redis: redis.Redis | RedisCluster | None = None
        self._script: Any = None
        self._connecting = asyncio.Lock()
        self._retry_at = 0.0  # time.monotonic() before which Redis is not tried
        self._failing = False  # warned about a failure and not yet back

    async def admit(self, key: str, limits: Limits) -> Verdict:
        if limits.unlimited:
            return ALLOW
        done = await self._run(key, "admit", limits, 0)
        if done is None:
            return ALLOW
        allowed, sec, usec, window, *counts = (int(x) for x in done)
        now = sec + usec / 1_000_000
        return judge(bool(allowed), Counts(window, *counts), now, limits)

    async def spend(self, key: str, limits: Limits, tokens: int) -> None:
        if limits.tpm is not None and tokens > 0:
            await self._run(key, "spend", limits, tokens)

    async def close(self) -> None:
        client, self._redis = self._redis, None
        if client is not None:
            await client.aclose()

    def name(self, key: str) -> str:
        """The Redis key holding `key`'s counts."""
        return self.prefix + hashlib.sha256(key.encode()).hexdigest()[:32]

    async def _run(self, key: str, op: str, limits: Limits, tokens: int) -> list[Any] | None:
        """The script's reply, or None when Redis failed (logged)."""
        if time.monotonic() < self._retry_at:
            return None
        args = [op, limits.rpm or 0, limits.tpm or 0, tokens, WINDOW_S, 2 * WINDOW_S]
        try:
            await self._connect()
            done = await self._script(keys=[self.name(key)], args=args)
        except OUTAGE as exc:
            self._retry_at = time.monotonic() + self.retry_s
            await self.close()  # reconnect from scratch, cluster detection included
            self._fail("is unreachable", exc)
            return None
        except redis.RedisError as exc:
            self._fail("failed", exc)
            return None
        if self._failing:
            self._failing = False
            log.warning("redis at %s is back; rate limits are enforced again", redacted(self.url))
        return done

    def _fail(self, what: str, exc: Exception) -> None:
        # Once per outage: every request of a busy gateway would log it otherwise.
        if not self._failing:
            self._failing = True
            name = type(exc).__name__
            log.warning("redis at %s %s (%s: %s); rate limits are not enforced", redacted(self.url), what, name, exc)

    async def _connect(self) -> None:
        async with self._connecting:
            if self._redis is not None:
                return
            options: dict[str, Any] = {"socket_timeout": self.timeout_s, "socket_connect_timeout": self.timeout_s}
            client: redis.Redis | RedisCluster = redis.Redis.from_url(self.url, **options)
            try:
                clustered = (await client.info("cluster")).get("cluster_enabled") == 1
            except redis.ResponseError:
                clustered = False  # INFO not allowed here: assume a single server
            except BaseException:
                await client.aclose()
                raise
            if clustered:
                await client.aclose()
                client = RedisCluster.from_url(self.url, **options)
            self._script = client.register_script(SCRIPT)
            self._redis = client


def limiter(redis_url: str | None) -> Limiter:
    """Limits shared through Redis at `redis_url`, else counted in this process."""
    return RedisLimiter(redis_url) if redis_url else MemoryLimiter()


def fits(counts: Counts, now: float, limits: Limits) -> bool:
    """Whether one more request fits; SCRIPT decides the same way."""
    requests, tokens = used(counts, now)
    return (limits.rpm is None or requests + 1 <= limits.rpm) and (limits.tpm is None or tokens < limits.tpm)


def used(counts: Counts, now: float) -> tuple[float, float]:
    """Requests and tokens in the minute up to `now`."""
    weight = 1 - (now - counts.window * WINDOW_S) / WINDOW_S
    return counts.last_requests * weight + counts.requests, counts.last_tokens * weight + counts.tokens


def judge(allowed: bool, counts: Counts, now: float, limits: Limits) -> Verdict:
    """The verdict on a request, from the counts after it (not counting it when refused)."""
    elapsed = now - counts.window * WINDOW_S
    requests, tokens = used(counts, now)
    headers: dict[str, str] = {}
    waits = [0.0]
    if limits.rpm is not None:
        headers["x-ratelimit-limit-requests"] = str(limits.rpm)
        headers["x-ratelimit-remaining-requests"] = str(max(0, math.floor(limits.rpm - requests)))
        headers["x-ratelimit-reset-requests"] = duration(reset(counts.last_requests, counts.requests, elapsed))
        if requests + 1 > limits.rpm:
            waits.append(wait(counts.last_requests, counts.requests, limits.rpm - 1, elapsed))
    if limits.tpm is not None:
        headers["x-ratelimit-limit-tokens"] = str(limits.tpm)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, math.floor(limits.tpm - tokens)))
        headers["x-ratelimit-reset-tokens"] = duration(reset(counts.last_tokens, counts.tokens, elapsed))
        if tokens >= limits.tpm:
            waits.append(wait(counts.last_tokens, counts.tokens, limits.tpm, elapsed))
    if allowed:
        return Verdict(True, 0.0, headers)
    # Just past the moment the budget frees (to the next millisecond), so a retry then fits.
    return Verdict(False, math.floor(max(waits) * 1000) / 1000 + 0.001, headers)


def wait(last: int, current: int, cap: int, elapsed: float) -> float:
    """Seconds until last * weight + current <= cap, where the weight falls as the window moves on,
    and at the next window the current counts become the last ones."""
    left = WINDOW_S - elapsed
    if current < cap or not current:  # the last window's share is what is over (judge asks only when over)
        return max(0.0, left - WINDOW_S * (cap - current) / last)
    # This window alone fills the cap (tokens: exactly tpm is full too): wait into the next one.
    return left + WINDOW_S * (1 - cap / current)


def reset(last: int, current: int, elapsed: float) -> float:
    """Seconds until nothing is counted any more (OpenAI's reset: back to the initial state)."""
    if current:
        return 2 * WINDOW_S - elapsed
    return WINDOW_S - elapsed if last else 0.0


def duration(seconds: float) -> str:
    """OpenAI's (Go's) duration format: "0s", "250ms", "1.5s", "6m0s"."""
    ms = max(0, round(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms" if ms else "0s"
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"
