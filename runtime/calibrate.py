"""`kvgate calibrate`: per model, the smallest blend recompute ratio that meets a fidelity target.

The fidelity harness (runtime/fidelity.py) runs over MuSiQue items kept apart from the benchmark ones
(rows from `offset` on); for each ratio the metric is averaged over the items, and the smallest ratio
meeting the target is stored under the cache dir, where the engine finds it at start-up
(runtime/calibration.py). The largest key deviation seen at the chosen ratio, times a margin, becomes
the limit above which a served request gets a larger ratio."""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvgate.runtime.blend import BlendConfig
from kvgate.runtime.calibration import METRICS, Calibration, meets, model_fingerprint, path, pick_ratio, save
from kvgate.runtime.config import EngineConfig
from kvgate.runtime.errors import DataError
from kvgate.runtime.fidelity import Item, Scores, load_items, make_reuser, measure
from kvgate.runtime.loader import LoadedModel, load
from kvgate.runtime.report import table, write_section
from kvgate.runtime.reuse import ReuseMode, Reuser

MARGIN = 1.5  # deviation limit = MARGIN x the largest per-item deviation seen at the chosen ratio
Curve = dict[float, Scores]  # recompute ratio -> the scores measured at it


@dataclass(frozen=True)
class Calibrating:
    """What to measure: `docs` documents per item (the ratio and its curve are that count's), and the
    document counts the served table covers (`counts`, each on its own items). `select`: how blends
    choose the tokens they recompute; `document_kv`: the documents' KV computed alone, or by a dense
    prefill of the same documents in another order ("context": what a server keeps for the documents a
    prompt brought). `data`: None, the shared MuSiQue set."""

    data: Path | None = None
    docs: int = 6
    limit: int = 8
    offset: int = 100
    target: float = 0.95
    metric: str = "top1"
    ratios: tuple[float, ...] = (0.0, 0.05, 0.10, 0.15, 0.20, 0.30, 0.50)
    shuffle: bool = True
    words: int = 0
    counts: tuple[int, ...] = (2, 4, 6)
    select: str = "deviation"
    document_kv: str = "alone"

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise DataError(f"--metric {self.metric!r}: one of {', '.join(METRICS)}")
        if self.document_kv not in ("alone", "context"):
            raise DataError(f"--document-kv {self.document_kv!r}: alone or context")
        if self.docs < 1 or self.limit < 1:
            raise DataError("--docs and --limit must be at least 1")
        if self.offset < 0 or self.words < 0:
            raise DataError("--offset and --words cannot be negative")
        if not self.ratios or any(not 0.0 <= r <= 1.0 for r in self.ratios):
            raise DataError("--ratios: percentages between 0 and 100")
        if not self.counts or min(self.counts) < 1:
            raise DataError("--table-docs: document counts (at least 1)")


def calibrate(
    config: EngineConfig, job: Calibrating, report: Path | None = None, command: str = ""
) -> tuple[Calibration, Path]:
    """Measure, choose, store where the engine finds it; also write the curve as a section of `report`."""
    began = time.perf_counter()
    loaded = load(config)
    # One reuser for every count, `docs` first, as each count's documents meet the store the counts before left.
    reuser = make_reuser(loaded, BlendConfig(select=job.select))
    counts = [job.docs, *sorted(set(job.counts) - {job.docs})]
    measured = {n: curve(loaded, reuser, job, n) for n in counts}
    scores, items = measured[job.docs]
    values = {r: s.mean("top1" if job.metric == "top1" else "kl") for r, s in scores.items()}
    ratio, met = pick_ratio(values, job.target, job.metric)
    cal = Calibration(
        ratio=ratio,
        deviation_limit=deviation_limit(scores, ratio),
        target=job.target,
        metric=job.metric,
        items=len(items),
        curve={f"{r:g}": v for r, v in values.items()},
        table={
            str(n): {f"{r:g}": {"kl": s.mean("kl"), "top1": s.mean("top1")} for r, s in c.items()}
            for n, (c, _) in sorted(measured.items())
        },
        select=job.select,
        document_kv=job.document_kv,
    )
    where = path(config.cache_dir, model_fingerprint(loaded), job.select)
    save(cal, where)
    shown = curve_table(scores, values, job)
    choice = tell(cal, job, values, met, shown, where)
    if report is not None:
        described = describe(job, loaded, items) + "\n\n" + shown
        write_report(report, command, cal, job, described, choice, time.perf_counter() - began)
    return cal, where


def curve(loaded: LoadedModel, reuser: Reuser, job: Calibrating, docs: int) -> tuple[Curve, list[Item]]:
    """Every ratio's scores over the items of `docs` documents, and the items."""
    found = load_items(loaded, job.data, docs, job.limit, job.shuffle, job.offset, job.words)
    others = None
    if job.document_kv == "context":
        others = load_items(loaded, job.data, docs, job.limit, not job.shuffle, job.offset, job.words)
    ratios = sorted(set(job.ratios))
    modes = [ReuseMode("blend", r) for r in ratios]
    decode = loaded.tokenizer.decode
    scores = measure(reuser, found, modes, loaded.eos_token_ids, decode, answers=False, others=others)
    return dict(zip(ratios, scores.values())), found


