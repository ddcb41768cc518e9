"""The decided pin policy against what memory does unpinned: no pin where memory keeps contexts
anyway, none that displaces fresher contexts worth more, a pin where eviction would lose a
predictable return; a returning turn holds its context until admitted. And a small simulated sweep:
decided pins never trail the better of no pins and a fixed TTL."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kvgate.agents import AgentConfig, PinPolicy, Programs, decide
from kvgate.bench.agents_sim import StepCosts
from kvgate.bench.agents_sweep import Regime, regime_jct, verdict
from kvgate.chunk_cache import ChunkKV, ChunkStore, MemoryTier
from tests.unit.test_chunk_cache import Clock
from tests.unit.test_programs import CALL, RESULT, FixedCosts, keep

DECIDE = PinPolicy("decide")
# A tool that takes 4 s, give or take little; the next turn comes in 3 cases out of 4.
WAITS = [1.0, 2.0, 3.0, 3.8, 4.0, 4.2, 30.0]
BACK = [0.0, 0.0, 0.0, 0.3, 0.6, 0.75, 0.75]


def test_no_pin_when_memory_keeps_contexts_past_the_longest_ttl() -> None:
    assert decide(DECIDE, WAITS, BACK, saved_s=100.0, held=0.1, resident_s=DECIDE.max_ttl_s) == 0.0
    assert decide(DECIDE, WAITS, BACK, saved_s=100.0, held=0.1, resident_s=math.inf) == 0.0


def test_a_pin_covers_a_predictable_return_that_eviction_would_lose() -> None:
    assert decide(DECIDE, WAITS, BACK, saved_s=2.0, held=0.3, resident_s=1.5) == 4.2


def test_the_queue_a_pinned_turn_passes_is_credited_to_the_pin_alone() -> None:
    # Returns spread on both sides of the residence (2 s). On the prefill alone, memory earns more per
    # second on fresher contexts; with the queue a pinned turn passes (program FCFS admits it first)
    # the pin to 4 s is worth it. Memory's contexts are found by chance: their rate stays the prefill's
    # (were the queue counted on both sides, it would cancel out and nothing would be pinned).
    waits, back = [1.0, 2.0, 4.0, 8.0], [0.2, 0.4, 0.7, 0.8]
    assert decide(DECIDE, waits, back, saved_s=1.0, held=0.1, resident_s=2.0) == 0.0
    assert decide(DECIDE, waits, back, saved_s=1.0, held=0.1, resident_s=2.0, passed_s=3.0) == 4.0
    # With no residence the memory is priced outright, against the whole saving.
    assert decide(DECIDE, waits, back, saved_s=1.0, held=0.5, passed_s=0.0) == 0.0
    assert decide(DECIDE, waits, back, saved_s=1.0, held=0.5, passed_s=3.0) == 4.0


def test_no_pin_when_memory_earns_more_on_fresher_contexts() -> None:
    # Most returns come within the residence: a pin for the rest would hold memory that
    # unpinned contexts use better (the same distribution, the same saving, any share of memory).
    early = [0.5, 1.0, 2.0, 6.0, 20.0]
    back = [0.3, 0.55, 0.68, 0.72, 0.75]
    for held in (0.01, 0.3, 0.9):
        assert decide(DECIDE, early, back, saved_s=50.0, held=held, resident_s=2.0) == 0.0


def test_a_pin_is_priced_at_what_memory_earns_on_the_contexts_it_keeps() -> None:
    # This program comes back after 4 s, past the residence (1.5 s): memory earns nothing on it
    # unpinned, so priced at its own rate the pin would look free. Memory's other contexts come back
    # within the residence: 1 s of prefill per 1.5 s for each quarter of memory. The pin's quarter
    # would earn more there than the pin wins; at a fifth of that rate, the pin wins.
    assert decide(DECIDE, WAITS, BACK, saved_s=1.0, held=0.25, resident_s=1.5) == 4.2
    memory = 1.0 / (1.5 * 0.25)
    assert decide(DECIDE, WAITS, BACK, saved_s=1.0, held=0.25, resident_s=1.5, memory_rate=memory) == 0.0
    assert decide(DECIDE, WAITS, BACK, saved_s=1.0, held=0.25, resident_s=1.5, memory_rate=memory / 5) == 4.2


def make(memory_bytes: int) -> tuple[Programs, ChunkStore, Clock]:
    clock = Clock()
    store = ChunkStore([MemoryTier(budget_bytes=memory_bytes, clock=clock, policy="lru")])
    costs = FixedCosts(bytes_per_token=8, memory_bytes=memory_bytes)  # as `keep` stores: float32 K and V
    return Programs(AgentConfig(pins=DECIDE), store, costs, clock=clock), store, clock


def rounds(programs: Programs, store: ChunkStore, clock: Clock, n: int, tool_s: float = 4.0) -> list[float]:
    """`n` programs run a turn each, 10 ms apart, call a tool that takes `tool_s`, come back, twice;
    the TTLs."""
    ttls = []
    for turn_no in range(3):
        for i in range(n):
            turn = programs.begin(f"p{i}", "t", [CALL, RESULT] if turn_no else [], 100)
            keep(store, turn, 100, clock.now)
            programs.end("t", turn)
            ttls.append(turn.pin_s)
            clock.now += 0.01
        clock.now += tool_s - 0.01 * n
    return ttls


def test_decide_never_pins_when_memory_is_free() -> None:
    programs, store, clock = make(memory_bytes=1 << 30)
    assert rounds(programs, store, clock, 100) == [0.0] * 300
    again = programs.begin("p0", "t", [CALL, RESULT], 100)
    assert again.pin_s == 0.0 and not again.pinned and store.tiers[0].stats()["pinned"] == 0


def test_decided_pins_cover_the_tool_when_memory_turns_over_faster_than_it_returns() -> None:
    # 100 contexts of 800 bytes stored 10 ms apart in 3,200 bytes: memory keeps one under a second.
    programs, store, clock = make(memory_bytes=3_200)
    ttls = rounds(programs, store, clock, 100)
    assert programs.resident_s() < 1.0
    assert ttls[-1] == pytest.approx(4.0)  # the tool, and not the prior's tail past it


def busy_with_quick_tools(others_find: float, slow_finds: float) -> tuple[Programs, list[float]]:
    """A tenant's programs whose tool ("quick") returns in 0.2 s, found in memory (it keeps a context
    about 1.4 s: four of 800 bytes in 3,200, one stored every 0.2 s), and among them one whose tool
    ("slow") takes 5 s; turns arriving find queues that long. The slow program's TTLs."""
    programs, store, clock = make(memory_bytes=3_200)
    ttls = []

    def turn(name: str, tool: str, first: bool) -> float:
        programs.costs.waiting_s = slow_finds if name == "slow" else others_find
        call = {"role": "assistant", "tool_calls": [{"function": {"name": tool, "arguments": {}}}]}
        t = programs.begin(name, "t", [] if first else [call, RESULT], 100)
        keep(store, t, 100, clock.now)
        programs.end("t", t)
        clock.now += 0.2
        return t.pin_s

    for i in range(64):
        for k in range(3):
            turn(f"q{i}", "quick", k == 0)
        if i % 8 == 0:  # the slow program's turn; it comes back 5 s (24 quick turns) later
            ttls.append(turn("slow", "slow", i == 0))
    assert 1.0 < programs.resident_s() < 2.0
    return programs, ttls


