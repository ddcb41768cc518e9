"""Lookup latency through the real SemanticCache at growing sizes (part of `kvgate bench semantic`)."""

from __future__ import annotations

import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from kvgate.bench.data import Pair
from kvgate.runtime.report import pct, table
from kvgate.semantic_cache import Entry, SemanticCache, SemanticCacheConfig
from kvgate.semantic_cache.embedder import Embedder
from kvgate.semantic_cache.sqlite_store import SQLiteStore

SEED = 0
Texts = tuple[list[str], np.ndarray]  # questions and their embeddings


def ms(samples: list[float]) -> str:
    return f"{np.percentile(samples, 50) * 1e3:.2f} / {np.percentile(samples, 99) * 1e3:.2f}"


NOISE = 0.6  # norm of the noise added to a real vector to make a filler entry (cosine ~0.86 to it)
T = TypeVar("T")


def answer(text: str) -> dict[str, Any]:
    content = f"An answer to: {text} " + "Lorem ipsum dolor sit amet. " * 24
    return {"content": content, "finish_reason": "stop", "usage": {"prompt_tokens": 20, "completion_tokens": 160}}


def latency_pool(pairs: list[Pair], a: np.ndarray, b: np.ndarray, n: int) -> tuple[Texts, Texts]:
    """`n` random pairs' `b` as the queries; every other distinct question as entries, their `a` first."""
    chosen = np.random.default_rng(SEED).choice(len(pairs), min(n, len(pairs)), replace=False)
    asked = {pairs[i][1] for i in chosen}
    seen: dict[str, np.ndarray] = {}
    firsts = [(pairs[i][0], a[i]) for i in chosen]
    for text, vec in [
        *firsts,
        *((p[0], a[i]) for i, p in enumerate(pairs)),
        *((p[1], b[i]) for i, p in enumerate(pairs)),
    ]:
        if text not in asked:
            seen.setdefault(text, vec)
    return (list(seen), np.stack(list(seen.values()))), ([pairs[i][1] for i in chosen], b[chosen])


def fillers(pool: Texts, start: int, stop: int) -> Texts:
    """Entries start..stop: the real questions first, then noisy copies of them (renormalised)."""
    texts, vecs = pool
    idx = np.arange(start, stop) % len(texts)
    out = vecs[idx].copy()
    copies = np.arange(start, stop) >= len(texts)
    noise = np.random.default_rng(SEED + start).standard_normal((int(copies.sum()), vecs.shape[1]))
    out[copies] += NOISE * noise / np.linalg.norm(noise, axis=1, keepdims=True)
    return [texts[i] for i in idx], (out / np.linalg.norm(out, axis=1, keepdims=True)).astype(np.float32)


def bulk_fill(cache: SemanticCache, store: SQLiteStore, texts: list[str], vecs: np.ndarray) -> None:
    """Entries written in one transaction (`SQLiteStore.load`), then read into the index as a first lookup
    of the scope does: faster than one `put` each, which also sweeps expiry and checks the quota."""
    now, entries = time.time(), []
    for text, vec in zip(texts, vecs, strict=True):
        cat = cache.classify(text, vec)
        entries.append(
            Entry(uuid.uuid4().hex, "bench", "bench", cat.name, text, answer(text), vec, now, now + cat.ttl_s, now)
        )
    store.load(entries)
    cache.rebuild()
    cache.hold("bench", now)


def timed(samples: list[float], fn: Callable[[], T]) -> T:
    start = time.perf_counter()
    out = fn()
    samples.append(time.perf_counter() - start)
    return out


def latency(embedder: Embedder, pool: Texts, asked: Texts, sizes: list[int]) -> list[list[str]]:
    queries, qvecs = asked
    real = queries[: max(1, len(queries) // 5)]
    embed: list[float] = []
    for q in real:
        timed(embed, lambda q=q: embedder.embed([q]))
    base, rows, have = SemanticCacheConfig(), [], 0
    with tempfile.TemporaryDirectory() as tmp:
        store = SQLiteStore(Path(tmp) / "semantic.sqlite3", embedder.dim)
        config = replace(base, categories=tuple(replace(c, quota=10**9) for c in base.categories))
        cache = SemanticCache(config, embedder=embedder, store=store)
        for size in sorted(sizes):
            began = time.perf_counter()
            bulk_fill(cache, store, *fillers(pool, have, size))
            filled, entries, given, full, puts = time.perf_counter() - began, len(cache.index), [], [], []
            for q, v in zip(queries[:20], qvecs[:20], strict=True):  # warm-up
                cache.lookup("bench", q, vector=v)
            found = [timed(given, lambda q=q, v=v: cache.lookup("bench", q, vector=v)) for q, v in zip(*asked)]
            for q in real:
                timed(full, lambda q=q: cache.lookup("bench", q))
            for i, v in enumerate(fillers(pool, size, size + 20)[1]):
                timed(puts, lambda i=i, v=v: cache.put("bench", "bench", f"{real[0]} #{i}", answer(""), vector=v))
            have = size + len(puts)
            rows.append([f"{entries:,}", ms(given), ms(full), ms(embed), ms(puts)])
            rows[-1] += [pct(sum(f.hit for f in found) / len(found)), f"{filled:.0f}"]
            print(" | ".join(rows[-1]), flush=True)
        cache.close()
    return rows


def latency_section(embedder: Embedder, pool: Texts, asked: Texts, sizes: list[int]) -> str:
    rows = latency(embedder, pool, asked, sizes)
    return (
        "### Lookup latency\n\n"
        "Through the real `SemanticCache` (SQLite store in a temporary directory, hnswlib M=16, ef=64). Lookup: "
        "`cache.lookup(scope, query, vector=...)` timed whole (classification, change-log sync, index search, "
        f"`store.get` of candidates, guards, `touch` on a hit) for {len(asked[0])} QQP `b` questions, none stored "
        f"verbatim. Entries: the {len(pool[0])} other distinct questions of the data (the queries' own `a` "
        f"first), then copies of them plus noise of norm {NOISE}, renormalised (cosine ~0.86 to the original). "
        "They are written in bulk (the rows `put` writes, one transaction) and read into the index as a first "
        "lookup of the scope does (fill s); quotas are lifted. With embedding: real `lookup(scope, query)` calls for "
        f"{max(1, len(asked[0]) // 5)} queries; embed alone: `embed([query])`. Put: `cache.put` of 20 new "
        "entries with vectors. Milliseconds p50 / p99. Target: p99 at most 2 ms at 100k without embedding.\n\n"
        + table(["entries", "lookup", "lookup with embedding", "embed alone", "put", "hits %", "fill s"], rows)
    )
