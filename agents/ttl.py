"""How long to pin a program's KV after a turn (Continuum), weighed against what memory does for it
unpinned.

Unpinned, a context stays in memory for about `resident_s` = R seconds after its last use: the idle
age at which memory evicts what is not pinned, as measured lately (an LRU's characteristic time).
What a pin of TTL T adds is the returns in (R, T]; what it takes is memory for T - R more seconds,
which the contexts stored after it would have used. Memory earns `memory_rate` on what it keeps
unpinned: the prefill its returns skip, per second and per whole memory tier (each context it keeps
earns P(back within R) x saved per R seconds); a pin must earn at least that on its share `held`
(times `memory_weight`):

    gain(T) = P(back in (R, T]) x (saved + passed)  -  weight x memory_rate x held x (T - R)

So the program must be likelier to come back per second of the pin than the contexts memory keeps
for free: no exchange rate between seconds and memory to guess, and no pin when memory keeps every
context anyway (R past the longest TTL) or when displacing fresher contexts costs more than the pin
wins. The rate is memory's, not the pinned context's own: a context whose returns come late earns
memory little unpinned, but the memory its pin takes would serve others at their rate (priced at the
context's own, pins went to exactly those and lost up to 5% to no pins where memory held four contexts).
`saved` is the prefill (or reload from a lower tier) a turn skips when its KV is still in memory;
`passed` the queueing a pinned turn skips, as program FCFS admits pinned turns first. Only the pin is
credited with it: the contexts memory keeps in its place are found by chance, and a turn found there
passes the queue only when held, late. (With the queue on both sides, the simulator's decided pins
lost up to 7.6% to a fixed TTL under overload, where the queue is most of a turn's wait.) With no
residence (R = 0) the memory is priced outright:

    gain(T) = P(back within T) x (saved + passed)  -  memory_weight x share of memory held x T
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Literal

PINS = ("off", "fixed", "decide")
# A longer pin for a gain within this share of a shorter one's is not worth its memory: when memory
# earns nothing on a context unpinned (every return comes after R), the prior's thin tail would
# otherwise win the longest TTL by a hair.
TIE = 0.01


@dataclass(frozen=True)
class PinPolicy:
    # off: never pin (contexts are evicted like any entry); fixed: always `fixed_ttl_s`; decide: as above.
    mode: Literal["off", "fixed", "decide"] = "decide"
    fixed_ttl_s: float = 10.0
    max_ttl_s: float = 300.0
    # The price of a pin's memory: seconds of compute per second of the whole memory tier when memory
    # keeps nothing unpinned; else times the rate memory earns unpinned (1: the same rate).
    memory_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in PINS:
            raise ValueError(f"unknown pin mode {self.mode!r}; one of {', '.join(PINS)}")
        if self.fixed_ttl_s < 0 or self.max_ttl_s < 0 or self.memory_weight < 0:
            raise ValueError("pin TTLs and the memory weight must not be negative")


def benefit(p_back: float, saved_s: float, held: float, weight: float, ttl: float) -> float:
    """Expected seconds a pin of `ttl` gains: `p_back` is P(the next turn comes within ttl),
    `held` the share of the memory tier the KV takes."""
    return p_back * saved_s - weight * held * ttl


def decide(
    policy: PinPolicy,
    waits: list[float],
    p_back: list[float],
    saved_s: float,
    held: float,
    resident_s: float = 0.0,
    passed_s: float = 0.0,
    memory_rate: float | None = None,
) -> float:
    """The TTL in seconds (0: do not pin). `waits` ascending, `p_back[i]` = P(back within waits[i]),
    already weighted by the chance that a next turn comes at all; `saved_s`: the prefill a turn
    skips when its KV is in memory; `held`: the share of memory the context takes; `resident_s`: how
    long memory keeps it unpinned, on average (0: not at all); `passed_s`: the queueing a pinned
    turn skips; `memory_rate`: what memory earns per second on the contexts it keeps unpinned, per
    whole tier (None: as if every context were this one)."""
    if policy.mode == "off" or held > 1:
        return 0.0
    if policy.mode == "fixed":
        return policy.fixed_ttl_s
    if resident_s >= policy.max_ttl_s:
        return 0.0  # memory keeps it anyway: a pin changes nothing
    pinned = saved_s + passed_s
    if resident_s <= 0:
        gains = [benefit(p, pinned, held, policy.memory_weight, wait) for wait, p in zip(waits, p_back)]
        return best_ttl(policy, waits, gains)
    base = cdf(waits, p_back, resident_s)
    # What memory earns per second on the pin's share: by default, on this context as it does unpinned.
    share_rate = base * saved_s / resident_s if memory_rate is None else memory_rate * held
    rate = policy.memory_weight * share_rate
    # Eviction takes unpinned contexts at ages spread around R (the simulator measures a fraction of
    # R to twice it): a pin that ends before 2R mostly guards returns that memory keeps anyway.
    gains = [
        (p - base) * pinned - rate * (wait - resident_s) if wait >= 2 * resident_s else 0.0
        for wait, p in zip(waits, p_back)
    ]
    return best_ttl(policy, waits, gains)


def best_ttl(policy: PinPolicy, waits: list[float], gains: list[float]) -> float:
    """The shortest wait within the longest TTL whose gain is within `TIE` of the highest positive
    one; 0 when none is positive."""
    within = [(wait, gain) for wait, gain in zip(waits, gains) if wait <= policy.max_ttl_s]
    top = max((gain for _, gain in within), default=0.0)
    return next((wait for wait, gain in within if gain > 0 and gain >= (1 - TIE) * top), 0.0)


def cdf(waits: list[float], p_back: list[float], t: float) -> float:
    """P(back within t) of the step distribution."""
    i = bisect.bisect_right(waits, t)
    return p_back[i - 1] if i else 0.0
