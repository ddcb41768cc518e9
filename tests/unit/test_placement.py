"""gateway/placement.py in a real Redis: what one front placed, another finds; the count is bounded, each
placement expires, and a Redis that does not answer is no placement (logged once), never an error."""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis

from kvgate.gateway.placement import RedisPlacements
from tests.helpers.servers import free_port


def test_what_one_front_placed_another_finds_and_counts(redis_url: str) -> None:
    async def check() -> None:
        one, two = RedisPlacements(redis_url), RedisPlacements(redis_url)
        await one.place("c1", "r0")
        await one.place("c2", "r0")
        await two.place("c3", "r1")
        assert await two.where("c1") == "r0" and await one.where("c3") == "r1" and await one.where("new") is None
        assert await two.live(["r0", "r1", "r2"]) == {"r0": 2, "r1": 1, "r2": 0}
        await two.place("c1", "r1")  # spilled or moved: counted where it is now
        assert await one.live(["r0", "r1"]) == {"r0": 1, "r1": 2} and await one.where("c1") == "r1"
        await one.close()
        await two.close()

    asyncio.run(check())


def test_placements_in_redis_are_bounded_and_expire(redis_url: str) -> None:
    async def check() -> None:
        kept = RedisPlacements(redis_url, max_count=2, ttl_s=1.0)
        for key in ("a", "b", "c"):
            await kept.place(key, "r0")
        assert await kept.where("a") is None and await kept.live(["r0"]) == {"r0": 2}  # the oldest went
        await asyncio.sleep(1.2)
        assert await kept.where("b") is None and await kept.live(["r0"]) == {"r0": 0}
        await kept.close()

    asyncio.run(check())
    with redis.Redis.from_url(redis_url) as raw:
        assert raw.zcard("kvgate:place:all") == 0 and not raw.keys("kvgate:place:k:*")


def test_a_redis_that_does_not_answer_is_no_placement(caplog: pytest.LogCaptureFixture) -> None:
    async def check() -> None:
        kept = RedisPlacements(f"redis://127.0.0.1:{free_port()}")  # nothing listens there
        await kept.place("c", "r0")
        assert await kept.where("c") is None and await kept.live(["r0", "r1"]) == {"r0": 0, "r1": 0}
        await kept.close()

    with caplog.at_level(logging.WARNING, logger="kvgate.routing"):
        asyncio.run(check())
    assert caplog.messages == ["redis did not answer (ConnectionError); requests are routed without placements"]
