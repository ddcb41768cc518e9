"""Soak: the semantic cache's memory as distinct system prompts (scopes) keep coming.

Each of --scopes scopes gets a lookup (a miss, which reads the scope in), --entries answers (`put`)
and a lookup of its first question, through the real SemanticCache on a real SQLite file. The
process's RSS is sampled as the scopes come; then --revisit scopes from the whole run (most long
forgotten) are looked up again: each must hit, read back from the store.

The embedder is a stub handing out random unit vectors, precomputed per question: the soak measures
the index's memory, not the embedder (MiniLM on CPU would spend minutes embedding 10,000 questions,
and a vector's values do not change what the index holds). Nothing else is a stand-in.

    .venv/bin/python benchmarks/semantic_soak.py --scopes 10000
    .venv/bin/python benchmarks/semantic_soak.py --scopes 10000 --flat-max 0   # every scope a graph
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from kvgate.semantic_cache import SemanticCache, SemanticCacheConfig
from kvgate.semantic_cache.index import FLAT_MAX

DIM = 384  # all-MiniLM-L6-v2's
PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 2**20
# The README's bound: per held scope, an hnswlib graph's fixed ~2.7 MB (only past flat_max entries)
# or a matrix of at least 16 rows, plus ~4 KB an entry (vector and links, capacity doubling);
# beside the scopes, the guards' word cache (at most ~12 MB) and SQLite's page cache (2 MB).
GRAPH, FLAT, ENTRY, BESIDE = 2.7e6, 16 * DIM * 4, 4e3, 14e6


def rss() -> int:
    """Resident bytes now (not the peak)."""
    gc.collect()
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


class RandomUnit:
    """Stands in for MiniLM in this soak only (see the module's docstring): a precomputed random unit
    vector per known question; any other text (the classifier's prototypes) gets one from its hash."""

    name, dim = "random-unit", DIM

    def __init__(self, questions: list[str], seed: int = 0) -> None:
        vectors = np.random.default_rng(seed).standard_normal((len(questions), DIM)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        self.known = dict(zip(questions, vectors, strict=True))

    def embed(self, texts: list[str]) -> np.ndarray:
        return np.stack([self.known[t] if t in self.known else self.hashed(t) for t in texts])

    def hashed(self, text: str) -> np.ndarray:
        seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
        vector = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
        return vector / np.linalg.norm(vector)


def scope(i: int) -> str:
    """The scope of a system prompt, hashed as gateway/semantic.py hashes one."""
    return hashlib.sha256(f"You are assistant number {i}. Answer briefly.".encode()).hexdigest()


def question(i: int, j: int) -> str:
    return f"For assistant {i}: what is question number {j} about?"


def bound(args: argparse.Namespace) -> float:
    per_scope = (GRAPH if args.entries > args.flat_max else FLAT) + ENTRY * args.entries
    return args.held * per_scope + BESIDE


def soak(args: argparse.Namespace, path: Path) -> dict[str, object]:
    questions = [question(i, j) for i in range(args.scopes) for j in range(args.entries)]
    embedder = RandomUnit(questions)
    config = SemanticCacheConfig(sqlite_path=path, scopes=args.held, flat_max=args.flat_max)
    cache = SemanticCache(config, embedder=embedder)
    answer = {"content": "An answer. " * 40, "finish_reason": "stop", "usage": {"prompt_tokens": 30}}
    cache.lookup("warm-up", "warm-up")  # the first lookup's one-off allocations are not the index's
    base, samples, began = rss(), [], time.perf_counter()
    step = max(1, args.scopes // 20)
    for i in range(args.scopes):
        assert not cache.lookup(scope(i), question(i, 0)).hit
        for j in range(args.entries):
            assert cache.put("soak", scope(i), question(i, j), answer) is not None
        assert cache.lookup(scope(i), question(i, 0)).hit
        assert cache.stats()["scopes"] <= args.held
        if (i + 1) % step == 0:
            samples.append((i + 1, rss() - base))
            print(f"{i + 1:>7} scopes  rss +{samples[-1][1] / MIB:7.1f} MiB  held {cache.stats()['scopes']}")
    filled = time.perf_counter() - began
    revisit = np.random.default_rng(1).choice(args.scopes, min(args.revisit, args.scopes), replace=False)
    began, hits = time.perf_counter(), 0
    for i in revisit:
        hits += cache.lookup(scope(int(i)), question(int(i), 0)).hit
    revisited = time.perf_counter() - began
    stats = cache.stats()
    cache.close()
    second_half = [b for n, b in samples if n > args.scopes // 2]
    return {
        "scopes": args.scopes,
        "entries_per_scope": args.entries,
        "semantic_scopes": args.held,
        "flat_max": args.flat_max,
        "base_rss_mib": round(base / MIB, 1),
        "growth_mib": [(n, round(b / MIB, 1)) for n, b in samples],
        "max_growth_mib": round(max(b for _, b in samples) / MIB, 1),
        "bound_mib": round(bound(args) / MIB, 1),
        "second_half_spread_mib": round((max(second_half) - min(second_half)) / MIB, 1) if second_half else 0,
        "fill_s": round(filled, 1),
        "revisited": len(revisit),
        "revisit_hits": hits,
        "revisit_ms_per_lookup": round(revisited / max(1, len(revisit)) * 1e3, 2),
        "held_scopes": stats["scopes"],
        "held_entries": stats["entries"],
        "scope_reads": stats["scope_reads"],
        "scopes_forgotten": stats["scopes_forgotten"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--scopes", type=int, default=10_000, help="distinct system prompts")
    parser.add_argument("--entries", type=int, default=1, help="answers stored per scope")
    parser.add_argument("--held", type=int, default=64, help="semantic_scopes: scope indexes held")
    parser.add_argument("--flat-max", type=int, default=FLAT_MAX, help="0: every scope an hnswlib graph")
    parser.add_argument("--revisit", type=int, default=500, help="scopes looked up again at the end")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        found = soak(args, Path(tmp) / "semantic.sqlite3")
    for name, value in found.items():
        print(f"{name}: {json.dumps(value)}")
    if found["max_growth_mib"] > found["bound_mib"] or found["revisit_hits"] != found["revisited"]:
        raise SystemExit("over the bound, or a revisited scope missed")


if __name__ == "__main__":
    main()
