"""Nearest cached questions, in memory: the entries of at most `limit` scopes. Beyond it the least
recently used scope is forgotten; the cache reads it back from the store when it is next asked for.

A scope holds every entry whose answer fits the same context (tenant, model, system prompt,
conversation, documents, sampling), so a search never has to filter out another scope's entries.
A small scope is searched exactly, as one matrix; past `flat_max` entries it moves into an hnswlib
graph. hnswlib costs ~2.6 MB per index whatever its capacity (65,536 label locks), so only a large
scope pays that."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator

import hnswlib
import numpy as np

START = 16  # rows (or graph slots) a scope allocates first; capacity doubles as it fills
FLAT_MAX = 1024  # a scope this small is searched exactly: ~0.1 ms, and no graph to keep


class Flat:
    """A small scope: its vectors as the rows of one matrix."""

    def __init__(self, dim: int) -> None:
        self.vectors = np.empty((0, dim), dtype=np.float32)
        self.ids: list[str] = []
        self.rows: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[str]:
        return iter(self.ids)

    def add(self, entry_id: str, vector: np.ndarray) -> None:
        n = len(self.ids)
        if n == len(self.vectors):
            self.resize(max(START, 2 * n))
        self.vectors[n] = vector
        self.rows[entry_id] = n
        self.ids.append(entry_id)

    def remove(self, entry_id: str) -> None:
        row, last = self.rows.pop(entry_id), self.ids.pop()
        if last != entry_id:  # the last row fills the hole
            self.vectors[row], self.ids[row], self.rows[last] = self.vectors[len(self.ids)], last, row
        if START < len(self.vectors) > 4 * len(self.ids):
            self.resize(2 * len(self.ids))

    def resize(self, rows: int) -> None:
        vectors = np.empty((rows, self.vectors.shape[1]), dtype=np.float32)
        vectors[: len(self.ids)] = self.vectors[: len(self.ids)]
        self.vectors = vectors

    def search(self, vector: np.ndarray, k: int) -> list[tuple[str, float]]:
        similarities = self.vectors[: len(self.ids)] @ vector
        best = np.argsort(-similarities)[:k]
        return [(self.ids[i], float(similarities[i])) for i in best]


class Graph:
    """A large scope: an hnswlib graph (cosine); a deleted slot is reused before the graph grows."""

    def __init__(self, dim: int, m: int, ef: int, ids: list[str], vectors: np.ndarray) -> None:
        self.hnsw = hnswlib.Index(space="cosine", dim=dim)
        capacity = max(START, 2 * len(ids))
        self.hnsw.init_index(max_elements=capacity, ef_construction=max(100, ef), M=m, allow_replace_deleted=True)
        self.hnsw.set_ef(ef)
        self.labels = dict(zip(ids, range(len(ids)), strict=True))
        self.ids = dict(enumerate(ids))  # label -> entry id
        self.next_label, self.deleted = len(ids), 0
        if ids:
            self.hnsw.add_items(vectors, list(range(len(ids))))

    def __len__(self) -> int:
        return len(self.labels)

    def __iter__(self) -> Iterator[str]:
        return iter(self.labels)

    def add(self, entry_id: str, vector: np.ndarray) -> None:
        if self.deleted == 0 and len(self) >= self.hnsw.get_max_elements():
            self.hnsw.resize_index(2 * self.hnsw.get_max_elements())
        label, self.next_label = self.next_label, self.next_label + 1
        self.hnsw.add_items(vector.reshape(1, -1), [label], replace_deleted=self.deleted > 0)
        self.deleted -= self.deleted > 0
        self.labels[entry_id], self.ids[label] = label, entry_id

    def remove(self, entry_id: str) -> None:
        label = self.labels.pop(entry_id)
        self.hnsw.mark_deleted(label)
        del self.ids[label]
        self.deleted += 1

    def search(self, vector: np.ndarray, k: int) -> list[tuple[str, float]]:
        labels, distances = self.hnsw.knn_query(vector.reshape(1, -1), k=min(k, len(self)))
        return [(self.ids[int(lab)], 1.0 - float(d)) for lab, d in zip(labels[0], distances[0], strict=True)]


class Index:
    def __init__(self, dim: int, m: int = 16, ef: int = 64, limit: int = 64, flat_max: int = FLAT_MAX) -> None:
        if limit < 1:
            raise ValueError("the index must hold at least one scope")
        self.dim, self.m, self.ef, self.limit, self.flat_max = dim, m, ef, limit, flat_max
        self.scopes: OrderedDict[str, Flat | Graph] = OrderedDict()  # least recently used first
        self.where: dict[str, str] = {}  # entry id -> its scope, for the scopes held
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.where)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self.where

    def holds(self, scope: str) -> bool:
        return scope in self.scopes

    def load(self, scope: str, ids: list[str], vectors: np.ndarray) -> int:
        """Hold `scope` with these entries (replacing what was held of it); returns the scopes forgotten."""
        vectors = unit(vectors.reshape(len(ids), self.dim))
        part = Graph(self.dim, self.m, self.ef, ids, vectors) if len(ids) > self.flat_max else Flat(self.dim)
        if isinstance(part, Flat):
            for entry_id, vector in zip(ids, vectors, strict=True):
                part.add(entry_id, vector)
        with self.lock:
            self._forget(scope)
            for entry_id in ids:
                self._remove(entry_id)  # were it held under another scope
                self.where[entry_id] = scope
            self.scopes[scope] = part
            forgotten = 0
            while len(self.scopes) > self.limit:
                self._forget(next(iter(self.scopes)))
                forgotten += 1
            return forgotten

    def add(self, scope: str, entry_id: str, vector: np.ndarray) -> bool:
        """Index an entry of a held scope; False (and nothing done) when the scope is not held."""
        vector = unit(vector.reshape(1, self.dim))[0]
        with self.lock:
            if scope not in self.scopes:
                return False
            self._remove(entry_id)
            part = self.scopes[scope]
            part.add(entry_id, vector)
            self.where[entry_id] = scope
            if isinstance(part, Flat) and len(part) > self.flat_max:
                self.scopes[scope] = Graph(self.dim, self.m, self.ef, part.ids, part.vectors[: len(part)])
            return True

    def remove(self, entry_id: str) -> bool:
        with self.lock:
            return self._remove(entry_id)

    def _remove(self, entry_id: str) -> bool:
        scope = self.where.pop(entry_id, None)
        if scope is None:
            return False
        self.scopes[scope].remove(entry_id)
        return True

    def _forget(self, scope: str) -> None:
        for entry_id in self.scopes.pop(scope, ()):
            del self.where[entry_id]

    def search(self, scope: str, vector: np.ndarray, k: int) -> list[tuple[str, float]]:
        """Up to k entries of `scope`, nearest first, with their cosine similarity; none if it is not held."""
        vector = unit(vector.reshape(1, self.dim))[0]
        with self.lock:
            part = self.scopes.get(scope)
            if part is None:
                return []
            self.scopes.move_to_end(scope)
            return part.search(vector, k) if len(part) else []

    def clear(self) -> None:
        with self.lock:
            self.scopes.clear()
            self.where.clear()


def unit(rows: np.ndarray) -> np.ndarray:
    """Rows scaled to length 1 (as hnswlib's cosine space does), float32."""
    rows = np.asarray(rows, dtype=np.float32)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.where(norms > 0, norms, 1.0)
