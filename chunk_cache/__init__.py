"""Content-addressed document KV on storage tiers: memory, disk, Redis, LMCache."""

from chunk_cache.byte_tier import ByteTier, TierUnavailable
from chunk_cache.config import ChunkCacheConfig
from chunk_cache.disk import DiskTier
from chunk_cache.entry import ChunkKV, CorruptEntry, Header
from chunk_cache.key import chunk_key, fingerprint
from chunk_cache.loading import LoadFailed, Loading
from chunk_cache.memory import MemoryTier
from chunk_cache.store import ChunkStore
from chunk_cache.tier import Tier, make_tier, register_tier, tier_names

__all__ = [
    "ByteTier",
    "DiskTier",
    "Header",
    "LoadFailed",
    "Loading",
    "TierUnavailable",
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
