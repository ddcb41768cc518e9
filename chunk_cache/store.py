"""The one object the runtime talks to: an ordered stack of tiers behaving as one cache.

Reads search the tiers in order; a hit in a lower tier is read layer by layer in the background
(`fetch` hands back a `Loading` at once) and promoted to the first tier once whole. Writes go to
the first tier now and to every lower tier behind the request, in a writer thread; each tier's
evictions demote to the next one down the same way. `settle` waits (a bounded time) until an
entry's writes have landed, and says which tier holds it: one that outlives the process, if any.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from kvgate.chunk_cache.byte_tier import ByteTier
from kvgate.chunk_cache.config import ChunkCacheConfig
from kvgate.chunk_cache.entry import ChunkKV
from kvgate.chunk_cache.loading import LoadFailed, Loading
from kvgate.chunk_cache.reads import counted
from kvgate.chunk_cache.tier import Tier, make_tier

log = logging.getLogger(__name__)

SETTLE_S = 30.0  # the longest `settle` waits for an entry's writes (behind the other writes queued)


class ChunkStore:
    def __init__(self, tiers: Sequence[Tier], write_queue: int = 64) -> None:
        if not tiers:
            raise ValueError("a chunk store needs at least one tier")
        self.tiers = list(tiers)
        for i, upper in enumerate(self.tiers[:-1]):
            upper.demote_to(lambda entry, below=i + 1: self._enqueue(entry, below))
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("hits", "misses", "promotions", "writes_dropped"), 0)
        self._loads = ThreadPoolExecutor(2, thread_name_prefix="kvgate-chunk-load")
        self._reading: set[Future[None]] = set()  # loads not finished: their promotion is a write too
        # Bounded: a queued write holds its entry in memory; past the bound, writes are dropped.
        self._writes: queue.Queue[tuple[ChunkKV, int, int] | None] = queue.Queue(write_queue)
        # A delete must win over the writes queued before it: each write and each delete takes a number,
        # and a write older than its key's last delete is dropped (the map is emptied with the queue).
        self._order = itertools.count()
        self._deleted: dict[str, int] = {}
        self._writing = threading.Lock()  # held while one write lands, and while a delete runs
        self._pending: dict[str, int] = {}  # key -> its writes queued or landing
        self._landed = threading.Condition()
        self._writer = threading.Thread(target=self._write_behind, name="kvgate-chunk-write", daemon=True)
        self._writer.start()

    @classmethod
    def from_config(cls, config: ChunkCacheConfig | None = None) -> ChunkStore:
        config = config or ChunkCacheConfig()
        return cls([make_tier(name, **config.tier_options(name)) for name in config.tiers])

    def fetch(self, key: str, model: str | None = None) -> ChunkKV | Loading | None:
        """The entry, or a Loading that is reading it from a lower tier; None on a miss everywhere.
        `model`: an entry computed by another model is damaged, not a hit."""
        for i, tier in enumerate(self.tiers):
            if isinstance(tier, ByteTier):
                opened = tier.open(key, model)
                if opened is None:
                    continue
                self._count("hits")
                loading = Loading(tier, *opened, self._loads, done=self._promote if i > 0 else None)
                counted(tier.name, loading.kv.nbytes)
                self._track(loading.finished)
                return loading
            entry = tier.get(key)
            if entry is not None and (model is None or entry.model == model):
                self._count("hits")
                counted(tier.name, entry.nbytes)
                if i > 0:
                    self._promote(entry)
                return entry
        self._count("misses")
        return None

    def get(self, key: str, model: str | None = None) -> ChunkKV | None:
        found = self.fetch(key, model)
        if isinstance(found, Loading):
            try:
                return found.result()
            except LoadFailed:
                return None
        return found

    def put(self, entry: ChunkKV, until: float | None = None) -> bool:
        """Into the first tier that takes it now; into every tier below it in the background.
        `until`: pin it in the first tier until then (on that tier's clock)."""
        for i, tier in enumerate(self.tiers):
            taken = tier.put(entry) if until is None or i else tier.put_pinned(entry, until)
            if taken:
                if i + 1 < len(self.tiers):
                    self._enqueue(entry, i + 1)
                return True
        return False

    def delete(self, key: str) -> bool:
        """Gone from every tier; a write of it still queued does not bring it back."""
        with self._writing:
            self._deleted[key] = next(self._order)
            return sum(tier.delete(key) for tier in self.tiers) > 0

    def __contains__(self, key: object) -> bool:
        return any(key in tier for tier in self.tiers)

    def resident(self, key: str) -> bool:
        """Whether `key` is in memory (the first tier): read without a load."""
        return key in self.tiers[0]

    @property
    def memory_bytes(self) -> int:
        return self.tiers[0].budget

    @property
    def tiered(self) -> bool:
        """Whether a tier below memory keeps what memory evicts."""
        return len(self.tiers) > 1

    def residence_s(self, horizon_s: float) -> float:
        """How long memory keeps an unpinned entry after its last use, lately (inf: it evicted none within
        `horizon_s`)."""
        return self.tiers[0].residence_s(horizon_s)

    def where(self, key: str) -> Tier | None:
        """The tier that holds `key`: the lowest durable one that does, else the first that does."""
        holding = [tier for tier in self.tiers if key in tier]
        durable = [tier for tier in holding if tier.durable]
        return durable[-1] if durable else holding[0] if holding else None

    def settle(self, key: str, timeout_s: float = SETTLE_S) -> Tier | None:
        """Wait until the writes of `key` queued so far have landed (at most `timeout_s`), then say
        where it is. A write dropped or refused is not waited for: the answer is then where it is."""
        with self._landed:
            self._landed.wait_for(lambda: key not in self._pending, timeout_s)
        return self.where(key)

    def pin(self, key: str, until: float) -> bool:
        """Pin `key` in the fastest tier that holds it and can pin (`until` on that tier's clock)."""
        return any(tier.pin(key, until) for tier in self.tiers)

    def unpin(self, key: str) -> bool:
        return sum(tier.unpin(key) for tier in self.tiers) > 0

    def demote(self, key: str) -> bool:
        """Move an entry out of the first tier into the ones below (its pin is over, and memory is
        for what comes next); with no tier below, it only loses its pin."""
        if len(self.tiers) == 1:
            return self.tiers[0].unpin(key)
        entry = self.tiers[0].get(key)
        if entry is None:
            return False
        # Below first, then out of memory: a reader in between finds it in one tier or the other.
        with self._writing:
            if key not in self._deleted:
                for tier in self.tiers[1:]:
                    if key not in tier:
                        tier.put(entry)
        return self.tiers[0].take(key) is not None

    def flush(self) -> None:
        """Wait until every write queued so far has reached its tiers, promotions of loads begun so far too."""
        with self._lock:
            reading = list(self._reading)
        wait(reading)  # first: a promotion can evict, which queues a write
        self._writes.join()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counts = dict(self._counts)
        return {**counts, "tiers": [{"tier": tier.name, **tier.stats()} for tier in self.tiers]}

    def close(self) -> None:
        self.flush()
        self._writes.put(None)
        self._writer.join()
        self._loads.shutdown(wait=True)
        for tier in self.tiers:
            tier.close()

    def _count(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1

    def _track(self, load: Future[None]) -> None:
        with self._lock:
            self._reading.add(load)
        load.add_done_callback(self._untrack)  # runs at once if the load has finished already

    def _untrack(self, load: Future[None]) -> None:
        with self._lock:
            self._reading.discard(load)

    def _promote(self, entry: ChunkKV) -> None:
        if self.tiers[0].put(entry):
            self._count("promotions")

    def _enqueue(self, entry: ChunkKV, below: int) -> None:
        self._pend(entry.key, 1)
        try:
            self._writes.put_nowait((entry, below, next(self._order)))
        except queue.Full:
            self._pend(entry.key, -1)
            self._count("writes_dropped")

    def _pend(self, key: str, n: int) -> None:
        with self._landed:
            left = self._pending.get(key, 0) + n
            if left:
                self._pending[key] = left
            else:
                del self._pending[key]
                self._landed.notify_all()

    def _write_behind(self) -> None:
        # The lowest CPU priority: serializing and writing a prompt's KV (~130 MB for a 2.8k-token float32 prompt
        # of the default model) never takes a core from the engine's next prefill or decode steps, only idle time.
        if sys.platform == "linux":  # per thread there (elsewhere the call would renice the whole process)
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except OSError:
                pass
        while (job := self._writes.get()) is not None:
            entry, below, order = job
            try:
                with self._writing:
                    if self._deleted.get(entry.key, -1) < order:
                        for tier in self.tiers[below:]:
                            if entry.key not in tier:
                                tier.put(entry)
                    if self._writes.empty():
                        self._deleted.clear()
            except Exception:
                log.exception("writing chunk %s behind failed", entry.key)
            finally:
                self._pend(entry.key, -1)
                self._writes.task_done()
        self._writes.task_done()
