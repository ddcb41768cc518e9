"""Content-addressed document KV on storage tiers: memory now; disk, Redis and LMCache plug in as Tiers."""

from chunk_cache.config import ChunkCacheConfig
from chunk_cache.entry import ChunkKV, CorruptEntry
from chunk_cache.key import chunk_key, fingerprint
from chunk_cache.memory import MemoryTier
from chunk_cache.store import ChunkStore
from chunk_cache.tier import Tier, make_tier, register_tier, tier_names

__all__ = [
    "ChunkCacheConfig",
    "ChunkKV",
    "ChunkStore",
    "CorruptEntry",
    "MemoryTier",
    "Tier",
    "chunk_key",
    "fingerprint",
    "make_tier",
    "register_tier",
    "tier_names",
]
