"""How long a tool takes: per tool, the empirical distribution of observed durations (the next
turn's arrival minus the previous turn's end), blended with a lognormal prior that stands in for
the observations not made yet. Processes that share them (agents/programs.py: `SharedTools`) each add
what they saw and load every process's."""

from __future__ import annotations

import bisect
import math
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

ANY = "*"  # every tool pooled: the guess for a call whose tool is not known yet


@dataclass(frozen=True)
class Prior:
    median_s: float = 2.0
    sigma: float = 1.0  # of the log duration
    weight: float = 4.0  # pseudo-observations: real ones outweigh it once there are a few

    def cdf(self, t: float) -> float:
        if t <= 0:
            return 0.0
        return 0.5 * (1 + math.erf((math.log(t) - math.log(self.median_s)) / (self.sigma * math.sqrt(2))))

    def quantile(self, p: float) -> float:
        return self.median_s * math.exp(self.sigma * math.sqrt(2) * _erfinv(2 * p - 1))


def _erfinv(y: float) -> float:
    """Inverse error function: Winitzki's approximation, polished by two Newton steps."""
    a = 0.147
    ln = math.log(1 - y * y)
    first = 2 / (math.pi * a) + ln / 2
    x = math.copysign(math.sqrt(math.sqrt(first * first - ln / a) - first), y)
    for _ in range(2):
        x -= (math.erf(x) - y) / (2 / math.sqrt(math.pi) * math.exp(-x * x))
    return x


Tools = tuple[str, ...]
Follows = list[tuple[Tools, Tools, int]]  # (a call's tools, the next call's tools, how often)


@dataclass
class Seen:
    """What one process saw of a tenant's tools since it last shared."""

    returns: list[tuple[Tools, float]] = field(default_factory=list)  # tools called together, seconds until back
    follows: list[tuple[Tools, Tools]] = field(default_factory=list)  # a call, then the program's next
    keep: int = 512  # the latest kept, however long the store does not answer

    def add(self, before: Tools, tools: Tools, seconds: float) -> None:
        """`tools` (called after `before`) came back after `seconds`."""
        self.returns.append((tools, seconds))
        self.follows.append((before, tools))
        self.trim()

    def follow(self, older: Seen) -> None:
        """`older` was seen before all of this (it could not be shared then)."""
        self.returns[:0], self.follows[:0] = older.returns, older.follows
        self.trim()

    def trim(self) -> None:
        del self.returns[: -self.keep], self.follows[: -self.keep]


class SharedTools(Protocol):
    def exchange(self, seen: dict[str, Seen]) -> dict[str, tuple[dict[str, list[float]], Follows]]:
        """Add what this process saw, per tenant; every process's, per tenant of `seen`: each tool's
        latest durations (oldest first) and the calls seen to follow others."""


# The prior's quantiles offered as TTL candidates, so that a tool seen rarely still has choices.
PRIOR_LEVELS = tuple(i / 20 for i in range(1, 20)) + (0.99,)


class Durations:
    """One tool's durations: the last `window` observations, sorted, and the prior."""

    def __init__(self, prior: Prior, window: int = 512) -> None:
        self.prior, self.window = prior, window
        self.recent: deque[float] = deque()
        self.sorted: list[float] = []

    def observe(self, seconds: float) -> None:
        if not seconds >= 0 or math.isinf(seconds):
            return
        if len(self.recent) == self.window:
            del self.sorted[bisect.bisect_left(self.sorted, self.recent.popleft())]
        self.recent.append(seconds)
        bisect.insort(self.sorted, seconds)

    def __len__(self) -> int:
        return len(self.sorted)

    def cdf(self, t: float) -> float:
        """P(duration <= t)."""
        seen = bisect.bisect_right(self.sorted, t)
        w = self.prior.weight
        return (seen + w * self.prior.cdf(t)) / (len(self.sorted) + w)

    def candidates(self) -> list[float]:
        """Where P(duration <= t) can jump: every observation, and the prior's quantiles."""
        return sorted({*self.sorted, *(self.prior.quantile(p) for p in PRIOR_LEVELS)})


