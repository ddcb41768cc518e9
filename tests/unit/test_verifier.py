"""The verifier: the shipped file loads and scores a paraphrase above a near question with another
answer; it saves and loads back the same; a file fitted on other features is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvgate.semantic_cache.verifier import NAMES, SHIPPED, Verifier, normalised, pair_features, same_answer


@pytest.fixture(scope="module")
def verifier() -> Verifier:
    return Verifier.load(SHIPPED)


def test_the_shipped_verifier_is_small_and_knows_the_shipped_categories(verifier: Verifier) -> None:
    from kvgate.semantic_cache import SemanticCacheConfig

    assert SHIPPED.stat().st_size < 64 * 1024
    assert verifier.categories == tuple(c.name for c in SemanticCacheConfig().categories)
    assert verifier.w1.shape == (len(NAMES) + len(verifier.categories), verifier.b1.shape[0])


def test_a_paraphrase_scores_above_a_question_with_another_answer(verifier: Verifier) -> None:
    cached = "How can I improve my English speaking skills?"
    paraphrase = verifier.score("How do I get better at speaking English?", cached, 0.85, "advice")
    swapped = verifier.score("How can I improve my French speaking skills?", cached, 0.85, "advice")
    negated = verifier.score("Why can't I improve my English speaking skills?", cached, 0.85, "advice")
    assert 0.0 < max(swapped, negated) < paraphrase < 1.0


def test_features_see_the_words_that_differ(verifier: Verifier) -> None:
    cached = "How do I learn Python?"
    same = dict(zip(NAMES, pair_features(cached, cached, 1.0, verifier.rarity), strict=True))
    more = dict(zip(NAMES, pair_features("How do I learn Python for kids?", cached, 0.9, verifier.rarity), strict=True))
    assert same["unmatched_query"] == 0 and same["word_jaccard"] == 1.0
    assert more["unmatched_query"] == 1 and more["unmatched_cached"] == 0 and more["rarest_unmatched"] > 0


def test_a_verifier_saves_and_loads_back_the_same(verifier: Verifier, tmp_path: Path) -> None:
    verifier.save(tmp_path / "v.npz")
    again = Verifier.load(tmp_path / "v.npz")
    args = ("Is tea good for you?", "Is green tea healthy?", 0.8, "factual")
    assert again.score(*args) == pytest.approx(verifier.score(*args), abs=1e-6)


def test_a_file_fitted_on_other_features_is_refused(verifier: Verifier, tmp_path: Path) -> None:
    path = tmp_path / "old.npz"
    verifier.save(path)
    with np.load(path) as f:
        arrays = dict(f)
    arrays["meta"] = np.array(json.dumps({"features": ["cosine"], "categories": list(verifier.categories)}))
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match="other features"):
        Verifier.load(path)


def test_the_same_question_and_the_same_answer_ignore_case_and_spacing() -> None:
    assert normalised("What is  the capital of France?") == normalised("what is the capital of france")
    assert same_answer("Paris.\n", " Paris. ") and not same_answer("Paris.", "Lyon.")
