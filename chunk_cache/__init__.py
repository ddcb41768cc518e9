"""Content-addressed document KV on storage tiers: memory, disk, Redis, LMCache."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ByteTier": ".byte_tier",
    "ChunkCacheConfig": ".config",
    "ChunkKV": ".entry",
    "ChunkStore": ".store",
    "CorruptEntry": ".entry",
    "DiskTier": ".disk_tier",
    "Header": ".entry",
    "LoadFailed": ".loading",
    "Loading": ".loading",
    "MemoryTier": ".memory_tier",
    "Reads": ".reads",
    "Tier": ".tier",
    "TierUnavailable": ".byte_tier",
    "chunk_key": ".key",
    "fingerprint": ".key",
    "make_tier": ".tier",
    "reading": ".reads",
    "register_tier": ".tier",
    "tier_names": ".tier",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    """Names load on first use, so that a light process (a proxy front) imports no torch through here."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
