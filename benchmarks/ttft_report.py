"""What `kvgate bench ttft` writes: per order of the documents, every arm's mean TTFT, speedup and fidelity (a
table), the verdicts against the issue's target, and its figures: speedup against fidelity per arm, and
(`--plot`) the fidelity frontier, one line per reuse mode and blend selection method."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.bench.fidelity import TARGET_KL, TARGET_TOP1
from kvgate.bench.plots import TARGET, figure, image
from kvgate.runtime.fidelity import ANSWER
from kvgate.runtime.report import table
from kvgate.runtime.reuse import ReuseMode

TARGET_SPEEDUP = 4.0  # the target, against the fastest full prefill, on shuffled documents
ORDERS = ("stored", "shuffled")
COLOURS = {"prefix": "black", "naive": "tab:grey", "deviation": "tab:blue", "attention": "tab:green"}


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


@dataclass(frozen=True)
class Arm:
    """One way of starting the prompt that is timed: its row's name, the reuse mode, and for a blend the
    method selecting the tokens it recomputes and the ratio asked (the calibrated one where none is given)."""

    name: str
    mode: ReuseMode
    select: str = ""
    ratio: float = 0.0

    @property
    def line(self) -> str:
        """The frontier's line this arm is a point of: its mode, or the blend's selection method."""
        return self.select if self.mode.mode == "blend" else self.mode.mode


def label(reuse: ReuseMode, calibrated: float, select: str = "") -> str:
    """A row's name; `select` names a blend selecting otherwise than the server (`caches.blend_select`)."""
    if reuse.mode != "blend":
        return reuse.mode
    also = f", select {select}" if select else ""
    if reuse.ratio is None:
        return f"blend {calibrated:.0%} (calibrated){also}"
    return f"blend {reuse.ratio:.0%}{also}"


def verdict(name: str, t: Timing, full: float) -> str:
    speedup = full / t.mean("seconds")
    parts = [
        f"top-1 {100 * t.mean('top1'):.1f}% ({'met' if t.mean('top1') >= TARGET_TOP1 else 'missed'})",
        f"KL {t.mean('kl'):.3f} ({'met' if t.mean('kl') <= TARGET_KL else 'missed'})",
        f"{speedup:.1f}x ({'met' if speedup >= TARGET_SPEEDUP else 'missed'})",
    ]
    return f"`{name}`: " + ", ".join(parts)


def tables(results: dict[str, dict[str, Timing]], items: int) -> list[str]:
    """One table per order of the documents."""
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
            + ", ".join(f"`{k}` {v} of {items} items" for k, v in escalated.items())
            if escalated
            else ""
        )
        what = "stored order" if order == "stored" else "shuffled (a fixed permutation per item)"
        sections.append(f"### Documents in {what}\n\n" + table(header, rows) + extra)
    return sections


def target(shuffled: dict[str, Timing]) -> str:
    """Which blends meet the issue's target on shuffled documents, and every reuse's verdict."""
    full = shuffled["full"].mean("seconds")
    verdicts = [verdict(name, t, full) for name, t in shuffled.items() if name.startswith(("blend", "naive"))]
    met = [
        name
        for name, t in shuffled.items()
        if name.startswith("blend")
        and t.mean("top1") >= TARGET_TOP1
        and t.mean("kl") <= TARGET_KL
        and full / t.mean("seconds") >= TARGET_SPEEDUP
    ]
    return (
        f"Target on shuffled documents: top-1 >= {TARGET_TOP1:.0%} and first-token KL <= {TARGET_KL:g} at >= "
        f"{TARGET_SPEEDUP:g}x TTFT. "
        + (f"Met by: {', '.join(met)}." if met else "**Not met by any blend ratio measured.**")
        + "\n\n"
        + "\n".join(f"- {v}" for v in verdicts)
    )


