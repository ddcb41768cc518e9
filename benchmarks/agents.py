"""`kvgate bench agents`: multi-turn agent programs against the real runtime through the gateway on
loopback (the openai SDK as client), with a KV memory small enough to force eviction. Job
completion time (JCT) and makespan for pins off (LRU) / fixed TTL / decided TTL, each with FCFS
and program FCFS, on one workload, in one run; then the discrete-event simulator at scale."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai

from kvgate.bench.agent_workload import ProgramSpec, generate
from kvgate.bench.report import table, write_section
from kvgate.bench.server import gateway
from kvgate.gateway.settings import Settings
from kvgate.runtime.engine import Engine
from kvgate.runtime.loader import LoadedModel, load

# (arrivals per second, KV memory MiB): an engine busy but keeping up, and one overloaded.
SIMULATED = [(0.2, 192), (0.25, 128)]
POLICIES = [(pins, queue) for pins in ("off", "fixed", "decide") for queue in ("fcfs", "program")]


@dataclass
class Run:
    jct: list[float] = field(default_factory=list)
    makespan: float = 0.0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    pinned_turns: int = 0
    turns: int = 0


def tool_call(i: int, tool: str) -> dict[str, Any]:
    return {"id": f"call-{i}", "type": "function", "function": {"name": tool, "arguments": "{}"}}


def tool_schemas(specs: list[ProgramSpec]) -> list[dict[str, Any]]:
    names = sorted({c.tool for s in specs for c in s.calls})
    return [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in names]


async def program(
    client: openai.AsyncOpenAI, model: str, spec: ProgramSpec, tools: list, output_tokens: int, start: float, run: Run
) -> None:
    """One agent: its turns in order, each tool call taking its drawn duration."""
    await asyncio.sleep(max(0.0, start + spec.arrival_s - time.monotonic()))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": spec.system},
        {"role": "user", "content": spec.task},
    ]
    for i in range(spec.turns):
        raw = await client.chat.completions.with_raw_response.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            tools=tools,
            max_tokens=output_tokens,
            temperature=0,
            extra_headers={"x-kvgate-program-id": spec.id, "cache-control": "no-cache, no-store"},
        )
        reply = raw.parse()
        run.turns += 1
        run.prompt_tokens += reply.usage.prompt_tokens
        run.reused_tokens += int(raw.headers.get("x-kvgate-reused-tokens", 0))
        run.pinned_turns += float(raw.headers.get("x-kvgate-pin-ttl", 0)) > 0
        if i == len(spec.calls):
            break
        call = spec.calls[i]
        answer = reply.choices[0].message.content
        messages.append({"role": "assistant", "content": answer, "tool_calls": [tool_call(i, call.tool)]})
        await asyncio.sleep(call.duration_s)
        messages.append({"role": "tool", "tool_call_id": f"call-{i}", "content": call.result})
    run.jct.append(time.monotonic() - (start + spec.arrival_s))


async def drive(url: str, model: str, specs: list[ProgramSpec], output_tokens: int) -> Run:
    run = Run()
    tools = tool_schemas(specs)
    async with openai.AsyncOpenAI(base_url=url, api_key="bench", max_retries=0, timeout=3600) as client:
        start = time.monotonic() + 0.5
        await asyncio.gather(*(program(client, model, s, tools, output_tokens, start, run) for s in specs))
        run.makespan = time.monotonic() - start - specs[0].arrival_s
    return run


def p95(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=20)[-1] if len(xs) > 1 else xs[0]


def passages(path: Path | None) -> list[str]:
    if path is None or not path.exists():
        return []
    with path.open() as f:
        return [p for line in f for p in json.loads(line)["passages"]]


def rows(runs: dict[tuple[str, str], Run]) -> list[list[str]]:
    base = statistics.mean(runs[("off", "fcfs")].jct)
    out = []
    for (pins, queue), r in runs.items():
        mean = statistics.mean(r.jct)
        out.append(
            [
                f"{pins} + {queue}",
                f"{mean:.1f}",
                f"{p95(r.jct):.1f}",
                f"{r.makespan:.1f}",
                f"{base / mean:.2f}x",
                f"{r.reused_tokens / max(r.prompt_tokens, 1):.0%}",
                f"{r.pinned_turns}/{r.turns}",
            ]
        )
    return out


HEADER = ["policy", "mean JCT (s)", "p95 JCT (s)", "makespan (s)", "mean JCT vs off + fcfs", "prompt reused", "pinned"]


def bench_agents(
    base: Settings,
    programs: int,
    rate_per_s: float,
    memory_mb: int,
    fixed_ttl_s: float,
    output_tokens: int,
    seed: int,
    data: Path | None,
    sim_programs: int,
    output: Path,
    command: str,
) -> dict[tuple[str, str], Run]:
    specs = generate(programs, rate_per_s, seed=seed, text_source=passages(data))
    loaded: LoadedModel = load(base.engine_config())
    runs = {}
    for pins, queue in POLICIES:
        settings = base.model_copy(
            update={
                "chunk_cache_bytes": memory_mb << 20,
                "chunk_cache_disk_bytes": 0,  # an evicted context is computed again
                "redis_url": None,
                "chunk_cache_policy": "lru",
                "agent_pins": pins,
                "agent_fixed_ttl_s": fixed_ttl_s,
                "queue_order": queue,
                "semantic_cache": False,
            }
        )
        with gateway(settings, loaded) as (url, model):
            runs[(pins, queue)] = asyncio.run(drive(url, model, specs, output_tokens))
        print(f"{pins} + {queue}: mean JCT {statistics.mean(runs[(pins, queue)].jct):.1f} s", flush=True)
    turns = sum(s.turns for s in specs)
    body = (
        f"{programs} programs ({turns} turns), Poisson arrivals at {rate_per_s}/s, "
        f"{output_tokens} output tokens a turn, "
        f"KV memory {memory_mb} MiB (LRU, no disk tier), fixed TTL {fixed_ttl_s} s. Tool durations lognormal per tool "
        f"(benchmarks/agent_workload.py). JCT: a program's last answer minus its arrival.\n\n"
        + table(HEADER, rows(runs))
    )
    if sim_programs:
        from kvgate.bench.agents_sim import bench_sim, measure, report

        engine = Engine(base.engine_config(), loaded)
        try:
            costs = measure(engine)
        finally:
            engine.shutdown()
        for rate, mib in SIMULATED:
            simulated = bench_sim(costs, sim_programs, rate, mib << 20, fixed_ttl_s, seed, output_tokens)
            body += "\n\n" + report(simulated, costs, sim_programs, rate, mib << 20, fixed_ttl_s)
    write_section(output, "agents", "Agent programs: TTL pins and program FCFS", command, body)
    print(body)
    return runs
