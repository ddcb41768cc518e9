"""What the engine's steps cost, measured as they run.

Two rates. `prefill_s`: seconds per prompt token, as prefill-sized steps took them (the cost model's
unit: runtime/costs.py). `added_s`: what rows added to a step cost beyond the step itself. A step
reads every weight once however many rows it carries, so rows riding along in a step cost less than
the same rows computed alone (on the default model on 2 CPU cores: 64 rows alone 225 ms, added to a
4-sequence decode step 138 ms). It is the slope of step time over step tokens, fitted over recent
steps.
"""

from __future__ import annotations

PREFILL_ROWS = 64  # a step of at least this many tokens is mostly prefill: its rate is a prefill rate
DEFAULT_S_PER_TOKEN = 1 / 300  # before any measurement: a CPU's rate
DECAY = 0.98  # each step's weight in the fit, per later step (about the last 50 steps count)
MIN_SPREAD = 16.0  # steps' sizes must differ by about this many tokens for a slope to mean anything


class StepTimes:
    def __init__(self) -> None:
        self.per_token: float | None = None  # a moving average over prefill steps
        self.w = self.t = self.s = self.tt = self.ts = 0.0  # the fit's weighted sums: 1, tokens, s, t², t·s

    def measured(self, tokens: int, seconds: float) -> None:
        """A step computed `tokens` rows in `seconds`."""
        if tokens >= PREFILL_ROWS:  # decode steps would skew the per-token rate
            rate, old = seconds / tokens, self.per_token
            self.per_token = rate if old is None else 0.8 * old + 0.2 * rate
        d = DECAY
        self.w, self.t, self.s = d * self.w + 1, d * self.t + tokens, d * self.s + seconds
        self.tt, self.ts = d * self.tt + tokens * tokens, d * self.ts + tokens * seconds

    def prefill_s(self, tokens: int) -> float:
        """Seconds to prefill `tokens` in steps of their own."""
        return tokens * (self.per_token or DEFAULT_S_PER_TOKEN)

    def added_s(self, tokens: int) -> float:
        """Seconds `tokens` more rows add to a step: the fitted slope, never above the prefill rate
        (where steps have all been alike, there is no slope: the prefill rate)."""
        mean_t = self.t / self.w if self.w else 0.0
        spread = self.tt / self.w - mean_t * mean_t if self.w else 0.0
        if spread < MIN_SPREAD * MIN_SPREAD:
            return self.prefill_s(tokens)
        slope = (self.ts / self.w - mean_t * self.s / self.w) / spread
        return tokens * min(max(slope, 0.0), self.per_token or DEFAULT_S_PER_TOKEN)
