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
    # A word ending in "nt" is no negation; only a contraction is ("needn't", below).
    ("What should I do if I want to learn Python?", "How do I learn Python?"),
    # Quantities are normalised: thousands separators, ordinal suffixes, calendar abbreviations.
    ("Is 1,000 calories a day enough?", "Is 1000 calories a day enough?"),
    ("Who was born on July 4th?", "Who was born on July 4?"),
    ("Why is October 31st special?", "Why is October 31 special?"),
    ("What happened on June 2nd?", "What happened on June 2?"),
    ("What happened on March 3rd?", "What happened on March 3?"),
    ("is the bank open on dec 25", "is the bank open on december 25"),
    # A name is found in any case, with its apostrophe, as a plural, or as its adjective.
    ("Who is Conan O'Brien married to?", "Who is the wife of Conan O'Brien?"),
    ("What is the capital of Spain?", "Which city is the capital of Spain?"),
    ("What is an API?", "What are APIs?"),
    ("How do I center a div with CSS?", "How can I center a div using CSS?"),
    ("How much do CEOs earn?", "How much does a CEO earn?"),
    ("What is traditional food in Peru?", "What is traditional Peruvian food?"),
    ("What currency is used in the Bahamas?", "What is the Bahamian currency?"),
    ("What did Mrs Thatcher say about Europe?", "What did Mrs Thatcher think of Europe?"),  # a short name's "s"
    # A contraction of "I" is no name, whatever its apostrophe.
    ("What should I do if I'm tired?", "What should I do if I am tired?"),
]

TRAPS = [
    ("Is coffee good for you?", "Is coffee not good for you?", "negation"),
    ("What are the advantages of nuclear power?", "What are the disadvantages of nuclear power?", "negation"),
    ("Needn't I pay tax on tips?", "Need I pay tax on tips?", "negation"),
    ("What helps with weight gain?", "What helps with weight loss?", "negation"),
    ("How do I get a visa for Canada?", "How do I get a visa for Australia?", "entities"),
    ("How do I get a visa?", "How do I get a visa for Canada?", "entities"),
    ("What is the price of gas in GA?", "What is the price of gas?", "entities"),  # "gas" is not a plural of GA
    ("What is the capital of Iran?", "What is the capital of Iraq?", "entities"),
    ("What is the population of Austin?", "What is the population of Austria?", "entities"),
    ("What size is a4 paper?", "What size is b4 paper?", "entities"),
    ("How do I reset my iPhone?", "How do I reset my iPad?", "entities"),  # a capital inside: a name
    ("How do I enable HTTPS on nginx?", "How do I enable HTTP on nginx?", "entities"),  # an acronym is no plural
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
