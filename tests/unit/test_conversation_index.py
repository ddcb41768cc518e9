"""gateway/conversation_index.py: the answered turns a later request continues, in a real Redis. What one
front answered, another continues; a turn used again is kept as long again; the count is bounded, each
turn expires; a Redis that does not answer finds nothing (logged once), never an error."""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis

from kvgate.gateway.conversation_index import InProcess, InRedis, conversation_index
from tests.helpers.servers import free_port

ASKED = [{"role": "system", "content": "You book trips."}, {"role": "user", "content": "Book Oslo."}]
CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "book", "arguments": '{"city": "Oslo"}'}}],
}
TOOLS = [{"type": "function", "function": {"name": "book", "parameters": {"type": "object"}}}]


def next_turn(call_id: str = "call_1") -> list[dict]:
    """The framework's next request: the history, the answer as it was given (its call id rewritten, maybe),
    the tool's result."""
    answered = {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "id": call_id}]}
    return [*ASKED, answered, {"role": "tool", "tool_call_id": call_id, "content": "booked"}]


def test_what_one_front_answered_another_continues(redis_url: str) -> None:
    async def check() -> None:
        one, two = InRedis(redis_url, 100, 60.0), InRedis(redis_url, 100, 60.0)
        assert await two.find("t", TOOLS, next_turn()) is None
        await one.remember("t", TOOLS, ASKED, CALL, "conv-1")
        assert await two.find("t", TOOLS, next_turn("call_other")) == "conv-1"
        assert await two.find("other tenant", TOOLS, next_turn()) is None
        assert await two.find("t", None, next_turn()) is None  # other tools: another conversation
        done = {"role": "assistant", "content": "Booked your trip to Oslo."}
        await two.remember("t", TOOLS, next_turn(), done, "conv-1")
        third = [*next_turn(), done, {"role": "user", "content": "And a hotel?"}]  # two answered turns to look up
        assert await one.find("t", TOOLS, third) == "conv-1"
        await one.close()
        await two.close()

    asyncio.run(check())


def test_turns_in_redis_are_bounded_and_expire_unless_used_again(redis_url: str) -> None:
    async def check() -> None:
        kept = InRedis(redis_url, capacity=2, ttl_s=1.0)
        for n in range(3):
            asked = [{"role": "user", "content": f"Book trip {n}."}]
            await kept.remember("t", None, asked, {"role": "assistant", "content": "Done."}, f"conv-{n}")
        found = [
            await kept.find(
                "t",
                None,
                [
                    {"role": "user", "content": f"Book trip {n}."},
                    {"role": "assistant", "content": "Done."},
                    {"role": "user", "content": "Thanks."},
                ],
            )
            for n in range(3)
        ]
        assert found == [None, "conv-1", "conv-2"]  # the least recently used went
        await asyncio.sleep(0.7)
        again = [{"role": "user", "content": "Book trip 2."}, {"role": "assistant", "content": "Done."}]
        assert await kept.find("t", None, [*again, {"role": "user", "content": "More."}]) == "conv-2"  # kept longer
        await asyncio.sleep(0.6)
        first = [{"role": "user", "content": "Book trip 1."}, {"role": "assistant", "content": "Done."}]
        assert await kept.find("t", None, [*first, {"role": "user", "content": "More."}]) is None  # expired
        assert await kept.find("t", None, [*again, {"role": "user", "content": "More."}]) == "conv-2"
        await kept.close()

    asyncio.run(check())
    with redis.Redis.from_url(redis_url) as raw:
        assert raw.zcard("kvgate:conv:all") == 2 and len(raw.keys("kvgate:conv:*:t:*")) == 1


def test_a_redis_that_does_not_answer_finds_nothing(caplog: pytest.LogCaptureFixture) -> None:
    async def check() -> None:
        kept = InRedis(f"redis://127.0.0.1:{free_port()}", 100, 60.0)  # nothing listens there
        await kept.remember("t", TOOLS, ASKED, CALL, "conv-1")
        assert await kept.find("t", TOOLS, next_turn()) is None
        await kept.close()

    with caplog.at_level(logging.WARNING, logger="kvgate.agents"):
        asyncio.run(check())
    assert caplog.messages == ["redis did not answer (ConnectionError); turns start new programs until it does"]


def test_without_redis_the_turns_live_in_this_process() -> None:
    async def check() -> None:
        kept = conversation_index(None, 100, 60.0)
        assert isinstance(kept, InProcess)
        await kept.remember("t", TOOLS, ASKED, CALL, "conv-1")
        assert await kept.find("t", TOOLS, next_turn("call_other")) == "conv-1"
        await kept.close()

    asyncio.run(check())
