"""`kvgate bench decode`: what a decode step costs.

1. The model's decode step (runtime/model.py `forward`, one token per sequence), its attention batched
   (runtime/decode.py, the batch kept from step to step) against per sequence, in one process, the two
   interleaved step by step: 1 and 8 sequences with 100 and 1000 cached tokens each.
2. The engine's own work per decode step: a whole step of the engine (schedule, forward, sample, detokenize,
   deliver) with a 2-layer random-weight Llama of hidden size 64, whose arithmetic is negligible, at 1, 8 and
   64 sequences.
3. How that work grows with layers: the same engine at 2 and 32 layers beside the model's decode step alone
   (its forward) at those depths, so that what a layer adds to a step is seen beside what it adds to the kernels.

python -m kvgate.bench.decode_step [--dtype auto,float32] [--steps 24] [--tokens 256]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvgate.gateway.settings import Settings
from kvgate.runtime.config import EngineConfig
from kvgate.runtime.decode import Batch, Batches
from kvgate.runtime.engine import Engine
from kvgate.runtime.invariance import row_floor
from kvgate.runtime.kv import KVCache, Pool
from kvgate.runtime.loader import LoadedModel, load
from kvgate.runtime.model import Run, forward
from kvgate.runtime.report import cpu, write_section
from kvgate.runtime.request import Request
from kvgate.runtime.sampling import SamplingParams
from kvgate.runtime.threads import claim

OUTPUT = Path(__file__).with_name("BENCHMARKS.md")
SHAPES = ((1, 100), (1, 1000), (8, 100), (8, 1000))
COUNTS = (1, 8, 64)  # sequences a step in the engine's rows
DEPTHS = (2, 32)  # layers of the engine's rows that show the growth


def caches(loaded: LoadedModel, sequences: int, tokens: int) -> list[KVCache]:
    """Each sequence's prompt prefilled, its blocks from one pool as the engine's are (runtime/kv.py `Pool`)."""
    c, pool = loaded.model.config, Pool()
    out, words = [], min(c.vocab_size, 1005) - 5
    for b in range(sequences):
        kv = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, loaded.model.dtype, "cpu", 8192, pool)
        forward(loaded.model, [Run(kv, [(7 * b + j) % words + 5 for j in range(tokens)], 0)])
        out.append(kv)
    return out


class PerSequence(Batches):
    def of(self, caches: list[KVCache], windows: set[int | None], group: int = 1) -> Batch | None:
        return None


def steps(loaded: LoadedModel, sequences: int, tokens: int, count: int) -> tuple[float, float]:
    """Median ms of a decode step: attention per sequence, batched."""
    sets = [caches(loaded, sequences, tokens) for _ in range(2)]
    ways, times = (PerSequence(), Batches()), ([], [])  # type: ignore[var-annotated]
    for _ in range(count + 4):
        for kvs, batches, spent in zip(sets, ways, times):
            start = time.perf_counter()
            forward(loaded.model, [Run(kv, [5], len(kv)) for kv in kvs], pad=False, batches=batches)
            spent.append(time.perf_counter() - start)
    alone, together = (statistics.median(t[4:]) * 1e3 for t in times)
    return alone, together


def engine_ms(tiny: Engine, sequences: int, tokens: int = 64) -> float:
    """ms per engine step, the sequences' 4-token prompts and their decode steps together."""

    async def run() -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)

        async def one(i: int) -> None:
            async for _ in tiny.generate(Request([5 + i, 6, 7, 8], params)):
                pass

        steps, start = tiny.steps, time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(sequences)))
        return (time.perf_counter() - start) / (tiny.steps - steps) * 1e3

    return statistics.median(asyncio.run(run()) for _ in range(3))


