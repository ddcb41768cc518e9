"""One sequence's prompt KV, and its one owner: what the prompt reuses (a program's context, prefix blocks,
documents, chunks, spans), recomputes and has left to compute, and what it leaves for later prompts. The engine
asks it for the next run within a token budget (`next`), tells it when a run is done (`ran`) and when the prompt's
KV is whole (`settle`) or the sequence over (`keep`); the rest of the engine only reads it. The caches' shared
collaborators and policy (runtime/caching.py) are passed in."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field, replace

import torch

from kvgate.agents.programs import Turn
from kvgate.chunk_cache import ChunkKV
from kvgate.chunk_cache.reads import Reads, reading
from kvgate.runtime.blend import Steps
from kvgate.runtime.caching import Caches
from kvgate.runtime.chunks import Chunks
from kvgate.runtime.kv import KVCache
from kvgate.runtime.model import Run
from kvgate.runtime.prefix import Blocks
from kvgate.runtime.quality import FULL
from kvgate.runtime.request import Plan
from kvgate.runtime.reuse import ReuseMode
from kvgate.runtime.reuse_report import NOTHING, Fidelity, ReuseReport
from kvgate.runtime.spans import Shared

log = logging.getLogger("kvgate.engine")


@dataclass
class Missing:
    """A document of the prompt that no tier holds: computed alone (positions 0..T-1), chunk by
    chunk in its sequence's steps like any prefill, then stored."""

    key: str
    token_ids: list[int]
    kv: KVCache


def run_end(computed: int, budget: int, length: int, grid: int = 1) -> int:
    """Where a prompt chunk starting at `computed` ends within `budget`: the prompt's end, or else the last
    multiple of `grid` (`computed` itself when none fits: an empty chunk)."""
    stop = min(computed + budget, length)
    return stop if stop == length else max(computed, stop - stop % grid)


def said(*notes: str) -> tuple[str, ...]:
    """A report's notes: those that say something."""
    return tuple(note for note in notes if note)


