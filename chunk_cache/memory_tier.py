"""The first tier: entries held in process (host or device) memory, evicted by value.

value = recent hits x recompute cost / bytes, where "recent hits" is a hit count that halves
every `half_life_s` (a put counts as the first use). Between accesses every entry's value
decays by the same factor, so the eviction order is a time-independent priority:
    log2(uses) + log2(cost) - log2(bytes) + touched / half_life
which is what `_priority` computes (logs keep it finite for any clock value).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvgate.chunk_cache.entry import ChunkKV
from kvgate.chunk_cache.tier import Tier, register_tier

log = logging.getLogger(__name__)

RESIDENCE_WEIGHT = 1 / 16  # of each eviction in the running mean of the age at eviction


@dataclass
class _Slot:
    entry: ChunkKV
    uses: float  # decayed use count as of `touched`
    touched: float
    pinned_until: float = -math.inf

    def use(self, now: float, half_life_s: float) -> None:
        self.uses = self.uses * 0.5 ** ((now - self.touched) / half_life_s) + 1.0
        self.touched = now

    def hold(self, entry: ChunkKV) -> None:
        self.entry = entry

    def pin(self, until: float) -> None:
        self.pinned_until = until


@register_tier("memory")
class MemoryTier(Tier):
    def __init__(
        self,
        budget_bytes: int,
        half_life_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        device: str | torch.device | None = None,
        policy: str = "value",
    ) -> None:
        """device: where held entries live (None: wherever they were put from). policy: "value",
        or "lru" (least recently used first; the baseline value is measured against)."""
        super().__init__()
        if budget_bytes < 0 or not half_life_s > 0:
            raise ValueError(f"need budget_bytes >= 0 and half_life_s > 0, got {budget_bytes}, {half_life_s}")
        if policy not in ("value", "lru"):
            raise ValueError(f"unknown eviction policy {policy!r}; one of value, lru")
        self.policy = policy
        self.budget_bytes, self.half_life_s, self.clock, self.device = budget_bytes, half_life_s, clock, device
        self._slots: dict[str, _Slot] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._hits = self._misses = self._puts = self._refused = self._evictions = 0
        # Idle age of the unpinned entries evicted lately (a running mean), and when the last went.
        self._residence, self._evicted_at = math.inf, -math.inf

    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def budget(self) -> int:
        return self.budget_bytes

    def get(self, key: str) -> ChunkKV | None:
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                self._misses += 1
                return None
            self._hits += 1
            self._use(slot, self.clock())
            return slot.entry

    def put(self, entry: ChunkKV) -> bool:
        return self._put(entry, None)

    def put_pinned(self, entry: ChunkKV, until: float) -> bool:
        """Store and pin in one step. A pin is never evicted before it ends, by a pinned entry or
        not: when only pins hold the room it needs, the entry is refused."""
        return self._put(entry, until)

    def _put(self, entry: ChunkKV, until: float | None) -> bool:
        if self.device is not None:
            entry = entry.to(self.device)  # a copy to device is slow: keep it outside the lock
        size = entry.nbytes
        with self._lock:
            now = self.clock()
            old = self._slots.get(entry.key)
            victims = self._victims(entry.key, self._bytes - (old.entry.nbytes if old else 0) + size, now)
            if victims is None:
                self._refused += 1
                return False
            for victim in victims:
                self._remove(victim.entry.key)
                self._evictions += 1
                self._evicted(now - victim.touched, now)
            if old is not None:
                self._remove(entry.key)
                self._use(old, now)
                old.hold(entry)
                slot = old
            else:
                slot = _Slot(entry, 1.0, now)
            if until is not None:
                slot.pin(until)
            self._slots[entry.key] = slot
            self._bytes += size
            self._puts += 1
        self._demote(victims)
        return True

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._remove(key) is not None

    def take(self, key: str) -> ChunkKV | None:
        with self._lock:
            slot = self._remove(key)
        return slot.entry if slot else None

    def pin(self, key: str, until: float) -> bool:
        """Never evict `key` while clock() < until (a later pin replaces an earlier one)."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None:
                slot.pin(until)
            return slot is not None

    def unpin(self, key: str) -> bool:
        return self.pin(key, -math.inf)

    def residence_s(self, horizon_s: float = math.inf) -> float:
        """How long memory keeps an unpinned entry after its last use, lately: the mean idle age of
        those it evicted; inf when it evicted none within `horizon_s`."""
        with self._lock:
            return self._residence if self.clock() - self._evicted_at <= horizon_s else math.inf

    def value(self, key: str) -> float | None:
        """The entry's current eviction value (decayed uses x cost / bytes); None if absent."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                return None
            decay = 0.5 ** ((self.clock() - slot.touched) / self.half_life_s)
            return slot.uses * decay * slot.entry.cost / max(slot.entry.nbytes, 1)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._slots

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._slots)

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            now = self.clock()
            return {
                "hits": self._hits,
                "misses": self._misses,
                "puts": self._puts,
                "refused": self._refused,
                "evictions": self._evictions,
                "entries": len(self._slots),
                "pinned": sum(s.pinned_until > now for s in self._slots.values()),
                "bytes": self._bytes,
                "budget_bytes": self.budget_bytes,
            }

    def _use(self, slot: _Slot, now: float) -> None:
        slot.use(now, self.half_life_s)

    def _evicted(self, age: float, now: float) -> None:
        first = math.isinf(self._residence)
        self._residence = age if first else self._residence + RESIDENCE_WEIGHT * (age - self._residence)
        self._evicted_at = now

    def _priority(self, slot: _Slot) -> float:
        if self.policy == "lru":
            return slot.touched
        # Zero cost still orders entries by uses, bytes and recency.
        cost, size = max(slot.entry.cost, 1e-30), max(slot.entry.nbytes, 1)
        return math.log2(slot.uses) + math.log2(cost) - math.log2(size) + slot.touched / self.half_life_s

    def _victims(self, key: str, needed: int, now: float) -> list[_Slot] | None:
        """The entries whose removal brings `needed` bytes within budget, None if impossible: the
        lowest-value unpinned ones."""
        excess = needed - self.budget_bytes
        if excess <= 0:
            return []
        others = (s for k, s in self._slots.items() if k != key)
        candidates = sorted((s for s in others if s.pinned_until <= now), key=self._priority)
        if sum(s.entry.nbytes for s in candidates) < excess:
            return None
        victims = []
        for slot in candidates:
            victims.append(slot)
            excess -= slot.entry.nbytes
            if excess <= 0:
                break
        return victims

    def _remove(self, key: str) -> _Slot | None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._bytes -= slot.entry.nbytes
        return slot

    def _demote(self, victims: list[_Slot]) -> None:
        if self.on_evict is None:
            return
        for victim in victims:
            try:
                self.on_evict(victim.entry)
            except Exception:
                # A failing lower tier loses the entry; it must not fail the put that evicted it.
                log.exception("demoting chunk %s failed", victim.entry.key)