def tiny_model(loaded: LoadedModel, where: Path, vocab: int | None = None, layers: int = 2) -> LoadedModel:
    """A random Llama of hidden size 64 over the default tokenizer (`vocab`: its first tokens only)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=vocab or len(loaded.tokenizer), max_position_embeddings=1024, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(loaded.model.dtype).eval()
    model.save_pretrained(where)
    return LoadedModel(model, loaded.tokenizer, "tiny", where, loaded.eos_token_ids)


def tiny_engine(tiny: LoadedModel) -> Engine:
    config = EngineConfig(dtype=tiny.dtype, cache_dir=tiny.path / "cache", max_num_seqs=64)
    return Engine(config, tiny)


def engine_cells(loaded: LoadedModel, vocab: int | None, layers: int, tokens: int, count: int) -> list[float]:
    """The engine's ms a step at 1, 8 and 64 sequences, then (`count` > 0) its model's forward alone at the
    same sequences and their mean context."""
    with tempfile.TemporaryDirectory() as where:
        tiny = tiny_model(loaded, Path(where), vocab, layers)
        engine = tiny_engine(tiny)
        try:
            cells = [engine_ms(engine, n, tokens) for n in COUNTS]
        finally:
            engine.shutdown()
        return cells + [on_its_own_thread(steps, tiny, n, tokens // 2, count)[1] for n in COUNTS if count]


def ms(cells: list[float], digits: int = 2) -> str:
    return " | ".join(f"{c:.{digits}f}" for c in cells)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate bench decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="auto", help="comma-separated: auto, float32, bfloat16")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per shape and path")
    p.add_argument("--tokens", type=int, default=256, help="tokens each sequence decodes, in the engine's rows")
    p.add_argument("--output", type=Path, default=OUTPUT)
    return p


def on_its_own_thread(fn, *args):  # type: ignore[no-untyped-def]
    """fn(*args) on a thread that claims the cores and ends, its OpenMP team with it (runtime/threads.py)."""
    out: list = []
    worker = threading.Thread(target=lambda: (claim(), out.append(fn(*args))))
    worker.start()
    worker.join()
    if not out:
        raise RuntimeError("the measurement failed (its traceback is above)")
    return out[0]


def model_rows(dtype: str, count: int) -> tuple[LoadedModel, list[str], int]:
    config = Settings.load(engine={"dtype": dtype}).engine_config()
    loaded = load(config)
    row_floor(loaded.model, config.cache_dir)
    rows = []
    for sequences, tokens in SHAPES:
        alone, together = steps(loaded, sequences, tokens, count)
        rows.append(f"| {loaded.dtype} | {sequences} x {tokens} | {alone:.1f} | {together:.1f} | "
                    f"{alone / together:.2f}x |")  # fmt: skip
        print(rows[-1], flush=True)
    return loaded, rows, torch.get_num_threads()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    rows, engine_rows, depth_rows = [], [], []
    for dtype in args.dtype.split(","):
        loaded, more, threads = on_its_own_thread(model_rows, dtype, args.steps)
        rows += more
        for vocab in (512, None):
            cells = engine_cells(loaded, vocab, 2, args.tokens, 0)
            engine_rows.append(f"| {loaded.dtype} | {vocab or len(loaded.tokenizer)} | {ms(cells)} |")
            print(engine_rows[-1], flush=True)
        deep = [engine_cells(loaded, 512, layers, args.tokens, args.steps) for layers in DEPTHS]
        for layers, cells in zip(DEPTHS, deep):
            depth_rows.append(f"| {loaded.dtype} | {layers} | {ms(cells[:3])} | {ms(cells[3:])} |")
        added = [(b - a) / (DEPTHS[1] - DEPTHS[0]) for a, b in zip(*deep)]
        depth_rows.append(f"| {loaded.dtype} | a layer more | {ms(added[:3], 3)} | {ms(added[3:], 3)} |")
        print(*depth_rows[-3:], sep="\n", flush=True)
    body = "\n".join([
        f"The model's decode step ({loaded.name}, {threads} threads), median ms of "
        f"{args.steps} steps, the two paths interleaved:", "",
        "| dtype | sequences x cached tokens | attention per sequence | batched | gain |", "|---|---|---|---|---|",
        *rows, "",
        "The engine's own work per decode step, ms (a 2-layer random Llama, hidden 64: schedule, forward, "
        f"sample, detokenize, deliver; 4-token prompts, {args.tokens} tokens each, median of 3 runs). Over the "
        "first 512 tokens of the default tokenizer its arithmetic is negligible; over all of them the LM head "
        "and the greedy choice over 49k logits a sequence are not:", "",
        "| dtype | vocabulary | 1 sequence | 8 | 64 |", "|---|---|---|---|---|", *engine_rows, "",
        f"How it grows with layers: the engine's step (vocabulary 512) beside its model's decode step alone (the "
        f"forward, batched, {args.tokens // 2} cached tokens a sequence), ms, at {DEPTHS[0]} and {DEPTHS[1]} "
        "layers, and what a layer adds to each:", "",
        "| dtype | layers | engine, 1 | 8 | 64 | forward, 1 | 8 | 64 |", "|---|---|---|---|---|---|---|---|",
        *depth_rows, "", cpu() + ".",
    ])  # fmt: skip
    command = "kvgate bench decode " + " ".join(argv if argv is not None else sys.argv[1:])
    write_section(args.output, "decode", "What a decode step costs", command.strip(), body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