@dataclass
class PromptKV:
    seq: int  # its sequence's id, for the log
    prompt_ids: list[int]
    kv: KVCache  # the sequence's own
    plan: Plan | None  # the prompt's pieces; once its exact head is read, the chunks found after it (`chunked`)
    turn: Turn | None
    tenant: str
    ingest: bool  # only compute and store the plan's documents
    planned: bool = False  # the plan's (or the turn's) reuse has run
    exact: int = 0  # leading prompt tokens whose KV is full prefill's own (what prefix blocks may keep)
    # Where the rows that are full prefill's own bit for bit end: rows read decoded (or lossy) and every row
    # computed over them are not (`read`).
    bitwise: int = 1 << 62
    matched: int = 0  # where the prompt's tokens found in prefix blocks end (the read itself ends on the grid)
    blended: int = 0  # prompt tokens read from the blocks an earlier blend of the same tokens left
    kept: int = 0  # where storing its prefix blocks goes on (the blocks before are stored)
    chunked: int = 0  # where keeping its content-defined chunks goes on
    missing: list[Missing] | None = None  # the plan's documents no tier holds (None: not looked yet)
    fresh: dict[str, ChunkKV] = field(default_factory=dict)  # documents computed for this prompt
    in_context: set[str] = field(default_factory=set)  # new documents whose KV this prompt's full prefill leaves
    reusing: Steps[torch.Tensor | None] | None = None  # the reuse underway, spread over steps
    gated: tuple[str, float] | None = None  # the gate's key served (a mode or KVCOMM shape) and its ratio (FULL: none)
    shared: Shared | None = None  # a span prefill whose lessons wait for the prompt's KV to complete
    report: ReuseReport = NOTHING  # what reuse made of the prompt's KV, and how far that moves its first token
    reads: Reads = field(default_factory=Reads)  # what its reads of stored KV hit, by tier
    loaded_at: float | None = None  # time.monotonic() once its exact head is read and its documents looked up
    reused_at: float | None = None  # and once a blend of its documents or spans ended (runtime/stages.py)

    # ---- what the engine asks and tells ---------------------------------------------------

    def next(self, caches: Caches, budget: int, grid: int) -> Run | torch.Tensor | None:
        """Advance the prompt's reuse by about `budget` tokens of work. A run for this step: the next chunk of a
        document the prompt lacks, or the prompt's own next chunk (ending on `grid`) once reuse left the rest to
        prefill; the first token's logits when reuse covered the whole prompt; None when the step has nothing to
        run for it (the reuse goes on, or an ingest's documents are all stored). What its reads hit is counted."""
        with reading(self.reads):
            return self.advance(caches, budget, grid)

    def advance(self, caches: Caches, budget: int, grid: int) -> Run | torch.Tensor | None:
        if self.missing is None:
            self.start(caches)
            self.missing = self.lacking(caches)
            self.loaded_at = time.monotonic()
        if self.missing:
            doc = self.missing[0]
            done = len(doc.kv)
            return Run(doc.kv, doc.token_ids[done : done + budget], done)
        if self.ingest:
            self.remember(caches)
            return None
        if self.reusing is None:
            self.reusing = self.reuse_rest(caches)
        spent = 0.0
        try:
            while spent < budget:
                spent += next(self.reusing)
            return None
        except StopIteration as stop:
            logits = stop.value
        finally:
            if self.planned:
                self.reusing = None
        if logits is not None:  # the whole prompt is in the KV: straight to the first token
            return logits
        tokens = self.chunk(budget, grid)
        return Run(self.kv, tokens, len(self.kv)) if tokens else None

    def chunk(self, budget: int, grid: int = 1) -> list[int]:
        """The prompt's next tokens to compute within `budget`: up to its end, or else to the last multiple of `grid`
        (none fits: empty), so that the prompt's KV is the same however it is chunked (runtime/model.py)."""
        computed = len(self.kv)
        return self.prompt_ids[computed : run_end(computed, budget, len(self.prompt_ids), grid)]

    def ran(self, caches: Caches) -> None:
        """A step ran a chunk of a document the prompt lacked: once whole, it is stored."""
        assert self.missing
        doc = self.missing[0]
        if len(doc.kv) < len(doc.token_ids):
            return
        self.missing.pop(0)
        seconds = caches.cost(len(doc.token_ids))
        keys, values = doc.kv.copy(0, len(doc.token_ids))
        self.fresh[doc.key] = caches.reuser.stored(doc.key, doc.token_ids, keys, values, seconds)

    def remember(self, caches: Caches) -> None:
        """An ingest is done: its documents' tokens are kept to find them by id, and what was found stored counted."""
        plan = self.plan
        assert plan is not None
        for ids, is_document in zip(plan.pieces, plan.documents):
            if is_document:
                caches.reuser.remember(caches.reuser.key(ids, plan.scope), ids)
        found = len(self.prompt_ids) - sum(len(entry.token_ids) for entry in self.fresh.values())
        self.report = ReuseReport(reused=found)

    # ---- the exact head and the documents lacking -----------------------------------------

    def lacking(self, caches: Caches) -> list[Missing]:
        """The plan's documents no tier holds, to compute in the sequence's steps (a blend would
        otherwise compute each in one piece, stalling every other stream meanwhile)."""
        if self.plan is None or not any(self.plan.documents):
            return []
        plan = self.plan.after(len(self.kv))
        reuser = caches.reuser
        if not self.ingest and (plan.reuse.mode not in ("naive", "blend") or not reuser.shiftable):
            return []
        found = reuser.missing(plan.pieces, plan.documents, plan.scope)
        if caches.in_context and found and not self.ingest and plan.scope and plan.reuse == ReuseMode("blend"):
            # Mostly new documents, reuse left to the server: the prompt is prefilled in full (its answer
            # exact) and their KV kept as this context computed it. Only within a scope: that KV
            # carries its context.
            documents = sum(len(p) for p, d in zip(plan.pieces, plan.documents) if d)
            if 2 * sum(len(ids) for _, ids in found) >= documents:
                self.in_context = {key for key, _ in found}
                return []
        return [Missing(key, ids, reuser.new_kv()) for key, ids in found]

    def start(self, caches: Caches) -> None:
        """Begin the prompt's KV with what is exactly its own: the program's stored context it
        continues, then the prefix blocks that continue that (every prompt stores its exact blocks)."""
        if self.ingest:
            return
        turn, mode, kv, cached = self.turn, "", self.kv, 0
        if turn is not None and turn.resume:
            context = caches.reuser.resume(kv, self.prompt_ids, turn.resume)
            if caches.exact and context.exact == context.tokens and context.tokens % caches.grid:
                kv.truncate(context.tokens - context.tokens % caches.grid)  # the rest from where a prefill would be
            if context.exact < len(kv):  # it holds decoded rows
                self.bitwise = context.exact
            cached = len(kv)
            mode = "program" if cached else ""
            if turn.keep:  # the KV now lives in the sequence: the stored copy would count twice
                caches.reuser.store.delete(turn.resume)
        resumed = len(kv)
        blocks = self.blocks_for(caches)
        attached = blocks.attach(kv, self.prompt_ids, self.tenant) if blocks is not None else None
        found = attached.tokens if attached is not None else 0
        self.matched = attached.matched if attached is not None else 0
        if attached is not None and attached.exact < len(kv) and self.bitwise >= resumed:
            self.bitwise = attached.exact  # the first row read that is not full prefill's own
        self.exact = len(kv)
        # Blocks found need not be stored again: only from the block where the found ones end.
        self.kept = 0 if resumed or blocks is None else found - found % blocks.size
        self.report = ReuseReport(
            mode or ("prefix" if found else ""), reused=cached + found, fidelity=self.read(caches, cached + found)
        )
        again = self.blended_for(caches)
        read = again.attach(kv, self.prompt_ids, self.tenant).tokens if again is not None else 0
        if read and len(kv) <= self.matched:  # no further than the exact blocks went: computed exactly
            kv.truncate(len(kv) - read)
            read = 0
        if read:
            self.blended = read
            note = f"{read} tokens as a blend of the same tokens left them"
            fidelity = caches.fidelity("blend", caches.reuser.blend.ratio, 0)
            self.report = ReuseReport("blend", (note,), self.report.reused + read, fidelity=fidelity)
        self.plan = self.chunks_after_head(caches)

    def chunks_after_head(self, caches: Caches) -> Plan | None:
        """A prompt's plan once its exact head is in the KV. A plain prompt: the chunks after the head
        that a tier holds, reused as documents are (None: no chunk found, or "prefix" asked). A
        program's: its spans, unless chunks cover more of it than spans with a source do (a message
        quoted inside another, a history re-rendered, the tools' message gone)."""
        plan = self.plan
        if plan is not None and (any(plan.documents) or plan.reuse.mode == "full"):
            return plan
        spans = plan is not None and bool(plan.spans)
        reuse = plan.reuse if plan is not None else ReuseMode()
        if reuse.mode == "kvcomm":  # chunks have no anchors: blended
            reuse = ReuseMode("blend", reuse.ratio)
        chunks = self.chunks_for(caches)
        if chunks is None or reuse.mode not in ("naive", "blend") or not caches.reuser.shiftable:
            return plan if spans else None
        head = max(len(self.kv), self.matched)  # what prefix blocks held in place is computed, not blended
        found = chunks.find(self.prompt_ids, head, self.tenant)
        if spans and plan is not None:
            if found.reused <= caches.spans.sourced(plan.pieces, plan.spans, head, plan.scope):
                return plan
        if not any(found.found):
            return None
        note = f"{sum(found.found)} chunks found by content"
        agent = plan.agent if plan is not None else ""
        return Plan(found.pieces, found.found, reuse, chunks.scope(self.tenant), note=note, agent=agent)

    def blocks_for(self, caches: Caches) -> Blocks | None:
        """The prefix blocks the prompt reads and leaves: none for an ingest, nor for a prompt that
        asked for full prefill (the truth that reuse is measured against touches no cache)."""
        full = self.plan is not None and self.plan.reuse.mode == "full"
        return None if self.ingest or full else caches.blocks

    def blended_for(self, caches: Caches) -> Blocks | None:
        """The blocks blended prompts leave, for a plain prompt that may blend chunks (not a program's turn that
        resumes its own context, not documents' (`chunks_for`), not one that asked for prefix or full). A turn
        that resumes nothing (a conversation whose id changes with each step) reads them as any prompt does."""
        plan = self.plan
        if caches.blended is None or self.chunks_for(caches) is None or (self.turn is not None and self.turn.resume):
            return None
        if plan is not None and (plan.spans or plan.reuse.mode not in ("naive", "blend")):
            return None
        return caches.blended

    def chunks_for(self, caches: Caches) -> Chunks | None:
        """The content-defined chunks the prompt reads and leaves: those of a plain prompt or a
        program's; none for documents (kept under their own keys), an ingest or full prefill."""
        plan, chunks = self.plan, caches.chunks
        if chunks is None or self.ingest or plan is None:
            return None if self.ingest else chunks
        documents = any(plan.documents) and plan.scope != chunks.scope(self.tenant)  # not chunks found
        return None if documents or plan.reuse.mode == "full" else chunks

    def read(self, caches: Caches, reused: int) -> Fidelity | None:
        """The fidelity of `reused` tokens' KV read as it was stored (prefix blocks, a program's context)."""
        return caches.read(reused, len(self.kv) - min(self.bitwise, len(self.kv)))

    # ---- the reuse after the head ------------------------------------------------------------

    def reuse_rest(self, caches: Caches) -> Steps[torch.Tensor | None]:
        """Continue the KV of a prompt after its exact head as its plan says, stepwise: documents
        reused (a blend, layer by layer), or shared spans reused (KVCOMM); the first token's
        logits when the whole prompt is done, else None (the rest is prefilled in the usual steps)."""
        plan = self.plan
        head = len(self.kv)
        if plan is None or plan.spans:
            self.planned = True
            if plan is None:
                self.exact = self.exact if self.blended else len(self.prompt_ids)
                return None
            reuse, why = self.choose(caches, plan)
            own = caches.gate.base("kvcomm" if reuse.mode == "kvcomm" else "blend")
            ratio = reuse.ratio if reuse.ratio is not None else own
            self.shared = caches.spans.prefill(
                self.kv, plan.pieces, plan.spans, reuse.mode, plan.agent, plan.scope, ratio
            )
            done = self.shared.prefilled
            # "full": no span reused, the head's report goes on
            mode, notes = (self.report.mode, self.report.notes) if done.mode == "full" else (done.mode, ())
            spans = done.reused > head and done.mode != "full"
            withheld = self.gated is not None and self.gated[1] == FULL
            if not (spans or (withheld and any(s.source is not None for s in self.shared.spans))):
                self.gated = None  # nothing reused, or nothing to reuse: a check would compare dense with dense
            self.exact = head if spans else len(self.prompt_ids)
            self.reused_at = time.monotonic() if spans else None
            key = self.gated[0] if self.gated is not None else "kvcomm"
            fidelity = caches.fidelity(key, ratio, 0) if spans else self.read(caches, done.reused)
            self.report = ReuseReport(mode, said(*notes, done.note, why), done.reused, done.recomputed, fidelity)
            return done.logits
        rest = plan.after(head)
        if self.matched > head:  # documents wholly inside what the blocks matched (cut by the grid): computed
            ends = (head + n for n in itertools.accumulate(len(p) for p in rest.pieces))
            documents = [d and end > self.matched for d, end in zip(rest.documents, ends)]
            rest = replace(rest, documents=documents)
        reuse, why = self.choose(caches, rest) if any(rest.documents) else (ReuseMode("full"), "")
        done = yield from caches.reuser.prefilling(self.kv, rest.pieces, rest.documents, reuse, plan.scope, self.fresh)
        self.planned = True
        blended = done.mode in ("naive", "blend")
        self.reused_at = time.monotonic() if blended else None
        # Else all it reused: the exact head, its report going on
        mode, notes = (done.mode, ()) if blended or not head else (self.report.mode, self.report.notes)
        notes = said(*notes, plan.note, done.note, why)
        self.report = ReuseReport(mode, notes, head + done.reused, done.recomputed, self.report.fidelity)
        if not self.blended:  # else exact up to where a blend's blocks were read, as start() left it
            self.exact = len(self.prompt_ids)
            if blended:  # exact up to the head: a blend computes the tokens before its first document its own way
                self.exact = head
        if done.reused:
            key = self.gated[0] if self.gated is not None else done.mode
            self.report = replace(self.report, fidelity=caches.fidelity(key, done.ratio, sum(rest.documents)))
        return done.logits

    def choose(self, caches: Caches, plan: Plan) -> tuple[ReuseMode, str]:
        """The reuse to run and why (Caches.choose), and the quality check it may be due (`gated`)."""
        program = self.turn is not None
        reuse, why, gated = caches.choose(plan, len(self.kv), len(self.prompt_ids), bool(self.in_context), program)
        if gated is not None:
            self.gated = gated
        return reuse, why

    # ---- what it leaves ----------------------------------------------------------------------

    def settle(self, caches: Caches) -> None:
        """The prompt's KV is complete and its first token out (sampling leaves the prompt's rows
        as they are): what it leaves to store, its exact prefix or its new spans as sources and
        its dense ones as anchors."""
        plan, shared, self.shared = self.plan, self.shared, None
        kv, ids, tenant = self.kv, self.prompt_ids, self.tenant
        try:
            if blocks := self.blocks_for(caches):
                self.kept = blocks.keep(kv, ids[: self.exact], tenant, self.kept, self.bitwise)
            again = self.blended_for(caches)
            if again is not None and self.exact < len(ids) and self.report.reused > self.exact:
                read = self.exact + self.blended if self.blended else 0  # the chain's blocks from its first
                again.keep(kv, ids, tenant, read)
            if chunks := self.chunks_for(caches):
                self.chunked = chunks.keep(kv, ids, tenant)
            if plan is not None and self.in_context:
                caches.reuser.keep_in_context(kv, plan.pieces, plan.documents, self.in_context, plan.scope, caches.cost)
            if shared is not None and plan is not None:
                caches.spans.settle(kv, shared, plan.agent, plan.scope)
        except Exception:  # the answer stands; later prompts compute these again
            log.exception("request %d: storing its prompt's KV failed", self.seq)

    def keep(self, caches: Caches, output_ids: list[int], text: str) -> None:
        """The sequence is over: the blocks of its answer, when its prompt's KV is exact (as vLLM
        keeps full decode blocks; the next turn of a chat begins with them); and a program's turn
        its whole context for the next turn."""
        kv, prompt = self.kv, len(self.prompt_ids)
        all_ids = self.prompt_ids + output_ids
        decoded = min(self.bitwise, prompt)  # the answer's rows were decoded
        blocks = self.blocks_for(caches)
        if blocks is not None and self.exact == prompt:
            try:
                blocks.keep(kv, all_ids, self.tenant, self.kept, decoded)
            except Exception:
                log.exception("request %d: storing its prefix blocks failed", self.seq)
        if chunks := self.chunks_for(caches):  # its answer: a span a later prompt may quote
            try:
                chunks.keep(kv, all_ids, self.tenant, self.chunked, final=True)
            except Exception:
                log.exception("request %d: storing its chunks failed", self.seq)
        turn = self.turn
        if turn is None or not turn.keep:
            return
        until = time.monotonic() + turn.pin_s if turn.pin_s > 0 else None
        try:
            caches.reuser.keep(kv, all_ids, turn.keep, caches.cost(len(kv)), until, decoded)
            plan = self.plan
            if plan is not None and plan.spans:  # its answer: a span other agents may read
                caches.spans.wrote(kv, prompt, output_ids, text, plan.agent, plan.scope)
        except Exception:  # the answer stands; the next turn computes its prompt again
            log.exception("request %d: keeping its context failed", self.seq)
