"""Category-aware semantic response cache: embeddings, an hnswlib index per scope, a response store
(SQLite or Redis), per-category thresholds, TTLs and quotas, and guards against false hits."""

from kvgate.semantic_cache.cache import Lookup, SemanticCache
from kvgate.semantic_cache.config import Category, SemanticCacheConfig, categories
from kvgate.semantic_cache.embedder import Embedder, MiniLM, make_embedder
from kvgate.semantic_cache.entry import Entry
from kvgate.semantic_cache.guards import GUARDS, refusal
from kvgate.semantic_cache.store import Store, make_store, register_store

__all__ = [
    "GUARDS",
    "Category",
    "Embedder",
    "Entry",
    "Lookup",
    "MiniLM",
    "SemanticCache",
    "SemanticCacheConfig",
    "Store",
    "categories",
    "make_embedder",
    "make_store",
    "refusal",
    "register_store",
]
