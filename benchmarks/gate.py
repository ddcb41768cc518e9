"""`python -m kvgate.bench.gate`: how fast the quality gate reacts to bad reuse, and recovers.

A real engine with every reused request checked (shadow_rate 1) serves MuSiQue questions over their
passages. Three phases, each request's check done before the next request: the store sound (where
the gate settles), then the stored document KV perturbed in place (values scaled by -3: a fault no
real part produces on demand), then restored. Reported: the checks until the gate reaches full
prefill, and the checks until reuse is served again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from kvgate.bench.commands import MUSIQUE
from kvgate.chunk_cache import ChunkKV
from kvgate.runtime.config import EngineConfig
from kvgate.runtime.engine import Engine
from kvgate.runtime.planner import Chat, Planner
from kvgate.runtime.quality import FULL, QualityConfig
from kvgate.runtime.request import Request, Result
from kvgate.runtime.sampling import SamplingParams


def rows(path: Path, limit: int, docs: int, words: int) -> list[tuple[str, list[str]]]:
    found = []
    with path.open() as f:
        for line, _ in zip(f, range(limit)):
            row = json.loads(line)
            found.append((row["question"], [" ".join(p.split()[:words]) for p in row["passages"][:docs]]))
    return found


def ask(
    engine: Engine,
    planner: Planner,
    question: str,
    docs: list[str],
    scope: str = "",
    wait_s: float = 600,
    ratio: float | None = None,
) -> Result:
    """A chat over `docs` through the engine (one token), returned once its shadow check, if one is
    due, is done (it runs when the engine is idle), or `wait_s` later. `ratio`: a blend's, asked."""
    documents = [{"text": d} for d in docs]
    messages = [{"role": "user", "content": question}]
    ids, plan = planner.chat(Chat(messages, documents=documents, scope=scope, ratio=ratio))

    async def run() -> Result:
        result = Result()
        async for out in engine.generate(Request(ids, SamplingParams(max_tokens=1, temperature=0), plan)):
            result.add(out)
        return result

    result = asyncio.run(run())
    deadline = time.monotonic() + wait_s
    while engine.shadow.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    return result


def phase(engine: Engine, planner: Planner, items, requests: int, until) -> tuple[int | None, list[float]]:
    """Serve `requests` requests round the items; the number of checks after which `until(ratio)`
    first held (None: never), and the ratio served after each."""
    ratios, hit = [], None
    for n in range(requests):
        question, docs = items[n % len(items)]
        ask(engine, planner, question, docs)
        ratio = dict(engine.gate.stats())["blend"]["ratio"]
        ratios.append(ratio)
        if hit is None and until(ratio):
            hit = n + 1
    return hit, ratios


def stored(engine: Engine, planner: Planner, items: list[tuple[str, list[str]]]) -> list[ChunkKV]:
    """The stored KV of the items' documents (those a tier holds), to perturb in place."""
    entries = [engine.reuser.store.get(engine.reuser.key(planner.tokens(d))) for _, docs in items for d in docs]
    return [e for e in entries if e is not None]


def parser() -> argparse.ArgumentParser:
    """The command line (`kvgate bench` hands it the arguments as given)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=MUSIQUE)
    parser.add_argument("--items", type=int, default=6)
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--words", type=int, default=60)
    parser.add_argument("--requests", type=int, default=50, help="per phase")
    parser.add_argument("--kl", type=float, default=0.05, help="the gate's KL target")
    parser.add_argument("--top1", type=float, default=0.95, help="the gate's first-token agreement target")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not args.data.is_file():
        print(f"{args.data}: no such data file (the shared MuSiQue set)", file=sys.stderr)
        return 2
    quality = QualityConfig(shadow_rate=1.0, target_kl=args.kl, target_top1=args.top1)
    with tempfile.TemporaryDirectory() as cache:
        engine = Engine(EngineConfig(cache_dir=Path(cache), quality=quality))
        try:
            planner = Planner(engine.reuser)
            items = rows(args.data, args.items, args.docs, args.words)
            began = time.perf_counter()
            settled, sound = phase(engine, planner, items, args.requests, lambda r: r == FULL)
            entries = stored(engine, planner, items)
            saved = [e.values.clone() for e in entries]
            for e in entries:
                e.values.mul_(-3.0)
            closed, bad = phase(engine, planner, items, args.requests, lambda r: r == FULL)
            for e, v in zip(entries, saved):
                e.values.copy_(v)
            reopened, good = phase(engine, planner, items, args.requests, lambda r: r < FULL)
            stats = dict(engine.gate.stats())["blend"]
        finally:
            engine.shutdown()
    print(
        f"targets: KL <= {args.kl:g}, top-1 >= {args.top1:.0%}; "
        f"{quality.window}-check window, {quality.min_checks} to climb"
    )
    print(f"sound store: full prefill after {settled} checks; ratio served at the end {sound[-1]:.0%}")
    print(f"perturbed store: full prefill after {closed} checks (ratios {', '.join(f'{r:.0%}' for r in bad[:30])})")
    print(f"restored: reuse served again after {reopened} checks; ratio at the end {good[-1]:.0%}")
    print(f"lifetime: {stats['checks']} checks, mean KL {stats['kl']:.3f}, top-1 {stats['top1']:.1%}")
    print(f"took {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
