"""Content-addressed document KV on storage tiers: memory, disk, Redis, LMCache."""

from kvgate.chunk_cache.byte_tier import ByteTier, TierUnavailable
from kvgate.chunk_cache.config import ChunkCacheConfig
from kvgate.chunk_cache.disk import DiskTier
from kvgate.chunk_cache.entry import ChunkKV, CorruptEntry, Header
from kvgate.chunk_cache.key import chunk_key, fingerprint
from kvgate.chunk_cache.loading import LoadFailed, Loading
from kvgate.chunk_cache.memory import MemoryTier
from kvgate.chunk_cache.store import ChunkStore
from kvgate.chunk_cache.tier import Tier, make_tier, register_tier, tier_names

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
