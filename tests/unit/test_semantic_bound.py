"""The semantic cache's error bound: a new cache serves only the same question, verdicts open it as far
as the operator's max_error_rate allows, wrong ones close an entry, and a caller's report teaches it
and deletes the entry. The bound on its own first, then through the real cache (MiniLM, SQLite)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvgate.semantic_cache import Category, MiniLM, SemanticCache, SemanticCacheConfig
from kvgate.semantic_cache.bound import NEVER, Bound, BoundConfig

QUESTION = "How can I learn to play the guitar quickly?"
PARAPHRASE = "What is the fastest way to learn guitar?"


def test_a_new_bound_serves_nothing_and_right_verdicts_open_it() -> None:
    bound = Bound({"c": 0.1})
    assert bound.threshold("c") == NEVER and not bound.allows("c", "e", 0.99)
    for i in range(BoundConfig().warmup - 1):
        bound.asked("c", 0.95)
        bound.learn("c", f"e{i}", 0.95, True)
    assert bound.threshold("c") == NEVER  # not before the category's warm-up
    for i in range(40):
        bound.asked("c", 0.95)
        bound.learn("c", f"e{i}", 0.95, True)
    assert bound.threshold("c") <= 0.95 and bound.allows("c", "other", 0.95)
    assert not bound.allows("c", "other", 0.5)  # nothing was learnt there


def test_wrong_verdicts_keep_a_score_range_shut() -> None:
    bound = Bound({"c": 0.1})
    for i in range(40):
        bound.asked("c", 0.95)
        bound.learn("c", f"e{i}", 0.95, i % 3 != 0)  # a third wrong
    assert bound.threshold("c") == NEVER


def test_the_error_is_weighed_by_how_often_each_score_is_asked_not_by_how_often_it_was_checked() -> None:
    """Most questions land where a fifth of the answers are wrong; the well-checked scores above are
    right but rare: serving from 0.9 would be wrong ~18% of the time, over a 12% bound."""
    bound = Bound({"c": 0.12})
    for score, asked, wrong_every in ((0.905, 1800, 5), (0.925, 50, 0), (0.945, 50, 0), (0.965, 50, 0), (0.985, 50, 0)):
        for _ in range(asked):
            bound.asked("c", score)
        for i in range(200):
            bound.learn("c", f"{score}-{i}", score, not (wrong_every and i % wrong_every == 0))
    assert not bound.allows("c", "x", 0.905) and bound.allows("c", "x", 0.925)


def test_a_zero_error_rate_never_serves_another_question_whatever_the_evidence() -> None:
    bound = Bound({"c": 0.0})
    for _ in range(100):
        bound.learn("c", "e", 0.99, True)
    assert not bound.allows("c", "e", 0.999)


def test_an_entry_wrong_at_a_score_serves_nothing_at_or_below_it_and_right_ones_loosen_it() -> None:
    bound = Bound({"c": 0.1}, BoundConfig(min_right=2))
    for i in range(60):
        bound.asked("c", 0.9)
        bound.learn("c", f"e{i}", 0.9, True)
    limit = bound.threshold("c")
    assert limit <= 0.9
    bound.learn("c", "bad", 0.93, False)
    assert bound.allows("c", "good", 0.93) and not bound.allows("c", "bad", 0.93)
    assert bound.allows("c", "bad", 0.94)
    low = limit - 0.2
    assert not bound.allows("c", "loved", low)
    bound.learn("c", "loved", low, True)
    bound.learn("c", "loved", low, True)
    assert bound.allows("c", "loved", low) and not bound.allows("c", "loved", low - 0.01)


def test_the_entries_taught_are_bounded() -> None:
    bound = Bound({"c": 0.1}, BoundConfig(entries=3))
    for i in range(5):
        bound.learn("c", f"e{i}", 0.5, False)
    assert list(bound.own) == ["e2", "e3", "e4"]
    assert bound.stats()["entries_taught"] == 3


@pytest.mark.parametrize("delta", [0.03, 0.05, 0.1])
def test_on_a_stream_the_realised_error_stays_under_delta(delta: float) -> None:
    """Scores uniform in [0.5, 1]; a candidate at score s is wrong with probability 2(1 - s), twice
    what the bound's prior says. Misses are all checked, would-be hits 5% of the time."""
    rng = np.random.default_rng(0)
    bound = Bound({"c": delta})
    served = wrong = 0
    for i in range(20_000):
        score = float(rng.uniform(0.5, 1.0))
        right = bool(rng.random() >= 2 * (1 - score))
        bound.asked("c", score)
        if bound.allows("c", str(i), score) and rng.random() >= 0.05:
            served += 1
            wrong += not right
        else:
            bound.learn("c", str(i), score, right)
    assert served > 300  # it opened
    assert wrong / served <= delta


# ---- through the cache ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedder() -> MiniLM:
    return MiniLM()


def bounded(tmp_path: Path, embedder: MiniLM, delta: float = 0.1, **options) -> SemanticCache:
    category = Category("all", threshold=0.5, floor=0.5, ttl_s=3600, quota=100, max_error_rate=delta)
    config = SemanticCacheConfig(sqlite_path=tmp_path / "s.sqlite3", categories=(category,), verify_rate=0.0)
    return SemanticCache(SemanticCacheConfig(**{**config.__dict__, **options}), embedder=embedder)


