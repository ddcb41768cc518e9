"""Guards against false hits: a question and its near neighbour that embed close together but ask
for a different answer. Each guard compares the query with the cached query and says whether they
agree; `refusal` names the first guard that does not. Rules only: no model to download."""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache

_WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?|\d+(?:[.,]\d+)*(?:st|nd|rd|th|s|k|m|bn)?", re.UNICODE)
_SENTENCE_START = re.compile(r"(?:^|[.?!:;\"(]\s*)([A-Za-z][\w']*)")

NEGATIONS = frozenset(
    "not no never none nobody nothing nowhere neither nor without cannot cant dont doesnt didnt isnt arent wasnt "
    "werent wont wouldnt shouldnt couldnt hasnt havent hadnt mustnt aint".split()
)
# Words whose swap flips the answer while the embedding barely moves.
ANTONYMS = [
    ("advantages", "disadvantages"),
    ("advantage", "disadvantage"),
    ("pros", "cons"),
    ("best", "worst"),
    ("better", "worse"),
    ("good", "bad"),
    ("increase", "decrease"),
    ("before", "after"),
    ("most", "least"),
    ("more", "less"),
    ("more", "fewer"),
    ("positive", "negative"),
    ("legal", "illegal"),
    ("buy", "sell"),
    ("win", "lose"),
    ("rich", "poor"),
    ("cheap", "expensive"),
    ("high", "low"),
    ("higher", "lower"),
    ("love", "hate"),
    ("start", "stop"),
    ("true", "false"),
    ("male", "female"),
    ("men", "women"),
    ("man", "woman"),
    ("boy", "girl"),
    ("boys", "girls"),
    ("husband", "wife"),
    ("import", "export"),
    ("gain", "lose"),
    ("weight gain", "weight loss"),
    ("up", "down"),
    ("inside", "outside"),
    ("hot", "cold"),
    ("fast", "slow"),
    ("easy", "hard"),
    ("easiest", "hardest"),
    ("safe", "dangerous"),
    ("north", "south"),
    ("east", "west"),
    ("past", "future"),
    ("always", "never"),
    ("maximum", "minimum"),
    ("max", "min"),
    ("largest", "smallest"),
    ("biggest", "smallest"),
    ("longest", "shortest"),
    ("oldest", "youngest"),
    ("first", "last"),
    ("early", "late"),
    ("add", "remove"),
    ("enable", "disable"),
    ("encrypt", "decrypt"),
    ("upload", "download"),
    ("sunrise", "sunset"),
    ("ascending", "descending"),
    ("input", "output"),
]
# Words that narrow or widen what is asked about.
SCOPE = frozenset("only all every each always just exactly entire whole both alone solely per except".split())
_TO_TWENTY = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty"
).split()
_TENS = "thirty forty fifty sixty seventy eighty ninety".split()
NUMBER_WORDS = {w: str(i) for i, w in enumerate(_TO_TWENTY)} | {w: str(30 + 10 * i) for i, w in enumerate(_TENS)}
NUMBER_WORDS |= {"hundred": "e2", "thousand": "e3", "million": "e6", "billion": "e9", "trillion": "e12"}
NUMBER_WORDS |= {
    w: f"#{i + 1}" for i, w in enumerate("first second third fourth fifth sixth seventh eighth ninth tenth".split())
}
CALENDAR = frozenset(
    # Not "may": far more often "may I..." than the month (which the names guard sees as "May").
    "january february march april june july august september october november december jan feb mar apr jun jul "
    "aug sep sept oct nov dec monday tuesday wednesday thursday friday saturday sunday today tomorrow yesterday "
    "tonight".split()
)
# Capitalised words that are not names.
NOT_NAMES = frozenset("i i'm i've i'd i'll ok okay tv".split())


# Held for the few comparisons of one lookup (each guard splits both questions). Texts are at most
# 800 characters through the gateway (QUERY_CHARS): 1024 of them hold ~12 MB at most, however many
# distinct questions come.
@lru_cache(maxsize=1024)
def words(text: str) -> tuple[str, ...]:
    return tuple(w.lower().replace("'", "") for w in _WORD.findall(text))


def negated(text: str) -> bool:
    return any(w in NEGATIONS or w.endswith("nt") and w[:-2] + "n't" in text.lower() for w in words(text))


