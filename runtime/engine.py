"""The engine: a thread that steps the model over every live request, and the ways in."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import Future

import torch

from kvgate.agents.anchors import AnchorPool
from kvgate.agents.flight import Flight
from kvgate.chunk_cache import ChunkStore
from kvgate.runtime.calibration import find as find_calibration
from kvgate.runtime.calibration import model_fingerprint
from kvgate.runtime.config import EngineConfig
from kvgate.runtime.decode import Batches
from kvgate.runtime.errors import EngineError
from kvgate.runtime.grammar import Grammars
from kvgate.runtime.invariance import invariant, row_floor
from kvgate.runtime.kv import KVCache, Pool
from kvgate.runtime.loader import LoadedModel, load
from kvgate.runtime.model import Run, forward, grid_of
from kvgate.runtime.outbox import Outbox
from kvgate.runtime.planner import Planner
from kvgate.runtime.quality import QualityGate, Standing
from kvgate.runtime.request import Output, Plan, Request, Result, check_fits
from kvgate.runtime.sampling import SamplingParams, choose, logprob_of, penalise, preselect
from kvgate.runtime.scheduler import Scheduler
from kvgate.runtime.sequence import Sequence
from kvgate.runtime.shadow import Shadow
from kvgate.runtime.spans import Spans
from kvgate.runtime.threads import Teams, claim, hand_over, switchable
from kvgate.runtime.timing import StepTimes
from kvgate.runtime.weights import decoder_of
from kvgate.runtime.wiring import make_caches, make_reuser

log = logging.getLogger("kvgate.engine")


Callback = Callable[[Output | BaseException], None]


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """Load (unless `loaded`) and measure on the engine's own thread, the one that computes from then on on
        `config.threads` cores; the calling thread computes on one from now on (runtime/threads.py)."""
        self.config = config
        hand_over()
        ready: Future = Future()
        self.thread = threading.Thread(target=self.run, args=(loaded, ready), name="kvgate-engine", daemon=True)
        self.thread.start()
        ready.result()

    def run(self, loaded: LoadedModel | None, ready: Future) -> None:
        try:
            claim(self.config.threads)
            self.setup(loaded)
        except BaseException as exc:
            ready.set_exception(exc)
            return
        ready.set_result(None)
        self.loop()

    def setup(self, loaded: LoadedModel | None) -> None:
        c = self.config
        self.loaded = loaded or load(c)
        self.model, self.tokenizer = self.loaded.model, self.loaded.tokenizer
        self.name, self.dtype = self.loaded.name, str(self.model.dtype).removeprefix("torch.")
        mc = self.model.config
        self.max_model_len = c.max_model_len or mc.max_position_embeddings
        first = decoder_of(self.model).layers[0]
        self.kv_shape = (mc.num_hidden_layers, first.kv_heads, first.head_dim)
        self.model_fp = model_fingerprint(self.loaded)
        row_floor(self.model, c.cache_dir)  # measured once per machine; every step is padded to it
        budget = max(c.max_num_batched_tokens, c.max_num_seqs)
        # Prompt chunks stop at multiples of the model's grid, so that a prompt's KV is the same however it is
        # split; a budget below that, or GEMMs that are not row-invariant, leave no reuse exact (runtime/caching.py).
        aligned = grid_of(self.model)
        grid = aligned if budget >= aligned else 1
        self.exact = grid == aligned and invariant(self.model)
        self.calibration = find_calibration(c.cache_dir, self.model_fp, c.shipped_calibration, c.blend_select)
        self.reuser = make_reuser(c, self.model, self.tokenizer, self.model_fp, self.calibration)
        self.grammars = Grammars(self.tokenizer, self.loaded.eos_token_ids)
        self.times, self.teams = StepTimes(), Teams(torch.get_num_threads() if switchable() else 1)
        self.anchors = AnchorPool(c.anchors) if c.anchors is not None else None
        self.spans = Spans(self.reuser, self.anchors, cost=self.prefill_s)
        self.gate = QualityGate(c.quality, {"blend": self.reuser.blend.ratio, "kvcomm": c.kvcomm_ratio})
        self.shadow = Shadow(self.gate, self.reuser, self.spans)
        self.caches = make_caches(
            c, self.reuser, self.spans, self.gate, self.calibration, self.prefill_s, self.exact, grid
        )
        # Programs in flight: counted by the gateway's agent programs, held at the scheduler's door when on.
        self.flight = Flight(self.reuser.store.memory_bytes, c.in_flight, c.in_flight_linger_s)
        gate = self.flight if c.in_flight > 0 else None
        self.scheduler = Scheduler(c.max_num_seqs, budget, c.queue_order, gate=gate, grid=grid)
        self.pool = Pool()  # the blocks of every sequence's KV, handed back on release (only on the engine thread)
        self.batches = Batches(paged=c.decode_batch == "paged")  # the last decode step's batch, kept for the next
        self.outbox = Outbox()  # outputs to clients, handed over once a step
        self.callbacks: dict[int, Callback] = {}
        self.settling: list[Sequence] = []  # prompts whose first token this step made: their KV to store
        self.inbox: list[tuple[Sequence | int | Future, Callback | None]] = []
        self.lock, self.wake = threading.Lock(), threading.Event()
        self.stopped, self.steps = False, 0

    # ---- the ways in (any thread) -------------------------------------------------------

    def check(self, prompt_tokens: int, max_tokens: int | None) -> None:
        """Raise InvalidPrompt for a prompt the engine cannot take (PromptTooLong for the context window)."""
        check_fits(prompt_tokens, max_tokens, self.max_model_len)

    def submit(self, request: Request, callback: Callback) -> int:
        params = request.params
        self.check(len(request.prompt_ids), params.max_tokens)
        kv = KVCache(*self.kv_shape, self.model.dtype, self.config.device, self.max_model_len, self.pool)
        matcher = self.grammars.matcher(params.grammar) if params.grammar is not None else None
        seq = Sequence.of(request, kv, self.loaded.eos_token_ids, self.max_model_len, matcher)
        with self.lock:
            self.inbox.append((seq, callback))
        self.wake.set()
        return seq.id

    def abort(self, seq_id: int) -> None:
        with self.lock:
            self.inbox.append((seq_id, None))
        self.wake.set()

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the engine thread between two steps (the model is never used by two threads)."""
        future: Future = Future()
        with self.lock:
            self.inbox.append((future, fn))
        self.wake.set()
        return future

    async def generate(self, request: Request) -> AsyncIterator[Output]:
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[Output | BaseException] = asyncio.Queue()

        def put(item: Output | BaseException) -> None:  # on the engine's thread
            self.outbox.post(loop, outputs.put_nowait, item)

        seq_id = self.submit(request, put)
        done = False
        try:
            while not done:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    done = True
                    raise out
                done = out.finish_reason is not None
                yield out
        finally:
            if not done:  # the caller went away: free the slot and the KV
                self.abort(seq_id)

    async def ingest(self, token_ids: list[int], scope: str = "", tenant: str = "") -> int:
        """Compute and keep a document's KV unless a tier holds it, in chunks between other
        sequences' steps; the tokens found already stored (0: computed now)."""
        plan = Plan([list(token_ids)], [True], scope=scope)
        cached = 0
        request = Request(token_ids, SamplingParams(max_tokens=1), plan, tenant=tenant, ingest=True)
        async for out in self.generate(request):
            cached = out.report.reused
        return cached

    def generate_sync(self, prompt_ids: list[int], params: SamplingParams, plan: Plan | None = None) -> Result:
        """generate() to the end, for a caller without an event loop."""

        async def gather() -> Result:
            result = Result()
            async for out in self.generate(Request(prompt_ids, params, plan)):
                result.add(out)
            return result

        return asyncio.run(gather())

    def shutdown(self) -> None:
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=10)
        self.reuser.store.close()  # writes still queued for lower tiers land first

    @property
    def load_stats(self) -> dict[str, int]:
        s = self.scheduler
        return {"waiting": len(s.waiting) + len(s.held), "running": len(s.running)}

    def prefill_s(self, tokens: int) -> float:
        """Seconds to prefill `tokens`, as measured so far."""
        return self.times.prefill_s(tokens)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * torch.Size(self.kv_shape).numel() * self.model.dtype.itemsize  # K and V, every layer

    # ---- what the gateway, the agents and the cost model read of its parts -------------------

    def alive(self) -> bool:
        return self.thread.is_alive()

    @property
    def store(self) -> ChunkStore:
        """The tiers every reused KV lives in (agent programs pin their contexts there)."""
        return self.reuser.store

    def planner(self) -> Planner:
        """A planner of prompts over this engine's documents."""
        return Planner(self.reuser, kvcomm=self.anchors is not None)

    def compile(self, lark: str) -> str:
        """A grammar checked against the model's tokenizer, on any thread (GrammarError when unusable)."""
        return self.grammars.compile(lark)

    def standing(self) -> Standing:
        """Where blends' recompute ratio comes from (Caches.standing)."""
        return self.caches.standing()

    def checks(self) -> tuple[Iterable[tuple[str, dict[str, float]]], int, int]:
        """The quality gate's shadow checks per mode, how many came due, and how many of those were dropped."""
        return self.gate.stats(), self.gate.due_count, self.gate.dropped

    def anchor_stats(self) -> dict[str, int] | None:
        """KVCOMM's anchor pool's counts; None without KVCOMM."""
        return self.anchors.stats() if self.anchors is not None else None

    def queue_s(self) -> float:
        """Seconds to prefill the waiting prompts a pinned program's turn is admitted ahead of."""
        return self.prefill_s(self.scheduler.passable_tokens)

    # ---- the engine thread ---------------------------------------------------------------

    def loop(self) -> None:
        while not self.stopped:
            self.wake.clear()
            self.drain_inbox()
            if self.scheduler:
                start = time.perf_counter()
                self.step()
                self.shadow.busy_for(time.perf_counter() - start)  # a part of a check, on its share of the time
            elif self.shadow.busy:  # spare capacity: one part of a quality check, then look again
                self.shadow.step()
            else:
                self.outbox.flush()
                self.wake.wait()
            self.outbox.flush()
            self.settle()

    def settle(self) -> None:
        """Store what the prompts whose first token just went out leave, once the step's outputs are on their way:
        the copies and write-behind of their KV are not in their time to first token."""
        settling, self.settling = self.settling, []
        for seq in settling:
            if seq.id in self.callbacks:
                seq.prompt.settle(self.caches)

    def drain_inbox(self) -> None:
        with self.lock:
            inbox, self.inbox = self.inbox, []
        for item, callback in inbox:
            if isinstance(item, Sequence):
                self.callbacks[item.id] = callback
                self.scheduler.add(item)
            elif isinstance(item, Future):
                if item.set_running_or_notify_cancel():
                    try:
                        item.set_result(callback())
                    except Exception as exc:
                        item.set_exception(exc)
            else:
                seq = next((s for s in list(self.scheduler) if s.id == item), None)
                if seq is not None:
                    self.finish(seq)

    def finish(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self.callbacks.pop(seq.id, None)
        self.shadow.ended(seq.id)
        seq.kv.release()  # what it left to later prompts is stored by now

    def step(self) -> None:
        batch: list[tuple[Sequence, Run]] = []
        for seq, tokens in self.scheduler.schedule():
            try:  # reuse first: the exact head, the documents lacking, the reuse; then the rest computed
                run = Run(seq.kv, tokens, seq.computed) if seq.prompt.planned else self.prepare(seq, len(tokens))
            except Exception as exc:
                self.fail(seq, exc)
                continue
            if run is not None:
                batch.append((seq, run))
        if not batch:
            return
        rider = self.shadow.ride()  # a quality check's rows, computed in this step on the checks' budget
        runs = [run for _, run in batch] + ([rider] if rider else [])
        pad = self.config.deterministic or rider is not None or any(seq.prefilling for seq, _ in batch)
        start = time.perf_counter()
        try:
            with self.teams.sized(None if pad else len(runs)):  # a padded step: all the threads, its rows as measured
                logits = forward(self.model, runs, pad=pad, batches=self.batches)
        except Exception as exc:  # a failed step ends its requests, never the engine
            for seq, _ in batch:
                self.fail(seq, exc)
            if rider:
                self.shadow.abandon()
            return
        self.steps += 1
        self.times.measured(sum(len(run.token_ids) for run in runs), time.perf_counter() - start)
        if rider:
            self.shadow.rode(logits[-1], self.times.added_s(len(rider.token_ids)))
        held = [seq for seq, run in batch if seq.matcher is not None and run.kv is seq.kv and not seq.prefilling]
        allowed = self.allowed(held, logits.shape[-1])
        free = [(seq.params, seq.matcher is None and seq.generator is None) for seq, _ in batch]
        best = preselect(logits, free)  # what can be chosen together: greedy rows, unseeded draws (sampling.py)
        for (seq, run), row, top in zip(batch, logits, best):
            if run.kv is not seq.kv:  # a chunk of a document the prompt lacks
                try:
                    seq.prompt.ran(self.caches)
                except Exception as exc:
                    self.fail(seq, exc)
                continue
            if seq.prefilling:
                continue
            try:
                self.sample(seq, row, allowed.get(seq.id), top)
            except Exception as exc:  # e.g. a NaN distribution: only this sequence ends
                self.fail(seq, exc)

    def prepare(self, seq: Sequence, budget: int) -> Run | None:
        """Advance a sequence's reuse by about `budget` tokens of work (PromptKV.next): this step's run for it,
        if any; a prompt whose reuse covered it whole gets its first token, an ingest whose documents are stored
        its end."""
        got = seq.prompt.next(self.caches, budget, self.scheduler.grid)
        if isinstance(got, torch.Tensor):
            self.sample(seq, got)
            return None
        if got is None and seq.ingest:  # its documents are stored, their tokens remembered to find them by id
            seq.stop()
            callback = self.callbacks[seq.id]
            self.finish(seq)
            if (out := seq.take_output()) is not None:
                self.deliver(seq, callback, out)
        return got

    def allowed(self, held: list[Sequence], width: int) -> dict[int, torch.Tensor]:
        """The tokens each constrained sequence may take next, its masks filled in parallel."""
        masks = self.grammars.masks([seq.matcher for seq in held], width, self.model.device) if held else []
        return {seq.id: mask for seq, mask in zip(held, masks)}

    def sample(
        self, seq: Sequence, logits: torch.Tensor, allowed: torch.Tensor | None = None, best: int | None = None
    ) -> None:
        """`best`: the logits' argmax, when known."""
        params = seq.params
        self.shadow.served(seq, logits)  # a check due of the first token, and of the answer's leading ones
        chosen = penalise(logits, params, seq.output_ids)
        if seq.matcher is not None:
            if allowed is None:
                allowed = self.allowed([seq], logits.shape[-1])[seq.id]
            chosen = self.grammars.restrict(seq.matcher, chosen, allowed)
        token = choose(chosen, params, seq.generator, best if chosen is logits else None)  # unless moved
        if seq.matcher is not None and token not in seq.eos_ids:
            self.grammars.consume(seq.matcher, token)
        logprob = logprob_of(logits, token, params.logprobs) if params.logprobs is not None else None
        seq.add(token, logprob, self.tokenizer)
        if seq.matcher is not None and seq.matcher.is_stopped():
            seq.stop()  # the grammar is complete: nothing may follow
        first = len(seq.output_ids) == 1  # the prompt's KV is whole (sampling leaves it as it is)
        callback = self.callbacks[seq.id]
        if seq.finish_reason is not None:
            if first:
                seq.prompt.settle(self.caches)
            seq.prompt.keep(self.caches, seq.output_ids, seq.text)
            self.finish(seq)
        out = seq.take_output()
        if out is not None:
            self.deliver(seq, callback, out)
        if first and seq.id in self.callbacks:  # what the prompt leaves: stored once its first token is out
            self.settling.append(seq)

    def fail(self, seq: Sequence, exc: Exception) -> None:
        log.exception("request %d failed", seq.id, exc_info=exc)
        callback = self.callbacks.get(seq.id)
        self.finish(seq)
        if callback is not None:
            self.deliver(seq, callback, EngineError(f"generation failed: {type(exc).__name__}: {exc}"))

    def deliver(self, seq: Sequence, callback: Callback, item: Output | BaseException) -> None:
        """Hand an output to its client. A client that cannot take it (its event loop is gone)
        loses its sequence; the other sequences of the batch carry on."""
        try:
            callback(item)
        except Exception:
            log.warning("request %d: its client is gone; aborting it", seq.id)
            self.finish(seq)
