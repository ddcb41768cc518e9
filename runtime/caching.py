"""What a sequence takes from the caches and leaves to them: the exact head of its prompt (a
program's context, prefix blocks), the documents its prompt lacks (computed in its own steps), the
reuse that continues its KV, and what it leaves for later prompts: prefix blocks, spans, a
program's context."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from kvgate.runtime.blend import Steps, cost
from kvgate.runtime.calibration import Calibration
from kvgate.runtime.chunks import Chunks
from kvgate.runtime.prefix import Blocks
from kvgate.runtime.quality import FULL, Gate, Standing, shape_key
from kvgate.runtime.reuse import Reuse, Reuser
from kvgate.runtime.sequence import Missing, Plan, Sequence
from kvgate.runtime.shared import Spans

log = logging.getLogger("kvgate.engine")
EXACT = "exact"  # the KV reused is, bit for bit, the KV full prefill computes (an exact prefix, a program's prompt)


class Caches:
    def __init__(
        self,
        reuser: Reuser,
        blocks: Blocks | None,
        spans: Spans,
        cost: Callable[[int], float],
        gate: Gate,
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

    def lacking(self, seq: Sequence) -> list[Missing]:
        """The plan's documents no tier holds, to compute in the sequence's steps (a blend would
        otherwise compute each in one piece, stalling every other stream meanwhile)."""
        if seq.plan is None or not any(seq.plan.documents):
            return []
        plan = seq.plan.after(len(seq.kv))
        if not seq.ingest and (plan.reuse.mode not in ("naive", "blend") or not self.reuser.shiftable):
            return []
        found = self.reuser.missing(plan.pieces, plan.documents, plan.scope)
        if self.in_context and found and not seq.ingest and plan.scope and plan.reuse == Reuse("blend"):
            # Mostly new documents, reuse left to the server: the prompt is prefilled in full (its answer
            # exact) and their KV kept as this context computed it. Only within a scope: that KV
            # carries its context.
            documents = sum(len(p) for p, d in zip(plan.pieces, plan.documents) if d)
            if 2 * sum(len(ids) for _, ids in found) >= documents:
                seq.cache.in_context = {key for key, _ in found}
                return []
        return [Missing(key, ids, *self.reuser.document_kv(len(ids))) for key, ids in found]

    def computed(self, seq: Sequence) -> None:
        """A step ran a chunk of a document the prompt lacked: once whole, it is stored."""
        assert seq.cache.missing
        doc = seq.cache.missing[0]
        if len(doc.kv) < len(doc.token_ids):
            return
        seq.cache.missing.pop(0)
        cost = self.cost(len(doc.token_ids))
        seq.cache.fresh[doc.key] = self.reuser.stored(doc.key, doc.token_ids, doc.keys, doc.values, cost)

    def remember(self, seq: Sequence) -> None:
        """An ingest is done: its documents' tokens are kept to find them by id."""
        plan = seq.plan
        assert plan is not None
        for ids, is_document in zip(plan.pieces, plan.documents):
            if is_document:
                self.reuser.remember(self.reuser.key(ids, plan.scope), ids)

    def start(self, seq: Sequence) -> None:
        """Begin the prompt's KV with what is exactly its own: the program's stored context it
        continues, then the prefix blocks that continue that (every prompt stores its exact blocks)."""
        if seq.ingest:
            return
        turn, reuse = seq.turn, seq.cache.reuse
        if turn is not None and turn.resume:
            context = self.reuser.resume(seq.kv, seq.prompt_ids, turn.resume)
            if self.exact and context.exact == context.tokens and context.tokens % self.grid:
                seq.kv.truncate(context.tokens - context.tokens % self.grid)  # the rest from where a prefill would be
            seq.cache.cached_tokens = len(seq.kv)
            if context.exact < len(seq.kv):  # it holds decoded rows
                seq.cache.bitwise = context.exact
            reuse = "program" if seq.cache.cached_tokens else ""
            if turn.keep:  # the KV now lives in the sequence: the stored copy would count twice
                self.reuser.store.delete(turn.resume)
        resumed = len(seq.kv)
        blocks = self.blocks_for(seq)
        attached = blocks.attach(seq.kv, seq.prompt_ids, seq.tenant) if blocks is not None else None
        found = attached.tokens if attached is not None else 0
        seq.cache.matched = attached.matched if attached is not None else 0
        if attached is not None and attached.exact < len(seq.kv) and seq.cache.bitwise >= resumed:
            seq.cache.bitwise = attached.exact  # the first row read that is not full prefill's own
        seq.cache.cached_tokens += found
        seq.cache.reuse = reuse or ("prefix" if found else "")
        seq.cache.exact = len(seq.kv)
        # Blocks found need not be stored again: only from the block where the found ones end.
        seq.cache.kept = 0 if resumed or blocks is None else found - found % blocks.size
        seq.cache.fidelity = self.read(seq)
        again = self.blended_for(seq)
        read = again.attach(seq.kv, seq.prompt_ids, seq.tenant).tokens if again is not None else 0
        if read and len(seq.kv) <= seq.cache.matched:  # no further than the exact blocks went: computed exactly
            seq.kv.truncate(len(seq.kv) - read)
            read = 0
        if read:
            seq.cache.blended = read
            seq.cache.cached_tokens += read
            seq.cache.reuse = f"blend; {read} tokens as a blend of the same tokens left them"
            seq.cache.fidelity = self.fidelity("blend", self.reuser.blend.ratio, 0)
        seq.plan = self.chunked(seq)

    def chunked(self, seq: Sequence) -> Plan | None:
        """A prompt's plan once its exact head is in the KV. A plain prompt: the chunks after the head
        that a tier holds, reused as documents are (None: no chunk found, or "prefix" asked). A
        program's: its spans, unless chunks cover more of it than spans with a source do (a message
        quoted inside another, a history re-rendered, the tools' message gone)."""
        plan = seq.plan
        if plan is not None and (any(plan.documents) or plan.reuse.mode == "full"):
            return plan
        spans = plan is not None and bool(plan.spans)
        reuse = plan.reuse if plan is not None else Reuse()
        if reuse.mode == "kvcomm":  # chunks have no anchors: blended
            reuse = Reuse("blend", reuse.ratio)
        chunks = self.chunks_for(seq)
        if chunks is None or reuse.mode not in ("naive", "blend") or not self.reuser.shiftable:
            return plan if spans else None
        head = max(len(seq.kv), seq.cache.matched)  # what prefix blocks held in place is computed, not blended
        found = chunks.find(seq.prompt_ids, head, seq.tenant)
        if spans and plan is not None and found.reused <= self.spans.sourced(plan.pieces, plan.spans, head, plan.scope):
            return plan
        if not any(found.found):
            return None
        note = f"{sum(found.found)} chunks found by content"
        agent = plan.agent if plan is not None else ""
        return Plan(found.pieces, found.found, reuse, chunks.scope(seq.tenant), note=note, agent=agent)

    def blocks_for(self, seq: Sequence) -> Blocks | None:
        """The prefix blocks a sequence reads and leaves: none for an ingest, nor for a prompt that
        asked for full prefill (the truth that reuse is measured against touches no cache)."""
        full = seq.plan is not None and seq.plan.reuse.mode == "full"
        return None if seq.ingest or full else self.blocks

    def blended_for(self, seq: Sequence) -> Blocks | None:
        """The blocks blended prompts leave, for a plain prompt that may blend chunks (not a program's turn that
        resumes its own context, not documents' (`chunks_for`), not one that asked for prefix or full). A turn
        that resumes nothing (a conversation whose id changes with each step) reads them as any prompt does."""
        plan = seq.plan
        if self.blended is None or self.chunks_for(seq) is None or (seq.turn is not None and seq.turn.resume):
            return None
        if plan is not None and (plan.spans or plan.reuse.mode not in ("naive", "blend")):
            return None
        return self.blended

    def chunks_for(self, seq: Sequence) -> Chunks | None:
        """The content-defined chunks a sequence reads and leaves: those of a plain prompt or a
        program's; none for documents (kept under their own keys), an ingest or full prefill."""
        plan, chunks = seq.plan, self.chunks
        if chunks is None or seq.ingest or plan is None:
            return None if seq.ingest else chunks
        documents = any(plan.documents) and plan.scope != chunks.scope(seq.tenant)  # not chunks found
        return None if documents or plan.reuse.mode == "full" else chunks

    def reuse(self, seq: Sequence) -> Steps[torch.Tensor | None]:
        """Continue the KV of a prompt after its exact head as its plan says, stepwise: documents
        reused (a blend, layer by layer), or shared spans reused (KVCOMM); the first token's
        logits when the whole prompt is done, else None (the rest is prefilled in the usual steps)."""
        plan = seq.plan
        head = len(seq.kv)
        if plan is None or plan.spans:
            seq.cache.planned = True
            if plan is None:
                seq.cache.exact = seq.cache.exact if seq.cache.blended else len(seq.prompt_ids)
                return None
            reuse, why = self.choose(seq, plan)
            own = self.gate.base("kvcomm" if reuse.mode == "kvcomm" else "blend")
            ratio = reuse.ratio if reuse.ratio is not None else own
            seq.cache.shared = self.spans.prefill(
                seq.kv, plan.pieces, plan.spans, reuse.mode, plan.agent, plan.scope, ratio
            )
            done = seq.cache.shared.prefilled
            label = seq.cache.reuse if done.mode == "full" else done.mode  # "full": no span reused
            seq.cache.cached_tokens, seq.cache.recomputed_tokens = done.reused, done.recomputed
            seq.cache.reuse = "; ".join(x for x in (label, done.note, why) if x)
            spans = done.reused > head and done.mode != "full"
            withheld = seq.cache.gated is not None and seq.cache.gated[1] == FULL
            if not (spans or (withheld and any(s.source is not None for s in seq.cache.shared.spans))):
                seq.cache.gated = None  # nothing reused, or nothing to reuse: a check would compare dense with dense
            seq.cache.exact = head if spans else len(seq.prompt_ids)
            key = seq.cache.gated[0] if seq.cache.gated is not None else "kvcomm"
            seq.cache.fidelity = self.fidelity(key, ratio, 0) if spans else self.read(seq)
            return done.logits
        rest = plan.after(head)
        if seq.cache.matched > head:  # documents wholly inside what the blocks matched (cut by the grid): computed
            ends = (head + n for n in itertools.accumulate(len(p) for p in rest.pieces))
            documents = [d and end > seq.cache.matched for d, end in zip(rest.documents, ends)]
            rest = replace(rest, documents=documents)
        reuse, why = self.choose(seq, rest) if any(rest.documents) else (Reuse("full"), "")
        done = yield from self.reuser.prefilling(
            seq.kv, rest.pieces, rest.documents, reuse, plan.scope, seq.cache.fresh
        )
        seq.cache.planned = True
        seq.cache.cached_tokens, seq.cache.recomputed_tokens = head + done.reused, done.recomputed
        blended = done.mode in ("naive", "blend")
        label = done.mode if blended or not head else seq.cache.reuse  # else all it reused: the exact head
        seq.cache.reuse = "; ".join(x for x in (label, plan.note, done.note, why) if x)
        if not seq.cache.blended:  # else exact up to where a blend's blocks were read, as start() left it
            seq.cache.exact = len(seq.prompt_ids)
            if blended:  # exact up to the head: a blend computes the tokens before its first document its own way
                seq.cache.exact = head
        if done.reused:
            key = seq.cache.gated[0] if seq.cache.gated is not None else done.mode
            seq.cache.fidelity = self.fidelity(key, done.ratio, sum(rest.documents))
        return done.logits

    def read(self, seq: Sequence) -> str:
        """The fidelity of KV read as it was stored (prefix blocks, a program's context): exact when every row
        is, bit for bit, what full prefill computes; else how many are not (decoded rows, rows a lossy codec
        read back, or an engine whose kernels are not row-invariant), unmeasured."""
        cached = seq.cache.cached_tokens
        if not cached:
            return ""
        if not self.exact:
            return "numerics; kernels not split-invariant here; source=none"
        other = len(seq.kv) - min(seq.cache.bitwise, len(seq.kv))
        return EXACT if other <= 0 else f"numerics; rows={other} decoded or read back lossy; source=none"

    def fidelity(self, mode: str, ratio: float, documents: int) -> str:
        """How far reusing KV at `ratio` moves the first token from full prefill's: the latest shadow
        checks of that mode (or KVCOMM shape's key) at that ratio, else what calibration measured for
        as many documents."""
        checked = self.gate.measured(mode, ratio)
        if checked is not None:
            kl, top1, answer, n = checked
            answered = f"; answer={answer:.3f}" if answer is not None else ""
            return f"kl={kl:.4f}; top1={top1:.3f}{answered}; ratio={ratio:g}; source=shadow; checks={n}"
        calibrated = self.calibration.measured(documents, ratio) if self.calibration and mode == "blend" else None
        if calibrated is not None:
            return f"kl={calibrated['kl']:.4f}; top1={calibrated['top1']:.3f}; ratio={ratio:g}; source=calibration"
        return f"ratio={ratio:g}; source=none"

    def choose(self, seq: Sequence, plan: Plan) -> tuple[Reuse, str]:
        """The reuse to run, and why when it is not the one the plan asked for. A ratio asked is run
        as asked. A mode left to the server gets the smallest ratio the calibration table says meets
        the fidelity target for this many documents (none: full prefill), never below the quality
        gate's rung, and may be checked (`seq.cache.gated`); a blend the cost model says is slower than full
        prefill runs as full prefill. With no table (and no operator's ratio) blends are calibrated online:
        full prefill, checked against the blend its checks measure, until they open a ratio (`Gate.uncalibrated`)."""
        reuse, why = plan.reuse, ""
        if seq.cache.in_context:
            return Reuse("full"), "documents new to the cache: prefilled in full, their KV kept as computed here"
        gated = reuse.ratio is None and reuse.mode == ("kvcomm" if plan.spans else "blend")
        key = self.gated(seq, plan, reuse.mode)
        if gated:
            rung, why = self.gate.serve(key)
            ratio = rung
            if reuse.mode == "blend" and self.calibration is not None:
                planned, note = self.calibration.ratio_for(sum(plan.documents), *self.targets)
                if planned is None:
                    return Reuse("full"), note
                ratio = max(ratio, planned)
            if ratio == FULL:
                probe = self.gate.calibrating(key)  # a blend the cost model says is slower opens nothing
                if probe is not None and (slower := self.slower(seq, plan, Reuse(reuse.mode, probe))):
                    return Reuse("full"), slower
                seq.cache.gated = (key, FULL)
                return Reuse("full"), why
            reuse = Reuse(reuse.mode, None if ratio == self.gate.base(reuse.mode) else ratio)
        if reuse.mode in ("blend", "kvcomm") and plan.reuse.ratio is None and (slower := self.slower(seq, plan, reuse)):
            return Reuse("full"), slower
        if gated:  # checks are of the gate's rung, whatever the calibration added on top
            seq.cache.gated = (key, rung)
        return reuse, why

    def gated(self, seq: Sequence, plan: Plan, mode: str) -> str:
        """The quality gate's ladder for a plan: an agent program's prompt climbs its reader's (the agent
        pairs that end at it: KVCOMM's spans or chunks found in it), any other the mode's."""
        program = bool(plan.spans) or seq.turn is not None
        return shape_key(mode, plan.agent) if program and plan.agent else mode

    def slower(self, seq: Sequence, plan: Plan, reuse: Reuse) -> str:
        """Why the cost model says `reuse` would be slower than computing the prompt after its exact
        head (a blend: the plan's pieces; spans: the prompt after the prefix `seq.kv` holds), or ""."""
        if plan.spans:
            head = len(seq.kv)
            tokens = len(seq.prompt_ids) - head
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
        `recompute_ratio`, or shadow checks (calibrated online: `Gate.standing`)."""
        online = self.gate.standing("blend")
        if online is not None:
            return online
        if self.calibration is not None:
            cal = self.calibration
            return Standing("table", note=f"kvgate calibrate: {cal.items} items, blends selecting by {cal.select}")
        return Standing("operator", ratio=self.reuser.blend.ratio)

    def settle(self, seq: Sequence) -> None:
        """The prompt's KV is complete and its first token out (sampling leaves the prompt's rows
        as they are): what it leaves to store, its exact prefix or its new spans as sources and
        its dense ones as anchors."""
        plan, shared, seq.cache.shared = seq.plan, seq.cache.shared, None
        try:
            if blocks := self.blocks_for(seq):
                ids, bitwise = seq.prompt_ids[: seq.cache.exact], seq.cache.bitwise
                seq.cache.kept = blocks.keep(seq.kv, ids, seq.tenant, seq.cache.kept, bitwise)
            again = self.blended_for(seq)
            if (
                again is not None
                and seq.cache.exact < len(seq.prompt_ids)
                and seq.cache.cached_tokens > seq.cache.exact
            ):
                read = (
                    seq.cache.exact + seq.cache.blended if seq.cache.blended else 0
                )  # the chain's blocks from its first
                again.keep(seq.kv, seq.prompt_ids, seq.tenant, read)
            if chunks := self.chunks_for(seq):
                seq.cache.chunked = chunks.keep(seq.kv, seq.prompt_ids, seq.tenant)
            if plan is not None and seq.cache.in_context:
                self.reuser.keep_in_context(
                    seq.kv, plan.pieces, plan.documents, seq.cache.in_context, plan.scope, self.cost
                )
            if shared is not None and plan is not None:
                self.spans.settle(seq.kv, shared, plan.agent, plan.scope)
        except Exception:  # the answer stands; later prompts compute these again
            log.exception("request %d: storing its prompt's KV failed", seq.id)

    def keep(self, seq: Sequence) -> None:
        """A finished sequence: the blocks of its answer, when its prompt's KV is exact (as vLLM
        keeps full decode blocks; the next turn of a chat begins with them); and a program's turn
        its whole context for the next turn."""
        blocks = self.blocks_for(seq)
        if blocks is not None and seq.cache.exact == len(seq.prompt_ids):
            try:
                decoded = min(seq.cache.bitwise, len(seq.prompt_ids))  # the answer's rows were decoded
                blocks.keep(seq.kv, seq.all_ids, seq.tenant, seq.cache.kept, decoded)
            except Exception:
                log.exception("request %d: storing its prefix blocks failed", seq.id)
        if chunks := self.chunks_for(seq):  # its answer: a span a later prompt may quote
            try:
                chunks.keep(seq.kv, seq.all_ids, seq.tenant, seq.cache.chunked, final=True)
            except Exception:
                log.exception("request %d: storing its chunks failed", seq.id)
        turn = seq.turn
        if turn is None or not turn.keep:
            return
        until = time.monotonic() + turn.pin_s if turn.pin_s > 0 else None
        try:
            decoded = min(seq.cache.bitwise, len(seq.prompt_ids))
            self.reuser.keep(seq.kv, seq.all_ids, turn.keep, self.cost(len(seq.kv)), until, decoded)
            plan = seq.plan
            if plan is not None and plan.spans:  # its answer: a span other agents may read
                self.spans.wrote(seq.kv, len(seq.prompt_ids), seq.output_ids, seq.text, plan.agent, plan.scope)
        except Exception:  # the answer stands; the next turn computes its prompt again
            log.exception("request %d: keeping its context failed", seq.id)
