"""`kvgate bench prefill`: prefill and decode speed of the runtime's own layer loop, side by side
with transformers' `model.forward` (SDPA) on the same prompts in the same run."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from kvgate.bench.plots import figure, image
from kvgate.runtime.config import EngineConfig
from kvgate.runtime.decode import Batches
from kvgate.runtime.kv import KVCache, Pool
from kvgate.runtime.loader import LoadedModel, load
from kvgate.runtime.model import Run, forward
from kvgate.runtime.progress import progress
from kvgate.runtime.report import table, write_section
from kvgate.runtime.threads import Teams, switchable

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "musique_rag_dev.jsonl"


def prompt_ids(loaded: LoadedModel, length: int) -> list[int]:
    """Real text (MuSiQue passages) when the shared data is there; the token ids only need to be plausible."""
    text = ""
    if DATA.is_file():
        with DATA.open() as f:
            for line in f:
                item = json.loads(line)
                text += "\n\n".join(
                    p if isinstance(p, str) else p.get("paragraph_text", p.get("text", "")) for p in item["passages"]
                )
                if len(text) > length * 8:
                    break
    else:
        text = "The quick brown fox jumps over the lazy dog. " * (length // 5)
    ids = loaded.tokenizer.encode(text)
    while len(ids) < length:
        ids += ids
    return ids[:length]


@dataclass
class Stepping:
    """What the engine keeps from one decode step to the next (runtime/engine.py): its blocks' pool, its batch, and
    how many threads each size of step runs fastest on."""

    pool: Pool = field(default_factory=Pool)
    batches: Batches = field(default_factory=Batches)
    teams: Teams = field(default_factory=lambda: Teams(torch.get_num_threads() if switchable() else 1))


def own(loaded: LoadedModel, ids: list[int], decode: int, stepping: Stepping) -> tuple[float, float]:
    """Seconds of the prompt's prefill, and of `decode` greedy steps after it, each step as the engine runs one."""
    mc = loaded.model.config
    kv = KVCache(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, loaded.model.dtype, "cpu", 0, stepping.pool)
    start = time.perf_counter()
    logits = forward(loaded.model, [Run(kv, ids, 0)])
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    with stepping.teams.sized(1):
        for _ in range(decode):
            token = int(logits[0].argmax())
            logits = forward(loaded.model, [Run(kv, [token], len(kv))], pad=False, batches=stepping.batches)
    spent = time.perf_counter() - start
    kv.release()
    return prefill, spent


