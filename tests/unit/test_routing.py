"""gateway/routing.py: the consistent-hash ring, spill-over, and the router that keeps a conversation on the
replica holding its KV and spreads new ones (over the in-process placements; the Redis ones that fronts
share: tests/unit/test_placement.py)."""

from __future__ import annotations

import asyncio
from collections import Counter

from kvgate.gateway.placement import MemoryPlacements
from kvgate.gateway.routing import Ring, Router, conversation_key

KEYS = [f"text:{i}" for i in range(2000)]


def test_keys_spread_over_the_workers_and_stay_put():
    ring = Ring(["w0", "w1", "w2"])
    spread = Counter(ring.owner(k) for k in KEYS)
    assert set(spread) == {"w0", "w1", "w2"} and min(spread.values()) > len(KEYS) / 3 * 0.6
    assert [Ring(["w0", "w1", "w2"]).owner(k) for k in KEYS] == [ring.owner(k) for k in KEYS]


def test_a_new_worker_takes_keys_only_from_the_others_share():
    before, after = Ring(["w0", "w1", "w2"]), Ring(["w0", "w1", "w2", "w3"])
    moved = [k for k in KEYS if before.owner(k) != after.owner(k)]
    assert all(after.owner(k) == "w3" for k in moved)  # nothing moves between the old workers
    assert len(moved) < len(KEYS) * 0.4


def test_the_worker_holding_most_documents_is_preferred():
    ring = Ring(["w0", "w1"])
    keys = [k for k in KEYS if ring.owner(k) == "w1"][:2] + [k for k in KEYS if ring.owner(k) == "w0"][:1]
    assert ring.preferred(keys) == "w1"
    assert ring.preferred([]) is None


def test_a_busy_worker_spills_to_the_least_loaded():
    ring = Ring(["w0", "w1", "w2"])
    key = next(k for k in KEYS if ring.owner(k) == "w0")
    load = {"w0": 0, "w1": 3, "w2": 1}
    assert ring.order([key], load.__getitem__, spill_at=2) == ["w0", "w2", "w1"]
    load["w0"] = 2
    assert ring.order([key], load.__getitem__, spill_at=2) == ["w2", "w0", "w1"]
    assert ring.order([], load.__getitem__, spill_at=2)[0] == "w2"  # nothing to hold: the least loaded


SYSTEM = {"role": "system", "content": "You are a travel agent."}


def turn(first: str, *more: dict) -> dict:
    return {"messages": [SYSTEM, {"role": "user", "content": first}, *more]}


def test_every_turn_of_a_conversation_has_its_first_turns_key():
    first = conversation_key("t", turn("Book Rome."), None, [])
    call = {"id": "call_1", "type": "function", "function": {"name": "book", "arguments": '{"city": "Rome"}'}}
    renamed = {**call, "id": "call_rewritten", "function": {**call["function"], "arguments": '{ "city":"Rome" }'}}
    later = turn("Book Rome.", {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "content": "ok"})
    assert conversation_key("t", later, None, []) == first
    assert conversation_key("t", turn("Book Rome.", {"role": "assistant", "tool_calls": [renamed]}), None, []) == first
    others = [
        conversation_key("u", turn("Book Rome."), None, []),  # another tenant
        conversation_key("t", turn("Book Oslo."), None, []),
        conversation_key("t", {**turn("Book Rome."), "tools": [{"type": "function"}]}, None, []),
        conversation_key("t", turn("Book Rome."), None, ["text:abc"]),  # other documents
        conversation_key("t", turn("Book Rome."), "agent-1", []),  # a program is its own
    ]
    assert first not in others and len(set(others)) == len(others)
    assert conversation_key("t", {"prompt": "Book Rome."}, None, []) is None
    odd = {"messages": [{"role": "assistant", "tool_calls": 5.0, "content": [1, {}]}, {"role": "user"}]}
    assert conversation_key("t", odd, None, [])  # found by fuzzing: a proxy forwards bodies it did not read