def test_a_new_cache_serves_the_same_question_but_not_yet_a_paraphrase(tmp_path: Path, embedder: MiniLM) -> None:
    cache = bounded(tmp_path, embedder)
    cache.put("t", "s", QUESTION, {"content": "Practise every day."})
    same = cache.lookup("s", "how can I learn to play the GUITAR quickly")  # the same words
    assert same.hit and same.score == 1.0
    near = cache.lookup("s", PARAPHRASE)
    assert not near.hit and near.candidate is not None and near.candidate.query == QUESTION
    assert 0.0 < near.score < 1.0  # the verifier's


def test_the_models_answers_open_an_entry_to_its_paraphrase(tmp_path: Path, embedder: MiniLM) -> None:
    """Three answers the same as the cached one: the entry's own evidence opens it (BoundConfig.min_right),
    while the category as a whole has too few verdicts to."""
    cache = bounded(tmp_path, embedder)
    cache.put("t", "s", QUESTION, {"content": "Practise every day."})
    for _ in range(60):
        found = cache.lookup("s", PARAPHRASE)
        if found.hit:
            break
        assert cache.learn(found, "Practise  every day.") is True  # the same answer: right
    assert found.hit and found.entry is not None and found.entry.query == QUESTION
    stats = cache.stats()["bound"]
    assert stats["verdicts"]["right"] == BoundConfig().min_right and stats["categories"]["all"]["threshold"] == NEVER


def test_a_different_answer_is_a_wrong_verdict_and_keeps_the_entry_shut(tmp_path: Path, embedder: MiniLM) -> None:
    cache = bounded(tmp_path, embedder)
    cache.put("t", "s", QUESTION, {"content": "Practise every day."})
    for _ in range(60):
        found = cache.lookup("s", PARAPHRASE)
        assert not found.hit
        assert cache.learn(found, "The guitar was invented in Spain in the 16th century.") is False
    assert cache.stats()["bound"]["verdicts"] == {"right": 0, "wrong": 60}


def test_a_share_of_would_be_hits_is_left_to_the_model(tmp_path: Path, embedder: MiniLM) -> None:
    cache = bounded(tmp_path, embedder, verify_rate=1.0)
    cache.put("t", "s", QUESTION, {"content": "Practise every day."})
    for _ in range(60):
        found = cache.lookup("s", PARAPHRASE)
        assert not found.hit
        if found.verify:
            break
        cache.learn(found, "Practise every day.")
    assert found.verify and cache.stats()["verified"] == 1
    assert cache.lookup("s", PARAPHRASE).verify and cache.stats()["verified"] == 2  # counted, each one


def test_a_zero_error_rate_category_serves_only_the_same_question(tmp_path: Path, embedder: MiniLM) -> None:
    cache = bounded(tmp_path, embedder, delta=0.0)
    cache.put("t", "s", QUESTION, {"content": "Practise every day."})
    for _ in range(30):
        cache.learn(cache.lookup("s", PARAPHRASE), "Practise every day.")
    assert not cache.lookup("s", PARAPHRASE).hit and cache.lookup("s", QUESTION).hit


def test_a_reported_hit_teaches_the_bound_and_deletes_the_entry(tmp_path: Path, embedder: MiniLM) -> None:
    cache = bounded(tmp_path, embedder)
    cache.put("t", "s", QUESTION, {"content": "Practise every day."})
    found = cache.lookup("s", QUESTION)
    cache.remember("chatcmpl-1", "t", found)
    assert cache.report("chatcmpl-1", "someone else") is None  # only the tenant served may report it
    assert cache.report("chatcmpl-404", "t") is None
    assert cache.report("chatcmpl-1", "t") == found.entry.id
    assert not cache.lookup("s", QUESTION).hit
    assert cache.stats()["bound"]["verdicts"]["wrong"] == 1
    assert not cache.bound.own  # the entry's own verdicts went with it, under no other name either
    assert bounded(tmp_path, embedder, bound=BoundConfig(entries=7, warmup=0)).bound.config.entries == 7
    assert cache.report("chatcmpl-1", "t") is None  # once


def test_the_hits_remembered_for_reports_are_bounded(tmp_path: Path, embedder: MiniLM) -> None:
    cache = bounded(tmp_path, embedder, served=2)
    cache.put("t", "s", QUESTION, {"content": "Practise every day."})
    found = cache.lookup("s", QUESTION)
    for i in range(3):
        cache.remember(f"chatcmpl-{i}", "t", found)
    assert list(cache.served) == ["chatcmpl-1", "chatcmpl-2"]
    assert cache.report("chatcmpl-0", "t") is None


def test_beside_a_checked_would_be_hit_is_served_and_still_judged(tmp_path: Path, embedder: MiniLM) -> None:
    cache = bounded(tmp_path, embedder, verify_rate=1.0, verify_beside=True)
    cache.put("t", "s", QUESTION, {"content": "Practise every day."})
    for _ in range(BoundConfig().min_right):
        cache.learn(cache.lookup("s", PARAPHRASE), "Practise every day.")
    found = cache.lookup("s", PARAPHRASE)
    assert found.hit and found.verify  # served all the same
    assert cache.learn(found, "Buy a piano instead.") is False
    assert not cache.lookup("s", PARAPHRASE).hit  # the wrong verdict shut the entry at that score
    same = cache.lookup("s", QUESTION)
    assert same.hit and not same.verify and cache.learn(same, "anything") is None  # nothing to judge
