"""The semantic cache on its own: the real MiniLM embedder, hnswlib and a SQLite file."""

from __future__ import annotations

import sqlite3
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvgate.semantic_cache import Category, MiniLM, SemanticCache, SemanticCacheConfig, categories
from kvgate.semantic_cache.policy import threshold

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def embedder() -> MiniLM:
    return MiniLM()


def make(path: Path, embedder: MiniLM, **options) -> SemanticCache:
    return SemanticCache(SemanticCacheConfig(sqlite_path=path / "semantic.sqlite3", **options), embedder=embedder)


@pytest.fixture
def cache(tmp_path: Path, embedder: MiniLM) -> SemanticCache:
    """The shipped categories without their error bound: the threshold and the guards decide (the
    bound has tests of its own, in test_semantic_bound.py)."""
    return make(tmp_path, embedder, categories=unbounded())


def unbounded() -> tuple[Category, ...]:
    return tuple(replace(c, max_error_rate=None) for c in categories())


def test_embeddings_are_normalised_and_batched_rows_match_single_ones(embedder: MiniLM) -> None:
    texts = ["short", "a much longer sentence about the weather in Paris today", QUESTION]
    batch = embedder.embed(texts)
    assert batch.shape == (3, 384) and batch.dtype == np.float32
    assert np.allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    for i, text in enumerate(texts):  # padding in a batch changes nothing
        assert np.allclose(embedder.embed([text])[0], batch[i], atol=1e-5)


def test_a_paraphrase_hits_and_reports_its_similarity(cache: SemanticCache) -> None:
    cache.put("t", "s", QUESTION, {"content": "Paris"})
    cache.put("t", "s", "Which river runs through Vellmoor?", {"content": "the Ashen"})  # a candidate too far
    found = cache.lookup("s", "What's the capital city of France?")
    assert found.hit and found.entry is not None and found.entry.response == {"content": "Paris"}
    assert found.threshold <= found.similarity < 1.0
    assert not cache.lookup("s", "How do I bake sourdough bread?").hit
    cache.lookup("s", QUESTION), cache.lookup("s", "How do I bake sourdough bread?")
    assert (cache.stats()["hits"], cache.stats()["misses"]) == (2, 2)  # each lookup counted


def test_another_scope_never_hits(cache: SemanticCache) -> None:
    cache.put("tenant-a", "scope-a", QUESTION, {"content": "Paris"})
    assert cache.lookup("scope-a", QUESTION).hit
    assert not cache.lookup("scope-b", QUESTION).hit


def test_a_guard_refuses_a_close_question_with_another_answer(cache: SemanticCache) -> None:
    cache.put("t", "s", "Is coffee good for your health?", {"content": "yes, in moderation"})
    found = cache.lookup("s", "Is coffee not good for your health?")
    assert not found.hit and found.refused == "negation"
    found = cache.lookup("s", "Is coffee good for your health in 2010?")
    assert not found.hit and found.refused == "numbers"
    assert cache.stats()["refused"] == 2  # each refused miss counted


def test_a_refused_candidate_is_passed_over_for_the_next(cache: SemanticCache) -> None:
    cache.put("t", "s", "Is coffee good for your health?", {"content": "yes, in moderation"})
    negated = cache.put("t", "s", "Is coffee not healthy?", {"content": "it is, in moderation"})  # less similar
    found = cache.lookup("s", "Is coffee not good for your health?")  # the first candidate is refused
    assert found.hit and found.entry.id == negated.id and found.refused == "negation"
    assert cache.stats()["refused"] == 0  # a hit is not a refusal, whatever it passed over


def test_the_verifier_scores_the_candidate_and_without_one_the_similarity_does(
    tmp_path: Path, embedder: MiniLM
) -> None:
    paraphrase = "What's the capital city of France?"
    for verifier in (True, False):
        options = {} if verifier else {"verifier": None}
        cache = make(tmp_path / str(verifier), embedder, categories=unbounded(), **options)
        cache.put("t", "s", QUESTION, {"content": "Paris"})
        found = cache.lookup("s", paraphrase)
        assert found.hit
        if verifier:
            assert cache.verifier is not None
            want = cache.verifier.score(paraphrase, QUESTION, found.similarity, found.category.name)
            assert found.score == want != found.similarity
        else:
            assert cache.verifier is None and found.score == found.similarity


def test_the_best_scored_candidate_is_served_not_the_nearest_or_the_last(cache: SemanticCache) -> None:
    query = "What's the capital city of France?"
    # By similarity: nearest, second, third; the verifier scores the second best (measured: 0.84, 0.87, 0.82).
    texts = [
        "Which city is the capital of France?",
        "France's capital is which city?",
        "Tell me the capital of France.",
    ]
    ids = [cache.put("t", "s", text, {"content": "Paris"}).id for text in texts]
    found = cache.lookup("s", query)
    vectors = cache.embed(query), *(cache.embed(t) for t in texts)
    similarities = [float(vectors[0] @ v) for v in vectors[1:]]
    assert cache.verifier is not None and min(similarities) >= found.threshold
    scores = [cache.verifier.score(query, t, s, found.category.name) for t, s in zip(texts, similarities)]
    assert similarities == sorted(similarities, reverse=True) and max(scores) == scores[1]
    assert found.hit and found.entry.id == ids[1] and found.score == pytest.approx(scores[1], abs=1e-5)


