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

`--also-select attention` times the blend selecting its tokens by another method too, at the same ratios
(through a second reuser reading the same stored documents); `--plot DIR` draws the fidelity frontier
(ttft_report.py) from the same run: speedup against top-1 and against KL, a line per selection method.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from kvgate.bench.plots import image
from kvgate.bench.ttft_report import ORDERS, Arm, Timing, frontier_figure, label, speedups, tables, target
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
from kvgate.runtime.loader import LoadedModel, load
from kvgate.runtime.progress import progress
from kvgate.runtime.report import write_section
from kvgate.runtime.reuse import ReuseMode, Reuser


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
    reuser: Reuser, others: dict[str, Reuser], item: Item, arms: list[Arm], repeats: int, eos: frozenset[int], out
) -> None:
    """Every arm timed `repeats` times, interleaved, the fastest kept and scored against full prefill's; an arm
    selecting otherwise than `reuser` runs through `others`' reuser of its selection method."""
    best: dict[str, tuple] = {}
    for _ in range(repeats):
        for arm in arms:
            seconds, kv, logits, done = timed(others.get(arm.select, reuser), item, arm.mode)
            if arm.name not in best or seconds < best[arm.name][0]:
                best[arm.name] = (seconds, kv, logits, done)
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


def room(loaded: LoadedModel, data: list[Item]) -> int:
    """Bytes of KV for every document and prefix of `data`, with a margin: the benchmark measures compute, not
    eviction."""
    mc = loaded.model.config
    per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim
    per_token *= torch.empty((), dtype=loaded.model.dtype).element_size()
    return int(1.25 * per_token * sum(2 * len(i.ids) for i in data))


def sibling(reuser: Reuser, select: str) -> Reuser:
    """A reuser over the same store whose blend selects the tokens it recomputes by `select` (it reads the
    documents `reuser` stored; it stores nothing)."""
    return Reuser(reuser.model, reuser.tokenizer, reuser.store, reuser.model_fp, replace(reuser.blend, select=select))


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
    also: tuple[str, ...] = (),
    plots: Path | None = None,
) -> dict[str, dict[str, Timing]]:
    """`also`: other blend selection methods, each timed at every ratio the server's own is (explicitly: no
    escalation); `plots`: the folder of the figures (None: the speedups' beside `output`, no frontier)."""
    began = time.perf_counter()
    loaded = load(config)
    stored = load_items(loaded, data, docs, limit, False, offset, words)
    shuffled = load_items(loaded, data, docs, limit, True, offset, words)
    need = room(loaded, stored)
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
    more = [r for r in sorted(set(ratios)) if r != calibrated]
    arms = [Arm("full", ReuseMode("full")), Arm("prefix", ReuseMode("prefix")), Arm("naive", ReuseMode("naive"))]
    for mode in [blend, *(ReuseMode("blend", r) for r in more)]:
        arms.append(Arm(label(mode, calibrated), mode, select.select, calibrated if mode.ratio is None else mode.ratio))
    others = [s for s in dict.fromkeys(also) if s != select.select]
    for other, r in ((s, r) for s in others for r in [calibrated, *more]):
        arms.append(Arm(label(ReuseMode("blend", r), calibrated, other), ReuseMode("blend", r), other, r))
    siblings = {s: sibling(reuser, s) for s in others}

    prepare(reuser, stored)
    lost = missing(reuser, stored)
    if lost:
        raise RuntimeError(f"{lost} documents or prefixes were evicted while storing them; raise the chunk cache")
    results = {order: {arm.name: Timing() for arm in arms} for order in ORDERS}
    for n, (a, b) in enumerate(progress(zip(stored, shuffled), "items timed", total=len(stored))):
        for order, item in zip(ORDERS, (a, b)):
            measure_item(reuser, siblings, item, arms, repeats, loaded.eos_token_ids, results[order])
            full = results[order]["full"].seconds[-1]
            line = ", ".join(f"{k} {full / t.seconds[-1]:.1f}x" for k, t in results[order].items() if k != "full")
            print(f"item {n + 1}/{len(stored)} {order}: {len(item.ids)} tokens, full {full:.2f} s; {line}", flush=True)

    sections = tables(results, len(stored))
    verdicts = target(results["shuffled"])
    name = "ttft" if select.select == "deviation" else f"ttft-select_{select.select}"
    where = plots or output.parent
    picture = where / f"{name}.png"
    described = f"{loaded.name}, {len(stored)} MuSiQue items, {docs} documents"
    speedups(results, picture, described)
    if plots is not None:  # right after the tables it is drawn from
        sections[-1] += "\n\n" + frontier_figure(results, arms, plots / f"{name}-frontier.png", output, described)
    tokens = statistics.fmean(len(i.ids) for i in stored)
    cut = f", each cut to its first {words} words" if words else ""
    selected = f"{select.select} (`caches.blend_select`)" + "".join(f"; `select {s}` rows: by {s}" for s in others)
    body = (
        f"{len(stored)} MuSiQue items (rows {offset}..{offset + len(stored) - 1}), {docs} passages each as "
        f"documents{cut}, {tokens:.0f} prompt tokens on average; model {loaded.name}, {loaded.dtype}, "
        f"{torch.get_num_threads()} threads. Blend ratio: {source}; tokens recomputed selected by "
        f"{selected}. Each mode timed {repeats} times per item, "
        "interleaved, fastest kept; TTFT = from an empty KV until the first answer token's logits exist. "
        "Speedup = mean full TTFT / mean mode TTFT. Fidelity against full prefill of the same prompt: first-token KL, "
        f"whether the first token's argmax matches, top-1 agreement over the reference answer's first {ANSWER} "
        "positions (teacher-forced).\n\n"
        + "\n\n".join(sections)
        + "\n\n"
        + verdicts
        + f"\n\n{image(picture, output, 'TTFT speedup against fidelity')}\n\n"
        f"Took {time.perf_counter() - began:.0f} s."
    )
    title = "Time to first token with document reuse" + ("" if name == "ttft" else f", blend_select {select.select}")
    write_section(output, name, title, command, body)
    print("\n\n".join(sections) + "\n\n" + verdicts, flush=True)
    return results
