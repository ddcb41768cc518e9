"""The online quality gate: how far reuse moves answers, measured while serving, and what it allows.

A share of the requests served with reuse (`shadow_rate`) is checked: the engine prefills the
same prompt in full, on idle capacity and on a share of its busy time (`shadow_share`), and
compares the two first-token distributions (runtime/shadow.py). Each reuse mode climbs a ladder
of recompute ratios: its own (calibrated) ratio, the larger `ratios`, then full prefill. The
checks of the rung being served decide: missing the target after `min_checks`, the mode climbs
one rung; meeting it with a margin over a whole `window`, it steps one down. At full prefill
nothing is reused, so there the checks run the other way: the reuse one rung below is computed
on spare capacity and compared with the full prefill that was served, so the gate learns when
reuse has recovered.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

FULL = 1.0  # the top rung: every token computed, nothing reused
RECOVER = 0.8  # a rung is left downward only with KL this far under the target


@dataclass(frozen=True)
class QualityConfig:
    shadow_rate: float = 0.0  # share of gated requests checked against full prefill (0: the gate never moves)
    target_kl: float = 0.05  # mean first-token KL(full || reuse) over the window, at most
    target_top1: float = 0.95  # share of checks whose first token's argmax equals full prefill's, at least
    window: int = 16  # the latest checks of a rung that decide
    min_checks: int = 8  # checks of a rung before it may be left upward
    ratios: tuple[float, ...] = (0.3, 0.5)  # rungs above a mode's own ratio, below full prefill
    max_pending: int = 8  # checks waiting for spare capacity; more are dropped
    # Share of the engine's busy time checks may take while requests are running (0: only when idle).
    shadow_share: float = 0.05

    def __post_init__(self) -> None:
        if not 0.0 <= self.shadow_rate <= 1.0:
            raise ValueError(f"shadow_rate {self.shadow_rate} outside [0, 1]")
        if not 0.0 <= self.shadow_share < 1.0:
            raise ValueError(f"shadow_share {self.shadow_share} outside [0, 1)")
        if not 1 <= self.min_checks <= self.window:
            raise ValueError(f"min_checks {self.min_checks} must be in 1..window ({self.window})")
        if any(not 0.0 <= r < FULL for r in self.ratios):
            raise ValueError(f"gate ratios {self.ratios} must lie in [0, 1)")


@dataclass
class Totals:
    checks: int = 0
    kl: float = 0.0  # summed
    agree: int = 0


class Ladder:
    """One reuse mode's rungs, where it stands, and the checks of that rung."""

    def __init__(self, base: float, config: QualityConfig) -> None:
        self.rungs = [base, *sorted(r for r in set(config.ratios) if r > base), FULL]
        self.at = 0
        self.checks: deque[tuple[float, bool]] = deque(maxlen=config.window)
        self.why = ""  # the last climb's reason, while above the first rung
        self.totals = Totals()

    @property
    def ratio(self) -> float:
        return self.rungs[self.at]

    @property
    def probe(self) -> float:
        """The ratio a check measures: the served one, or at full prefill the one below it."""
        return self.rungs[self.at - 1] if self.ratio == FULL else self.ratio

    def means(self) -> tuple[float, float]:
        n = len(self.checks)
        return sum(k for k, _ in self.checks) / n, sum(a for _, a in self.checks) / n

    def move(self, by: int, why: str = "") -> None:
        self.at += by
        self.checks.clear()
        self.why = why if self.at else ""


class Gate:
    """The ladders of the gated reuse modes. Read from any thread, moved by the engine's."""

    def __init__(self, config: QualityConfig, base: dict[str, float]) -> None:
        self.config = config
        self.ladders = {mode: Ladder(ratio, config) for mode, ratio in base.items()}
        self.credit = 0.0  # shadow_rate accumulated: a check is due at each whole one
        self.due_count = 0  # checks that came due
        self.dropped = 0  # of those, dropped: too many were waiting
        self.lock = threading.Lock()

    def base(self, mode: str) -> float:
        return self.ladders[mode].rungs[0]

    def serve(self, mode: str) -> tuple[float, str]:
        """The recompute ratio to serve `mode` with (FULL: no reuse), and why when above its own."""
        ladder = self.ladders[mode]
        with self.lock:
            ratio, why, raised = ladder.ratio, ladder.why, ladder.at > 0
        if not raised:
            return ratio, ""
        if ratio == FULL:
            return FULL, f"quality gate: {why}; reuse withheld until shadow checks recover"
        return ratio, f"quality gate: {why}; recompute raised to {ratio:.0%}"

    def due(self) -> bool:
        """Whether the request being served now gets a check (every 1/shadow_rate-th, evenly)."""
        if self.config.shadow_rate <= 0.0:
            return False
        self.credit += self.config.shadow_rate
        if self.credit < 1.0:
            return False
        self.credit -= 1.0
        self.due_count += 1
        return True

    def probe(self, mode: str) -> float:
        return self.ladders[mode].probe

    def record(self, mode: str, ratio: float, kl: float, agree: bool) -> None:
        """A check of `mode` at `ratio` (the rung it probed when it was taken). A check of a rung
        the mode has since left says nothing about where it stands: it only counts in the totals."""
        ladder = self.ladders[mode]
        c = self.config
        with self.lock:
            ladder.totals.checks += 1
            ladder.totals.kl += kl
            ladder.totals.agree += agree
            if ratio != ladder.probe:
                return
            ladder.checks.append((kl, agree))
            n = len(ladder.checks)
            mean_kl, top1 = ladder.means()
            missed = mean_kl > c.target_kl or top1 < c.target_top1
            if ladder.ratio == FULL:  # the checks are of the rung below: recovered, go back to it
                if n >= c.window and mean_kl <= RECOVER * c.target_kl and top1 >= c.target_top1:
                    ladder.move(-1, ladder.why)
                return
            if missed and n >= c.min_checks:
                why = (
                    f"first-token KL {mean_kl:.3f}, top-1 {top1:.0%} over the last {n} shadow checks at "
                    f"{ratio:.0%} recompute (target KL <= {c.target_kl:g}, top-1 >= {c.target_top1:.0%})"
                )
                ladder.move(+1, why)
            elif ladder.at and n >= c.window and mean_kl <= RECOVER * c.target_kl and top1 >= c.target_top1:
                ladder.move(-1, ladder.why)

    def measured(self, mode: str, ratio: float) -> tuple[float, float, int] | None:
        """The mean KL and top-1 of the latest checks of `mode` at `ratio`, and how many; None if none."""
        ladder = self.ladders.get(mode)
        with self.lock:
            if ladder is None or ladder.probe != ratio or not ladder.checks:
                return None
            return (*ladder.means(), len(ladder.checks))

    def stats(self) -> Iterable[tuple[str, dict[str, float]]]:
        """Per mode: lifetime checks, their mean KL and top-1, the window's, and the ratio served."""
        with self.lock:
            for mode, ladder in self.ladders.items():
                t = ladder.totals
                kl, top1 = ladder.means() if ladder.checks else (float("nan"), float("nan"))
                yield (
                    mode,
                    {
                        "checks": t.checks,
                        "kl": t.kl / t.checks if t.checks else float("nan"),
                        "top1": t.agree / t.checks if t.checks else float("nan"),
                        "window_kl": kl,
                        "window_top1": top1,
                        "ratio": ladder.ratio,
                    },
                )
