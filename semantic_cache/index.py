"""Nearest cached questions: one hnswlib index (cosine) per scope, in memory.

A scope holds every entry whose answer fits the same context (tenant, model, system prompt,
conversation, documents, sampling), so a search never has to filter out another scope's entries."""

from __future__ import annotations

import threading

import hnswlib
import numpy as np

START = 16  # an index's first capacity; it doubles as it fills


class _ScopeIndex:
    def __init__(self, dim: int, m: int, ef: int) -> None:
        self.hnsw = hnswlib.Index(space="cosine", dim=dim)
        self.hnsw.init_index(max_elements=START, ef_construction=max(100, ef), M=m, allow_replace_deleted=True)
        self.hnsw.set_ef(ef)
        self.live = 0
        self.deleted = 0


class Index:
    def __init__(self, dim: int, m: int = 16, ef: int = 64) -> None:
        self.dim, self.m, self.ef = dim, m, ef
        self.scopes: dict[str, _ScopeIndex] = {}
        self.where: dict[str, tuple[str, int]] = {}  # entry id -> (scope, label)
        self.ids: dict[int, str] = {}  # label -> entry id
        self.next_label = 0
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.where)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self.where

    def add(self, scope: str, entry_id: str, vector: np.ndarray) -> None:
        with self.lock:
            self._remove(entry_id)
            index = self.scopes.get(scope)
            if index is None:
                index = self.scopes[scope] = _ScopeIndex(self.dim, self.m, self.ef)
            if index.deleted == 0 and index.live >= index.hnsw.get_max_elements():
                index.hnsw.resize_index(2 * index.hnsw.get_max_elements())
            label = self.next_label
            self.next_label += 1
            # A deleted slot is reused before the index grows.
            index.hnsw.add_items(vector.reshape(1, -1), [label], replace_deleted=index.deleted > 0)
            if index.deleted:
                index.deleted -= 1
            index.live += 1
            self.where[entry_id] = (scope, label)
            self.ids[label] = entry_id

    def remove(self, entry_id: str) -> bool:
        with self.lock:
            return self._remove(entry_id)

    def _remove(self, entry_id: str) -> bool:
        found = self.where.pop(entry_id, None)
        if found is None:
            return False
        scope, label = found
        index = self.scopes[scope]
        index.hnsw.mark_deleted(label)
        del self.ids[label]
        index.live -= 1
        index.deleted += 1
        if index.live == 0:
            del self.scopes[scope]
        return True

    def search(self, scope: str, vector: np.ndarray, k: int) -> list[tuple[str, float]]:
        """Up to k entries of `scope`, nearest first, with their cosine similarity."""
        with self.lock:
            index = self.scopes.get(scope)
            if index is None:
                return []
            k = min(k, index.live)
            labels, distances = index.hnsw.knn_query(vector.reshape(1, -1), k=k)
            return [(self.ids[int(lab)], 1.0 - float(d)) for lab, d in zip(labels[0], distances[0], strict=True)]

    def clear(self) -> None:
        with self.lock:
            self.scopes.clear()
            self.where.clear()
            self.ids.clear()
