"""The one object the runtime talks to: an ordered stack of tiers behaving as one cache."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from chunk_cache.config import ChunkCacheConfig
from chunk_cache.entry import ChunkKV
from chunk_cache.tier import Tier, make_tier


class ChunkStore:
    """Reads search tiers in order and promote a lower hit to the first tier; writes go to the
    first tier that accepts; each tier's evictions demote to the next one down."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        if not tiers:
            raise ValueError("a chunk store needs at least one tier")
        self.tiers = list(tiers)
        for upper, lower in zip(self.tiers, self.tiers[1:]):
            upper.on_evict = lower.put
        self._lock = threading.Lock()
        self._hits = self._misses = self._promotions = 0

    @classmethod
    def from_config(cls, config: ChunkCacheConfig | None = None) -> ChunkStore:
        config = config or ChunkCacheConfig()
        return cls([make_tier(name, **config.tier_options(name)) for name in config.tiers])

    def get(self, key: str) -> ChunkKV | None:
        for i, tier in enumerate(self.tiers):
            entry = tier.get(key)
            if entry is None:
                continue
            promoted = i > 0 and self.tiers[0].put(entry)
            with self._lock:
                self._hits += 1
                self._promotions += promoted
            return entry
        with self._lock:
            self._misses += 1
        return None

    def put(self, entry: ChunkKV) -> bool:
        return any(tier.put(entry) for tier in self.tiers)

    def delete(self, key: str) -> bool:
        return sum(tier.delete(key) for tier in self.tiers) > 0

    def __contains__(self, key: object) -> bool:
        return any(key in tier for tier in self.tiers)

    def pin(self, key: str, until: float) -> bool:
        """Pin `key` in the fastest tier that holds it and can pin (`until` on that tier's clock)."""
        return any(tier.pin(key, until) for tier in self.tiers)

    def unpin(self, key: str) -> bool:
        return sum(tier.unpin(key) for tier in self.tiers) > 0

    def stats(self) -> dict[str, object]:
        with self._lock:
            counts = {"hits": self._hits, "misses": self._misses, "promotions": self._promotions}
        return {**counts, "tiers": [{"tier": tier.name, **tier.stats()} for tier in self.tiers]}
