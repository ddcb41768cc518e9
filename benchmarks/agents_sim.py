"""Agent programs at scale: a discrete-event simulation of the runtime on a virtual clock, with
step costs measured from the real engine.

Only the model is simulated. Admission and chunked prefill are the real `Scheduler`; program
contexts live in a real `ChunkStore` over a real LRU `MemoryTier` (as tiny entries, 1 token = 1
element, with the budget scaled the same way, so eviction and pin rules are the runtime's own);
TTLs, tool-duration learning and pin expiry are the real `agents.Programs`.
"""

from __future__ import annotations

import asyncio
import heapq
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvgate.agents.config import AgentConfig
from kvgate.agents.predictor import Prior
from kvgate.agents.programs import Programs, Turn
from kvgate.agents.ttl import PinPolicy
from kvgate.bench.agent_workload import ProgramSpec, generate
from kvgate.chunk_cache import ChunkKV, ChunkStore, MemoryTier
from kvgate.runtime.engine import Engine
from kvgate.runtime.prompt_kv import run_end
from kvgate.runtime.report import table
from kvgate.runtime.request import Request
from kvgate.runtime.sampling import SamplingParams
from kvgate.runtime.scheduler import Scheduler
from kvgate.runtime.sequence import Status

TEMPLATE_TOKENS = 12  # chat template tokens around each turn's new messages
SCOPE = "sim"
DECIDE, PRIOR = PinPolicy(), Prior()


@dataclass(frozen=True)
class StepCosts:
    step_s: float  # fixed per engine step
    prefill_s_per_token: float
    decode_s_per_seq: float  # per decoding sequence in a step
    bytes_per_token: int

    def step(self, prefill_tokens: int, decoding: int) -> float:
        return self.step_s + self.prefill_s_per_token * prefill_tokens + self.decode_s_per_seq * decoding