def negation(query: str, cached: str) -> bool:
    """Both ask it positively or both negatively, and no word of a polar pair is swapped for its opposite."""
    if negated(query) != negated(cached):
        return False
    q, c = set(words(query)), set(words(cached))
    ql, cl = " ".join(words(query)), " ".join(words(cached))
    for a, b in ANTONYMS:
        qa, qb = _has(a, q, ql), _has(b, q, ql)
        ca, cb = _has(a, c, cl), _has(b, c, cl)
        if (qa and not qb and cb and not ca) or (qb and not qa and ca and not cb):
            return False
    return True


def _has(term: str, vocabulary: set[str], joined: str) -> bool:
    return f" {term} " in f" {joined} " if " " in term else term in vocabulary


def quantities(text: str) -> frozenset[str]:
    """Numbers (digits or words), ordinals, years and calendar words, normalised."""
    found = set()
    for w in words(text):
        if w[0].isdigit():
            found.add(re.sub(r"(?<=\d)(st|nd|rd|th)$", "", re.sub(r"(?<=\d)[,](?=\d{3})", "", w)))
        elif w in NUMBER_WORDS:
            found.add(NUMBER_WORDS[w])
        elif w in CALENDAR:
            found.add(w[:3])
    # "one" is as often a pronoun as a number ("how does one..."): 1 and one are not compared.
    found.discard("1")
    return frozenset(found)


def numbers(query: str, cached: str) -> bool:
    """The same numbers, ordinals, dates and times."""
    return quantities(query) == quantities(cached)


def names(text: str) -> frozenset[str]:
    """Named entities, roughly: capitalised words not opening a sentence, acronyms, letters with digits;
    lower-cased and stemmed, but acronyms upper-cased: they match only themselves (HTTPS is not HTTP's plural)."""
    openers = {m.group(1) for m in _SENTENCE_START.finditer(text)}
    found = set()
    for raw in re.findall(r"[A-Za-z][\w'.&+-]*[\w+]|[A-Za-z]", text):
        if raw.lower() in NOT_NAMES or raw in openers and not raw.isupper():
            continue
        # Capitalised, or a capital inside (iPhone, eBay), or letters with digits (a4).
        if any(ch.isupper() for ch in raw) or any(ch.isdigit() for ch in raw):
            name = raw.replace("'", "")
            found.add(name.upper() if raw.isupper() else _stem(name.lower()))
    return frozenset(found)


def entities(query: str, cached: str) -> bool:
    """Every name in one question appears in the other (in any case, or as its adjective: India and
    Indian): no swapped or added entity."""
    return _named_in(names(query), _lemmas(cached)) and _named_in(names(cached), _lemmas(query))


def _named_in(found: frozenset[str], vocabulary: set[str]) -> bool:
    return all(
        n.lower() in vocabulary if n.isupper() else n in vocabulary or any(_related(n, w) for w in vocabulary)
        for n in found
    )


def _related(a: str, b: str) -> bool:
    """One word derived from the other: they share all but the last letter of the shorter one, at least 4."""
    shared = 0
    for x, y in zip(a, b):
        if x != y:
            break
        shared += 1
    return shared >= max(4, min(len(a), len(b)) - 1)


def _stem(w: str) -> str:
    return w.removesuffix("s") if len(w) > 3 else w


def _lemmas(text: str) -> set[str]:
    ws = words(text)
    return set(ws) | {_stem(w) for w in ws}


def scope(query: str, cached: str) -> bool:
    """The same restricting words (only, all, every, exactly...)."""
    return SCOPE.intersection(words(query)) == SCOPE.intersection(words(cached))


def order(query: str, cached: str) -> bool:
    """Not the same words in another order: who does what to whom ("import from India, sell in Canada"
    against "import from Canada, sell in India"; "do girls like shy guys" against "do guys like shy girls")."""
    q, c = words(query), words(cached)
    return set(q) != set(c) or list(dict.fromkeys(q)) == list(dict.fromkeys(c))


GUARDS: dict[str, Callable[[str, str], bool]] = {
    "negation": negation,
    "numbers": numbers,
    "entities": entities,
    "scope": scope,
    "order": order,
}


def refusal(query: str, cached: str, enabled: tuple[str, ...] = tuple(GUARDS)) -> str | None:
    """The name of the first enabled guard that refuses to serve `cached`'s answer for `query`, or None."""
    for name in enabled:
        if not GUARDS[name](query, cached):
            return name
    return None