def cdf_at(waits: list[float], p: list[float], t: float) -> float:
    """A step distribution given at ascending `waits`, read at t."""
    i = bisect.bisect_right(waits, t)
    return p[i - 1] if i else 0.0


class Predictor:
    """Durations per tool name, learnt as the program turns come back; thread-safe."""

    def __init__(self, prior: Prior = Prior(), window: int = 512, max_tools: int = 256) -> None:
        self.prior, self.window, self.max_tools = prior, window, max_tools
        self.tools: OrderedDict[str, Durations] = OrderedDict()  # the `max_tools` latest observed
        # How often a call to one set of tools followed a call to another, in the same program
        # (as many sets as tools are kept, each followed by as many).
        self.follows: OrderedDict[tuple[str, ...], dict[tuple[str, ...], int]] = OrderedDict()
        self.lock = threading.Lock()

    def observe(self, tools: Iterable[str], seconds: float) -> None:
        """A turn that called `tools` (run together) came back after `seconds`."""
        with self.lock:
            for tool in {*tools, ANY}:
                self._of(tool).observe(seconds)

    def called(self, before: tuple[str, ...], now: tuple[str, ...]) -> None:
        """A program called `now` after `before` (its previous call)."""
        with self.lock:
            counts = self.follows.setdefault(before, {})
            self.follows.move_to_end(before)
            if len(self.follows) > self.max_tools:
                self.follows.popitem(last=False)
            if now in counts or len(counts) < self.max_tools:
                counts[now] = counts.get(now, 0) + 1

    def load(self, durations: dict[str, list[float]], follows: Follows) -> None:
        """Every process's observations, in place of this one's (as bounded: `window`, `max_tools`)."""
        with self.lock:
            self.tools.clear()
            self.follows.clear()
            for tool, seen in durations.items():
                for seconds in seen:
                    self._of(tool).observe(seconds)
            for before, now, n in follows:
                counts = self.follows.setdefault(before, {})
                if now in counts or len(counts) < self.max_tools:
                    counts[now] = counts.get(now, 0) + n
                if len(self.follows) > self.max_tools:
                    self.follows.popitem(last=False)

    def after(self, before: tuple[str, ...]) -> tuple[list[float], list[float]]:
        """The wait for a program's next call, not yet made, whose previous call was to `before`: a
        mixture over the calls seen to follow it, and (weighted as one of them) every tool pooled."""
        with self.lock:
            counts = dict(self.follows.get(before, {}))
        parts = [(self.distribution(tools), n) for tools, n in counts.items()] + [(self.distribution(()), 1)]
        waits = sorted({t for (ts, _), _ in parts for t in ts})
        total = sum(n for _, n in parts)
        p = [sum(n * cdf_at(ts, ps, t) for (ts, ps), n in parts) / total for t in waits]
        return waits, p

    def distribution(self, tools: Iterable[str]) -> tuple[list[float], list[float]]:
        """For calls to `tools` made together (empty: not known): candidate waits t, ascending,
        and P(every call has returned within t) at each, taking the tools as independent."""
        with self.lock:
            of = [self._of(t) for t in set(tools) or {ANY}]
            ts = sorted({t for d in of for t in d.candidates()})
            return ts, [math.prod(d.cdf(t) for d in of) for t in ts]

    def observed(self, tool: str) -> int:
        with self.lock:
            return len(self.tools[tool]) if tool in self.tools else 0

    def _of(self, tool: str) -> Durations:
        if tool not in self.tools:
            self.tools[tool] = Durations(self.prior, self.window)
            if len(self.tools) > self.max_tools + 1:  # ANY (every tool pooled) is the oldest: spare it
                del self.tools[next(t for t in self.tools if t != ANY)]
        self.tools.move_to_end(tool)
        return self.tools[tool]
