"""`kvgate bench agents`: multi-turn agent programs against the real runtime through the gateway on
loopback (the Agents SDK or the openai SDK as client), with a KV memory small enough to force eviction. Job
completion time (JCT) and makespan for pins off (LRU) / fixed TTL / decided TTL, each with FCFS
and program FCFS, on one or more workloads (every policy on each), in one run; then the
discrete-event simulator at scale.

Near saturation a live run under LRU is unstable (memory thrashing feeds on the queue it makes, and
a run may tip into it or not), far more than the policies that keep contexts: the live table can pool
several workloads, and shows each one's ratio."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from kvgate.bench.agent_workload import ProgramSpec, generate
from kvgate.bench.server import gateway
from kvgate.gateway.settings import Settings
from kvgate.runtime.engine import Engine
from kvgate.runtime.loader import LoadedModel, load
from kvgate.runtime.progress import progress
from kvgate.runtime.report import table, write_section

# (arrivals per second, KV memory MiB): an engine busy but keeping up, and one overloaded.
SIMULATED = [(0.2, 192), (0.25, 128)]
DRIVERS = {
    "agents-sdk": "the OpenAI Agents SDK's tool loop (chat-completions model, tool_choice required, no kvgate "
    "field: programs are found by their messages; the last turn is the last tool call's)",
    "openai": "a hand-written loop on the openai SDK with kvgate's program header",
}


@dataclass(frozen=True)
class Policy:
    pins: str
    queue: str
    in_flight: float = 0.0  # programs in flight per context memory holds (agents/flight.py); 0: no limit

    def __str__(self) -> str:
        return f"{self.pins} + {self.queue}" + (f" + {self.in_flight:g} in flight" if self.in_flight else "")


BASELINE = Policy("off", "fcfs")
POLICIES = [Policy(pins, queue) for pins in ("off", "fixed", "decide") for queue in ("fcfs", "program")]


@dataclass
class Run:
    jct: list[float] = field(default_factory=list)
    makespan: float = 0.0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    pinned_turns: int = 0
    turns: int = 0
    evictions: int = -1  # from the memory tier (the gateway's metrics), -1: not reported


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


async def framework_program(
    client: openai.AsyncOpenAI, model: str, spec: ProgramSpec, output_tokens: int, start: float, run: Run
) -> None:
    """One agent as the OpenAI Agents SDK runs it (its chat-completions model, no kvgate field): the
    model must call a tool every turn (the tiny model would not by itself), each call takes the
    spec's next drawn duration, and the run ends when the spec's calls are done."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, ToolsToFinalOutputResult, function_tool

    await asyncio.sleep(max(0.0, start + spec.arrival_s - time.monotonic()))
    calls = list(spec.calls)

    def tool(name: str) -> Any:
        async def run_tool() -> str:
            call = calls.pop(0)
            await asyncio.sleep(call.duration_s)
            return call.result

        return function_tool(run_tool, name_override=name)

    def done(*_: object) -> ToolsToFinalOutputResult:
        return ToolsToFinalOutputResult(is_final_output=not calls, final_output="done" if not calls else None)

    agent = Agent(
        name=spec.id,
        instructions=spec.system,
        tools=[tool(name) for name in sorted({c.tool for c in spec.calls})],
        model=OpenAIChatCompletionsModel(model, client),
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=max(output_tokens, 48)
        ),
        tool_use_behavior=done,
        reset_tool_choice=False,
    )
    result = await Runner.run(agent, spec.task, max_turns=len(spec.calls) + 1)
    for response in result.raw_responses:
        run.turns += 1
        run.prompt_tokens += response.usage.input_tokens
        run.reused_tokens += response.usage.input_tokens_details.cached_tokens
    run.jct.append(time.monotonic() - (start + spec.arrival_s))


async def drive(url: str, model: str, specs: list[ProgramSpec], output_tokens: int, client_kind: str) -> Run:
    run = Run()
    tools = tool_schemas(specs)

    async def pinned(response: httpx.Response) -> None:
        run.pinned_turns += float(response.headers.get("x-kvgate-pin-ttl", 0)) > 0

    http = httpx.AsyncClient(timeout=3600, event_hooks={"response": [pinned]} if client_kind == "agents-sdk" else {})
    async with openai.AsyncOpenAI(base_url=url, api_key="bench", max_retries=0, http_client=http) as client:
        start = time.monotonic() + 0.5
        if client_kind == "agents-sdk":
            from agents import set_tracing_disabled

            set_tracing_disabled(True)
            work = [framework_program(client, model, s, output_tokens, start, run) for s in specs]
        else:
            work = [program(client, model, s, tools, output_tokens, start, run) for s in specs]
        await asyncio.gather(*work)
        run.makespan = time.monotonic() - start - specs[0].arrival_s
        metrics = (await http.get(url.removesuffix("/v1") + "/metrics")).text
    found = re.search(r'^kvgate_document_kv_evictions(?:_total)?\{tier="memory"\} ([0-9.e+]+)$', metrics, re.M)
    run.evictions = int(float(found.group(1))) if found else -1
    return run


def p95(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=20)[-1] if len(xs) > 1 else xs[0]


def passages(path: Path | None) -> list[str]:
    if path is None or not path.exists():
        return []
    with path.open() as f:
        return [p for line in f for p in json.loads(line)["passages"]]


