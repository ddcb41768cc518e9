"""The error bound: when a cached answer may be served for a question that is not the one it was
given for, so that the share of wrong hits in a category stays under the operator's `max_error_rate`.

Evidence comes as verdicts, each a verifier score (verifier.py) and whether the cached answer was
right for the question asked there: the model answered anyway (every miss near an entry, and a
share of would-be hits), or a caller reported a wrong hit. Per category, scores are cut into bins;
each bin counts questions asked and verdicts. Serving every question scoring at least t has an
error rate estimated bin by bin (each bin's verdicts, weighted by how often it is asked: verdicts
come unevenly, misses are all checked, hits only a share), each bin's estimate anchored to the
verifier's own calibration (worth `prior_weight` verdicts); the category's threshold is the lowest
t whose upper confidence bound is under delta, never below the lowest score checked. A category
serves nothing but the same question (the cache's own check, before any of this) until it has
`warmup` verdicts, and loosens as they come in.

Per entry (vCache's idea, kept small): a wrong verdict at score s means the entry serves no question
scoring s or less again; `min_right` right verdicts below the category's threshold with none wrong
lower the entry's own threshold to the lowest of them.

Processes on one shared store (Redis) pool the category evidence: each adds what it saw to the store's
and reads every process's back, at most every `SYNC_S` (`shared`, passed in). An entry's own verdicts
stay with the process that saw them."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvgate.semantic_cache.store import Evidence

NEVER = 1.01  # a threshold no score reaches
SYNC_S = 1.0  # how often a shared bound adds its evidence to every process's and reads theirs
KINDS = ("asked", "right", "wrong")
log = logging.getLogger("kvgate.semantic")


@dataclass(frozen=True)
class BoundConfig:
    bins: int = 50
    prior_weight: float = 16.0  # verdicts the verifier's own score is worth in each bin's estimate
    z: float = 1.645  # one-sided 95% upper bound
    entries: int = 100_000  # entries whose own verdicts are held (least recently taught forgotten)
    min_right: int = 3
    warmup: int = 50  # verdicts a category needs before it serves anything but the same question

    def __post_init__(self) -> None:
        if self.bins < 2 or self.prior_weight <= 0 or self.z < 0 or min(self.entries, self.min_right) < 1:
            raise ValueError("bound: need bins >= 2, prior_weight > 0, z >= 0, entries >= 1, min_right >= 1")
        if self.warmup < 0:
            raise ValueError("bound: need warmup >= 0")


class Tally:
    """One category's evidence: per score bin, questions asked, right and wrong verdicts."""

    def __init__(self, bins: int) -> None:
        self.asked = np.zeros(bins)
        self.right = np.zeros(bins)
        self.wrong = np.zeros(bins)
        self.threshold: float | None = None  # None: recompute

    def count(self, kind: str, at: int) -> None:
        """A question asked, or a verdict, in bin `at`: the threshold is recomputed."""
        getattr(self, kind)[at] += 1
        self.threshold = None

    def add(self, other: Tally) -> None:
        self.asked, self.right, self.wrong = (
            self.asked + other.asked,
            self.right + other.right,
            self.wrong + other.wrong,
        )

    def became(self, kinds: dict[str, list[float]], since: Tally) -> None:
        """Every process's evidence as the store sums it, and what came here since it was read."""
        self.asked, self.right, self.wrong = (np.array(kinds[k], dtype=float) + getattr(since, k) for k in KINDS)
        self.threshold = None

    def settled(self, threshold: float) -> float:
        self.threshold = threshold
        return threshold


@dataclass
class Own:
    """An entry's own verdicts."""

    right: int = 0
    lowest_right: float = NEVER
    highest_wrong: float = -1.0

    def judged(self, score: float, right: bool) -> None:
        if right:
            self.right, self.lowest_right = self.right + 1, min(self.lowest_right, score)
        else:
            self.highest_wrong = max(self.highest_wrong, score)