def route(router: Router, key: str | None, load: dict[str, int], affinity: tuple[str, ...] = ()) -> str:
    """Where the router sends a request, which then is served there."""

    async def go() -> str:
        first = (await router.order(list(load), key, affinity, load.__getitem__))[0]
        await router.served(key, first)
        return first

    return asyncio.run(go())


def test_a_conversation_stays_on_its_replica_and_new_ones_spread_evenly():
    router = Router(["r0", "r1", "r2"], MemoryPlacements(), spill_at=4)
    idle = {"r0": 0, "r1": 0, "r2": 0}
    homes = {f"c{n}": route(router, f"c{n}", idle) for n in range(7)}
    assert sorted(Counter(homes.values()).values()) == [2, 2, 3]  # none above its share plus one
    for _ in range(3):
        assert all(route(router, key, idle) == home for key, home in homes.items())
    assert route(router, "c0", {"r0": 1, "r1": 0, "r2": 0}) == homes["c0"]  # a little busier: it stays


def test_a_busy_replica_spills_the_turn_and_the_conversation_moves_with_it():
    router = Router(["r0", "r1"], MemoryPlacements(), spill_at=2)
    assert route(router, "c", {"r0": 0, "r1": 0}) == "r0"
    assert route(router, "c", {"r0": 2, "r1": 0}) == "r1"  # spilled: its KV is there now
    assert route(router, "c", {"r0": 0, "r1": 1}) == "r1"
    assert route(router, "c", {"r0": 0}) == "r0"  # r1 no longer serves the model: the conversation moves


def test_a_new_conversation_goes_where_its_documents_are():
    router = Router(["r0", "r1"], MemoryPlacements(), spill_at=2)
    doc = next(k for k in KEYS if router.ring.owner(k) == "r1")
    assert route(router, "a", {"r0": 0, "r1": 0}, (doc,)) == "r1"
    assert route(router, "b", {"r0": 0, "r1": 3}, (doc,)) == "r0"  # unless its replica is busy
    assert route(router, None, {"r0": 0, "r1": 0}) == "r0"  # nothing to tell: the fewest conversations, in order


def test_placements_are_bounded_and_expire():
    now = [0.0]
    kept = MemoryPlacements(max_count=2, ttl_s=10.0, clock=lambda: now[0])
    router = Router(["r0", "r1"], kept, spill_at=4)
    for key in ("a", "b", "c"):
        route(router, key, {"r0": 0, "r1": 0})
    assert len(kept) == 2 and asyncio.run(kept.where("a")) is None  # the least recently placed went
    now[0] = 10.0
    assert asyncio.run(kept.where("b")) is None and len(kept) == 0


def test_round_robin_takes_each_replica_in_turn_whatever_the_conversation():
    router = Router(["r0", "r1"], MemoryPlacements(), spill_at=4, policy="round_robin")
    assert [route(router, "c", {"r0": 0, "r1": 0}) for _ in range(4)] == ["r1", "r0", "r1", "r0"]


def test_each_decision_is_counted_by_why_it_was_made():
    """kvgate_routing_decisions_total{reason}: every reason from the start (at 0), each request under one."""
    router = Router(["r0", "r1"], MemoryPlacements(), spill_at=2)
    assert router.decisions == dict.fromkeys(("conversation", "documents", "fewest", "spilled", "round_robin"), 0)
    doc = next(k for k in KEYS if router.ring.owner(k) == "r1")
    route(router, "c", {"r0": 0, "r1": 0})  # new, nothing to tell: fewest
    route(router, "c", {"r0": 0, "r1": 0})  # its replica
    route(router, "c", {"r0": 2, "r1": 0})  # its replica busy: spilled
    route(router, "d", {"r0": 0, "r1": 0}, (doc,))  # where its documents are
    route(router, "e", {"r0": 0, "r1": 3}, (doc,))  # their replica busy: spilled
    assert router.decisions == {"conversation": 1, "documents": 1, "fewest": 1, "spilled": 2, "round_robin": 0}
    turns = Router(["r0", "r1"], MemoryPlacements(), spill_at=2, policy="round_robin")
    route(turns, "c", {"r0": 0, "r1": 0})
    assert turns.decisions["round_robin"] == 1 and sum(turns.decisions.values()) == 1