def deviation_limit(curve: Curve, ratio: float, margin: float = MARGIN) -> float | None:
    """`margin` x the largest deviation seen at `ratio`. A ratio of 0 selects nothing and measures
    no deviation; then the largest seen at any ratio (the check layer's deviation does not depend on
    the ratio). None when none was measured."""
    top = max(curve[ratio].deviation, default=0.0)
    if not top > 0.0:
        top = max((d for s in curve.values() for d in s.deviation), default=0.0)
    return margin * top if top > 0.0 else None


def tell(cal: Calibration, job: Calibrating, values: dict[float, float], met: bool, shown: str, where: Path) -> str:
    """Print the curve and the choice (a warning on stderr when no ratio met the target); returns the choice."""
    better = ">=" if METRICS[job.metric] else "<="
    choice = (
        f"chose ratio {100 * cal.ratio:g}%: the smallest whose mean {job.metric} {better} {job.target:g}"
        if met
        else f"NO ratio met the target ({job.metric} {better} {job.target:g}); chose the largest measured, "
        f"{100 * cal.ratio:g}%, which does not meet it either"
    )
    print(shown)
    print(f"{choice}; deviation limit {limit_text(cal)}; written to {where}", flush=True)
    if not met:
        best = max(values.values()) if METRICS[job.metric] else min(values.values())
        print(
            f"kvgate calibrate: WARNING: the target {job.metric} {better} {job.target:g} was not met at any ratio "
            f"(best {best:.3f})",
            file=sys.stderr,
            flush=True,
        )
    return choice


def limit_text(cal: Calibration) -> str:
    return f"{cal.deviation_limit:.3g}" if cal.deviation_limit is not None else "none"


def curve_table(curve: Curve, values: dict[float, float], job: Calibrating) -> str:
    better = ">=" if METRICS[job.metric] else "<="
    rows = [
        [
            f"{100 * r:g}%",
            f"{100 * s.mean('top1'):.1f}%",
            f"{s.mean('kl'):.3f}",
            f"{max(s.deviation, default=0.0):.3g}",
            "yes" if meets(values[r], job.target, job.metric) else "no",
        ]
        for r, s in curve.items()
    ]
    header = [
        "ratio",
        "top-1 (32, forced)",
        "first-token KL",
        "max key deviation",
        f"{job.metric} {better} {job.target:g}",
    ]
    return table(header, rows)


def describe(job: Calibrating, loaded: LoadedModel, items: list[Item]) -> str:
    tokens = statistics.fmean(len(i.ids) for i in items)
    order = "shuffled (a fixed permutation per item)" if job.shuffle else "in their stored order"
    kv = (
        "each document's KV computed alone"
        if job.document_kv == "alone"
        else "each document's KV as a dense prefill of the same documents in the other order computed it"
    )
    better = ">=" if METRICS[job.metric] else "<="
    return (
        f"{len(items)} MuSiQue calibration items (rows {job.offset}..{job.offset + len(items) - 1}, "
        f"disjoint from the benchmark rows), {job.docs} documents each, {order}, {tokens:.0f} prompt tokens on "
        f"average; {kv}; blends select tokens by {job.select}; model {loaded.name}, {loaded.dtype}. "
        f"Target: mean {job.metric} {better} {job.target:g} "
        "(top-1: teacher-forced agreement with full prefill over the first 32 answer positions; "
        "kl: first-token KL)."
    )


def write_report(
    report: Path, command: str, cal: Calibration, job: Calibrating, described: str, choice: str, took: float
) -> None:
    """The calibration as a section of a BENCHMARKS.md (`calibration`, suffixed by selection and KV)."""
    body = (
        described
        + "\n\nThe table served (what a request of that many documents gets: the smallest ratio meeting both "
        + "`quality.kl` and `quality.top1`, else full prefill):\n\n"
        + served_table(cal)
        + f"\n\nResult: {choice}. Deviation limit (served requests above it get a larger ratio): "
        f"{limit_text(cal)} = {MARGIN:g} x the largest per-item key deviation seen. Took {took:.0f} s."
    )
    suffix = ("" if job.select == "deviation" else f"-{job.select}") + (
        "-context" if job.document_kv == "context" else ""
    )
    title = "Calibration of the blend ratio" + (f", select {job.select}" if job.select != "deviation" else "")
    title += ", documents' KV from another prompt" if job.document_kv == "context" else ""
    write_section(report, "calibration" + suffix, title, command, body)


def served_table(cal: Calibration) -> str:
    """The per-document-count table as served: each ratio's first-token KL and top-1 over 32 positions."""
    counts = sorted(cal.table, key=int)
    ratios = sorted({r for n in counts for r in cal.table[n]}, key=float)
    rows = [[f"{100 * float(r):g}%", *(cell(cal.table[n].get(r)) for n in counts)] for r in ratios]
    return table(["ratio", *(f"{n} documents: KL, top-1" for n in counts)], rows)


def cell(measured: dict[str, float] | None) -> str:
    return "-" if measured is None else f"{measured['kl']:.3f}, {100 * measured['top1']:.1f}%"
