"""What reuse made of a prompt's KV, as the engine reports it to every consumer (the gateway's headers, metrics
and usage; the SDKs read the headers back). No torch here: a proxy front imports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Fidelity:
    """How far the KV a prompt reused moves its first token from full prefill's, as last measured: `exact` (the KV
    is full prefill's own bit for bit); `numerics` (read as stored, but `lossy_rows` rows are not bit for bit:
    decoded or read back lossy; none counted: the kernels are not split-invariant here); `measured` (KL and top-1
    agreement of the mode at `ratio`, from shadow checks or the calibration); `unmeasured` (at `ratio`)."""

    kind: Literal["exact", "numerics", "measured", "unmeasured"]
    ratio: float | None = None
    kl: float | None = None
    top1: float | None = None
    answer: float | None = None  # shadow checks: how much of the answer agreed
    source: Literal["shadow", "calibration", "none"] = "none"
    checks: int = 0
    lossy_rows: int = 0

    def __str__(self) -> str:
        """As x-kvgate-fidelity says it."""
        if self.kind == "exact":
            return "exact"
        if self.kind == "numerics":
            if self.lossy_rows:
                return f"numerics; rows={self.lossy_rows} decoded or read back lossy; source=none"
            return "numerics; kernels not split-invariant here; source=none"
        ratio = f"ratio={self.ratio:g}; source={self.source}"
        if self.kind == "unmeasured":
            return ratio
        answered = f"; answer={self.answer:.3f}" if self.answer is not None else ""
        checks = f"; checks={self.checks}" if self.source == "shadow" else ""
        return f"kl={self.kl:.4f}; top1={self.top1:.3f}{answered}; {ratio}{checks}"


@dataclass(frozen=True)
class ReuseReport:
    """What reuse made of a prompt's KV: the mode that ran (program, prefix, blend, naive, kvcomm, full; "" when
    nothing was reused), notes on how (what was found, why not as asked), the cached tokens kept as they were
    (`reused`) and those computed again (`recomputed`), and its fidelity (None: nothing read)."""

    mode: str = ""
    notes: tuple[str, ...] = ()
    reused: int = 0
    recomputed: int = 0
    fidelity: Fidelity | None = None

    def __str__(self) -> str:
        """As x-kvgate-reuse says it: the mode, then the notes."""
        return "; ".join(x for x in (self.mode, *self.notes) if x)


NOTHING = ReuseReport()
