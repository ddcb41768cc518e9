"""`kvgate bench ttft`: time to first token of each reuse mode against full prefill, in one run.

Documents are stored first (`Reuser.document` for each, what `POST /v1/documents` does), and every
item's prompt, documents in their stored order, is run once in full and its prefix kept (what an
earlier identical request leaves for exact prefix caching). Then, per item, the modes are timed
interleaved, each `repeats` times keeping the fastest: full prefill (the runtime's layer loop over
the whole prompt, SDPA `is_causal`: the fastest full prefill), exact prefix reuse, naive reuse and
blend at the calibrated ratio (plus any other ratios asked for), once with the documents in their
stored order and once shuffled (a fixed permutation per item: exact prefix reuse then finds only
the chat template's head). The time runs from the empty KV until the first answer token's logits
exist. The first token's logits and the KV each mode left are then scored against full prefill
(first-token KL, top-1 over the reference answer's first 32 positions, teacher-forced).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kvgate.bench.fidelity import TARGET_KL, TARGET_TOP1
from kvgate.runtime.blend import BlendConfig
from kvgate.runtime.calibration import load as load_calibration
from kvgate.runtime.calibration import model_fingerprint, path
from kvgate.runtime.config import EngineConfig
from kvgate.runtime.fidelity import (
    ANSWER,
    Item,
    greedy,
    keep_prefix,
    kl,
    load_items,
    make_reuser,
    prefix_blocks,
    start,
    teacher_forced,
    top1,
)
from kvgate.runtime.loader import load
from kvgate.runtime.report import table, write_section
from kvgate.runtime.reuse import ReuseMode, Reuser

TARGET_SPEEDUP = 4.0  # the target, against the fastest full prefill, on shuffled documents
ORDERS = ("stored", "shuffled")


@dataclass
class Timing:
    seconds: list[float] = field(default_factory=list)  # per item, the fastest of the repeats
    kl: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)  # first-token argmax agrees with full prefill
    top1: list[float] = field(default_factory=list)  # over the first 32 positions, teacher-forced
    reused: list[int] = field(default_factory=list)
    recomputed: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def mean(self, name: str) -> float:
        values = getattr(self, name)
        return statistics.fmean(values) if values else float("nan")


def label(reuse: ReuseMode, calibrated: float) -> str:
    if reuse.mode != "blend":
        return reuse.mode
    if reuse.ratio is None:
        return f"blend {calibrated:.0%} (calibrated)"
    return f"blend {reuse.ratio:.0%}"


def timed(reuser: Reuser, item: Item, reuse: ReuseMode):
    began = time.perf_counter()
    kv, logits, done = start(reuser, item, reuse)
    if logits.is_cuda:  # the GPU's work done, not only queued
        torch.cuda.synchronize(logits.device)
    return time.perf_counter() - began, kv, logits, done


def prepare(reuser: Reuser, data: list[Item]) -> None:
    """Every document stored, then every prompt (stored order) run once in full with its prefix kept."""
    for item in data:
        for ids, is_doc in zip(item.pieces, item.documents):
            if is_doc:
                reuser.document(ids)
    for item in data:
        kv, _, _ = start(reuser, item, ReuseMode("full"))
        keep_prefix(reuser, kv, item)


def missing(reuser: Reuser, data: list[Item]) -> int:
    """Documents and prefixes that did not stay in the store (an eviction would spoil the timing)."""
    keys = [reuser.key(ids) for item in data for ids, d in zip(item.pieces, item.documents) if d]
    blocks = prefix_blocks(reuser)
    for item in data:
        parent = blocks.root("")
        for first in range(0, len(item.ids) - len(item.ids) % blocks.size, blocks.size):
            parent = blocks.key(parent, item.ids[first : first + blocks.size], "")
            keys.append(parent)
    return sum(key not in reuser.store for key in keys)


def measure_item(
    reuser: Reuser, item: Item, modes: list[ReuseMode], names: list[str], repeats: int, eos: frozenset[int], out
) -> None:
    best: dict[str, tuple] = {}
    for _ in range(repeats):
        for mode, name in zip(modes, names):
            seconds, kv, logits, done = timed(reuser, item, mode)
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, kv, logits, done)
    _, ref_kv, ref_first, _ = best["full"]
    prompt_len = len(ref_kv)
    answer, _ = greedy(reuser, ref_kv, ref_first, eos)
    for name, (seconds, kv, logits, done) in best.items():
        kv.truncate(prompt_len)
        t = out[name]
        t.seconds.append(seconds)
        t.kl.append(kl(ref_first, logits))
        t.first.append(float(int(logits.argmax()) == int(ref_first.argmax())))
        t.top1.append(top1(teacher_forced(reuser, kv, logits, answer), answer))
        t.reused.append(done.reused)
        t.recomputed.append(done.recomputed)
        if done.note:
            t.notes.append(done.note)


def verdict(name: str, t: Timing, full: float) -> str:
    speedup = full / t.mean("seconds")
    parts = [
        f"top-1 {100 * t.mean('top1'):.1f}% ({'met' if t.mean('top1') >= TARGET_TOP1 else 'missed'})",
        f"KL {t.mean('kl'):.3f} ({'met' if t.mean('kl') <= TARGET_KL else 'missed'})",
        f"{speedup:.1f}x ({'met' if speedup >= TARGET_SPEEDUP else 'missed'})",
    ]
    return f"`{name}`: " + ", ".join(parts)


def plot(results: dict[str, dict[str, Timing]], picture: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for order, marker in zip(ORDERS, ("o", "s")):
        timings = results[order]
        full = timings["full"].mean("seconds")
        for name, t in timings.items():
            if name == "full":
                continue
            x = full / t.mean("seconds")
            for ax, y in ((left, 100 * t.mean("top1")), (right, t.mean("kl"))):
                ax.scatter(x, y, marker=marker, color="tab:blue" if order == "stored" else "tab:orange")
                ax.annotate(
                    name.replace(" (calibrated)", "*"), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points"
                )
    for ax in (left, right):
        ax.set_xscale("log")
        ax.axvline(TARGET_SPEEDUP, linestyle="--", color="tab:red", linewidth=0.8)
        ax.set_xlabel("TTFT speedup over full prefill (x, log)")
        ax.grid(alpha=0.3)
        ax.scatter([], [], marker="o", color="tab:blue", label="documents in stored order")
        ax.scatter([], [], marker="s", color="tab:orange", label="documents shuffled")
        ax.legend(fontsize=8)
    left.axhline(100 * TARGET_TOP1, linestyle="--", color="tab:red", linewidth=0.8)
    right.axhline(TARGET_KL, linestyle="--", color="tab:red", linewidth=0.8)
    left.set(ylabel=f"top-1 agreement, {ANSWER} positions forced (%)", ylim=(0, 101))
    right.set(ylabel="first-token KL(full || mode)", ylim=(0, None))
    fig.suptitle(title + " (target: red lines, upper right / lower right of them)", fontsize=10)
    fig.tight_layout()
    fig.savefig(picture, dpi=110)
    plt.close(fig)


def bench_ttft(
    config: EngineConfig,
    data: Path,
    docs: int,
    limit: int,
    ratio: float | None,
    ratios: list[float],
    repeats: int,
    words: int,
    offset: int,
    output: Path,
    command: str,
) -> dict[str, dict[str, Timing]]:
    began = time.perf_counter()
    loaded = load(config)
    stored = load_items(loaded, data, docs, limit, False, offset, words)
    shuffled = load_items(loaded, data, docs, limit, True, offset, words)
    # Room for every document and prefix: the benchmark measures compute, not eviction.
    per_token = 2 * loaded.model.config.num_hidden_layers * loaded.model.config.num_key_value_heads
    per_token *= loaded.model.config.head_dim * torch.empty((), dtype=loaded.model.dtype).element_size()
    need = int(1.25 * per_token * sum(2 * len(i.ids) for i in stored))
    calibration = load_calibration(path(config.cache_dir, model_fingerprint(loaded)))
    select = BlendConfig(select=config.blend_select)  # which tokens a blend recomputes: the server's setting
    if ratio is not None:
        source = f"given on the command line ({ratio:.0%})"
        reuser = make_reuser(loaded, select, memory_bytes=max(config.chunk_cache.memory_bytes, need))
        blend = ReuseMode("blend", ratio)
    elif calibration is not None:
        source = (
            f"calibrated ({calibration.ratio:.0%} for mean {calibration.metric} target {calibration.target:g} "
            f"over {calibration.items} items; deviation limit {calibration.deviation_limit}), served as the "
            "engine serves it: a request deviating above the limit gets the larger ratio"
        )
        reuser = make_reuser(
            loaded,
            replace(select, ratio=calibration.ratio),
            calibration.deviation_limit,
            max(config.chunk_cache.memory_bytes, need),
        )
        blend = ReuseMode("blend")
    else:
        source = f"NOT calibrated (no `kvgate calibrate` result for this model): the default {BlendConfig().ratio:.0%}"
        print(f"kvgate bench ttft: no calibration found; blend uses the default ratio {BlendConfig().ratio:.0%}")
        reuser = make_reuser(loaded, select, memory_bytes=max(config.chunk_cache.memory_bytes, need))
        blend = ReuseMode("blend", BlendConfig().ratio)  # its row is not "(calibrated)": nothing was
    calibrated = reuser.blend.ratio if ratio is None else ratio
    modes = [ReuseMode("full"), ReuseMode("prefix"), ReuseMode("naive"), blend]
    modes += [ReuseMode("blend", r) for r in sorted(set(ratios)) if r != calibrated]
    names = [label(m, calibrated) for m in modes]

    prepare(reuser, stored)
    lost = missing(reuser, stored)
    if lost:
        raise RuntimeError(f"{lost} documents or prefixes were evicted while storing them; raise the chunk cache")
    results = {order: {n: Timing() for n in names} for order in ORDERS}
    for n, (a, b) in enumerate(zip(stored, shuffled)):
        for order, item in zip(ORDERS, (a, b)):
            measure_item(reuser, item, modes, names, repeats, loaded.eos_token_ids, results[order])
            full = results[order]["full"].seconds[-1]
            line = ", ".join(f"{k} {full / t.seconds[-1]:.1f}x" for k, t in results[order].items() if k != "full")
            print(f"item {n + 1}/{len(stored)} {order}: {len(item.ids)} tokens, full {full:.2f} s; {line}", flush=True)

    sections = []
    for order in ORDERS:
        timings = results[order]
        full = timings["full"].mean("seconds")
        rows = [
            [
                name,
                f"{statistics.fmean(t.reused):.0f}",
                f"{statistics.fmean(t.recomputed):.0f}",
                f"{t.mean('seconds'):.3f}",
                f"{full / t.mean('seconds'):.2f}x",
                f"{t.mean('kl'):.3f}",
                f"{100 * t.mean('first'):.0f}%",
                f"{100 * t.mean('top1'):.1f}%",
            ]
            for name, t in timings.items()
        ]
        header = [
            "mode",
            "tokens reused",
            "reused tokens recomputed",
            "mean TTFT (s)",
            "speedup (full / mode)",
            "first-token KL",
            "first token = full's",
            f"top-1 ({ANSWER}, forced)",
        ]
        escalated = {name: len(t.notes) for name, t in timings.items() if t.notes}
        extra = (
            "\n\nRaised to a larger ratio for deviating above the calibrated limit: "
            + ", ".join(f"`{k}` {v} of {len(stored)} items" for k, v in escalated.items())
            if escalated
            else ""
        )
        what = "stored order" if order == "stored" else "shuffled (a fixed permutation per item)"
        sections.append(f"### Documents in {what}\n\n" + table(header, rows) + extra)

    shuffled_t = results["shuffled"]
    full = shuffled_t["full"].mean("seconds")
    verdicts = [verdict(name, t, full) for name, t in shuffled_t.items() if name.startswith(("blend", "naive"))]
    met = [
        name
        for name, t in shuffled_t.items()
        if name.startswith("blend")
        and t.mean("top1") >= TARGET_TOP1
        and t.mean("kl") <= TARGET_KL
        and full / t.mean("seconds") >= TARGET_SPEEDUP
    ]
    target = (
        f"Target on shuffled documents: top-1 >= {TARGET_TOP1:.0%} and first-token KL <= {TARGET_KL:g} at >= "
        f"{TARGET_SPEEDUP:g}x TTFT. "
        + (f"Met by: {', '.join(met)}." if met else "**Not met by any blend ratio measured.**")
        + "\n\n"
        + "\n".join(f"- {v}" for v in verdicts)
    )
    name = "ttft" if select.select == "deviation" else f"ttft-select_{select.select}"
    picture = output.parent / f"{name}.png"
    picture.parent.mkdir(parents=True, exist_ok=True)
    plot(results, picture, f"{loaded.name}, {len(stored)} MuSiQue items, {docs} documents")
    tokens = statistics.fmean(len(i.ids) for i in stored)
    cut = f", each cut to its first {words} words" if words else ""
    body = (
        f"{len(stored)} MuSiQue items (rows {offset}..{offset + len(stored) - 1}), {docs} passages each as "
        f"documents{cut}, {tokens:.0f} prompt tokens on average; model {loaded.name}, {loaded.dtype}, "
        f"{torch.get_num_threads()} threads. Blend ratio: {source}; tokens recomputed selected by "
        f"{select.select} (`caches.blend_select`). Each mode timed {repeats} times per item, "
        "interleaved, fastest kept; TTFT = from an empty KV until the first answer token's logits exist. "
        "Speedup = mean full TTFT / mean mode TTFT. Fidelity against full prefill of the same prompt: first-token KL, "
        f"whether the first token's argmax matches, top-1 agreement over the reference answer's first {ANSWER} "
        "positions (teacher-forced).\n\n"
        + "\n\n".join(sections)
        + "\n\n"
        + target
        + f"\n\n![TTFT speedup against fidelity]({picture.name})\n\nTook {time.perf_counter() - began:.0f} s."
    )
    title = "Time to first token with document reuse" + ("" if name == "ttft" else f", blend_select {select.select}")
    write_section(output, name, title, command, body)
    print("\n\n".join(sections) + "\n\n" + target, flush=True)
    return results
