"""`python -m kvgate.bench.gate_load`: the quality gate on a server that is never idle.

Clients that always have a request waiting (`--clients` of them, each asking again as soon as it is
answered) ask MuSiQue questions over their passages, the documents' KV stored beforehand, so every
request is served as a blend. Two engines over one loaded model take turns in one run: one checks
nothing (`shadow_rate` 0), one checks at the default `shadow_rate` and `shadow_share`. Reported:
- the checks that came due and how many completed (the rest were dropped, `max_pending` waiting);
- throughput (requests per second) of each engine, and the checking one's cost;
- the gaps between a stream's tokens on each (a check's part runs between two steps: the stall it makes);
- then, still under load, the stored KV perturbed in place (values x -3: a fault no real part
  produces on demand): the checks until the gate serves full prefill.
The gate's targets are ones a sound blend of these documents meets (`--kl`, `--top1`), so that the
sound store is served as a blend; with the default targets this model's blends climb to full
prefill (BENCHMARKS.md, "Quality gate").
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvgate.bench.commands import MUSIQUE, OUTPUT
from kvgate.bench.gate import rows, stored
from kvgate.runtime.config import EngineConfig
from kvgate.runtime.engine import Engine
from kvgate.runtime.loader import load
from kvgate.runtime.planner import Chat, Planner
from kvgate.runtime.quality import FULL, QualityConfig
from kvgate.runtime.report import table, write_section
from kvgate.runtime.request import Request
from kvgate.runtime.sampling import SamplingParams

Items = list[tuple[str, list[str]]]


@dataclass
class Served:
    requests: int = 0
    seconds: float = 0.0
    gaps: list[float] = field(default_factory=list)  # seconds between a stream's successive tokens

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


async def ask(engine: Engine, planner: Planner, question: str, docs: list[str], tokens: int) -> list[float]:
    """One request; the gaps between its tokens."""
    ids, plan = planner.chat(Chat([{"role": "user", "content": question}], documents=[{"text": d} for d in docs]))
    gaps, last = [], None
    async for _ in engine.generate(
        Request(ids, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), plan)
    ):
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now
    return gaps


def under_load(engine: Engine, items: Items, clients: int, seconds: float, tokens: int, until=None) -> Served:
    """`clients` closed-loop clients for `seconds` (or until `until()` holds): the requests answered."""
    planner = Planner(engine.reuser)
    served = Served()
    next_item = iter(range(1 << 30))

    async def client(deadline: float) -> None:
        while time.monotonic() < deadline and not (until and until()):
            question, docs = items[next(next_item) % len(items)]
            served.gaps += await ask(engine, planner, question, docs, tokens)
            served.requests += 1

    async def run() -> None:
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(client(deadline) for _ in range(clients)))

    began = time.perf_counter()
    asyncio.run(run())
    served.seconds = time.perf_counter() - began
    return served


def spread(gaps: list[float]) -> tuple[float, float, float]:
    ordered = sorted(gaps) or [0.0]
    return ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], ordered[-1]


def warm(engine: Engine, items: Items, tokens: int) -> None:
    """Every item asked twice, alone: its documents' KV stored, then read as a blend."""
    planner = Planner(engine.reuser)
    for _ in range(2):
        for question, docs in items:
            asyncio.run(ask(engine, planner, question, docs, tokens))


def blend_stats(engine: Engine) -> dict[str, float]:
    return dict(engine.gate.stats())["blend"]


def perturb(engine: Engine, items: Items) -> None:
    for entry in stored(engine, Planner(engine.reuser), items):
        entry.values.mul_(-3.0)