def test_only_the_guards_configured_refuse(tmp_path: Path, embedder: MiniLM) -> None:
    cache = make(tmp_path, embedder, categories=unbounded(), guards=("numbers",))
    cache.put("t", "s", "Is coffee good for your health?", {"content": "yes, in moderation"})
    assert cache.lookup("s", "Is coffee not good for your health?").hit  # no negation guard asked for
    assert cache.lookup("s", "Is coffee good for your health in 2010?").refused == "numbers"


def test_a_scope_past_flat_max_is_searched_in_its_graph(tmp_path: Path, embedder: MiniLM) -> None:
    cache = make(tmp_path, embedder, categories=unbounded(), flat_max=2)
    for q, a in [(QUESTION, "Paris"), ("How do birds fly?", "wings"), ("Why is the sky blue?", "scattering")]:
        cache.put("t", "s", q, {"content": a})
    found = cache.lookup("s", "What's the capital city of France?")
    assert found.hit and found.entry.response == {"content": "Paris"} and cache.stats()["errors"] == 0


def test_entries_expire_after_their_ttl_however_often_they_hit(tmp_path: Path, embedder: MiniLM) -> None:
    short = Category("all", threshold=0.85, floor=0.8, ttl_s=60, quota=100)
    cache = make(tmp_path, embedder, categories=(short,))
    cache.put("t", "s", QUESTION, {"content": "Paris"}, now=1000.0)
    assert cache.lookup("s", QUESTION, now=1059.0).hit  # a hit does not extend the TTL
    assert not cache.lookup("s", QUESTION, now=1060.0).hit
    assert cache.store.ids() == []  # the expired entry is gone from the store too


def test_a_category_keeps_its_quota_evicting_the_least_recently_used(tmp_path: Path, embedder: MiniLM) -> None:
    small = Category("all", threshold=0.9, floor=0.85, ttl_s=3600, quota=2)
    cache = make(tmp_path, embedder, categories=(small,))
    questions = ["How do birds fly?", "Why is the sky blue?", "What is Python used for?"]
    cache.put("t", "s", questions[0], {"content": "0"}, now=1.0)
    cache.put("t", "s", questions[1], {"content": "1"}, now=2.0)
    assert cache.lookup("s", questions[0], now=3.0).hit  # now the second is the least recently used
    cache.put("t", "s", questions[2], {"content": "2"}, now=4.0)
    assert [cache.lookup("s", q, now=5.0).hit for q in questions] == [True, False, True]
    assert len(cache.store.ids()) == 2 and cache.stats()["evicted"] == 1


def test_a_paraphrase_hit_counts_as_a_use_for_the_quota_too(tmp_path: Path, embedder: MiniLM) -> None:
    small = Category("all", threshold=0.8, floor=0.8, ttl_s=3600, quota=2)
    cache = make(tmp_path, embedder, categories=(small,))
    first = cache.put("t", "s", "How do birds fly?", {"content": "0"}, now=1.0)
    cache.put("t", "s", "Why is the sky blue?", {"content": "1"}, now=2.0)
    found = cache.lookup("s", "How are birds able to fly?", now=3.0)
    assert found.hit and found.score < 1.0 and found.entry.id == first.id  # a paraphrase, not the same question
    cache.put("t", "s", "What is Python used for?", {"content": "2"}, now=4.0)
    assert cache.lookup("s", "How do birds fly?", now=5.0).hit and not cache.lookup("s", "Why is the sky blue?").hit


def test_entries_survive_a_restart_and_a_scope_is_read_in_when_first_looked_up(
    tmp_path: Path, embedder: MiniLM
) -> None:
    make(tmp_path, embedder).put("t", "s", QUESTION, {"content": "Paris"})
    again = make(tmp_path, embedder)
    assert len(again.index) == 0 and again.stats()["scopes"] == 0  # start-up reads no scope
    found = again.lookup("s", QUESTION)
    assert found.hit and found.entry is not None and found.entry.response["content"] == "Paris"
    assert len(again.index) == 1 and again.stats()["scope_reads"] == 1


def test_a_damaged_entry_is_a_miss_and_is_deleted(tmp_path: Path, embedder: MiniLM) -> None:
    cache = make(tmp_path, embedder)
    entry = cache.put("t", "s", QUESTION, {"content": "Paris"})
    assert entry is not None
    with sqlite3.connect(tmp_path / "semantic.sqlite3") as db:
        db.execute("UPDATE entries SET response = ? WHERE id = ?", (b'{"content":"Lyon"}', entry.id))
    assert not cache.lookup("s", QUESTION).hit
    assert cache.store.ids() == [] and entry.id not in cache.index and cache.stats()["errors"] == 0


