"""Category-aware semantic response cache: embeddings, an hnswlib index per scope, a response store
(SQLite or Redis), per-category thresholds, TTLs and quotas, and guards against false hits."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Category": ".config",
    "Embedder": ".embedder",
    "Entry": ".entry",
    "GUARDS": ".guards",
    "Lookup": ".cache",
    "MiniLM": ".embedder",
    "SemanticCache": ".cache",
    "SemanticCacheConfig": ".config",
    "Store": ".store",
    "categories": ".config",
    "make_embedder": ".embedder",
    "make_store": ".store",
    "refusal": ".guards",
    "register_store": ".store",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    """Names load on first use, so that a light process (a proxy front) imports no torch through here."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