@torch.inference_mode()
def reference(loaded: LoadedModel, ids: list[int], decode: int) -> tuple[float, float]:
    model = loaded.model
    cache = DynamicCache()
    start = time.perf_counter()
    out = model(torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(decode):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        out = model(token, cache=cache, use_cache=True)  # the cache grows in place
    return prefill, time.perf_counter() - start


def batched_decode(loaded: LoadedModel, ids: list[int], batch: int, steps: int, stepping: Stepping) -> float:
    """Aggregate decode tokens/s with `batch` sequences stepping together (continuous batching), each step as the
    engine runs one: unpadded, its attention batched, on the team its size runs fastest on."""
    mc = loaded.model.config
    kvs = [
        KVCache(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, loaded.model.dtype, "cpu", 0, stepping.pool)
        for _ in range(batch)
    ]
    logits = torch.cat([forward(loaded.model, [Run(kv, ids, 0)]) for kv in kvs])
    start = time.perf_counter()
    for _ in range(steps):
        tokens = logits.argmax(-1).tolist()
        with stepping.teams.sized(batch):
            runs = [Run(kv, [t], len(kv)) for kv, t in zip(kvs, tokens)]
            logits = forward(loaded.model, runs, pad=False, batches=stepping.batches)
    rate = batch * steps / (time.perf_counter() - start)
    for kv in kvs:
        kv.release()  # its blocks back to the pool, as the engine does when a sequence ends
    return rate


def concurrency(rates: dict[int, float], picture: Path, title: str) -> None:
    """Aggregate decode tokens/s against the sequences decoding together, beside B times one sequence's."""
    streams = sorted(rates)
    with figure(picture, 1, (6.5, 4.2), title) as (ax,):
        ax.plot(streams, [rates[b] for b in streams], "o-", color="tab:blue", label="kvgate, all sequences")
        one = rates.get(1)
        if one is not None:
            ax.plot(streams, [b * one for b in streams], ":", color="grey", label="B x one sequence's (linear)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(streams, [str(b) for b in streams])
        ax.set(xlabel="sequences decoding together (B)", ylabel="decode tokens/s, all sequences", ylim=(0, None))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def batching(rates: dict[int, float], context: int, decode: int, repeats: int, plots: Path | None, output: Path) -> str:
    """The continuous-batching table, and with `plots` its figure right after it."""
    single = rates[min(rates)]
    rows = [[str(b), f"{rate:.1f}", f"{rate / single:.2f}"] for b, rate in sorted(rates.items())]
    text = (
        f"Continuous batching: aggregate decode tokens/s with B sequences of {context}-token "
        f"context stepping together ({decode} steps, median of {repeats} after one run of each B; each step as the "
        "engine runs one: unpadded, attention batched, on the threads its size runs fastest on).\n\n"
        + table(["B", "decode tok/s (all sequences)", f"vs B={min(rates)}"], rows)
    )
    if plots is None:
        return text
    picture = plots / "prefill-concurrency.png"
    concurrency(rates, picture, f"Continuous batching: {context}-token contexts, {decode} steps")
    return text + "\n\n" + image(picture, output, "decode tokens/s against sequences decoding together")


def bench_prefill(
    config: EngineConfig,
    lengths: list[int],
    decode: int,
    repeats: int,
    output: Path,
    command: str,
    context: int = 512,
    streams: tuple[int, ...] = (1, 4, 8),
    plots: Path | None = None,
) -> None:
    """`context`: the prompt tokens of each sequence in the continuous-batching rows, `streams` their batch
    sizes; `plots`: the folder of the figure (None: none)."""
    loaded = load(config)
    stepping = Stepping()
    own(loaded, prompt_ids(loaded, 64), 2, stepping)  # warm-up
    rows = []
    for length in progress(lengths, "prompt lengths"):
        ids = prompt_ids(loaded, length)
        ours = [own(loaded, ids, decode, stepping) for _ in range(repeats)]
        theirs = [reference(loaded, ids, decode) for _ in range(repeats)]
        p_own, d_own = min(o[0] for o in ours), min(o[1] for o in ours)
        p_ref, d_ref = min(t[0] for t in theirs), min(t[1] for t in theirs)
        rows.append(
            [
                str(length),
                f"{length / p_own:.0f}",
                f"{length / p_ref:.0f}",
                f"{p_ref / p_own:.2f}",
                f"{decode / d_own:.1f}",
                f"{decode / d_ref:.1f}",
                f"{d_ref / d_own:.2f}",
            ]
        )
        print(" | ".join(rows[-1]), flush=True)
    ctx = prompt_ids(loaded, context)
    rates: dict[int, float] = {}
    for b in progress(streams, "batch sizes"):
        batched_decode(
            loaded, ctx, b, decode, stepping
        )  # warm-up: the teams' timings of this size, the batch's storage
        rates[b] = statistics.median(batched_decode(loaded, ctx, b, decode, stepping) for _ in range(repeats))
        print(f"{b} | {rates[b]:.1f} | {rates[b] / rates[streams[0]]:.2f}", flush=True)
    body = (
        f"Model {loaded.name}, {loaded.dtype}. Prefill of one prompt and greedy decode of "
        f"{decode} tokens after it, best of {repeats}; `own` is the runtime's layer loop "
        "(`runtime/model.py`; decode steps as the engine runs them: unpadded, attention batched), `hf` is "
        "transformers' `model.forward` with SDPA and `DynamicCache` "
        "on the same model and prompt in the same run. Ratio = own speed / hf speed.\n\n"
        + table(
            [
                "prompt tokens",
                "prefill tok/s own",
                "prefill tok/s hf",
                "ratio",
                "decode tok/s own",
                "decode tok/s hf",
                "ratio",
            ],
            rows,
        )
        + "\n\n"
        + batching(rates, context, decode, repeats, plots, output)
    )
    write_section(output, "prefill", "Prefill and decode speed", command, body)
