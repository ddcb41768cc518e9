"""The semantic response cache: look a question up among the answers given in the same scope,
and keep new answers, under each category's error bound, TTL and per-tenant quota.

A lookup judges the nearest cached questions above the category's cosine threshold that no guard
refuses: the same question is served; another is scored by the verifier, and the best served only
when the error bound allows (bound.py), except a share of those, left to the model to check them.
The gateway hands every answer the model gave near an entry back (`learn`), and a caller may report
a wrong hit (`report`): the verdicts the bound learns from.

The store holds every entry; the in-memory index holds the scopes in use, at most `config.scopes`:
a scope is read from the store the first time it is looked up (not at start-up), and the least
recently used is forgotten beyond the limit."""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kvgate.semantic_cache.bound import Bound
from kvgate.semantic_cache.config import Category, SemanticCacheConfig
from kvgate.semantic_cache.embedder import Embedder, make_embedder
from kvgate.semantic_cache.entry import Entry
from kvgate.semantic_cache.guards import refusal
from kvgate.semantic_cache.index import Index
from kvgate.semantic_cache.policy import Classifier, threshold
from kvgate.semantic_cache.store import Store, make_store
from kvgate.semantic_cache.verifier import Verifier, normalised, same_answer

log = logging.getLogger("kvgate.semantic")


@dataclass
class Lookup:
    """What a lookup found. `entry` is set on a hit; `candidate` is the best cached question judged
    (the hit, or what a miss was near), with its `score`; `verify`: the model is to answer it to check
    the candidate (instead of the hit, or beside it: config.verify_beside); `refused` names the guard
    that turned a candidate away."""

    category: Category
    vector: np.ndarray
    threshold: float
    entry: Entry | None = None
    similarity: float = 0.0  # of the candidate, or of the nearest cached question on a miss
    refused: str | None = None
    candidate: Entry | None = None
    score: float = 0.0
    verify: bool = False

    @property
    def hit(self) -> bool:
        return self.entry is not None

    def near(self, similarity: float) -> None:
        self.similarity = max(self.similarity, similarity)

    def judge(self, entry: Entry, score: float, similarity: float) -> None:
        """A cached question judged: the candidate if it scores above the one before."""
        if self.candidate is None or score > self.score:
            self.take(entry, score, similarity)

    def take(self, entry: Entry, score: float, similarity: float) -> None:
        self.candidate, self.score, self.similarity = entry, score, similarity

    def refuse(self, guard: str) -> None:
        self.refused = self.refused or guard

    def checked(self) -> None:
        """The model answers it too, to check the candidate."""
        self.verify = True

    def served(self, entry: Entry | None) -> None:
        """The entry served (None: a miss after all, the store failing)."""
        self.entry = entry


class Served(NamedTuple):
    """A recent hit, as a caller may report it."""

    entry: str
    tenant: str
    category: str
    score: float


