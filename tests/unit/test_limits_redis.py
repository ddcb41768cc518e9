"""kvgate.gateway.limits.RedisLimiter against a real redis-server: what it stores, the server's clock, one
connection for every request, cluster detection, and an outage told to the operator once, and its end."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import time

import pytest
from redis.asyncio.cluster import RedisCluster

from kvgate.gateway.limits import WINDOW_S, Limits, RedisLimiter, Verdict
from tests.helpers.redis_server import RedisServer

ALLOW = Verdict(True, 0.0, {})  # what a request gets while Redis is not asked


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvgate.limits" and r.levelno == logging.WARNING]


def test_keys_are_stored_under_a_fixed_length_hash(redis_url: str, redis_server: RedisServer) -> None:
    async def run() -> None:
        limits = RedisLimiter(redis_url)
        try:
            for key in ("sk-short", "sk-" + "x" * 500):
                await limits.admit(key, Limits(rpm=3))
        finally:
            await limits.close()
        with redis_server.client() as raw:
            stored = sorted(k.decode() for k in raw.keys("*"))
        assert stored == sorted(limits.name(k) for k in ("sk-short", "sk-" + "x" * 500))
        assert all(re.fullmatch(r"kvgate:rl:[0-9a-f]{32}", k) for k in stored)

    asyncio.run(run())


def test_tokens_count_from_one_and_only_against_tpm(redis_url: str, redis_server: RedisServer) -> None:
    async def run() -> None:
        limits = RedisLimiter(redis_url)
        try:
            for tokens in (0, -5):
                await limits.spend("k", Limits(tpm=1), tokens)
            with redis_server.client() as raw:
                assert raw.keys("*") == []  # nothing spent: nothing written
            await limits.spend("k", Limits(rpm=5), 10**6)  # no tpm on that request: its tokens are not counted
            assert (await limits.admit("k", Limits(tpm=100))).headers["x-ratelimit-remaining-tokens"] == "100"
            await limits.spend("k", Limits(tpm=100), 99)
            assert (await limits.admit("k", Limits(rpm=5))).allowed  # a key without tpm is not refused for tokens
            assert (await limits.admit("k", Limits(tpm=100))).allowed  # nor one with tpm for its requests
            await limits.spend("k", Limits(tpm=100), 1)
            refused = await limits.admit("k", Limits(tpm=100))
            assert refused.allowed is False and refused.headers["x-ratelimit-remaining-tokens"] == "0"
        finally:
            await limits.close()

    asyncio.run(run())


def test_retry_after_is_on_the_servers_clock(redis_url: str, redis_server: RedisServer) -> None:
    async def run() -> None:
        limits = RedisLimiter(redis_url)
        try:
            for attempt in range(3):
                with redis_server.client() as raw:
                    before = raw.time()
                    await limits.admit(f"k{attempt}", Limits(rpm=1))
                    refused = await limits.admit(f"k{attempt}", Limits(rpm=1))
                    after = raw.time()
                start, end = before[0] + before[1] / 1e6, after[0] + after[1] / 1e6
                if start // WINDOW_S == end // WINDOW_S:
                    break
            # One request counts until the end of the window after its own: Retry-After says when that is.
            until = (start // WINDOW_S + 2) * WINDOW_S - refused.retry_after_s
            assert start - 0.002 <= until <= end
        finally:
            await limits.close()

    asyncio.run(run())


def test_one_connection_serves_every_request(redis_url: str, redis_server: RedisServer) -> None:
    async def run() -> None:
        limits = RedisLimiter(redis_url)
        try:
            for _ in range(20):
                await limits.admit("k", Limits(rpm=100))
        finally:
            await limits.close()

    with redis_server.client() as raw:
        before = raw.info("stats")["total_connections_received"]
    asyncio.run(run())
    with redis_server.client() as raw:
        assert raw.info("stats")["total_connections_received"] - before <= 2  # the limiter's and this one


def test_a_server_that_denies_info_is_taken_for_a_single_server() -> None:
    async def run(url: str) -> None:
        limits = RedisLimiter(url)
        try:
            assert (await limits.admit("k", Limits(rpm=1))).allowed
            assert (await limits.admit("k", Limits(rpm=1))).allowed is False
        finally:
            await limits.close()

    with RedisServer() as server:
        with server.client() as raw:
            raw.acl_setuser("gw", enabled=True, passwords=["+pw-1"], keys=["*"], commands=["+@all", "-info"])
        asyncio.run(run(server.url.replace("://", "://gw:pw-1@")))


def test_a_cluster_is_spoken_to_as_one_with_the_timeouts() -> None:
    async def run(node: RedisServer) -> None:
        limits = RedisLimiter(node.url, timeout_s=0.3, retry_s=60)
        try:
            assert (await limits.admit("k", Limits(rpm=1))).allowed
            assert isinstance(limits._redis, RedisCluster)
            assert node.process is not None
            os.kill(node.process.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                assert await asyncio.wait_for(limits.admit("k", Limits(rpm=1)), 10) == ALLOW
                assert time.monotonic() - started < 5
            finally:
                os.kill(node.process.pid, signal.SIGCONT)
        finally:
            await limits.close()

    with RedisServer(cluster=True) as node:
        asyncio.run(run(node))


def test_by_default_a_paused_redis_costs_half_a_second_and_is_tried_again_after_one() -> None:
    async def run(server: RedisServer) -> None:
        limits = RedisLimiter(server.url)
        try:
            assert (await limits.admit("k", Limits(rpm=5))).allowed
            assert server.process is not None
            os.kill(server.process.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                assert await limits.admit("k", Limits(rpm=5)) == ALLOW
                assert 0.4 < time.monotonic() - started < 1.0
                assert await limits.admit("k", Limits(rpm=5)) == ALLOW  # not asked: no headers
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
            await asyncio.sleep(1.2)
            assert (await limits.admit("k", Limits(rpm=5))).headers  # asked again: limits hold
        finally:
            await limits.close()

    with RedisServer() as server:
        asyncio.run(run(server))


def test_an_outage_is_logged_once_and_its_end_once(caplog: pytest.LogCaptureFixture) -> None:
    async def run(server: RedisServer) -> None:
        limits = RedisLimiter(server.url, retry_s=0)
        try:
            assert (await limits.admit("k", Limits(rpm=5))).allowed
            assert warnings(caplog) == []
            for outage in range(2):
                server.kill()
                for _ in range(3):
                    assert await limits.admit("k", Limits(rpm=5)) == ALLOW
                (down,) = warnings(caplog)[2 * outage :]
                assert down.startswith(f"redis at {server.url} is unreachable (ConnectionError: ")
                assert re.search(r"\(ConnectionError: .*connect.*\); rate limits are not enforced$", down, re.I)
                server.start()
                for _ in range(2):
                    assert (await limits.admit("k", Limits(rpm=5))).allowed
                assert warnings(caplog)[2 * outage + 1 :] == [
                    f"redis at {server.url} is back; rate limits are enforced again"
                ]
        finally:
            await limits.close()

    with caplog.at_level(logging.WARNING, logger="kvgate.limits"), RedisServer() as server:
        asyncio.run(run(server))


def test_a_failing_command_fails_open_with_a_warning(
    redis_url: str, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    async def run() -> None:
        limits = RedisLimiter(redis_url, retry_s=60)
        try:
            with redis_server.client() as raw:
                raw.set(limits.name("k"), "not a hash")
            assert await limits.admit("k", Limits(rpm=1)) == ALLOW
            (failed,) = warnings(caplog)
            assert failed.startswith(f"redis at {redis_url} failed (ResponseError: WRONGTYPE")
            assert failed.endswith("; rate limits are not enforced")
            assert (await limits.admit("other", Limits(rpm=1))).allowed  # Redis is asked again at once
            assert (await limits.admit("other", Limits(rpm=1))).allowed is False
        finally:
            await limits.close()

    with caplog.at_level(logging.WARNING, logger="kvgate.limits"):
        asyncio.run(run())