def speedups(results: dict[str, dict[str, Timing]], picture: Path, title: str) -> None:
    """Every arm a point: speedup over full prefill against top-1 and against KL, both orders."""
    with figure(picture, 2, (11, 4.2), title + " (target: red lines, upper right / lower right of them)") as axes:
        left, right = axes
        for order, marker in zip(ORDERS, ("o", "s")):
            timings = results[order]
            full = timings["full"].mean("seconds")
            for name, t in timings.items():
                if name == "full":
                    continue
                x = full / t.mean("seconds")
                for ax, y in ((left, 100 * t.mean("top1")), (right, t.mean("kl"))):
                    ax.scatter(x, y, marker=marker, color="tab:blue" if order == "stored" else "tab:orange")
                    short = name.replace(" (calibrated)", "*")
                    ax.annotate(short, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        for ax in axes:
            ax.set_xscale("log")
            ax.axvline(TARGET_SPEEDUP, **TARGET)
            ax.set_xlabel("TTFT speedup over full prefill (x, log)")
            ax.grid(alpha=0.3)
            ax.scatter([], [], marker="o", color="tab:blue", label="documents in stored order")
            ax.scatter([], [], marker="s", color="tab:orange", label="documents shuffled")
            ax.legend(fontsize=8)
        left.axhline(100 * TARGET_TOP1, **TARGET)
        right.axhline(TARGET_KL, **TARGET)
        left.set(ylabel=f"top-1 agreement, {ANSWER} positions forced (%)", ylim=(0, 101))
        right.set(ylabel="first-token KL(full || mode)", ylim=(0, None))


def lines(arms: list[Arm]) -> dict[str, list[Arm]]:
    """The frontier's lines: each reuse mode's arms but full prefill's (the reference), a blend's per selection
    method, by ratio."""
    found: dict[str, list[Arm]] = {}
    for arm in arms:
        if arm.mode.mode != "full":
            found.setdefault(arm.line, []).append(arm)
    return {line: sorted(members, key=lambda a: a.ratio) for line, members in found.items()}


def frontier(results: dict[str, dict[str, Timing]], arms: list[Arm], picture: Path, title: str) -> None:
    """The fidelity frontier: speedup over full prefill against top-1 and against first-token KL, one point per
    recompute ratio, one line per blend selection method and a point per other reuse mode; shuffled documents
    solid, stored order dotted; full prefill itself the star at 1x."""
    with figure(picture, 2, (12, 4.6), title) as axes:
        left, right = axes
        for order, style, filled in (("shuffled", "-", True), ("stored", ":", False)):
            timings = results[order]
            full = timings["full"].mean("seconds")
            for line, members in lines(arms).items():
                x = [full / timings[a.name].mean("seconds") for a in members]
                colour = COLOURS.get(line, "tab:purple")
                shown = {"label": line if line in ("prefix", "naive") else f"blend, select {line}"} if filled else {}
                face = colour if filled else "none"
                for ax, y in ((left, [100 * timings[a.name].mean("top1") for a in members]),
                              (right, [timings[a.name].mean("kl") for a in members])):  # fmt: skip
                    ax.plot(x, y, style, marker="o", color=colour, markerfacecolor=face, **shown)
                    for arm, at in zip(members, zip(x, y)):
                        if arm.mode.mode == "blend" and filled:
                            star = "*" if arm.mode.ratio is None else ""
                            ax.annotate(f"{arm.ratio:.0%}{star}", at, fontsize=7, xytext=(3, 3),
                                        textcoords="offset points")  # fmt: skip
        for ax, reference in ((left, 100.0), (right, 0.0)):
            ax.plot([1.0], [reference], "*", color="tab:red", markersize=10, label="full prefill")
            ax.axvline(TARGET_SPEEDUP, **TARGET)
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(lambda value, _: f"{value:g}x")
            ax.set_xlabel("TTFT speedup over full prefill (log)")
            ax.grid(alpha=0.3, which="both")
        left.plot([], [], "-", color="grey", label="documents shuffled")
        left.plot([], [], ":", color="grey", label="documents in stored order")
        left.plot([], [], **TARGET, label="target")
        left.legend(fontsize=7, loc="best")
        left.axhline(100 * TARGET_TOP1, **TARGET)
        right.axhline(TARGET_KL, **TARGET)
        left.set(ylabel=f"top-1 agreement, {ANSWER} positions forced (%)")
        right.set(ylabel="first-token KL(full || mode)")


def frontier_figure(
    results: dict[str, dict[str, Timing]], arms: list[Arm], picture: Path, output: Path, described: str
) -> str:
    """The fidelity frontier drawn to `picture`, and the markdown showing it in `output`."""
    frontier(results, arms, picture, f"Fidelity frontier: {described}")
    return image(picture, output, "fidelity frontier: TTFT speedup against top-1 and KL, per reuse mode")
