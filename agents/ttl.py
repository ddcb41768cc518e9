"""How long to pin a program's KV after a turn (Continuum): the TTL that maximises

    P(the next turn comes within TTL) x seconds saved  -  memory weight x share of memory held x TTL

where the seconds saved are the prefill (or reload from a lower tier) and the queueing the next
turn avoids when its KV is still in memory. Zero when no TTL is worth its memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PINS = ("off", "fixed", "decide")


@dataclass(frozen=True)
class PinPolicy:
    # off: never pin (contexts are evicted like any entry); fixed: always `fixed_ttl_s`; decide: as above.
    mode: Literal["off", "fixed", "decide"] = "decide"
    fixed_ttl_s: float = 10.0
    max_ttl_s: float = 300.0
    # Seconds of compute that holding the whole memory tier for one second is worth.
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


def decide(policy: PinPolicy, waits: list[float], p_back: list[float], saved_s: float, held: float) -> float:
    """The TTL in seconds (0: do not pin). `waits` ascending, `p_back[i]` = P(back within waits[i]),
    already weighted by the chance that a next turn comes at all."""
    if policy.mode == "off" or held > 1:
        return 0.0
    if policy.mode == "fixed":
        return policy.fixed_ttl_s
    best, best_gain = 0.0, 0.0
    for wait, p in zip(waits, p_back):
        if wait > policy.max_ttl_s:
            break
        gain = benefit(p, saved_s, held, policy.memory_weight, wait)
        if gain > best_gain:
            best, best_gain = wait, gain
    return best
