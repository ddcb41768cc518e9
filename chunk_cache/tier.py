"""The interface every storage tier implements, and the registry that builds tiers by name."""

from __future__ import annotations

import importlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from kvgate.chunk_cache.entry import ChunkKV


class Tier(ABC):
    """A byte-budgeted map from chunk key to ChunkKV. Implementations are thread-safe.

    A damaged or unreadable entry is a miss (get returns None), never an error or a wrong answer.
    Entries handed out are shared, not copied: their tensors are read-only to every caller.
    """

    name: ClassVar[str] = ""
    # Whether an entry it holds outlives this process (a crash, a restart): disk and Redis do.
    durable: ClassVar[bool] = False

    def __init__(self) -> None:
        # Called with each entry this tier evicts, after its lock is released; the store points
        # it at the next tier down, so that evictions demote.
        self.on_evict: Callable[[ChunkKV], object] | None = None

    def demote_to(self, on_evict: Callable[[ChunkKV], object]) -> None:
        """What each entry this tier evicts is handed to (the store's: the next tier down)."""
        self.on_evict = on_evict

    @abstractmethod
    def get(self, key: str) -> ChunkKV | None: ...

    @abstractmethod
    def put(self, entry: ChunkKV) -> bool:
        """Store (or replace) an entry; False when it cannot be held (too big, or the room is pinned)."""

    @abstractmethod
    def delete(self, key: str) -> bool: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def keys(self) -> list[str]: ...

    @abstractmethod
    def stats(self) -> dict[str, int | float]: ...

    @property
    @abstractmethod
    def nbytes(self) -> int: ...

    @property
    @abstractmethod
    def budget(self) -> int: ...

    def pin(self, key: str, until: float) -> bool:
        """Keep `key` from eviction until `until` on the tier's clock; False if absent or unsupported."""
        return False

    def unpin(self, key: str) -> bool:
        return False

    def residence_s(self, horizon_s: float = math.inf) -> float:
        """How long the tier keeps an unpinned entry after its last use, as measured lately (inf: it
        evicted nothing within `horizon_s`, or does not say)."""
        return math.inf

    def put_pinned(self, entry: ChunkKV, until: float) -> bool:
        """put, then pin (a tier that pins keeps a pin from eviction until it ends)."""
        return self.put(entry) and self.pin(entry.key, until)

    def take(self, key: str) -> ChunkKV | None:
        """Remove an entry and hand it back (to move it to another tier)."""
        entry = self.get(key)
        self.delete(key)
        return entry

    def close(self) -> None:  # noqa: B027 (optional: most tiers hold nothing to release)
        """Release connections, pools, threads; the tier is not used after this."""

    def __len__(self) -> int:
        return len(self.keys())


_TIERS: dict[str, type[Tier]] = {}
T = TypeVar("T", bound=type[Tier])


def register_tier(name: str) -> Callable[[T], T]:
    def register(cls: T) -> T:
        if _TIERS.get(name, cls) is not cls:
            raise ValueError(f"tier {name!r} is already registered as {_TIERS[name].__qualname__}")
        cls.name = name
        _TIERS[name] = cls
        return cls

    return register


def make_tier(name: str, **config: Any) -> Tier:
    """Build a registered tier; a tier shipped as `chunk_cache/<name>_tier.py` registers on first use,
    so an optional backend's dependencies are imported only when it is asked for."""
    if name not in _TIERS:
        try:
            importlib.import_module(f"kvgate.chunk_cache.{name}_tier")
        except ModuleNotFoundError as e:
            if e.name != f"kvgate.chunk_cache.{name}_tier":
                raise
    try:
        cls = _TIERS[name]
    except KeyError:
        raise ValueError(f"unknown chunk cache tier {name!r}; known: {', '.join(sorted(_TIERS))}") from None
    return cls(**config)


def tier_names() -> list[str]:
    return sorted(_TIERS)
