"""The chunk cache's configuration: which tiers, in order, and each one's options."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def user_cache_dir() -> Path:
    """The user's cache (the XDG rule, as every tool reads it): the configs' default. The gateway's Settings,
    the one reader of kvgate's own variables, put KVGATE_CACHE_DIR in its place."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvgate"


def default_disk_dir() -> Path:
    return user_cache_dir() / "chunks"


@dataclass(frozen=True)
class ChunkCacheConfig:
    # Registered tier names, fastest first; a hit in a later tier promotes to the first.
    tiers: tuple[str, ...] = ("memory",)
    memory_bytes: int = 2 << 30
    # A use this long ago counts half as much as one now, when choosing what to evict.
    half_life_s: float = 600.0
    # What the memory tier evicts first: "value" (hits x cost / bytes, decayed), or "lru".
    memory_policy: str = "value"
    # None: entries stay where they were computed (the runtime's device).
    memory_device: str | None = None
    disk_dir: Path = field(default_factory=default_disk_dir)
    disk_bytes: int = 16 << 30
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_bytes: int = 4 << 30
    lmcache_bytes: int = 4 << 30
    # How the disk and Redis tiers store entries: "int8" or "int4" (codec.py), None: raw.
    disk_codec: str | None = None
    redis_codec: str | None = None

    def tier_options(self, name: str) -> dict[str, Any]:
        """The keyword arguments `make_tier(name, ...)` gets."""
        if name == "memory":
            return {
                "budget_bytes": self.memory_bytes,
                "half_life_s": self.half_life_s,
                "device": self.memory_device,
                "policy": self.memory_policy,
            }
        if name == "disk":
            return {"root": self.disk_dir, "budget_bytes": self.disk_bytes, "codec": self.disk_codec}
        if name == "redis":
            return {"url": self.redis_url, "budget_bytes": self.redis_bytes, "codec": self.redis_codec}
        if name == "lmcache":
            return {"budget_bytes": self.lmcache_bytes}
        return {}