def test_a_gone_or_expired_candidate_is_passed_over_for_the_next(tmp_path: Path, embedder: MiniLM) -> None:
    short = Category("all", threshold=0.7, floor=0.7, ttl_s=60, quota=100)
    cache = make(tmp_path, embedder, categories=(short,))
    damaged = cache.put("t", "s", QUESTION, {"content": "Paris"}, now=1000.0)
    second = cache.put("t", "s", "What's the capital city of France?", {"content": "Paris, again"}, now=1000.0)
    assert damaged is not None and second is not None
    assert cache.lookup("s", QUESTION, now=1000.0).entry.id == damaged.id  # the scope is held: both indexed
    with sqlite3.connect(tmp_path / "semantic.sqlite3") as db:
        db.execute("UPDATE entries SET response = ? WHERE id = ?", (b'{"content":"Lyon"}', damaged.id))
    found = cache.lookup("s", QUESTION, now=1001.0)  # the exact match first, damaged: then the paraphrase
    assert found.hit and found.entry.id == second.id and damaged.id not in cache.index

    expired = cache.put("t", "s", QUESTION, {"content": "Paris"}, now=1000.0)
    later = cache.put("t", "s", "Tell me the capital of France.", {"content": "Paris, later"}, now=1050.0)
    assert expired is not None and later is not None
    found = cache.lookup("s", QUESTION, now=1070.0)  # the first two expired at 1060
    assert found.hit and found.entry.id == later.id and expired.id not in cache.index
    assert cache.stats()["errors"] == 0


def test_a_store_that_fails_is_a_miss_each_time_and_counted(tmp_path: Path, embedder: MiniLM) -> None:
    cache = make(tmp_path, embedder, categories=unbounded())
    cache.put("t", "s", QUESTION, {"content": "Paris"})
    cache.store.db.close()  # the SQLite connection gone: every read of the store raises
    assert not cache.lookup("s", QUESTION).hit and not cache.lookup("s", QUESTION).hit
    assert cache.stats()["errors"] == 2 and cache.stats()["misses"] == 2


def test_invalidation_by_entry_category_and_tenant(cache: SemanticCache) -> None:
    a = cache.put("alice", "s-alice", QUESTION, {"content": "Paris"})
    cache.put("alice", "s-alice", "How do I reverse a list in Python?", {"content": "reversed()"})
    cache.put("bob", "s-bob", QUESTION, {"content": "Paris"})
    assert a is not None and a.category == "factual"
    assert cache.invalidate(category="code") == 1
    assert cache.invalidate(tenant="bob") == 1
    assert not cache.lookup("s-bob", QUESTION).hit and cache.lookup("s-alice", QUESTION).hit
    assert cache.invalidate(a.id) == 1 and not cache.lookup("s-alice", QUESTION).hit
    with pytest.raises(ValueError, match="^say which entries: an id, a category or a tenant$"):
        cache.invalidate()  # never "all of them" by omission


def test_the_classifier_uses_rules_then_prototypes(cache: SemanticCache) -> None:
    def category(q: str) -> str:
        return cache.classify(q, cache.embed(q)).name

    assert category("Why does my Python function return None?") == "code"
    assert category("When is my next appointment with the dentist?") == "personal"
    assert category("Remind me what I asked you earlier") == "personal"
    assert category("What is the weather in Paris today?") == "time_sensitive"
    assert category("What is 12 * 7?") == "math"
    assert category("How can I become more confident?") == "advice"
    assert category("Why do people fall in love so easily?") == "conversation"  # by prototype: no rule matches


def test_thresholds_relax_with_the_queue_but_never_below_the_floor() -> None:
    config = SemanticCacheConfig(relax_step=0.05, queue_long=4)
    c = Category("c", threshold=0.9, floor=0.87, ttl_s=1, quota=1)
    assert threshold(c, config, 0) == 0.9
    assert threshold(c, config, 2) == pytest.approx(0.875)
    assert threshold(c, config, 100) == pytest.approx(0.87)


def test_a_long_queue_lets_a_looser_paraphrase_hit(tmp_path: Path, embedder: MiniLM) -> None:
    category = Category("all", threshold=0.97, floor=0.9, ttl_s=3600, quota=10)
    cache = make(tmp_path, embedder, categories=(category,), relax_step=0.07, queue_long=4)
    cache.put("t", "s", QUESTION, {"content": "Paris"})
    idle, busy = (
        cache.lookup("s", "What's the capital city of France?"),
        cache.lookup("s", "What's the capital city of France?", queued=9),
    )
    assert 0.9 < idle.similarity < 0.97  # between the floor and the threshold
    assert not idle.hit and idle.threshold == 0.97
    assert busy.hit and busy.threshold == pytest.approx(0.9)


def test_a_write_from_another_cache_on_the_same_file_is_seen_without_a_restart(
    tmp_path: Path, embedder: MiniLM
) -> None:
    reader, writer = make(tmp_path, embedder), make(tmp_path, embedder)
    writer.put("t", "s", QUESTION, {"content": "Paris"})
    assert reader.lookup("s", QUESTION).hit
    assert writer.invalidate(tenant="t") == 1
    assert not reader.lookup("s", QUESTION).hit and len(reader.index) == 0
