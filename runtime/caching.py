"""The caches a prompt's KV reads and leaves, and the policy over them, shared by every sequence: prefix blocks,
content-defined chunks, the blocks blends leave, documents and spans (through the reuser and spans), which reuse a
prompt gets (the calibration, the quality gate, the cost model) and what its fidelity reads. Each sequence's own
state is its PromptKV's (runtime/prompt_kv.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from kvgate.runtime.blend import cost
from kvgate.runtime.calibration import Calibration
from kvgate.runtime.chunks import Chunks
from kvgate.runtime.prefix import Blocks
from kvgate.runtime.quality import FULL, QualityGate, Standing, shape_key
from kvgate.runtime.request import Plan
from kvgate.runtime.reuse import ReuseMode, Reuser
from kvgate.runtime.reuse_report import Fidelity
from kvgate.runtime.spans import Spans

EXACT = Fidelity("exact")  # the KV reused is, bit for bit, the KV full prefill computes (an exact prefix, a program's)


class Caches:
    def __init__(
        self,
        reuser: Reuser,
        blocks: Blocks | None,
        spans: Spans,
        cost: Callable[[int], float],
        gate: QualityGate,
        calibration: Calibration | None,
        in_context: bool = True,
        chunks: Chunks | None = None,
        blended: Blocks | None = None,
        exact: bool = False,
        grid: int = 1,
    ) -> None:
        self.reuser, self.spans, self.cost = reuser, spans, cost  # cost: seconds to prefill n tokens
        # Whether the engine computes a prompt's rows the same however its prefill is split (runtime/model.py);
        # if not, no reuse is called exact.
        self.exact, self.grid = exact, grid  # its prefill chunks end at multiples of `grid`
        self.blocks = blocks  # None: no automatic prefix caching
        self.chunks = chunks  # None: no content-defined chunks
        # A blended prompt's KV, kept in blocks of a chain of their own, so that the same tokens asked again
        # read it whole (they would blend the same chunks again) and never as exact. None: not kept.
        self.blended = blended
        self.gate, self.calibration = gate, calibration
        self.in_context = in_context  # new documents' KV kept as their first prompt computed it

    def read(self, cached: int, other: int) -> Fidelity | None:
        """The fidelity of KV read as it was stored (prefix blocks, a program's context), `cached` tokens of which
        `other` rows are not full prefill's own bit for bit: exact when every row is; else how many are not (decoded
        rows, rows a lossy codec read back, or an engine whose kernels are not row-invariant), unmeasured."""
        if not cached:
            return None
        if not self.exact:
            return Fidelity("numerics")
        return EXACT if other <= 0 else Fidelity("numerics", lossy_rows=other)

    def fidelity(self, mode: str, ratio: float, documents: int) -> Fidelity:
        """How far reusing KV at `ratio` moves the first token from full prefill's: the latest shadow
        checks of that mode (or KVCOMM shape's key) at that ratio, else what calibration measured for
        as many documents."""
        checked = self.gate.measured(mode, ratio)
        if checked is not None:
            kl, top1, answer, n = checked
            return Fidelity("measured", ratio, kl, top1, answer, "shadow", n)
        calibrated = self.calibration.measured(documents, ratio) if self.calibration and mode == "blend" else None
        if calibrated is not None:
            return Fidelity("measured", ratio, calibrated["kl"], calibrated["top1"], source="calibration")
        return Fidelity("unmeasured", ratio)

    def choose(
        self, plan: Plan, head: int, length: int, in_context: bool = False, program: bool = False
    ) -> tuple[ReuseMode, str, tuple[str, float] | None]:
        """The reuse to run for `plan` (the prompt of `length` tokens after its exact `head`), why when it is not
        the one the plan asked for, and the quality gate's key and ratio a check of it would compare (None: none).
        A ratio asked is run as asked. A mode left to the server gets the smallest ratio the calibration table says
        meets the fidelity target for this many documents (none: full prefill), never below the quality gate's
        rung; a blend the cost model says is slower than full prefill runs as full prefill. With no table (and no
        operator's ratio) blends are calibrated online: full prefill, checked against the blend its checks
        measure, until they open a ratio (`QualityGate.uncalibrated`). `in_context`: the prompt brings documents new to
        the cache, prefilled in full; `program`: an agent program's turn."""
        reuse, why, gate = plan.reuse, "", self.gate
        if in_context:
            return (
                ReuseMode("full"),
                "documents new to the cache: prefilled in full, their KV kept as computed here",
                None,
            )
        gated = reuse.ratio is None and reuse.mode == ("kvcomm" if plan.spans else "blend")
        key = self.ladder(plan, reuse.mode, program)
        if not gated:  # not the gate's to serve: priced only when its ratio is left to the server
            priced = reuse.mode in ("blend", "kvcomm") and plan.reuse.ratio is None
            if priced and (slower := self.slower(plan, reuse, head, length)):
                return ReuseMode("full"), slower, None
            return reuse, "", None
        rung, why = gate.serve(key)
        ratio = rung
        if reuse.mode == "blend" and self.calibration is not None:
            planned, note = self.calibration.ratio_for(sum(plan.documents), *self.targets)
            if planned is None:
                return ReuseMode("full"), note, None
            ratio = max(ratio, planned)
        if ratio == FULL:
            probe = gate.calibrating(key)  # a blend the cost model says is slower opens nothing
            if probe is not None and (slower := self.slower(plan, ReuseMode(reuse.mode, probe), head, length)):
                return ReuseMode("full"), slower, None
            return ReuseMode("full"), why, (key, FULL)
        reuse = ReuseMode(reuse.mode, None if ratio == gate.base(reuse.mode) else ratio)
        if slower := self.slower(plan, reuse, head, length):
            return ReuseMode("full"), slower, None
        return reuse, why, (key, rung)  # checks are of the gate's rung, whatever the calibration added on top

    def ladder(self, plan: Plan, mode: str, program: bool) -> str:
        """The quality gate's ladder for a plan: an agent program's prompt (`program`, or one with spans) climbs
        its reader's (the agent pairs that end at it: KVCOMM's spans or chunks found in it), any other the mode's."""
        return shape_key(mode, plan.agent) if (program or bool(plan.spans)) and plan.agent else mode

    def slower(self, plan: Plan, reuse: ReuseMode, head: int, length: int) -> str:
        """Why the cost model says `reuse` would be slower than computing the prompt after its exact `head` (a
        blend: the plan's pieces; spans: the rest of the prompt's `length` tokens), or ""."""
        if plan.spans:
            tokens = length - head
            reused = self.spans.sourced(plan.pieces, plan.spans, head, plan.scope)
            ratio = reuse.ratio if reuse.ratio is not None else self.gate.base("kvcomm")
            config = self.spans.config(reuse.mode, ratio)
            what = "span reuse (KVCOMM) would be slower than computing the prompt after its exact prefix"
        else:
            tokens = sum(len(p) for p in plan.pieces)
            reused = sum(len(p) for p, d in zip(plan.pieces, plan.documents) if d)
            ratio = reuse.ratio if reuse.ratio is not None else self.reuser.blend.ratio
            config = replace(self.reuser.blend, ratio=ratio)
            what = "reuse would be slower than full prefill"
        work = cost(tokens, reused, self.reuser.kv_shape[0], config)
        if not reused or work < tokens:  # nothing to reuse: computed as it is, whatever the mode
            return ""
        return f"{what} here (cost model: {work:.0f} vs {tokens} tokens)"

    @property
    def targets(self) -> tuple[float, float]:
        return self.gate.config.target_kl, self.gate.config.target_top1

    def standing(self) -> Standing:
        """Where the ratio of blends left to the server comes from: the calibration table, the operator's
        `recompute_ratio`, or shadow checks (calibrated online: `QualityGate.standing`)."""
        online = self.gate.standing("blend")
        if online is not None:
            return online
        if self.calibration is not None:
            cal = self.calibration
            return Standing("table", note=f"kvgate calibrate: {cal.items} items, blends selecting by {cal.select}")
        return Standing("operator", ratio=self.reuser.blend.ratio)
