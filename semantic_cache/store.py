"""Where entries live, outside the index: the interface, and the registry that builds a store by name.

The store is the truth; the in-memory index only proposes candidates. Every change is also written
to the store's change log, so that each process's index follows the others' writes and deletions."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from kvgate.semantic_cache.entry import Entry

Change = tuple[str, str, str]  # ("put" | "del", entry id, the entry's scope or "" when unknown)
Evidence = dict[str, dict[str, list[float]]]  # category -> "asked" | "right" | "wrong" -> a count per score bin


class Store(ABC):
    name: ClassVar[str] = ""

    @abstractmethod
    def put(self, entry: Entry, quota: int, now: float, capacity: int | None = None) -> list[str]:
        """Write (or replace) an entry; then drop expired entries, the least recently used of its tenant's
        entries of its category beyond `quota`, and, while the category holds more than `capacity`
        entries (all tenants), the least recently used entry of the tenant holding the most of it.
        Returns the ids dropped."""

    @abstractmethod
    def get(self, entry_id: str) -> Entry | None:
        """The entry, or None: absent, or damaged (a damaged entry is deleted)."""

    @abstractmethod
    def touch(self, entry_id: str, now: float) -> None:
        """Record a hit: last use (for eviction) and the hit count."""

    @abstractmethod
    def delete(self, entry_ids: list[str]) -> int: ...

    @abstractmethod
    def ids(self, tenant: str | None = None, category: str | None = None) -> list[str]:
        """Every entry's id, or those of one tenant and/or category."""

    @abstractmethod
    def entries(self, scope: str) -> Iterator[Entry]:
        """Every intact entry of a scope (to read it into the index)."""

    @abstractmethod
    def cursor(self) -> str:
        """The change log's current end."""

    @abstractmethod
    def changes(self, since: str) -> tuple[str, list[Change]] | None:
        """Changes after `since` and the new end; None when the log no longer reaches back that far."""

    def evidence(self, added: Evidence) -> Evidence | None:
        """The error bound's evidence shared by every process on this store: add what this one saw
        since it last asked (per category, per kind: asked, right, wrong, a count per score bin) and
        return the totals. None: not shared (this store lives in one process) or out of reach."""
        return None

    def close(self) -> None:
        return None


_STORES: dict[str, Callable[..., Store]] = {}


def register_store(name: str) -> Callable[[type[Store]], type[Store]]:
    def add(cls: type[Store]) -> type[Store]:
        cls.name = name
        _STORES[name] = cls
        return cls

    return add


def make_store(name: str, **options: Any) -> Store:
    """`sqlite` or `redis`: a module `semantic_cache/<name>_store.py` registers itself when first asked for."""
    if name not in _STORES:
        try:
            importlib.import_module(f"kvgate.semantic_cache.{name}_store")
        except ModuleNotFoundError as exc:
            raise ValueError(f"no semantic cache store named {name!r}") from exc
    return _STORES[name](**options)