def rows(runs: dict[Policy, list[Run]]) -> list[list[str]]:
    """A row per policy, its workloads pooled (makespan: their mean; the ratio: of pooled mean JCTs),
    then each workload's own ratio."""
    each_base = [statistics.mean(r.jct) for r in runs[BASELINE]]
    pooled_base = statistics.mean(t for r in runs[BASELINE] for t in r.jct)
    out = []
    for policy, rs in runs.items():
        jct = [t for r in rs for t in r.jct]
        evictions = [r.evictions for r in rs]
        out.append(
            [
                str(policy),
                f"{statistics.mean(jct):.1f}",
                f"{p95(jct):.1f}",
                f"{statistics.mean(r.makespan for r in rs):.1f}",
                f"{pooled_base / statistics.mean(jct):.2f}x",
                " / ".join(f"{b / statistics.mean(r.jct):.2f}x" for b, r in zip(each_base, rs, strict=True)),
                f"{sum(r.reused_tokens for r in rs) / max(sum(r.prompt_tokens for r in rs), 1):.0%}",
                f"{sum(r.pinned_turns for r in rs)}/{sum(r.turns for r in rs)}",
                str(sum(evictions)) if min(evictions) >= 0 else "?",
            ]
        )
    return out


HEADER = ["policy", "mean JCT (s)", "p95 JCT (s)", "makespan (s)", "mean JCT vs off + fcfs", "each workload's"]
HEADER += ["prompt reused", "pinned", "memory evictions"]


def section(programs: int, simulated: bool) -> tuple[str, str]:
    """The BENCHMARKS.md section's name and title: a live run alone (no simulation) has its own, by its
    program count, so that it does not overwrite the default run's."""
    title = "Agent programs: TTL pins and program FCFS"
    return ("agents", title) if simulated else (f"agents-live-{programs}", f"{title}, live, {programs} programs")


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
    client_kind: str = "agents-sdk",
    sweep_programs: int = 0,
    policies: list[tuple[str, str, float]] | None = None,
    workloads: int = 1,
) -> dict[Policy, list[Run]]:
    """Every policy live on each of `workloads` workloads (seeds from `seed`), then (`sim_programs`)
    the simulator on SIMULATED and (`sweep_programs`) its sweep; the section (`section`) written to
    `output`. off + fcfs is the baseline."""
    chosen = [Policy(*p) for p in policies] if policies else POLICIES
    loaded: LoadedModel = load(base.engine_config())
    runs: dict[Policy, list[Run]] = {}
    text = passages(data)
    workload = {w: generate(programs, rate_per_s, seed=w, text_source=text) for w in range(seed, seed + workloads)}
    order = [BASELINE, *(p for p in chosen if p != BASELINE)]
    runs_of = itertools.product(workload.items(), order)  # every policy on a workload, in turn
    for (w, specs), policy in progress(runs_of, "live runs (workload x policy)", total=len(workload) * len(order)):
        settings = base.model_copy(
            update={
                # no disk tier: an evicted context is computed again
                "caches": {"memory_bytes": memory_mb << 20, "disk_bytes": 0, "policy": "lru"},
                "redis_url": None,
                "agents": {"pins": policy.pins, "fixed_ttl_s": fixed_ttl_s, "in_flight": policy.in_flight},
                "engine": {"queue_order": policy.queue},
                "semantic_cache": {"enabled": False},
            }
        )
        with gateway(settings, loaded) as (url, model):
            run = asyncio.run(drive(url, model, specs, output_tokens, client_kind))
        runs.setdefault(policy, []).append(run)
        print(f"workload {w}, {policy}: mean JCT {statistics.mean(run.jct):.1f} s", flush=True)
    parts: list[str] = []
    if runs:
        turns = " / ".join(str(sum(s.turns for s in specs)) for specs in workload.values())
        parts.append(
            f"{workloads} workload(s) (seeds {', '.join(map(str, workload))}), each {programs} programs "
            f"({turns} turns), Poisson arrivals at {rate_per_s}/s, driven by {DRIVERS[client_kind]}, "
            f"{output_tokens} output tokens a turn, KV memory {memory_mb} MiB (LRU, no disk tier), fixed TTL "
            f"{fixed_ttl_s} s. Tool durations lognormal per tool (benchmarks/agent_workload.py). JCT: a program's "
            "last answer minus its arrival; each workload's: that workload's ratio alone (under LRU near saturation "
            "a run may tip into thrashing or not); memory evictions: entries the memory tier evicted for room "
            "(pressure: contexts that did not all fit); in flight: a new program waits while that many times the "
            "contexts memory holds are in flight (agents/flight.py).\n\n" + table(HEADER, rows(runs))
        )
    if sim_programs or sweep_programs:
        from kvgate.bench.agents_sim import bench_sim, measure, report
        from kvgate.bench.agents_sweep import sweep, sweep_report

        engine = Engine(base.engine_config(), loaded)
        try:
            costs = measure(engine)
        finally:
            engine.shutdown()
        for rate, mib in SIMULATED if sim_programs else ():
            simulated = bench_sim(costs, sim_programs, rate, mib << 20, fixed_ttl_s, seed, output_tokens)
            parts.append(report(simulated, costs, sim_programs, rate, mib << 20, fixed_ttl_s))
        if sweep_programs:
            results = sweep(costs, programs=sweep_programs, fixed_ttl_s=fixed_ttl_s, output_tokens=output_tokens)
            parts.append(sweep_report(results, costs, sweep_programs, fixed_ttl_s))
    body = "\n\n".join(parts)
    write_section(output, *section(programs, simulated=bool(sim_programs or sweep_programs)), command, body)
    print(body)
    return runs