class Bound:
    def __init__(
        self,
        deltas: dict[str, float],
        config: BoundConfig = BoundConfig(),
        shared: Callable[[Evidence], Evidence | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if any(not 0.0 <= d < 1.0 for d in deltas.values()):
            raise ValueError("max_error_rate: each within [0, 1)")
        self.deltas, self.config, self.shared, self.clock = dict(deltas), config, shared, clock
        self.tallies = {name: Tally(config.bins) for name in deltas}
        self.pending = {name: Tally(config.bins) for name in deltas}  # seen here since the last sync
        self.synced, self.failing = -SYNC_S, False
        self.own: OrderedDict[str, Own] = OrderedDict()
        self.verdicts = {"right": 0, "wrong": 0}
        self.lock = threading.Lock()
        mids = (np.arange(config.bins) + 0.5) / config.bins
        self.prior_error = 1.0 - mids  # a calibrated verifier's error at each bin

    def bin(self, score: float) -> int:
        return min(self.config.bins - 1, max(0, int(score * self.config.bins)))

    def asked(self, category: str, score: float) -> None:
        """A question whose best candidate scored `score` (what serving at a threshold would serve)."""
        with self.lock:
            for tally in (self.tallies[category], self.pending[category]):
                tally.count("asked", self.bin(score))

    def learn(self, category: str, entry_id: str, score: float, right: bool) -> None:
        with self.lock:
            for tally in (self.tallies[category], self.pending[category]):
                tally.count("right" if right else "wrong", self.bin(score))
            self.verdicts["right" if right else "wrong"] += 1
            own = self.own.pop(entry_id, None) or Own()
            own.judged(score, right)
            self.own[entry_id] = own
            while len(self.own) > self.config.entries:
                self.own.popitem(last=False)

    def forget(self, entry_id: str) -> None:
        with self.lock:
            self.own.pop(entry_id, None)

    def threshold(self, category: str) -> float:
        """The lowest score the category may serve at: its error's upper bound stays under delta."""
        self.sync()
        with self.lock:
            tally = self.tallies[category]
            if tally.threshold is None:
                return tally.settled(self._threshold(tally, self.deltas[category]))
            return tally.threshold

    def sync(self) -> None:
        """Add this process's evidence to the store's and take every process's (at most every SYNC_S;
        the store is asked outside the lock: a store out of reach holds up no other lookup)."""
        with self.lock:
            if self.shared is None or self.clock() - self.synced < SYNC_S:
                return
            self.synced = self.clock()
            sent, self.pending = self.pending, {name: Tally(self.config.bins) for name in self.deltas}
        added = {name: {kind: getattr(t, kind).tolist() for kind in KINDS} for name, t in sent.items()}
        try:
            totals = self.shared(added)
        except Exception as exc:  # kept here until the store answers: this process's evidence is not lost
            with self.lock:
                for name, tally in sent.items():
                    self.pending[name].add(tally)
                if not self.failing:
                    self.failing = True
                    log.warning("semantic cache: the bound's shared evidence is out of reach (%s)", type(exc).__name__)
            return
        with self.lock:
            self.failing = False
            for name, kinds in (totals or {}).items():
                if name in self.tallies:  # every process's, and what came here since they were read
                    self.tallies[name].became(kinds, self.pending[name])

    def _threshold(self, tally: Tally, delta: float) -> float:
        if delta <= 0:
            return NEVER
        if tally.right.sum() + tally.wrong.sum() < self.config.warmup:
            return NEVER
        # The verifier's score anchors each bin's estimate, worth prior_weight verdicts: a lucky run of
        # right verdicts moves it little (a bound that opened on luck would serve above its rate).
        m, checked = self.config.prior_weight, tally.right + tally.wrong
        seen = checked + m
        error = (tally.wrong + m * self.prior_error) / seen
        spread = np.maximum(error, 1.0 / (seen + 1.0)) * (1.0 - error) / seen
        weight = tally.asked + 1.0  # every bin asked at least once: no region is free of doubt
        # Serving the bins from t up: sums over b >= t, for every t at once.
        above = np.cumsum(weight[::-1])[::-1]
        mean = np.cumsum((weight * error)[::-1])[::-1] / above
        var = np.cumsum((weight**2 * spread)[::-1])[::-1] / above**2
        upper = mean + self.config.z * np.sqrt(var)
        ok = np.nonzero((upper <= delta) & (np.arange(len(upper)) >= np.argmax(checked > 0)))[0]
        return float(ok[0]) / self.config.bins if len(ok) else NEVER  # never below the lowest score checked

    def allows(self, category: str, entry_id: str, score: float) -> bool:
        if self.deltas[category] <= 0:  # only the same question: no evidence loosens that
            return False
        limit = self.threshold(category)
        with self.lock:
            own = self.own.get(entry_id)
        if own is not None:
            if own.highest_wrong >= 0:
                limit = max(limit, own.highest_wrong + 1e-6)
            elif own.right >= self.config.min_right:
                limit = min(limit, own.lowest_right)
        return score >= limit

    def stats(self) -> dict[str, object]:
        return {
            "verdicts": dict(self.verdicts),
            "entries_taught": len(self.own),
            "categories": {
                name: {
                    "max_error_rate": self.deltas[name],
                    "threshold": self.threshold(name),
                    "asked": int(tally.asked.sum()),
                    "right": int(tally.right.sum()),
                    "wrong": int(tally.wrong.sum()),
                }
                for name, tally in self.tallies.items()
            },
        }