def test_no_pin_for_a_slow_tool_when_memory_earns_more_on_quick_ones() -> None:
    # Unpinned, the slow program's context is always gone when it returns: memory earns nothing on it.
    # Priced at that, a 5 s pin looks free and every one of its turns would pin.
    _, ttls = busy_with_quick_tools(0.0, 0.0)
    assert ttls[-5:] == [0.0] * 5


def test_a_pin_passes_the_queue_turns_find_not_the_queue_of_the_moment() -> None:
    # Every turn finds a 10 s queue: a pinned return passes it, which is worth the memory.
    _, ttls = busy_with_quick_tools(10.0, 10.0)
    assert ttls[-5:] == pytest.approx([5.0] * 5)
    # Only the slow program's turns find it, one in 25: its return most likely will not.
    _, ttls = busy_with_quick_tools(0.0, 10.0)
    assert ttls[-5:] == [0.0] * 5


def returning(names: list[str]) -> tuple[Programs, ChunkStore, list[str]]:
    """Programs whose first turn ended a moment ago, their contexts still in memory, unpinned; memory
    busy (it evicts others' entries 2 s after their put, 800 bytes every 0.5 s into 3,200)."""
    programs, store, clock = make(memory_bytes=3_200)
    for i in range(8):
        kv = torch.zeros(1, 1, 100, 1)
        store.put(ChunkKV(f"busy-{i}", list(range(100)), kv, kv))
        clock.now += 0.5
    for name in names:
        turn = dataclasses.replace(programs.begin(name, "t", [], 100), pin_s=0.0)
        keep(store, turn, 100, clock.now)
        programs.end("t", turn)
    clock.now += 0.5
    programs.costs.waiting_s = 5.0  # a queue longer than memory keeps a context: it would be evicted
    assert programs.resident_s() == pytest.approx(2.0)
    contexts = [programs.programs[("t", name)].context for name in names]
    assert all(c in store.tiers[0] for c in contexts) and store.tiers[0].stats()["pinned"] == 0
    return programs, store, contexts


def test_a_returning_turn_holds_its_context_until_the_engine_takes_it() -> None:
    programs, store, (context,) = returning(["p"])
    waiting = programs.begin("p", "t", [CALL, RESULT], 100)
    assert waiting.resume == context
    for i in range(8):  # others store their contexts while the turn waits in the queue
        kv = torch.zeros(1, 1, 100, 1)
        store.put(ChunkKV(f"other-{i}", list(range(100)), kv, kv))
    assert context in store.tiers[0]


def test_a_held_turn_goes_first_like_a_pinned_one() -> None:
    programs, _, _ = returning(["a"])
    assert programs.begin("a", "t", [CALL, RESULT], 100).pinned


def test_a_turn_whose_context_memory_keeps_through_the_queue_is_neither_held_nor_first() -> None:
    programs, store, (context,) = returning(["a"])
    programs.costs.waiting_s = 1.0  # memory keeps a context 2 s after its use; it was used 0.5 s ago
    turn = programs.begin("a", "t", [CALL, RESULT], 100)
    assert turn.resume == context and not turn.pinned and store.tiers[0].stats()["pinned"] == 0


# About the 135M model on 2 CPU cores (benchmarks/agents_sim.py `measure`), fp32 KV.
COSTS = StepCosts(step_s=0.08, prefill_s_per_token=0.0017, decode_s_per_seq=0.0009, bytes_per_token=46080)


@pytest.mark.parametrize(
    "regime",
    [Regime(0.7, 128, 1.0), Regime(0.95, 128, 0.5), Regime(1.2, 384, 1.0)],
    ids=["light", "pressed", "roomy"],
)
def test_decided_pins_never_trail_the_best_of_off_and_fixed(regime: Regime) -> None:
    jct = regime_jct(COSTS, regime, programs=60, fixed_ttl_s=4.0, seeds=1, output_tokens=16)
    assert verdict(jct)[1] >= 0.97
