"""`kvgate calibrate`: per model, the smallest blend recompute ratio that meets a fidelity target.

The fidelity harness (benchmarks/fidelity.py) runs over MuSiQue items kept apart from the benchmark
ones (rows from `offset` on); for each ratio the metric is averaged over the items, and the smallest
ratio meeting the target is stored under the cache dir, where the engine finds it at start-up. The
largest key deviation seen at the chosen ratio, times a margin, becomes the limit above which a
request gets a larger ratio when served.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from kvgate.bench.fidelity import Scores, load_items, make_reuser, measure
from kvgate.bench.report import table, write_section
from kvgate.runtime.blend import BlendConfig
from kvgate.runtime.calibration import METRICS, Calibration, meets, model_fingerprint, path, pick_ratio, save
from kvgate.runtime.config import EngineConfig
from kvgate.runtime.loader import load
from kvgate.runtime.reuse import Reuse

MARGIN = 1.5  # deviation limit = MARGIN x the largest per-item deviation seen at the chosen ratio


def metric_of(scores: Scores, metric: str) -> float:
    return scores.mean("top1" if metric == "top1" else "kl")


def deviation_limit(curve: dict[float, Scores], ratio: float, margin: float = MARGIN) -> float | None:
    """`margin` x the largest deviation seen at `ratio`. A ratio of 0 selects nothing and measures
    no deviation; then the largest seen at any ratio (the check layer's deviation does not depend on
    the ratio). None when none was measured."""
    top = max(curve[ratio].deviation, default=0.0)
    if not top > 0.0:
        top = max((d for s in curve.values() for d in s.deviation), default=0.0)
    return margin * top if top > 0.0 else None


def calibrate(
    config: EngineConfig,
    data: Path,
    docs: int,
    limit: int,
    offset: int,
    target: float,
    metric: str,
    ratios: list[float],
    shuffle: bool,
    words: int,
    report: Path | None,
    command: str,
    counts: list[int] | None = None,
    select: str = "deviation",
    document_kv: str = "alone",
) -> tuple[Calibration, Path]:
    """`counts`: the document counts the served table covers (each measured on its own items);
    the single ratio (and its curve) is `docs`'s. `select`: how blends choose the tokens they
    recompute; `document_kv`: the documents' KV computed alone, or by a dense prefill of the same
    documents in another order ("context": what a server keeps for the documents a prompt brought)."""
    if metric not in METRICS:
        raise ValueError(f"--metric {metric!r}: one of {', '.join(METRICS)}")
    began = time.perf_counter()
    loaded = load(config)
    data_items = load_items(loaded, data, docs, limit, shuffle, offset, words)
    if document_kv not in ("alone", "context"):
        raise ValueError(f"--document-kv {document_kv!r}: alone or context")
    reuser = make_reuser(loaded, BlendConfig(select=select))
    ratios = sorted(set(ratios))
    modes = [Reuse("blend", r) for r in ratios]

    def curve_of(n: int, found: list) -> dict[float, Scores]:
        others = load_items(loaded, data, n, limit, not shuffle, offset, words) if document_kv == "context" else None
        decode = loaded.tokenizer.decode
        scores = measure(reuser, found, modes, loaded.eos_token_ids, decode, answers=False, others=others)
        return dict(zip(ratios, scores.values()))

    curve = curve_of(docs, data_items)
    curves = {docs: curve}
    for n in sorted(set(counts or ()) - {docs}):
        curves[n] = curve_of(n, load_items(loaded, data, n, limit, shuffle, offset, words))
    served = {
        str(n): {f"{r:g}": {"kl": s.mean("kl"), "top1": s.mean("top1")} for r, s in c.items()}
        for n, c in sorted(curves.items())
    }
    values = {r: metric_of(s, metric) for r, s in curve.items()}
    ratio, met = pick_ratio(values, target, metric)
    cal = Calibration(
        ratio=ratio,
        deviation_limit=deviation_limit(curve, ratio),
        target=target,
        metric=metric,
        items=len(data_items),
        curve={f"{r:g}": v for r, v in values.items()},
        table=served,
        select=select,
        document_kv=document_kv,
    )
    where = path(config.cache_dir, model_fingerprint(loaded), select)
    save(cal, where)

    better = ">=" if METRICS[metric] else "<="
    rows = [
        [
            f"{100 * r:g}%",
            f"{100 * s.mean('top1'):.1f}%",
            f"{s.mean('kl'):.3f}",
            f"{max(s.deviation, default=0.0):.3g}",
            "yes" if meets(values[r], target, metric) else "no",
        ]
        for r, s in curve.items()
    ]
    curve_table = table(
        ["ratio", "top-1 (32, forced)", "first-token KL", "max key deviation", f"{metric} {better} {target:g}"], rows
    )
    limit_text = f"{cal.deviation_limit:.3g}" if cal.deviation_limit is not None else "none"
    choice = (
        f"chose ratio {100 * ratio:g}%: the smallest whose mean {metric} {better} {target:g}"
        if met
        else f"NO ratio met the target ({metric} {better} {target:g}); chose the largest measured, "
        f"{100 * ratio:g}%, which does not meet it either"
    )
    print(curve_table)
    print(f"{choice}; deviation limit {limit_text}; written to {where}", flush=True)
    if not met:
        print(
            f"kvgate calibrate: WARNING: the target {metric} {better} {target:g} was not met at any ratio "
            f"(best {max(values.values()) if METRICS[metric] else min(values.values()):.3f})",
            file=sys.stderr,
            flush=True,
        )
    if report is not None:
        tokens = statistics.fmean(len(i.ids) for i in data_items)
        order = "shuffled (a fixed permutation per item)" if shuffle else "in their stored order"
        kv = (
            "each document's KV computed alone"
            if document_kv == "alone"
            else "each document's KV as a dense prefill of the same documents in the other order computed it"
        )
        body = (
            f"{len(data_items)} MuSiQue calibration items (rows {offset}..{offset + len(data_items) - 1}, "
            f"disjoint from the benchmark rows), {docs} documents each, {order}, {tokens:.0f} prompt tokens on "
            f"average; {kv}; blends select tokens by {select}; model {loaded.name}, {loaded.dtype}. "
            f"Target: mean {metric} {better} {target:g} "
            "(top-1: teacher-forced agreement with full prefill over the first 32 answer positions; "
            "kl: first-token KL).\n\n"
            + curve_table
            + "\n\nThe table served (what a request of that many documents gets: the smallest ratio meeting both "
            + "`fidelity_kl` and `fidelity_top1`, else full prefill):\n\n"
            + served_table(cal)
            + f"\n\nResult: {choice}. Deviation limit (served requests above it get a larger ratio): "
            f"{limit_text} = {MARGIN:g} x the largest per-item key deviation seen. "
            f"Took {time.perf_counter() - began:.0f} s."
        )
        suffix = ("" if select == "deviation" else f"-{select}") + ("-context" if document_kv == "context" else "")
        title = "Calibration of the blend ratio" + (f", select {select}" if select != "deviation" else "")
        title += ", documents' KV from another prompt" if document_kv == "context" else ""
        write_section(report, "calibration" + suffix, title, command, body)
    return cal, where


def served_table(cal: Calibration) -> str:
    """The per-document-count table as served: each ratio's first-token KL and top-1 over 32 positions."""
    counts = sorted(cal.table, key=int)
    ratios = sorted({r for n in counts for r in cal.table[n]}, key=float)
    rows = [[f"{100 * float(r):g}%", *(cell(cal.table[n].get(r)) for n in counts)] for r in ratios]
    return table(["ratio", *(f"{n} documents: KL, top-1" for n in counts)], rows)


def cell(measured: dict[str, float] | None) -> str:
    return "-" if measured is None else f"{measured['kl']:.3f}, {100 * measured['top1']:.1f}%"
