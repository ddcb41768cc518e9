"""`kvgate bench exact`: every request the engine serves as `exact` against `reuse: full` of the same request,
greedy, token for token: repeats, a shared system prompt with new questions, an agent's turns with its history
resent, documents in their stored order with new questions. Also what invariance costs: a cold prompt's
prefill and a decode step, with the grid and row padding (runtime/model.py) and without.

python -m kvgate.bench.exactness [--dtype float32,bfloat16] [--rounds 10] [--tokens 24]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from kvgate.runtime import invariance
from kvgate.runtime import model as model_module
from kvgate.runtime.config import EngineConfig
from kvgate.runtime.engine import Engine
from kvgate.runtime.kv import KVCache
from kvgate.runtime.model import Run, attend, forward
from kvgate.runtime.report import cpu, write_section
from kvgate.runtime.request import Plan, Result
from kvgate.runtime.retrieval_task import tasks
from kvgate.runtime.reuse import ReuseMode
from kvgate.runtime.sampling import SamplingParams

OUTPUT = Path(__file__).with_name("BENCHMARKS.md")
SYSTEM = "You are a careful assistant for a shipping company. Answer briefly and cite the documents. " * 8


def chat(engine: Engine, messages: list[dict[str, str]]) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def prompts(engine: Engine, rounds: int) -> list[tuple[str, list[dict[str, str]]]]:
    """(shape, messages) in the order they are sent: each shape's later requests reuse its earlier ones."""
    work = tasks(rounds, seed=7, words=60)
    out: list[tuple[str, list[dict[str, str]]]] = []
    for i, task in enumerate(work):
        question, own = task.question, "\n\n".join(task.asked)
        out += [("repeat", [{"role": "user", "content": f"{own}\n\n{question}"}])] * 2
        out.append(("system prompt", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]))
        documents = "\n\n".join(work[0].stored)  # the same documents every time, in their stored order
        out.append(("documents", [{"role": "user", "content": f"{documents}\n\n{question}"}]))
        out.append(("agent turn", [{"role": "user", "content": f"{own}\n\nPlan step {i}: {question}"}]))
    return out


def serve(engine: Engine, ids: list[int], tokens: int, full: bool = False) -> Result:
    plan = Plan([ids], [False], ReuseMode("full")) if full else None
    return engine.generate_sync(ids, SamplingParams(max_tokens=tokens, temperature=0), plan)


def check(dtype: str, rounds: int, tokens: int) -> tuple[Counter, Counter, list[str]]:
    """Per shape: requests served exact, and of them those whose tokens equal reuse: full's; and the labels."""
    engine = Engine(EngineConfig(dtype=dtype, cache_dir=Path(tempfile.mkdtemp())))
    exact, same, labels = Counter(), Counter(), []
    try:
        for shape, messages in prompts(engine, rounds):
            ids = chat(engine, messages)
            served = serve(engine, ids, tokens)
            if shape == "agent turn":  # the turn after: the answer resent, a tool's result, the next question
                turn = [*messages, {"role": "assistant", "content": served.text}, {"role": "user", "content": "ok?"}]
                ids = chat(engine, turn)
                served = serve(engine, ids, tokens)
            fidelity = served.report.fidelity
            labels.append(fidelity.kind if fidelity is not None else "none")
            if fidelity is not None and fidelity.kind == "exact":
                exact[shape] += 1
                same[shape] += served.token_ids == serve(engine, ids, tokens, full=True).token_ids
    finally:
        engine.shutdown()
    return exact, same, labels


def cost(dtype: str, tokens: int = 2048, reps: int = 3) -> tuple[float, float, float, float]:
    """Seconds of a cold prefill of `tokens` and of a one-sequence decode step after it: invariant as served,
    and as before (one attention call per run, no padding)."""
    engine = Engine(EngineConfig(dtype=dtype, cache_dir=Path(tempfile.mkdtemp())))
    model, shape = engine.model, engine.kv_shape
    engine.shutdown()
    ids = list(range(1000, 1000 + tokens))

    def timed() -> tuple[float, float]:
        prefill, decode = [], []
        for _ in range(reps):
            kv = KVCache(*shape, model.dtype, "cpu", 8192)
            start = time.perf_counter()
            forward(model, [Run(kv, ids, 0)])
            prefill.append(time.perf_counter() - start)
            start = time.perf_counter()
            for i in range(8):
                forward(model, [Run(kv, [5], tokens + i)])
            decode.append((time.perf_counter() - start) / 8)
        return statistics.median(prefill), statistics.median(decode)

    invariant = timed()
    grid, floors = model_module.attend_grid, dict(invariance._floors)
    try:  # the kernels as they were: whatever one call per run picks, no padding
        model_module.attend_grid = lambda q, k, v, start, scale, window, out: out.copy_(attend(q, k, v, scale, window))
        invariance._floors.update(dict.fromkeys(floors, 1))
        before = timed()
    finally:
        model_module.attend_grid = grid
        invariance._floors.update(floors)
    return invariant[0], before[0], invariant[1], before[1]


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate bench exact", description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of the five shapes (six requests each)")
    parser.add_argument("--tokens", type=int, default=24, help="greedy tokens compared")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    rows, costs = [], []
    for dtype in args.dtype.split(","):
        exact, same, labels = check(dtype, args.rounds, args.tokens)
        for shape in sorted(exact):
            rows.append(f"| {dtype} | {shape} | {exact[shape]} | {same[shape]} of {exact[shape]} |")
        served = ", ".join(f"{label} x{n}" for label, n in Counter(labels).most_common())
        rows.append(f"| {dtype} | all ({len(labels)} requests: {served}) | {sum(exact.values())} | "
                    f"{sum(same.values())} of {sum(exact.values())} |")  # fmt: skip
        p1, p0, d1, d0 = cost(dtype)
        costs.append(f"| {dtype} | {p1:.2f} / {p0:.2f} s ({p1 / p0:.2f}x) | {d1 * 1e3:.1f} / {d0 * 1e3:.1f} ms "
                     f"({d1 / d0:.2f}x) |")  # fmt: skip
        print(rows[-1], costs[-1], flush=True)
    body = "\n".join([
        "Requests served `exact`, and of them those whose greedy tokens equal `reuse: full` of the same request.",
        "", "| dtype | shape | served exact | equal to full |", "|---|---|---|---|", *rows, "",
        "What invariance costs (one process, torch's threads; median of 3): invariant / as before.", "",
        "| dtype | cold prefill, 2048 tokens | decode step, 1 sequence |", "|---|---|---|", *costs,
        "", cpu() + ".",
    ])  # fmt: skip
    command = "kvgate bench exact " + " ".join(argv if argv is not None else sys.argv[1:])
    write_section(args.output, "exact", "Exact reuse against full prefill", command.strip(), body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
