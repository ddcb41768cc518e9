"""kvgate.gateway.limits: rpm and tpm per API key, in one process (on a clock the tests move) and shared
through a real redis-server by several limiters, as several gateway processes would share it."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvgate.gateway.limits import WINDOW_S, Counts, Limits, MemoryLimiter, RedisLimiter, Verdict, duration, limiter
from tests.helpers.redis_server import RedisServer

START = 1000 * WINDOW_S + 10.0  # 10 s into a fixed window
REQUEST_HEADERS = {"x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"}
TOKEN_HEADERS = {"x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"}


class Clock:
    def __init__(self, now: float = START) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# --- in one process -----------------------------------------------------------------------------


def test_rpm_refuses_the_request_past_it_and_counts_no_refused_one() -> None:
    async def run() -> None:
        limits = MemoryLimiter(Clock())
        for remaining in (2, 1, 0):
            verdict = await limits.admit("k", Limits(rpm=3))
            assert verdict.allowed and verdict.retry_after_s == 0
            assert verdict.headers["x-ratelimit-remaining-requests"] == str(remaining)
        for _ in range(3):
            refused = await limits.admit("k", Limits(rpm=3))
            assert not refused.allowed and refused.headers["x-ratelimit-remaining-requests"] == "0"
            # Three requests 10 s into the window: at 20 s into the next, 2/3 of them still count.
            assert refused.retry_after_s == pytest.approx(70, abs=0.002)
        assert (await limits.admit("other", Limits(rpm=3))).allowed  # budgets are per key

    asyncio.run(run())


def test_the_window_rolls_and_a_retry_after_retry_after_fits() -> None:
    async def run() -> None:
        clock = Clock()
        limits = MemoryLimiter(clock)
        for _ in range(3):
            await limits.admit("k", Limits(rpm=3))
        refused = await limits.admit("k", Limits(rpm=3))
        clock.now = START + refused.retry_after_s - 0.01
        assert not (await limits.admit("k", Limits(rpm=3))).allowed
        clock.now = START + refused.retry_after_s
        assert (await limits.admit("k", Limits(rpm=3))).allowed
        assert not (await limits.admit("k", Limits(rpm=3))).allowed
        clock.now += 2 * WINDOW_S  # both windows have passed: the whole budget is back
        verdict = await limits.admit("k", Limits(rpm=3))
        assert verdict.allowed and verdict.headers["x-ratelimit-remaining-requests"] == "2"

    asyncio.run(run())


def test_tpm_refuses_the_next_request_once_spent_tokens_reach_it() -> None:
    async def run() -> None:
        clock = Clock()
        limits = MemoryLimiter(clock)
        tpm = Limits(tpm=100)
        assert (await limits.admit("k", tpm)).allowed
        await limits.spend("k", tpm, 60)
        verdict = await limits.admit("k", tpm)
        assert verdict.allowed and verdict.headers["x-ratelimit-remaining-tokens"] == "40"
        await limits.spend("k", tpm, 50)  # the response went over: the next request is refused
        refused = await limits.admit("k", tpm)
        assert not refused.allowed and refused.headers["x-ratelimit-remaining-tokens"] == "0"
        # 110 tokens 10 s into the window: 100/110 of them still count 50 + 60/11 s later.
        assert refused.retry_after_s == pytest.approx(50 + 60 / 11, abs=0.002)
        clock.now += refused.retry_after_s
        assert (await limits.admit("k", tpm)).allowed
        await limits.spend("k", Limits(rpm=5), 10**6)  # no tpm: tokens are not counted
        assert (await limits.admit("k", Limits(rpm=5))).allowed

    asyncio.run(run())


def test_headers_name_only_the_limits_set_and_unlimited_is_always_allowed() -> None:
    async def run() -> None:
        limits = MemoryLimiter(Clock())
        both = await limits.admit("a", Limits(rpm=10, tpm=1000))
        assert set(both.headers) == REQUEST_HEADERS | TOKEN_HEADERS
        assert both.headers["x-ratelimit-limit-requests"] == "10" and both.headers["x-ratelimit-limit-tokens"] == "1000"
        assert both.headers["x-ratelimit-reset-requests"] == "1m50s"  # until nothing is counted
        assert both.headers["x-ratelimit-reset-tokens"] == "0s"  # no tokens spent
        assert set((await limits.admit("b", Limits(rpm=10))).headers) == REQUEST_HEADERS
        assert set((await limits.admit("c", Limits(tpm=10))).headers) == TOKEN_HEADERS
        for _ in range(1000):
            assert await limits.admit("d", Limits()) == Verdict(True, 0.0, {})
        await limits.spend("d", Limits(), 10**9)

    asyncio.run(run())


def test_durations_are_in_openais_format() -> None:
    assert [duration(s) for s in (0, 0.0004, 0.25, 1, 1.5, 59.9996, 86.4, 360)] == [
        "0s",
        "0s",
        "250ms",
        "1s",
        "1.5s",
        "1m0s",
        "1m26.4s",
        "6m0s",
    ]


def test_limits_are_positive_or_none() -> None:
    for bad, message in (({"rpm": 0}, "rpm must be at least 1"), ({"tpm": -1}, "tpm must be at least 1")):
        with pytest.raises(ValueError, match=message):
            Limits(**bad)
    shared = limiter("redis://x")
    assert isinstance(limiter(None), MemoryLimiter) and isinstance(shared, RedisLimiter) and shared.url == "redis://x"


def test_tpm_counts_tokens_from_one_and_spending_exactly_tpm_refuses() -> None:
    async def run() -> None:
        limits = MemoryLimiter(Clock())
        await limits.spend("idle", Limits(tpm=1), 0)  # nothing spent: nothing stored
        assert "idle" not in limits._counts
        await limits.spend("k", Limits(tpm=1), -5)
        await limits.spend("k", Limits(rpm=5), 10**6)  # no tpm on that request: its tokens are not counted
        assert (await limits.admit("k", Limits(tpm=100))).headers["x-ratelimit-remaining-tokens"] == "100"
        await limits.spend("k", Limits(tpm=1), 1)
        refused = await limits.admit("k", Limits(tpm=1))
        assert refused.allowed is False and refused.headers["x-ratelimit-remaining-tokens"] == "0"

    asyncio.run(run())


def test_spending_exactly_tpm_asks_to_wait_until_the_window_rolls() -> None:
    async def run() -> None:
        clock = Clock()
        limits = MemoryLimiter(clock)
        await limits.spend("k", Limits(tpm=100), 100)
        refused = await limits.admit("k", Limits(tpm=100))
        clock.now += refused.retry_after_s
        assert (await limits.admit("k", Limits(tpm=100))).allowed

    asyncio.run(run())


def test_tokens_of_the_last_window_alone_can_refuse_until_their_share_fits() -> None:
    async def run() -> None:
        clock = Clock()
        limits = MemoryLimiter(clock)
        await limits.spend("k", Limits(tpm=100), 200)  # one long answer: twice the budget
        clock.now = (START // WINDOW_S + 1) * WINDOW_S + 15  # 15 s into the next window: 75 % of 200 counts
        refused = await limits.admit("k", Limits(tpm=100))
        assert refused.allowed is False and refused.retry_after_s == pytest.approx(
            15.001, abs=1e-9
        )  # 200 * share <= 100
        clock.now += refused.retry_after_s
        assert (await limits.admit("k", Limits(tpm=100))).allowed

    asyncio.run(run())


def test_the_last_windows_share_falls_and_retry_after_is_when_it_fits() -> None:
    async def run() -> None:
        clock = Clock()
        limits = MemoryLimiter(clock)
        for _ in range(3):
            await limits.admit("a", Limits(rpm=3))
        for _ in range(4):
            await limits.admit("b", Limits(rpm=4))
        window = (START // WINDOW_S + 1) * WINDOW_S
        clock.now = window + 19.5  # 19.5 s into the next window: 67.5 % of the last one counts
        refused = await limits.admit("a", Limits(rpm=3))  # 3 * 0.675 + 1 > 3, until 3 * share + 1 <= 3 in 0.5 s
        assert refused.allowed is False and refused.retry_after_s == pytest.approx(0.501, abs=1e-9)
        assert refused.headers["x-ratelimit-reset-requests"] == "40.5s"  # the last window's share ends
        clock.now += refused.retry_after_s
        assert (await limits.admit("a", Limits(rpm=3))).allowed
        clock.now = window + 30  # 30 s in: 4 * 0.5 + 2 fit in 4, one more does not until 4 * share + 2 <= 3
        assert (await limits.admit("b", Limits(rpm=4))).allowed and (await limits.admit("b", Limits(rpm=4))).allowed
        refused = await limits.admit("b", Limits(rpm=4))
        assert refused.retry_after_s == pytest.approx(15.001, abs=1e-9)
        assert refused.headers["x-ratelimit-reset-requests"] == "1m30s"  # this window's ones count until the next

    asyncio.run(run())


def test_spent_tokens_count_in_the_next_window_by_their_share() -> None:
    async def run() -> None:
        clock = Clock()
        limits = MemoryLimiter(clock)
        await limits.spend("k", Limits(tpm=1000), 600)
        assert (await limits.admit("k", Limits(tpm=1000))).headers["x-ratelimit-reset-tokens"] == "1m50s"
        clock.now += WINDOW_S + 20  # 30 s into the next window: half of the 600 count
        verdict = await limits.admit("k", Limits(tpm=1000))
        assert verdict.headers["x-ratelimit-remaining-tokens"] == "700"
        assert verdict.headers["x-ratelimit-reset-tokens"] == "30s"

    asyncio.run(run())


def test_keys_idle_for_two_windows_are_forgotten_once_a_window() -> None:
    async def run() -> None:
        clock = Clock()
        limits = MemoryLimiter(clock)
        await limits.admit("old", Limits(rpm=1))
        clock.now += WINDOW_S
        await limits.admit("new", Limits(rpm=1))
        assert set(limits._counts) == {"old", "new"}  # idle for one window: still counts
        clock.now += WINDOW_S
        await limits.admit("new", Limits(rpm=1))
        assert set(limits._counts) == {"new"}
        limits._counts["planted"] = Counts(0)
        await limits.admit("new", Limits(rpm=1))
        assert "planted" in limits._counts  # not swept again within the window
        clock.now += WINDOW_S
        await limits.admit("new", Limits(rpm=1))
        assert set(limits._counts) == {"new"}

    asyncio.run(run())


def test_a_clock_stepped_back_forgets_the_counts_and_does_not_fail() -> None:
    async def run() -> None:
        clock = Clock()
        limits = MemoryLimiter(clock)
        await limits.admit("k", Limits(rpm=1))
        clock.now -= 3 * WINDOW_S  # NTP stepped the wall clock back
        assert (await limits.admit("k", Limits(rpm=1))).allowed

    asyncio.run(run())


# --- shared through Redis -----------------------------------------------------------------------


def test_redis_refuses_past_rpm_and_its_keys_expire_unnamed(redis_url: str, redis_server: RedisServer) -> None:
    async def run() -> Verdict:
        limits = RedisLimiter(redis_url)
        try:
            for remaining in (2, 1, 0):
                verdict = await limits.admit("sk-secret", Limits(rpm=3))
                assert verdict.allowed and verdict.headers["x-ratelimit-remaining-requests"] == str(remaining)
            return await limits.admit("sk-secret", Limits(rpm=3))
        finally:
            await limits.close()

    refused = asyncio.run(run())
    assert not refused.allowed and refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert 0 < refused.retry_after_s <= 2 * WINDOW_S
    with redis_server.client() as raw:
        (key,) = raw.keys("*")
        assert key.startswith(b"kvgate:rl:") and b"sk-secret" not in key
        assert 0 < raw.ttl(key) <= 2 * WINDOW_S


def test_redis_counts_roll_with_the_window(redis_url: str, redis_server: RedisServer) -> None:
    limits = RedisLimiter(redis_url)
    both = Limits(rpm=3, tpm=1000)

    async def admit() -> Verdict:
        return await limits.admit("k", both)

    async def run() -> None:
        try:
            for _ in range(3):
                await admit()
            await limits.spend("k", both, 100)
            assert not (await admit()).allowed
            with redis_server.client() as raw:  # as if the counts were from the window before: they count less
                raw.hincrby(limits.name("k"), "w", -1)
            verdict = await admit()
            assert 900 <= int(verdict.headers["x-ratelimit-remaining-tokens"]) <= 1000
            with redis_server.client() as raw:  # two windows ago: nothing counts
                raw.hincrby(limits.name("k"), "w", -2)
            verdict = await admit()
            assert verdict.allowed and verdict.headers["x-ratelimit-remaining-requests"] == "2"
            assert verdict.headers["x-ratelimit-remaining-tokens"] == "1000"
        finally:
            await limits.close()

    asyncio.run(run())


@pytest.mark.parametrize("cluster", [False, True], ids=["single", "cluster"])
def test_two_limiters_share_one_budget(redis_server: RedisServer, redis_url: str, cluster: bool) -> None:
    async def run(redis_url: str) -> None:
        one, two = RedisLimiter(redis_url), RedisLimiter(redis_url)
        try:
            rpm = Limits(rpm=4)
            for limits in (one, two, one, two):
                assert (await limits.admit("k", rpm)).allowed
            for limits in (one, two):
                refused = await limits.admit("k", rpm)
                assert not refused.allowed and refused.retry_after_s > 0
            tpm = Limits(tpm=100)
            assert (await one.admit("t", tpm)).allowed
            await one.spend("t", tpm, 100)
            refused = await two.admit("t", tpm)
            assert not refused.allowed and refused.headers["x-ratelimit-remaining-tokens"] == "0"
        finally:
            await one.close()
            await two.close()

    if not cluster:
        asyncio.run(run(redis_url))
        return
    with RedisServer(cluster=True) as node:
        asyncio.run(run(node.url))


def test_redis_down_allows_requests_and_limits_come_back_with_it() -> None:
    async def run(redis_server: RedisServer) -> None:
        limits = RedisLimiter(redis_server.url, retry_s=0)
        try:
            assert (await limits.admit("k", Limits(rpm=1))).allowed
            assert not (await limits.admit("k", Limits(rpm=1))).allowed
            redis_server.kill()
            started = time.monotonic()
            for _ in range(3):
                assert await limits.admit("k", Limits(rpm=1)) == Verdict(True, 0.0, {})  # fails open
            await limits.spend("k", Limits(tpm=1), 5)
            assert time.monotonic() - started < 2
            redis_server.start()  # empty again: one request fits, the next does not
            assert (await limits.admit("k", Limits(rpm=1))).allowed
            assert not (await limits.admit("k", Limits(rpm=1))).allowed
        finally:
            await limits.close()

    with RedisServer() as redis_server:
        asyncio.run(run(redis_server))


def test_redis_down_at_start_allows_and_skips_redis_for_a_while() -> None:
    async def run(redis_url: str) -> None:
        limits = RedisLimiter(redis_url, retry_s=60)
        try:
            for _ in range(3):
                assert (await limits.admit("k", Limits(rpm=1))).allowed
        finally:
            await limits.close()

    with RedisServer() as redis_server:
        redis_server.kill()
        asyncio.run(run(redis_server.url))


def test_a_paused_redis_costs_one_timeout_then_limits_come_back() -> None:
    """A redis-server stopped with SIGSTOP accepts connections and never answers: a request waits one
    socket timeout, whether on a command or on a new connection's AUTH, is allowed, and Redis is left
    alone for retry_s; once it answers again, the counts before the pause hold."""
    import os
    import signal

    async def run(redis_server: RedisServer) -> None:
        limits = RedisLimiter(redis_server.url.replace("://", "://:pw-4711@"), timeout_s=0.3, retry_s=0.5)
        try:
            assert (await limits.admit("k", Limits(rpm=1))).allowed
            assert redis_server.process is not None
            os.kill(redis_server.process.pid, signal.SIGSTOP)
            try:
                for _ in range(2):  # the command on the open connection, then a new connection
                    started = time.monotonic()
                    assert await limits.admit("k", Limits(rpm=1)) == Verdict(True, 0.0, {})
                    assert time.monotonic() - started < 0.6  # one timeout
                    started = time.monotonic()
                    assert (await limits.admit("k", Limits(rpm=1))).allowed
                    assert time.monotonic() - started < 0.05  # not tried again for retry_s
                    await asyncio.sleep(0.5)
            finally:
                os.kill(redis_server.process.pid, signal.SIGCONT)
            assert not (await limits.admit("k", Limits(rpm=1))).allowed
        finally:
            await limits.close()

    with RedisServer() as redis_server:
        with redis_server.client() as raw:
            raw.config_set("requirepass", "pw-4711")
        asyncio.run(run(redis_server))
