"""What callers can grow in the semantic cache stays bounded, with the real MiniLM embedder, a real
SQLite file or a real redis-server, and a real server on loopback with the shared engine:
- distinct system prompts (scopes) hold at most `semantic_scopes` indexes; a forgotten scope is read
  back from the store when next used, and its answers hit again;
- start-up reads no scope; a write from another process reaches a held scope and reads no other;
- one tenant's flood evicts only its own entries (per-tenant quota), and made-up tenants cannot grow
  a category past quota x tenant_shares;
- a scope's matrix shrinks as entries go; a large scope moves into a graph and still hits;
- the guards' word cache keeps at most 1,024 questions however many distinct ones come."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvgate.gateway.settings import Settings
from kvgate.runtime.engine import Engine
from kvgate.semantic_cache import Category, MiniLM, SemanticCache, SemanticCacheConfig, refusal
from kvgate.semantic_cache.guards import words
from kvgate.semantic_cache.index import Flat, Graph
from tests.helpers.servers import serving

QUESTION = "What is the capital of France?"
ADMIN = "admin-secret"


@pytest.fixture(scope="module")
def embedder() -> MiniLM:
    return MiniLM()


def make(path: Path, embedder: MiniLM, **options) -> SemanticCache:
    return SemanticCache(SemanticCacheConfig(sqlite_path=path / "semantic.sqlite3", **options), embedder=embedder)


def test_300_scopes_hold_at_most_8_indexes_and_a_forgotten_scope_hits_again(tmp_path: Path, embedder: MiniLM) -> None:
    cache = make(tmp_path, embedder, scopes=8)
    vector = cache.embed(QUESTION)  # one question under 300 system prompts: the scopes differ, not it
    for i in range(300):
        scope = f"system prompt {i}"
        assert not cache.lookup(scope, QUESTION, vector=vector).hit
        cache.put("t", scope, QUESTION, {"content": f"answer {i}"}, vector=vector)
        assert cache.stats()["scopes"] <= 8 and len(cache.index) <= 8
    assert not cache.index.holds("system prompt 0") and cache.stats()["scopes_forgotten"] == 300 - 8
    found = cache.lookup("system prompt 0", QUESTION, vector=vector)  # read back from the store
    assert found.hit and found.entry is not None and found.entry.response == {"content": "answer 0"}
    assert cache.stats()["scopes"] == 8 and cache.stats()["scope_reads"] == 301


def test_start_up_reads_no_scope_and_another_writer_reaches_only_held_scopes(tmp_path: Path, embedder: MiniLM) -> None:
    writer = make(tmp_path, embedder)
    vector = writer.embed(QUESTION)
    for i in range(20):
        writer.put("t", f"old {i}", QUESTION, {"content": str(i)}, vector=vector)
    reader = make(tmp_path, embedder, scopes=4)
    assert reader.stats()["scopes"] == 0 and len(reader.index) == 0
    assert not reader.lookup("s", QUESTION).hit
    writer.put("t", "s", QUESTION, {"content": "Paris"})
    other = writer.put("t", "other", QUESTION, {"content": "Lyon"})
    assert other is not None
    assert reader.lookup("s", QUESTION).hit  # followed from the log: no second read of the scope
    assert reader.stats()["scope_reads"] == 1 and not reader.index.holds("other") and other.id not in reader.index
    assert reader.lookup("other", QUESTION).hit and reader.stats()["scope_reads"] == 2
    assert writer.stats()["scopes"] == 0  # writing to a scope never reads it in


@pytest.fixture(params=["sqlite", "redis"])
def config(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SemanticCacheConfig]:
    small = Category("all", threshold=0.9, floor=0.85, ttl_s=3600, quota=3)
    options = {"categories": (small,), "tenant_shares": 2, "sqlite_path": tmp_path / "semantic.sqlite3"}
    if request.param == "redis":
        options["redis_url"] = request.getfixturevalue("redis_url")
    yield SemanticCacheConfig(**options)


def test_one_tenants_flood_evicts_only_its_own_entries(config: SemanticCacheConfig, embedder: MiniLM) -> None:
    cache, start = SemanticCache(config, embedder=embedder), time.time()  # real times: Redis expires its keys
    calm = cache.put("calm", "calm scope", QUESTION, {"content": "Paris"}, now=start)
    assert calm is not None
    questions = [f"How do I cook recipe number {i}?" for i in range(40)]
    for i, (q, v) in enumerate(zip(questions, embedder.embed(questions), strict=True)):
        cache.put("flood", "flood scope", q, {"content": str(i)}, vector=v, now=start + 1 + i)
    assert len(cache.store.ids(tenant="flood")) == 3  # its quota, of its own entries
    assert cache.store.ids(tenant="calm") == [calm.id]
    assert cache.lookup("calm scope", QUESTION, now=start + 100).hit
    # Made-up tenants (a key each) fill the category to quota x tenant_shares, no further; the
    # tenants holding the most lose entries, never the one holding a single entry.
    vector = cache.embed(QUESTION)
    for t in range(4):
        for i in range(3):
            cache.put(
                f"made-up {t}", f"scope {t}", f"{QUESTION} #{i}", {"content": "x"}, vector=vector, now=start + 200
            )
    assert len(cache.store.ids(category="all")) == 6 and cache.store.ids(tenant="calm") == [calm.id]


def test_a_scopes_matrix_shrinks_as_entries_go_and_held_counts_go_with_their_tenant(
    tmp_path: Path, embedder: MiniLM
) -> None:
    cache = make(tmp_path, embedder)
    vectors = embedder.embed([f"Question number {i}?" for i in range(200)])
    entries = [
        cache.put("t", "s", f"Question number {i}?", {"content": str(i)}, vector=v) for i, v in enumerate(vectors)
    ]
    assert not cache.index.holds("s")  # written, never looked up: not read in
    cache.lookup("s", "Question number 7?", vector=vectors[7])
    part = cache.index.scopes["s"]
    assert isinstance(part, Flat) and len(part) == 200
    for entry in entries[:195]:
        assert entry is not None and cache.invalidate(entry.id) == 1
    cache.sync()
    assert len(part) == 5 and len(part.vectors) <= 4 * 5  # not the 256 rows it grew to
    assert cache.invalidate(tenant="t") == 5
    assert cache.store.db.execute("SELECT count(*) FROM held").fetchone()[0] == 0  # type: ignore[attr-defined]


def test_a_large_scope_moves_into_a_graph_and_hits_after_being_forgotten(tmp_path: Path, embedder: MiniLM) -> None:
    cache = make(tmp_path, embedder, scopes=2, flat_max=4)
    questions = [QUESTION, "How do birds fly?", "Why is the sky blue?", "What is Python used for?", "Name a color."]
    vectors = embedder.embed(questions)
    cache.lookup("big", QUESTION, vector=vectors[0])
    for i, (q, v) in enumerate(zip(questions, vectors, strict=True)):
        cache.put("t", "big", q, {"content": str(i)}, vector=v)
    assert isinstance(cache.index.scopes["big"], Graph)
    for scope in ("a", "b"):
        cache.lookup(scope, QUESTION, vector=vectors[0])
    assert not cache.index.holds("big")
    found = cache.lookup("big", "Why is the sky blue?", vector=vectors[2])
    assert found.hit and found.entry is not None and found.entry.response == {"content": "2"}
    assert isinstance(cache.index.scopes["big"], Graph)


def test_the_guards_word_cache_is_bounded() -> None:
    for i in range(3000):
        refusal(f"Is question {i} about the Harbor Line?", f"Was question {i} about the Harbor Line?")
    assert words.cache_info().currsize <= words.cache_info().maxsize == 1024


def test_a_server_holds_at_most_semantic_scopes_and_a_forgotten_scope_still_hits(
    engine: Engine, tmp_path: Path
) -> None:
    settings = Settings(
        engine={"max_num_seqs": 4},
        semantic_cache={"path": tmp_path / "semantic.sqlite3", "scopes": 2},
        security={"admin_key": ADMIN},
    )
    with serving(settings, engine) as url, httpx.Client(base_url=url, timeout=120) as http:

        def ask(system: str) -> httpx.Response:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
            body = {"model": engine.loaded.name, "messages": messages, "max_tokens": 4, "temperature": 0}
            return http.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-probe"})

        admin = {"authorization": f"Bearer {ADMIN}"}
        for i in range(5):
            answer = ask(f"You are assistant number {i}.")
            assert answer.status_code == 200 and answer.headers["x-kvgate-cache"] == "miss"
            held = http.get("/admin/semantic-cache", headers=admin).json()
            assert held["scopes"] <= 2 and held["scope_limit"] == 2
        again = ask("You are assistant number 0.")  # forgotten three prompts ago
        assert again.status_code == 200 and again.headers["x-kvgate-cache"] == "hit"
        assert http.get("/admin/semantic-cache", headers=admin).json()["scope_reads"] == 6