def parser() -> argparse.ArgumentParser:
    """The command line (`kvgate bench` hands it the arguments as given)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=MUSIQUE)
    parser.add_argument("--items", type=int, default=8)
    parser.add_argument("--docs", type=int, default=3)
    parser.add_argument("--words", type=int, default=50)
    parser.add_argument("--clients", type=int, default=4, help="closed-loop clients, each always with a request")
    parser.add_argument("--seconds", type=float, default=60, help="per turn of each engine")
    parser.add_argument("--rounds", type=int, default=2, help="turns of each engine, alternating")
    parser.add_argument("--tokens", type=int, default=16, help="answer tokens per request")
    parser.add_argument("--kl", type=float, default=0.2, help="the gate's KL target")
    parser.add_argument("--top1", type=float, default=0.8, help="the gate's first-token agreement target")
    parser.add_argument("--react-seconds", type=float, default=600, help="how long the perturbed phase may run")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not args.data.is_file():
        print(f"{args.data}: no such data file (the shared MuSiQue set)", file=sys.stderr)
        return 2
    command = "python -m kvgate.bench.gate_load " + " ".join(argv if argv is not None else sys.argv[1:])
    items = rows(args.data, args.items, args.docs, args.words)
    checked_quality = QualityConfig(target_kl=args.kl, target_top1=args.top1, shadow_rate=0.05)
    with tempfile.TemporaryDirectory() as cache:
        base = EngineConfig(cache_dir=Path(cache), prefix_caching=False)  # blends are the subject
        loaded = load(base)
        engines = {
            "no checks": Engine(replace(base, quality=replace(checked_quality, shadow_rate=0.0)), loaded),
            "checked": Engine(replace(base, quality=checked_quality), loaded),
        }
        try:
            for engine in engines.values():
                warm(engine, items, args.tokens)
            checked = engines["checked"]
            shadow = checked.shadow
            before = (checked.gate.due_count, blend_stats(checked)["checks"], checked.gate.dropped)
            paid = (shadow.spent_s, shadow.rides)
            served = {name: Served() for name in engines}
            for _ in range(args.rounds):
                for name, engine in engines.items():
                    turn = under_load(engine, items, args.clients, args.seconds, args.tokens)
                    served[name].requests += turn.requests
                    served[name].seconds += turn.seconds
                    served[name].gaps += turn.gaps
            due = checked.gate.due_count - before[0]
            done = blend_stats(checked)["checks"] - before[1]
            dropped = checked.gate.dropped - before[2]
            spent, rides = shadow.spent_s - paid[0], shadow.rides - paid[1]
            ratio_sound, answer_sound = blend_stats(checked)["ratio"], blend_stats(checked)["answer"]
            perturb(checked, items)
            at, marks = blend_stats(checked)["checks"], {}

            def reacted() -> bool:
                stats = blend_stats(checked)
                if stats["ratio"] > ratio_sound:
                    marks.setdefault("raised", stats["checks"] - at)
                marks["checks"] = stats["checks"] - at
                return stats["ratio"] == FULL

            react = under_load(checked, items, args.clients, args.react_seconds, args.tokens, until=reacted)
            reacted()
            ratio_end = blend_stats(checked)["ratio"]
        finally:
            for engine in engines.values():
                engine.shutdown()
    cost = 1 - served["checked"].rate / served["no checks"].rate
    body_rows = [
        ["throughput, no checks", f"{served['no checks'].rate:.2f} requests/s ({served['no checks'].requests})", ""],
        ["throughput, checked", f"{served['checked'].rate:.2f} requests/s ({served['checked'].requests})", ""],
        ["throughput cost of checking", f"{cost:.1%}", "<= 5%"],
        [
            "inter-token gap p50 / p99 / max, no checks",
            " / ".join(f"{x * 1000:.0f} ms" for x in spread(served["no checks"].gaps)),
            "",
        ],
        [
            "... checked (a check's rows ride in a step, or a part runs between two)",
            " / ".join(f"{x * 1000:.0f} ms" for x in spread(served["checked"].gaps)),
            "",
        ],
        ["checks due (quality.shadow_rate of requests)", str(due), ""],
        ["checks completed", f"{done:.0f} ({done / due:.0%} of due)" if due else "0", ">= 80%"],
        ["checks dropped (the oldest past max_pending, or of a rung left since)", str(dropped), ""],
        [
            "busy time paid for checks (share of the checked engine's turns; per completed check)",
            f"{spent:.1f} s ({spent / served['checked'].seconds:.1%}; {spent / done if done else 0:.2f} s)",
            "",
        ],
        ["check parts ridden in the engine's steps (64 rows each)", str(rides), ""],
        ["ratio served, sound store", f"{ratio_sound:.0%}", ""],
        ["checks' answer agreement, sound store (leading tokens equal, a share)", f"{answer_sound:.2f}", ""],
        ["perturbed store under load: checks until the first raise", f"{marks.get('raised', 'none')}", ""],
        [
            "... and until full prefill",
            f"{marks['checks']:.0f} ({react.requests} requests, {react.seconds:.0f} s)"
            if ratio_end == FULL
            else f"not within {args.react_seconds:g} s: {ratio_end:.0%} after {marks['checks']:.0f} checks",
            "<= 50",
        ],
    ]
    q = checked_quality
    body = (
        f"{len(items)} MuSiQue items (rows 0..{len(items) - 1}), {args.docs} passages cut to {args.words} words, "
        f"{args.clients} closed-loop clients, {args.tokens}-token answers, {args.rounds} turns of {args.seconds:g} s "
        f"per engine, alternating. Checked engine: quality.shadow_rate {q.shadow_rate:g}, "
        f"quality.shadow_share {q.shadow_share:g}, "
        f"targets KL <= {q.target_kl:g}, top-1 >= {q.target_top1:.0%}; prefix caching off (blends are the subject).\n\n"
        + table(["row", "measured", "target"], body_rows)
    )
    write_section(args.output, "gate-load", "Quality gate under continuous load", command, body)
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
