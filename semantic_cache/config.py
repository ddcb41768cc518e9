"""The semantic cache's configuration: one frozen object, categories from the settings file."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvgate.semantic_cache.bound import BoundConfig
from kvgate.semantic_cache.verifier import SHIPPED

DEFAULT_CATEGORIES = Path(__file__).with_name("categories.yaml")


@dataclass(frozen=True)
class Category:
    """A kind of question with its own policy.

    threshold: the cosine similarity a cached question needs to be considered; floor: the lowest it
    may be relaxed to under load;
    max_error_rate: the share of wrong hits the operator accepts (delta): a question that is not the
    cached one is served only when the error bound (bound.py) says so; 0 serves only the same
    question; None: no bound, the threshold alone decides (and the guards);
    ttl_s: an entry's lifetime from its write (absolute, hits do not extend it);
    quota: entries kept per tenant, its least recently used evicted beyond it (see also
    SemanticCacheConfig.tenant_shares);
    patterns: regular expressions (case-insensitive) that put a question in this category;
    prototypes: example questions; a question not matched by any pattern goes to the category of
    its nearest prototype."""

    name: str
    threshold: float
    floor: float
    ttl_s: float
    quota: int
    max_error_rate: float | None = None
    patterns: tuple[str, ...] = ()
    prototypes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 < self.floor <= self.threshold <= 1.0:
            raise ValueError(f"category {self.name!r}: need 0 < floor <= threshold <= 1")
        if self.max_error_rate is not None and not 0.0 <= self.max_error_rate < 1.0:
            raise ValueError(f"category {self.name!r}: max_error_rate within [0, 1), or null for no bound")
        if self.ttl_s <= 0 or self.quota < 1:
            raise ValueError(f"category {self.name!r}: ttl_s and quota must be positive")


def categories(raw: list[dict[str, Any]] | None = None) -> tuple[Category, ...]:
    """Categories from the settings (a list of mappings), or the packaged defaults."""
    if raw is None:
        raw = yaml.safe_load(DEFAULT_CATEGORIES.read_text())["categories"]
    found = tuple(
        Category(**{**c, "patterns": tuple(c.get("patterns", ())), "prototypes": tuple(c.get("prototypes", ()))})
        for c in raw
    )
    names = [c.name for c in found]
    if not found or len(set(names)) != len(names):
        raise ValueError("semantic cache categories: at least one, with distinct names")
    return found


@dataclass(frozen=True)
class SemanticCacheConfig:
    categories: tuple[Category, ...] = field(default_factory=categories)
    # The category of a question that matches no pattern and is near no prototype; the last one if empty.
    default_category: str = ""
    prototype_similarity: float = 0.35  # a prototype this close (cosine) or closer decides the category
    # Where entries live: SQLite at sqlite_path, or Redis (shared by processes) when redis_url is set.
    sqlite_path: Path = Path("semantic.sqlite3")
    redis_url: str = ""
    embedder: str = "minilm"  # or "package.module:Class"
    guards: tuple[str, ...] = ("negation", "numbers", "entities", "scope")
    candidates: int = 4  # nearest entries checked by the guards before giving up
    # Under load, thresholds relax by up to relax_step (never below a category's floor); the load is
    # the runtime's queue length over queue_long, capped at 1.
    relax_step: float = 0.03
    queue_long: int = 8
    hnsw_m: int = 16
    hnsw_ef: int = 64
    # Scopes held in memory (an index each), the least recently used forgotten beyond it and read
    # back from the store when next looked up. A scope of up to flat_max entries is searched exactly
    # (no hnswlib graph, whose ~2.6 MB fixed cost only larger scopes pay).
    scopes: int = 64
    flat_max: int = 1024
    # A category holds at most quota * tenant_shares entries in all (tenants made up by callers must
    # not grow the store without end); beyond, the tenant holding the most of it loses its least
    # recently used entry, so one tenant's flood evicts its own entries first.
    tenant_shares: int = 4
    # The error bound: the verifier that scores a (question, cached question) pair (None: the cosine
    # is the score), the share of would-be hits the model answers to check them (instead of the hit,
    # or beside it), and when two answers agree (the same text, or answers' embeddings this close).
    verifier: Path | None = SHIPPED
    verify_rate: float = 0.1
    verify_beside: bool = False  # a checked would-be hit is served all the same (the model answers later)
    answer_similarity: float = 0.9
    bound: BoundConfig = field(default_factory=BoundConfig)
    served: int = 10_000  # recent hits remembered, so that a caller can report one wrong by its id

    def __post_init__(self) -> None:
        if self.scopes < 1 or self.flat_max < 0 or self.tenant_shares < 1 or self.served < 1:
            raise ValueError("semantic cache: need scopes, served, tenant_shares >= 1 and flat_max >= 0")
        if not 0.0 <= self.verify_rate <= 1.0 or not 0.0 < self.answer_similarity <= 1.0:
            raise ValueError("semantic cache: verify_rate within [0, 1], answer_similarity within (0, 1]")

    def category(self, name: str) -> Category:
        for c in self.categories:
            if c.name == name:
                return c
        raise KeyError(name)

    @property
    def fallback(self) -> Category:
        return self.category(self.default_category) if self.default_category else self.categories[-1]
