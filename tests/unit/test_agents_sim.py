"""benchmarks/agents_sim.py: the agent-program simulator runs the real scheduler, store and pin
policy on a virtual clock; these tests pin down what it models (no model is loaded)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvgate.agents.ttl import PinPolicy
from kvgate.bench.agent_workload import Call, ProgramSpec, generate
from kvgate.bench.agents_sim import HEADER, StepCosts, bench_sim, prompt_tokens, report, simulate

# About the 135M model on 2 CPU cores (benchmarks/agents_sim.py `measure`), fp32 KV.
COSTS = StepCosts(step_s=0.05, prefill_s_per_token=0.0018, decode_s_per_seq=0.007, bytes_per_token=46080)
MIB = 1 << 20
OFF, DECIDE = PinPolicy(mode="off"), PinPolicy(mode="decide")


def lone(calls: tuple[Call, ...] = ()) -> list[ProgramSpec]:
    return [ProgramSpec("p", 1.0, "", "", 400, calls)]


def test_a_step_costs_a_fixed_part_plus_its_prefill_tokens_and_decoding_sequences() -> None:
    assert COSTS.step(0, 0) == pytest.approx(0.05)
    assert COSTS.step(1000, 4) == pytest.approx(0.05 + 1.8 + 0.028)


def test_a_lone_turn_is_one_prefill_step_then_a_decode_step_per_further_token() -> None:
    r = simulate(lone(), COSTS, output_tokens=16)
    prompt = 400 + 12
    assert r.jct_s["p"] == pytest.approx(COSTS.step(prompt, 0) + 15 * COSTS.step(0, 1))
    assert (r.turns, r.steps, r.prefilled, r.reused) == (1, 16, prompt, 0)


def test_a_prompt_longer_than_the_token_budget_is_prefilled_in_chunks() -> None:
    r = simulate(lone(), COSTS, output_tokens=2, max_num_batched_tokens=100)
    assert r.steps == 5 + 1  # 412 prompt tokens in chunks of 100, then one decode step


def test_the_next_turn_prefills_only_what_its_stored_context_lacks() -> None:
    call = Call("search", 3.0, "", 150)
    r = simulate(lone((call,)), COSTS, output_tokens=16)
    first, second = prompt_tokens(lone()[0], 0, 16), prompt_tokens(lone((call,))[0], 1, 16)
    kept = first + 16 - 1  # the last sampled token has no KV yet
    assert (r.found, r.reused, r.prefilled) == (1, kept, first + second - kept)
    turn_s = COSTS.step(first, 0) + 15 * COSTS.step(0, 1)
    assert r.jct_s["p"] == pytest.approx(turn_s + 3.0 + COSTS.step(second - kept, 0) + 15 * COSTS.step(0, 1))


def test_every_turn_of_every_program_completes() -> None:
    specs = generate(60, 0.25, seed=3)
    for pins in (OFF, PinPolicy(mode="fixed", fixed_ttl_s=5.0), DECIDE):
        for order in ("fcfs", "program"):
            r = simulate(specs, COSTS, order, pins, memory_bytes=64 * MIB)
            assert r.turns == sum(s.turns for s in specs)
            assert sorted(r.jct_s) == sorted(s.id for s in specs) and min(r.jct_s.values()) > 0
            total = sum(prompt_tokens(s, k, 16) for s in specs for k in range(s.turns))
            assert r.prefilled + r.reused == total  # every prompt token is computed or reused, once


def test_with_memory_for_every_context_pins_change_nothing() -> None:
    specs = generate(80, 0.2, seed=1)
    off, decide = (simulate(specs, COSTS, "fcfs", pins, memory_bytes=1 << 40) for pins in (OFF, DECIDE))
    assert off.jct_s == decide.jct_s
    assert off.found == decide.found == off.turns - len(specs)  # every later turn found its context


def test_under_memory_pressure_decided_pins_with_program_fcfs_beat_lru_with_fcfs() -> None:
    # Memory for about 5 contexts of ~1,000 tokens: far fewer than the programs live at once.
    specs = generate(200, 0.25, seed=0)
    base = simulate(specs, COSTS, "fcfs", OFF, memory_bytes=128 * MIB)
    best = simulate(specs, COSTS, "program", DECIDE, memory_bytes=128 * MIB)
    assert best.mean_jct_s < 0.8 * base.mean_jct_s
    assert best.found > base.found and best.prefilled < base.prefilled


def test_program_fcfs_admits_a_returning_turn_before_younger_programs() -> None:
    # One program returns from its tool while a burst of younger programs waits in the queue. Nothing
    # is pinned (pins off; memory holds every context anyway): its turn goes first by its program's age alone.
    old = ProgramSpec("old", 0.0, "", "", 400, (Call("read_file", 0.5, "", 100),))
    young = [ProgramSpec(f"young-{i}", 0.4 + i * 1e-3, "", "", 1800, ()) for i in range(12)]
    runs = {o: simulate([old, *young], COSTS, o, OFF, max_num_seqs=2) for o in ("fcfs", "program")}
    assert runs["program"].jct_s["old"] < runs["fcfs"].jct_s["old"] / 2


def test_the_simulation_is_deterministic_for_a_seed() -> None:
    def run(seed: int) -> dict[str, float]:
        specs = [replace(s, id=s.id.replace(f"-{seed}-", "-")) for s in generate(50, 0.3, seed=seed)]
        return simulate(specs, COSTS, "program", DECIDE, memory_bytes=64 * MIB).jct_s

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_the_bench_runs_every_policy_on_one_workload() -> None:
    rows = bench_sim(COSTS, programs=40, rate_per_s=0.2)
    policies = [[p, q] for p in ("off", "fixed", "decide") for q in ("fcfs", "program")]
    assert [r[:2] for r in rows] == [*policies, ["decide", "program + 2 in flight"]]
    assert rows[0][HEADER.index("mean JCT speedup vs off+fcfs")] == "1.00x"
    assert report(rows, COSTS, programs=40).endswith("\n".join("| " + " | ".join(r) + " |" for r in rows))


def test_with_programs_in_flight_limited_memory_recomputes_less_and_programs_end_sooner() -> None:
    """An overloaded engine whose memory holds about two contexts: new programs wait at the door."""
    specs = generate(30, 0.5, seed=0)
    free = simulate(specs, COSTS, "program", DECIDE, memory_bytes=96 * MIB)
    limited = simulate(specs, COSTS, "program", DECIDE, memory_bytes=96 * MIB, in_flight=2.0)
    assert limited.prefilled < 0.9 * free.prefilled
    assert limited.mean_jct_s < 0.9 * free.mean_jct_s
    assert limited.turns == free.turns  # every turn of every program still ran