def run_batch(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """Generate for every prompt at once: wall seconds, and the engine steps it took."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(ids: list[int]) -> None:
        async for _ in engine.generate(Request(ids, params)):
            pass

    async def every() -> None:
        await asyncio.gather(*(one(p) for p in prompts))

    steps, start = engine.steps, time.perf_counter()
    asyncio.run(every())
    return time.perf_counter() - start, engine.steps - steps


def measure(
    engine: Engine,
    lengths: tuple[int, ...] = (256, 512, 1024),
    batches: tuple[int, ...] = (1, 4, 8),
    decode_prompt: int = 384,
    max_tokens: int = 24,
    repeats: int = 2,
    seed: int = 0,
) -> StepCosts:
    """Step costs fitted by least squares to whole prefills (one token out) of `lengths` and to
    `batches` concurrent sequences decoding `max_tokens` each; each run the fastest of `repeats`
    (another process on the same cores only ever slows a run down)."""
    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size

    def best(n: int, b: int, tokens: int) -> tuple[float, int]:
        return min(
            run_batch(engine, [[rng.randrange(vocab) for _ in range(n)] for _ in range(b)], tokens)
            for _ in range(repeats)
        )

    best(64, 1, 4)  # warm-up
    xs, ys = [], []
    for n in lengths:
        seconds, steps = best(n, 1, 1)
        xs.append([steps, n, 0])
        ys.append(seconds)
    for b in batches:
        seconds, steps = best(decode_prompt, b, max_tokens)
        # The last prompt chunk's step samples the first token: max_tokens - 1 decode steps each.
        xs.append([steps, b * decode_prompt, b * (max_tokens - 1)])
        ys.append(seconds)
    fit = np.linalg.lstsq(np.array(xs, dtype=float), np.array(ys), rcond=None)[0]
    step_s, per_token, per_seq = (max(float(c), 0.0) for c in fit)
    return StepCosts(step_s, per_token, per_seq, engine.kv_bytes_per_token)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(eq=False)  # the scheduler finds sequences in its lists by identity
class SimSeq:
    """What `Scheduler` reads of a `runtime.sequence.Sequence`; only lengths matter."""

    prompt_ids: range
    turn: Turn
    arrival: float
    program: int  # index into the specs
    index: int  # the program's turn number, from 0
    status: Status = Status.WAITING
    computed: int = 0  # tokens whose KV exists
    outputs: int = 0
    planned: bool = False
    tenant: str = ""  # one tenant: the simulator studies programs, not tenants

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt_ids)

    def admit(self) -> None:
        self.status = Status.RUNNING

    def end(self) -> None:
        self.status = Status.FINISHED

    def next_run(self, budget: int, grid: int = 1) -> range:
        if not self.prefilling:
            return range(1)
        return self.prompt_ids[self.computed : run_end(self.computed, budget, len(self.prompt_ids), grid)]


class SimCosts:
    """`agents.costs.Costs` for the simulated engine: prefill at the measured rate, the queue from
    the scheduler's passable prompt tokens, no tier below memory."""

    def __init__(self, costs: StepCosts, memory_bytes: int, scheduler: Scheduler) -> None:
        self.costs, self.scheduler = costs, scheduler
        self.bytes_per_token, self.memory_bytes = costs.bytes_per_token, memory_bytes

    def prefill_s(self, tokens: int) -> float:
        return tokens * self.costs.prefill_s_per_token

    def queue_s(self) -> float:
        return self.prefill_s(self.scheduler.passable_tokens)

    def reload_s(self, nbytes: int) -> float | None:
        return None


_ELEMENT = torch.zeros(1, 1, 1, 1, dtype=torch.uint8)


def context(key: str, tokens: int, cost: float) -> ChunkKV:
    """A stored context of `tokens` tokens: 2 bytes a token (a key and a value element, no copy)."""
    kv = _ELEMENT.expand(1, 1, tokens, 1)
    return ChunkKV(key, range(tokens), kv, kv, cost)


def prompt_tokens(spec: ProgramSpec, turn: int, output_tokens: int) -> int:
    results = sum(c.result_tokens for c in spec.calls[:turn])
    return spec.prompt_tokens + results + turn * output_tokens + (turn + 1) * TEMPLATE_TOKENS


def messages(spec: ProgramSpec, turn: int) -> list[dict[str, Any]]:
    if turn == 0:
        return [{"role": "user", "content": ""}]
    call = {"function": {"name": spec.calls[turn - 1].tool}}
    return [{"role": "assistant", "tool_calls": [call]}, {"role": "tool", "content": ""}]


@dataclass
class SimResult:
    jct_s: dict[str, float]  # per program: its last turn's end minus its arrival
    makespan_s: float  # the last end minus the first arrival
    turns: int = 0
    found: int = 0  # turns whose program's previous context was still stored
    prefilled: int = 0  # prompt tokens computed
    reused: int = 0  # prompt tokens taken from a stored context
    steps: int = 0
    busy_s: float = 0.0  # virtual seconds the engine spent in steps
    stats: dict[str, Any] = field(default_factory=dict)  # the memory tier's, at the end

    @property
    def mean_jct_s(self) -> float:
        return float(np.mean(list(self.jct_s.values())))

    @property
    def p95_jct_s(self) -> float:
        return float(np.percentile(list(self.jct_s.values()), 95))


def simulate(
    specs: list[ProgramSpec],
    costs: StepCosts,
    queue_order: str = "fcfs",
    pins: PinPolicy = DECIDE,
    memory_bytes: int = 1 << 30,
    output_tokens: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 2048,
    prior: Prior = PRIOR,
    in_flight: float = 0.0,
) -> SimResult:
    """Run every turn of every program to its end. A turn arrives (its program's first: at the
    program's arrival; a later one: its tool's duration after the previous turn ended), is queued
    and prefilled by the real scheduler, continuing from its program's stored context when the
    store still holds it, decodes `output_tokens`, and leaves its context pinned as `pins` decides."""
    clock = Clock()
    scheduler = Scheduler(max_num_seqs, max(max_num_batched_tokens, max_num_seqs), queue_order)
    tier = MemoryTier(2 * (memory_bytes // costs.bytes_per_token), clock=clock, policy="lru")
    store = ChunkStore([tier])
    config = AgentConfig(pins=pins, prior=prior, in_flight=in_flight)
    programs = Programs(config, store, SimCosts(costs, memory_bytes, scheduler), clock=clock)
    if in_flight > 0:
        scheduler.gate = programs.flight
    arrivals = [(s.arrival_s, i, 0) for i, s in enumerate(specs)]
    heapq.heapify(arrivals)
    ends: dict[str, float] = {}
    out = SimResult({}, 0.0)
    due: float | None = None  # the next pin deadline

    def arrive(at: float, i: int, k: int) -> None:
        spec = specs[i]
        n = prompt_tokens(spec, k, output_tokens)
        # The gateway begins a turn when its request arrives, which may be in the middle of a step.
        later, clock.now = clock.now, at
        turn = programs.begin(spec.id, SCOPE, messages(spec, k), n)
        clock.now = later
        scheduler.add(SimSeq(range(n), turn, at, i, k))

    def finish(seq: SimSeq) -> None:
        nonlocal due
        scheduler.remove(seq)
        now, turn, spec = clock.now, seq.turn, specs[seq.program]
        # Engine.keep: the whole context (the last sampled token has no KV yet), pinned for the TTL.
        entry = context(turn.keep, seq.computed, costs.prefill_s_per_token * seq.computed)
        store.put(entry, until=now + turn.pin_s if turn.pin_s > 0 else None)
        programs.end(SCOPE, turn, more=seq.index < len(spec.calls))
        if turn.pin_s > 0:
            due = now + turn.pin_s if due is None else min(due, now + turn.pin_s)
        out.turns += 1
        if seq.index < len(spec.calls):
            heapq.heappush(arrivals, (now + spec.calls[seq.index].duration_s, seq.program, seq.index + 1))
        else:
            ends[spec.id] = now

    def plan(seq: SimSeq, tokens: range) -> range:
        """Engine.reuse: a turn's first step starts from its program's stored context, if found."""
        seq.planned = True
        entry = store.get(seq.turn.resume) if seq.turn.resume else None
        if entry is not None:
            seq.computed = min(entry.tokens, len(seq.prompt_ids) - 1)
            out.found += 1
            out.reused += seq.computed
            store.delete(seq.turn.resume)  # as the engine does: the KV now lives in the sequence
        return seq.next_run(len(tokens))

    try:
        while arrivals or scheduler or scheduler.held:
            if not scheduler:  # idle, or only first turns held: until the next arrival (or a tool's lateness)
                clock.now = max(clock.now, arrivals[0][0]) if arrivals else clock.now + 1.0
            while arrivals and arrivals[0][0] <= clock.now:
                arrive(*heapq.heappop(arrivals))
            if due is not None and due <= clock.now:
                due = programs.expire()
            batch = [(s, t if s.planned else plan(s, t)) for s, t in scheduler.schedule()]
            prefill = sum(len(t) for s, t in batch if s.prefilling)
            decoding = sum(not s.prefilling for s, _ in batch)
            seconds = costs.step(prefill, decoding)
            clock.now += seconds
            out.busy_s += seconds
            out.prefilled += prefill
            out.steps += 1
            for seq, tokens in batch:
                seq.computed += len(tokens)
                if seq.prefilling:
                    continue
                seq.outputs += 1
                if seq.outputs >= output_tokens:
                    finish(seq)
        out.stats = tier.stats()
    finally:
        store.close()
    out.jct_s = {s.id: ends[s.id] - s.arrival_s for s in specs}
    out.makespan_s = max(ends.values()) - min(s.arrival_s for s in specs)
    return out


HEADER = ["pins", "queue", "mean JCT s", "p95 JCT s", "makespan s", "mean JCT speedup vs off+fcfs", "context found"]
HEADER += ["prompt tokens prefilled", "engine busy"]


PROGRAMS, RATE_PER_S, MEMORY_BYTES, FIXED_TTL_S = 200, 0.2, 192 << 20, 10.0
# Programs in flight per context memory holds, for the policies that limit them (agents/flight.py).
IN_FLIGHT = 2.0


def bench_sim(
    costs: StepCosts,
    programs: int = PROGRAMS,
    rate_per_s: float = RATE_PER_S,
    memory_bytes: int = MEMORY_BYTES,
    fixed_ttl_s: float = FIXED_TTL_S,
    seed: int = 0,
    output_tokens: int = 16,
) -> list[list[str]]:
    """Every pin policy (off: plain LRU; fixed; decided) with each queue order, on one workload."""
    specs = generate(programs, rate_per_s, seed=seed)
    rows, base = [], None
    policies = [(mode, order, 0.0) for mode in ("off", "fixed", "decide") for order in ("fcfs", "program")]
    for mode, order, in_flight in [*policies, ("decide", "program", IN_FLIGHT)]:
        pins = PinPolicy(mode=mode, fixed_ttl_s=fixed_ttl_s)
        r = simulate(specs, costs, order, pins, memory_bytes, output_tokens, in_flight=in_flight)
        base = base or r.mean_jct_s
        order += f" + {in_flight:g} in flight" if in_flight else ""
        rows.append([mode, order, f"{r.mean_jct_s:.1f}", f"{r.p95_jct_s:.1f}", f"{r.makespan_s:.0f}"])
        resumed = r.turns - len(specs)
        rows[-1] += [f"{base / r.mean_jct_s:.2f}x", f"{r.found / max(resumed, 1):.0%}", f"{r.prefilled:,}"]
        rows[-1].append(f"{r.busy_s / r.makespan_s:.0%}")
    return rows


def report(
    rows: list[list[str]],
    costs: StepCosts,
    programs: int = PROGRAMS,
    rate_per_s: float = RATE_PER_S,
    memory_bytes: int = MEMORY_BYTES,
    fixed_ttl_s: float = FIXED_TTL_S,
) -> str:
    """`bench_sim`'s rows as a markdown section; pass the arguments `bench_sim` was given."""
    return (
        f"### Simulated: {programs} programs\n\n"
        "A discrete-event simulation (benchmarks/agents_sim.py) of the same workload shape on a virtual clock: "
        "the real `Scheduler`, `ChunkStore` over an LRU `MemoryTier` and `agents.Programs`; only the model is "
        f"replaced by step costs measured from the engine: {costs.step_s * 1e3:.1f} ms a step, "
        f"{costs.prefill_s_per_token * 1e3:.2f} ms a prompt token, {costs.decode_s_per_seq * 1e3:.1f} ms a decoding "
        f"sequence, {costs.bytes_per_token:,} bytes of KV a token. Poisson arrivals at {rate_per_s}/s, "
        f"KV memory {memory_bytes >> 20} MiB, fixed TTL {fixed_ttl_s} s. Context found: later turns whose "
        "program's previous context was still stored; engine busy: step time over the makespan.\n\n"
        + table(HEADER, rows)
    )
