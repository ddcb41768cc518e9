"""`kvgate bench precision`: bf16 weights and KV against fp32, both full prefill, side by side.

fp32 full prefill is the truth the rest of kvgate is measured against; this says how far serving
in bf16 moves the answer, and what it buys. Per MuSiQue item (documents and question, as
`bench fidelity` builds them), in one run with both models loaded and the two alternating:
- time to first token (full prefill) and a decode step's time;
- first-token KL(fp32 || bf16), top-1 agreement over fp32's greedy answer teacher-forced, and
  whether bf16's own greedy answer equals fp32's.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kvgate.runtime.config import EngineConfig
from kvgate.runtime.fidelity import Item, kl, load_items, top1
from kvgate.runtime.kv import KVCache
from kvgate.runtime.loader import LoadedModel, load
from kvgate.runtime.model import Run, forward
from kvgate.runtime.progress import progress
from kvgate.runtime.report import pct, table, write_section

DTYPES = ("float32", "bfloat16")


@dataclass
class Answer:
    ids: list[int]
    first: torch.Tensor  # the first answer token's logits
    ttft: float
    step: float  # mean seconds of a decode step


@dataclass
class Rows:
    ttft: dict[str, list[float]] = field(default_factory=lambda: {d: [] for d in DTYPES})
    step: dict[str, list[float]] = field(default_factory=lambda: {d: [] for d in DTYPES})
    kl: list[float] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)
    equal: list[bool] = field(default_factory=list)


def new_kv(loaded: LoadedModel) -> KVCache:
    c = loaded.model.config
    return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, loaded.model.dtype, "cpu")


def answer(loaded: LoadedModel, ids: list[int], tokens: int) -> Answer:
    kv = new_kv(loaded)
    began = time.perf_counter()
    first = forward(loaded.model, [Run(kv, ids, 0)])[0].float()
    ttft = time.perf_counter() - began
    out, logits = [], first
    began = time.perf_counter()
    while True:
        out.append(int(logits.argmax()))
        if out[-1] in loaded.eos_token_ids or len(out) == tokens:
            break
        logits = forward(loaded.model, [Run(kv, [out[-1]], len(kv))])[0]
    steps = max(1, len(out) - 1)
    return Answer(out, first, ttft, (time.perf_counter() - began) / steps)


def forced(loaded: LoadedModel, ids: list[int], reference: list[int]) -> torch.Tensor:
    """The logits at every position of `reference` after the prompt `ids` (a fresh full prefill)."""
    kv = new_kv(loaded)
    logits = forward(loaded.model, [Run(kv, ids + reference[:-1], 0)], every=True)
    return logits[len(ids) - 1 :].float()


def measure(models: dict[str, LoadedModel], items: list[Item], tokens: int) -> Rows:
    rows = Rows()
    for n, item in enumerate(progress(items, "items")):
        order = DTYPES if n % 2 == 0 else DTYPES[::-1]  # alternate which runs first
        answers = {d: answer(models[d], item.ids, tokens) for d in order}
        for d in DTYPES:
            rows.ttft[d].append(answers[d].ttft)
            rows.step[d].append(answers[d].step)
        truth, served = answers["float32"], answers["bfloat16"]
        rows.kl.append(kl(truth.first[None], served.first[None]))
        rows.top1.append(top1(forced(models["bfloat16"], item.ids, truth.ids), truth.ids))
        rows.equal.append(truth.ids == served.ids)
        print(f"item {n}: kl {rows.kl[-1]:.4f} equal {rows.equal[-1]}", flush=True)
    return rows


def report(rows: Rows, tokens: int) -> str:
    mean = statistics.fmean
    fp32, bf16 = (mean(rows.ttft[d]) for d in DTYPES)
    s32, s16 = (mean(rows.step[d]) * 1000 for d in DTYPES)
    body = [
        ["time to first token (full prefill)", f"{fp32:.2f} s", f"{bf16:.2f} s", f"{fp32 / bf16:.2f}x"],
        ["decode step, 1 stream", f"{s32:.1f} ms", f"{s16:.1f} ms", f"{s32 / s16:.2f}x"],
        ["first-token KL, fp32 to bf16", "0", f"{mean(rows.kl):.4f} (max {max(rows.kl):.4f})", ""],
        [f"top-1 over fp32's answer ({tokens} tokens, forced)", "100%", f"{pct(mean(rows.top1))}%", ""],
        [
            f"greedy {tokens}-token answers equal to fp32's",
            f"{len(rows.equal)} of {len(rows.equal)}",
            f"{sum(rows.equal)} of {len(rows.equal)}",
            "",
        ],
    ]
    return table(["row", "float32", "bfloat16", "fp32 / bf16 (>1: bf16 faster)"], body)


def bench_precision(
    config: EngineConfig, data: Path, docs: int, limit: int, tokens: int, output: Path, command: str
) -> str:
    models = {d: load(replace(config, dtype=d)) for d in DTYPES}
    items = load_items(models["float32"], data, docs, limit, False, 0, 0)
    rows = measure(models, items, tokens)
    cpu = torch.backends.cpu.get_cpu_capability()
    prompt = statistics.fmean(len(i.ids) for i in items)
    body = (
        f"{len(items)} MuSiQue items (rows 0..{len(items) - 1}), {docs} passages each and the question, "
        f"{prompt:.0f} prompt tokens on average; model {models['float32'].name}; CPU capability {cpu}. "
        "Both models loaded in one process, each item run in both (the first alternating), full prefill each; "
        "fp32 is the reference.\n\n" + report(rows, tokens)
    )
    write_section(output, "precision", "bf16 against fp32: speed and how far it moves the answer", command, body)
    return report(rows, tokens)
