"""Guards: a paraphrase passes every guard; each kind of trap is refused by its guard."""

from __future__ import annotations

import pytest

from kvgate.semantic_cache.guards import refusal

PARAPHRASES = [
    ("How do I learn Python quickly?", "What is the fastest way to learn python?"),
    ("How can I lose weight fast?", "What is the quickest way to lose weight?"),
    ("Why can't I sleep at night?", "Why am I not able to sleep at night?"),
    ("How does one become confident?", "How can I become more confident?"),
    ("What are the best books on Indian history?", "Which books about the history of India are best?"),
]

TRAPS = [
    ("Is coffee good for you?", "Is coffee not good for you?", "negation"),
    ("What are the advantages of nuclear power?", "What are the disadvantages of nuclear power?", "negation"),
    ("How do I get a visa for Canada?", "How do I get a visa for Australia?", "entities"),
    ("Who won the World Cup in 2014?", "Who won the World Cup in 2018?", "numbers"),
    ("What are three ways to save money?", "What are five ways to save money?", "numbers"),
    ("What happened on March 3?", "What happened on April 3?", "numbers"),
    ("Which countries drive on the left?", "Which countries only drive on the left?", "scope"),
    ("Why do women shave their legs?", "Why do all women shave their legs?", "scope"),
    ("Is Java faster than Go?", "Is Go faster than Java?", "order"),
    ("Do girls like shy guys?", "Do guys like shy girls?", "order"),
    ("Should India help Nepal as much as India can?", "Should Nepal help India as much as Nepal can?", "order"),
]


@pytest.mark.parametrize(("a", "b"), PARAPHRASES)
def test_paraphrases_pass(a: str, b: str) -> None:
    assert refusal(a, b) is None and refusal(b, a) is None


@pytest.mark.parametrize(("a", "b", "guard"), TRAPS)
def test_traps_are_refused_by_their_guard(a: str, b: str, guard: str) -> None:
    assert refusal(a, b) == guard and refusal(b, a) == guard


def test_the_same_words_in_the_same_order_pass_the_order_guard() -> None:
    assert refusal("How does this circuit work?", "how does THIS circuit work") is None


def test_only_enabled_guards_refuse() -> None:
    assert refusal("Who won in 2014?", "Who won in 2018?", enabled=("negation",)) is None