class SemanticCache:
    def __init__(self, config: SemanticCacheConfig, embedder: Embedder | None = None, store: Store | None = None):
        self.config = config
        self.embedder = embedder or make_embedder(config.embedder)
        dim = self.embedder.dim
        if store is None:
            store = (
                make_store("redis", url=config.redis_url, dim=dim)
                if config.redis_url
                else make_store("sqlite", path=config.sqlite_path, dim=dim)
            )
        self.store = store
        self.classify = Classifier(config, self.embedder)
        self.index = Index(dim, config.hnsw_m, config.hnsw_ef, config.scopes, config.flat_max)
        self.verifier = Verifier.load(config.verifier) if config.verifier else None
        bounded = {c.name: c.max_error_rate for c in config.categories if c.max_error_rate is not None}
        self.bound = Bound(bounded, config.bound, shared=store.evidence)  # pooled by processes on one Redis
        self.served: OrderedDict[str, Served] = OrderedDict()  # by the id of the completion that served it
        self.chance = random.Random()
        self.lock = threading.Lock()  # around following the change log, and reading a scope in
        self.counts = dict.fromkeys(
            ("hits", "misses", "refused", "verified", "puts", "evicted", "errors", "scope_reads", "scopes_forgotten"), 0
        )
        self.cursor: str | None = None  # the store's change log, applied up to here; None: rebuild first
        try:
            self.rebuild()
        except Exception:  # a store out of reach at start-up: misses until it answers
            log.warning("semantic cache: the store is out of reach; misses until it answers", exc_info=True)

    # ---- the index follows the store ----------------------------------------------------------

    def rebuild(self) -> None:
        """Forget every scope held and follow the store's log from its end: each scope is read back
        from the store when next looked up (at start-up, or after falling behind the log)."""
        with self.lock:
            self.index.clear()
            self.cursor = None
            self.cursor = self.store.cursor()

    def hold(self, scope: str, now: float) -> None:
        """Read `scope`'s unexpired entries from the store into the index, unless it is held already."""
        with self.lock:
            if self.index.holds(scope):
                return
            entries = [e for e in self.store.entries(scope) if not e.expired(now)]
            vectors = np.stack([e.vector for e in entries]) if entries else np.zeros((0, self.embedder.dim))
            self.counts["scopes_forgotten"] += self.index.load(scope, [e.id for e in entries], vectors)
            self.counts["scope_reads"] += 1

    def sync(self) -> None:
        """Apply the store's changes since the last sync: writes and deletions by any process, to the
        scopes held (a write to another scope is not even read)."""
        if self.cursor is None:
            return self.rebuild()
        with self.lock:
            found = self.store.changes(self.cursor)
            if found is not None:
                self.cursor, changes = found
                for op, entry_id, scope in changes:
                    if op == "del":
                        self.index.remove(entry_id)
                    elif entry_id not in self.index and (not scope or self.index.holds(scope)):
                        self.follow(entry_id)
        if found is None:
            log.info("semantic cache: fell behind the store's change log; forgetting the scopes held")
            self.rebuild()

    def follow(self, entry_id: str) -> None:
        entry = self.store.get(entry_id)
        if entry is not None:
            self.index.add(entry.scope, entry.id, entry.vector)  # a no-op unless its scope is held

    # ---- the ways in ---------------------------------------------------------------------------

    def embed(self, query: str) -> np.ndarray:
        return self.embedder.embed([query])[0]

    def lookup(
        self,
        scope: str,
        query: str,
        vector: np.ndarray | None = None,
        queued: int = 0,
        now: float | None = None,
    ) -> Lookup:
        """The best cached answer for `query` in `scope` that clears the threshold and every guard.
        A failing store is a miss."""
        vector = self.embed(query) if vector is None else vector
        category = self.classify(query, vector)
        found = Lookup(category, vector, threshold(category, self.config, queued))
        try:
            now = time.time() if now is None else now
            self.sync()
            self.hold(scope, now)
            self.find(found, scope, query, now)
        except Exception:
            log.warning("semantic cache lookup failed; answering as a miss", exc_info=True)
            self.counts["errors"] += 1
            found.served(None)
        self.counts["hits" if found.hit else "misses"] += 1
        self.counts["refused"] += found.refused is not None and not found.hit
        return found

    def find(self, found: Lookup, scope: str, query: str, now: float) -> None:
        category, same = found.category, normalised(query)
        for entry_id, similarity in self.index.search(scope, found.vector, self.config.candidates):
            found.near(similarity)
            if similarity < found.threshold:
                break
            entry = self.store.get(entry_id)
            if entry is None or entry.scope != scope:  # gone (or damaged, and now deleted)
                self.index.remove(entry_id)
                continue
            if entry.expired(now):
                self.index.remove(entry_id)
                self.store.delete([entry_id])
                continue
            if normalised(entry.query) == same:
                found.take(entry, 1.0, similarity)
                return self.serve(found, now)
            guard = refusal(query, entry.query, self.config.guards)
            if guard is not None:
                found.refuse(guard)
                continue
            score = self.verifier.score(query, entry.query, similarity, category.name) if self.verifier else similarity
            found.judge(entry, score, similarity)
        if found.candidate is None:
            return
        if category.max_error_rate is None:  # no bound: the threshold and the guards decide
            return self.serve(found, now)
        self.bound.asked(category.name, found.score)
        if not self.bound.allows(category.name, found.candidate.id, found.score):
            return
        if self.chance.random() < self.config.verify_rate:
            found.checked()
            self.counts["verified"] += 1
            if not self.config.verify_beside:
                return
        self.serve(found, now)

    def serve(self, found: Lookup, now: float) -> None:
        assert found.candidate is not None
        self.store.touch(found.candidate.id, now)
        found.served(found.candidate)

    # ---- verdicts ------------------------------------------------------------------------------

    def learn(self, found: Lookup, answer: str) -> bool | None:
        """The model's `answer` to a question the lookup did not serve (or served, to check it), against
        the answer of the cached question it was near: whether that was right (taught to the bound), or
        None when there is nothing to judge."""
        candidate = found.candidate
        if found.hit and not found.verify or candidate is None or found.category.max_error_rate is None:
            return None
        cached = str(candidate.response.get("content", ""))
        right = same_answer(answer, cached)
        if not right:
            a, b = self.embedder.embed([answer, cached])
            right = float(a @ b) >= self.config.answer_similarity
        self.bound.learn(found.category.name, candidate.id, found.score, right)
        return right

    def remember(self, request_id: str, tenant: str, found: Lookup) -> None:
        """A hit served as `request_id`, so that the caller may report it wrong."""
        if found.entry is None:
            return
        with self.lock:
            self.served[request_id] = Served(found.entry.id, tenant, found.category.name, found.score)
            while len(self.served) > self.config.served:
                self.served.popitem(last=False)

    def report(self, request_id: str, tenant: str) -> str | None:
        """A caller says the hit served as `request_id` was wrong: the bound learns it, and the entry
        goes. Returns the entry's id, or None when no recent hit of this tenant has that id."""
        with self.lock:
            hit = self.served.get(request_id)
            if hit is None or hit.tenant != tenant:
                return None
            del self.served[request_id]
        if hit.category in self.bound.deltas:
            self.bound.learn(hit.category, hit.entry, hit.score, False)
        self.bound.forget(hit.entry)  # the entry goes: its own verdicts with it
        self.invalidate(hit.entry)
        return hit.entry

    def put(
        self,
        tenant: str,
        scope: str,
        query: str,
        response: dict[str, Any],
        vector: np.ndarray | None = None,
        category: Category | None = None,
        now: float | None = None,
    ) -> Entry | None:
        """Keep an answer; None when the store failed (the answer is then simply not cached)."""
        now = time.time() if now is None else now
        vector = self.embed(query) if vector is None else vector
        category = category or self.classify(query, vector)
        entry = Entry(
            id=uuid.uuid4().hex,
            tenant=tenant,
            scope=scope,
            category=category.name,
            query=query,
            response=response,
            vector=np.asarray(vector, dtype=np.float32),
            created=now,
            expires=now + category.ttl_s,
            last_used=now,
        )
        try:
            dropped = self.store.put(entry, category.quota, now, category.quota * self.config.tenant_shares)
            self.index.add(scope, entry.id, entry.vector)  # if held: so that sync need not read it back
            self.sync()
        except Exception:
            log.warning("semantic cache write failed; the answer is not cached", exc_info=True)
            self.counts["errors"] += 1
            return None
        self.counts["puts"] += 1
        self.counts["evicted"] += len(dropped)
        return entry

    def invalidate(self, entry_id: str | None = None, category: str | None = None, tenant: str | None = None) -> int:
        """Delete one entry, or every entry of a category and/or tenant; returns how many went."""
        if entry_id is not None:
            ids = [entry_id]
        elif category is None and tenant is None:
            raise ValueError("say which entries: an id, a category or a tenant")
        else:
            ids = self.store.ids(tenant=tenant, category=category)
        gone = self.store.delete(ids)
        self.sync()
        return gone

    def stats(self) -> dict[str, Any]:
        held = {"entries": len(self.index), "scopes": len(self.index.scopes), "scope_limit": self.index.limit}
        return {**held, **self.counts, "bound": self.bound.stats()}

    def close(self) -> None:
        self.store.close()
