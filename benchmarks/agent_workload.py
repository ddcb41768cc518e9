"""A multi-turn agent workload: programs arriving as a Poisson process, each a task followed by
tool calls whose durations are drawn per tool from a lognormal, and whose results grow the context.

The same workload drives the live benchmark (`benchmarks/agents.py`, through the gateway) and the
discrete-event simulator (`benchmarks/agents_sim.py`); text comes from real passages when given.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Tool:
    name: str
    median_s: float
    sigma: float  # of the log duration
    result_tokens: int  # about how long its results are


# Shaped after coding agents: quick reads and searches, slow test runs.
TOOLS = (
    Tool("read_file", 0.8, 0.4, 220),
    Tool("search", 1.5, 0.5, 160),
    Tool("python", 2.5, 0.7, 120),
    Tool("run_tests", 6.0, 0.5, 140),
)


@dataclass(frozen=True)
class Call:
    tool: str
    duration_s: float
    result: str
    result_tokens: int


@dataclass(frozen=True)
class ProgramSpec:
    id: str
    arrival_s: float  # after the workload's start
    system: str
    task: str
    prompt_tokens: int  # system and task, about
    calls: tuple[Call, ...]  # one per turn but the last

    @property
    def turns(self) -> int:
        return len(self.calls) + 1


def words(text_source: list[str], rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of text (1.3 tokens a word), from real passages when there are any."""
    n = max(1, int(tokens / 1.3))
    if not text_source:
        return " ".join(f"w{rng.randrange(5000)}" for _ in range(n))
    out: list[str] = []
    while len(out) < n:
        out += rng.choice(text_source).split()
    return " ".join(out[:n])


def generate(
    programs: int,
    rate_per_s: float,
    turns: tuple[int, int] = (3, 5),
    system_tokens: int = 400,
    seed: int = 0,
    tools: tuple[Tool, ...] = TOOLS,
    text_source: list[str] | None = None,
    spread: float = 1.0,
) -> list[ProgramSpec]:
    """`programs` programs, arriving at `rate_per_s` on average, each with a number of turns drawn
    from `turns` (inclusive); each program's system prompt is its own (no program shares KV).
    `spread` scales every tool's sigma: how far one call's duration strays from its tool's median."""
    rng = random.Random(seed)
    source = text_source or []
    clock, out = 0.0, []
    for i in range(programs):
        clock += rng.expovariate(rate_per_s)
        calls = []
        for _ in range(rng.randint(*turns) - 1):
            tool = rng.choice(tools)
            duration = rng.lognormvariate(0.0, tool.sigma * spread) * tool.median_s
            n = max(16, int(rng.gauss(tool.result_tokens, tool.result_tokens / 5)))
            calls.append(Call(tool.name, duration, words(source, rng, n), n))
        system = f"You are agent {i}. " + words(source, rng, system_tokens)
        task = "Task: " + words(source, rng, 40)
        out.append(ProgramSpec(f"program-{seed}-{i}", clock, system, task, system_tokens + 40, tuple(calls)))
    return out
