"""gateway/tool_times.py: tool durations pooled by replicas on one real Redis. A replica that never saw a
tenant's tool pins for as long as that tool takes on another; each tool's durations and the tenant's tools
are bounded; a Redis that does not answer keeps what a replica saw there, to pool once it answers."""

from __future__ import annotations

import logging

import pytest
import redis

from kvgate.agents import AgentConfig, Programs
from kvgate.agents.predictor import ANY, Seen
from kvgate.chunk_cache import ChunkStore, MemoryTier
from kvgate.gateway.tool_times import RedisToolTimes
from tests.helpers.servers import free_port
from tests.unit.test_chunk_cache import Clock
from tests.unit.test_programs import CALL, RESULT, FixedCosts


def replica(url: str, clock: Clock) -> Programs:
    store = ChunkStore([MemoryTier(budget_bytes=1 << 20, clock=clock)])
    return Programs(AgentConfig(), store, FixedCosts(), clock=clock, shared=RedisToolTimes(url))


def tool_turns(programs: Programs, clock: Clock, program: str, took_s: float) -> None:
    """A program's first turn (it calls `search`), the tool taking `took_s`, the turn with its result."""
    first = programs.begin(program, "tenant", [{"role": "user", "content": "go"}], 100)
    programs.end("tenant", first)
    clock.now += took_s
    second = programs.begin(program, "tenant", [CALL, RESULT], 150)
    clock.now += 1.0  # past the pooling interval
    programs.end("tenant", second)


def test_a_replica_learns_how_long_a_tool_takes_from_another(redis_url: str) -> None:
    clock = Clock()
    one, two = replica(redis_url, clock), replica(redis_url, clock)
    tool_turns(one, clock, "p1", 7.0)
    assert one.predictor("tenant").observed("search") == 1
    tool_turns(two, clock, "p2", 3.0)  # two's first turn ends: pooled with one's
    learnt = two.predictor("tenant")
    assert learnt.observed("search") == 2 and 7.0 in learnt.distribution(["search"])[0]
    assert learnt.after(("search",))[0]  # which call follows which, pooled too
    tool_turns(one, clock, "p3", 5.0)
    assert one.predictor("tenant").observed("search") == 3  # nothing counted twice
    assert two.predictor("other tenant").observed("search") == 0


def test_tenants_pooled_at_once_each_get_their_own(redis_url: str) -> None:
    times = RedisToolTimes(redis_url)
    seen = {"a": Seen(), "b": Seen()}
    seen["a"].add((), ("search",), 7.0)
    seen["b"].add((), ("fetch",), 2.0)
    seen["b"].add(("fetch",), ("fetch",), 3.0)
    pooled = times.exchange(seen)
    assert pooled["a"][0] == {ANY: [7.0], "search": [7.0]} and pooled["a"][1] == [((), ("search",), 1)]
    assert pooled["b"][0] == {ANY: [2.0, 3.0], "fetch": [2.0, 3.0]}
    assert sorted(pooled["b"][1]) == [((), ("fetch",), 1), (("fetch",), ("fetch",), 1)]
    times.close()


def test_a_tenants_durations_and_tools_are_bounded(redis_url: str) -> None:
    times = RedisToolTimes(redis_url, window=3, max_tools=2)
    seen = Seen()
    for n in range(5):
        seen.add((), (f"tool{n}",), float(n))
    pooled, _ = times.exchange({"tenant": seen})["tenant"]
    assert set(pooled) == {"tool3", "tool4", ANY} and pooled[ANY] == [2.0, 3.0, 4.0]  # oldest first
    with redis.Redis.from_url(redis_url) as raw:
        assert len(raw.keys("kvgate:tools:*:d:*")) == 3  # the dropped tools' lists went too
    times.close()


def test_a_redis_that_does_not_answer_keeps_what_was_seen_to_pool_later(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    away = Programs(
        AgentConfig(),
        ChunkStore([MemoryTier(budget_bytes=1 << 20, clock=clock)]),
        FixedCosts(),
        clock=clock,
        shared=RedisToolTimes(f"redis://127.0.0.1:{free_port()}"),  # nothing listens there
    )
    with caplog.at_level(logging.WARNING, logger="kvgate.agents"):
        tool_turns(away, clock, "p1", 7.0)
    assert away.predictor("tenant").observed("search") == 1  # still counts here
    assert caplog.messages == ["tool durations are not pooled: the shared store did not answer (ConnectionError)"]
    assert away.seen["tenant"].returns == [(("search",), 7.0)]  # kept for the next pooling
