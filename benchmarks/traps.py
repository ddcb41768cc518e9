"""Traps for the semantic cache, for `kvgate bench semantic`: questions a typed edit turned into a
different question that still embeds close to the original; what a lookup serves them, with and
without the guards; and the guards' report. The guards (semantic_cache/guards.py) look for the same
kinds of words the generators edit, so the synthetic traps flatter them: QQP's own near
non-duplicates are reported beside them."""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvgate.bench.data import Half
from kvgate.runtime.report import pct, table
from kvgate.semantic_cache.config import SemanticCacheConfig
from kvgate.semantic_cache.guards import GUARDS, refusal, words
from kvgate.semantic_cache.verifier import STOP

if TYPE_CHECKING:
    from kvgate.semantic_cache.policy import Classifier

NATURAL = 0.7  # natural traps: QQP non-duplicates at least this similar (the lowest threshold compared)

AUX = {
    "is": "isn't",
    "are": "aren't",
    "was": "wasn't",
    "were": "weren't",
    "do": "don't",
    "does": "doesn't",
    "did": "didn't",
    "can": "can't",
    "could": "couldn't",
    "should": "shouldn't",
    "would": "wouldn't",
    "will": "won't",
    "has": "hasn't",
    "have": "haven't",
}
UNDO = {v: k for k, v in AUX.items()} | {"cannot": "can", "dont": "do", "doesnt": "does", "cant": "can"}
SUBJECTS = frozenset("i you we they he she it one people someone anyone".split())
# Names by kind: a swap stays within its kind (India -> China), which keeps the embedding close.
KINDS = [
    "India China Pakistan USA America Canada Australia Germany France Japan Russia Brazil UK England Italy Spain "
    "Mexico Nigeria Singapore Israel Iran Bangladesh Nepal Ireland Sweden Korea",
    "Delhi Mumbai Bangalore Hyderabad Chennai Pune Kolkata London Paris Tokyo Chicago Boston Toronto Sydney Berlin "
    "Dubai Seattle",
    "Google Apple Microsoft Amazon Facebook Quora Samsung Tesla Uber Netflix Infosys TCS Wipro Intel IBM Oracle "
    "Twitter Flipkart Yahoo Nokia Sony Snapchat Instagram WhatsApp",
    "Trump Hillary Clinton Obama Modi Putin Gandhi Einstein Musk Kejriwal Rahul",
    "Python Java JavaScript PHP Ruby Swift Android iOS Windows Linux Excel MATLAB",
    "English Spanish French German Chinese Japanese Russian Arabic Hindi",
]
NAME_KIND = {name: kind for kind, names in enumerate(KINDS) for name in names.split()}
NUMBER_WORDS = "two three four five six seven eight nine ten twenty hundred thousand million".split()
NARROW = [
    " for beginners",
    " for kids",
    " in 2010",
    " without a degree",
    " for women",
    " at night",
    " in winter",
    " for free",
    " as a student",
    " after 40",
]
WIDEN = re.compile(r"\s+\b(only|just|all|every)\b", re.IGNORECASE)
THE = re.compile(r"\b(is|are|was|were) the\b", re.IGNORECASE)


def negation(q: str, rng: np.random.Generator, pool: list[str]) -> str | None:
    """Take a negation out, or put one in: after the auxiliary's subject pronoun ("how can I not..."),
    or as the auxiliary's contraction ("why don't women...")."""
    tokens = q.split()
    for i, tok in enumerate(tokens):
        low = tok.lower().strip("?,.")
        if low in UNDO or low in ("not", "never"):
            if low in ("not", "never"):
                return " ".join(tokens[:i] + tokens[i + 1 :])
            tokens[i] = _case(UNDO[low], tok) + tok[len(low) :]
            return " ".join(tokens)
    for i, tok in enumerate(tokens[:-1]):
        low = tok.lower()
        if low in AUX:
            if tokens[i + 1].lower() in SUBJECTS and i + 2 < len(tokens):
                word = "never" if rng.random() < 0.3 else "not"
                return " ".join([*tokens[: i + 2], word, *tokens[i + 2 :]])
            tokens[i] = _case(AUX[low], tok)
            return " ".join(tokens)
    return None


def entity(q: str, rng: np.random.Generator, pool: list[str]) -> str | None:
    """Swap a name for another of its kind (countries, cities, companies, people, languages), or
    else a capitalised word for another name seen in the data."""
    words = re.findall(r"\b[A-Z][A-Za-z+#]*\b", q)
    known = [w for w in words if w in NAME_KIND]
    if known:
        old = known[int(rng.integers(len(known)))]
        others = [n for n in KINDS[NAME_KIND[old]].split() if n != old]
    else:
        inner = [w for w in words[1:] if w in set(pool) and w != "I"]
        if not inner:
            return None
        old = inner[int(rng.integers(len(inner)))]
        others = [n for n in pool if n[:4] != old[:4]]  # not an inflection of the same name
    new = others[int(rng.integers(len(others)))]
    return re.sub(rf"\b{re.escape(old)}\b", new, q, count=1)


def number(q: str, rng: np.random.Generator, pool: list[str]) -> str | None:
    """Change a year by a few years, another number by a bit, or a number word for another."""
    found = re.search(r"(?<![\w.,])\d+(?![\d.,]\d)", q)
    if found:
        n = int(found.group())
        if 1900 <= n <= 2030:
            new = n + int(rng.choice([-1, 1])) * int(rng.integers(1, 8))
        else:
            new = n + int(rng.integers(1, max(2, n // 2) + 1))
        return q[: found.start()] + str(new) + q[found.end() :]
    words = [w for w in re.findall(r"\b[a-z]+\b", q) if w in NUMBER_WORDS]
    if not words:
        return None
    old = words[0]
    new = str(rng.choice([w for w in NUMBER_WORDS if w != old]))
    return re.sub(rf"\b{old}\b", new, q, count=1)


def scope(q: str, rng: np.random.Generator, pool: list[str]) -> str | None:
    """Widen (drop "only", "just", "all", "every") or narrow ("is the only...", or a qualifier at the
    end: for beginners, in 2010, without a degree...)."""
    if WIDEN.search(q):
        return WIDEN.sub("", q, count=1)
    if THE.search(q) and rng.random() < 0.3:
        return THE.sub(lambda m: f"{m.group(1)} the only", q, count=1)
    stem = q.rstrip().rstrip("?").rstrip()
    return stem + str(rng.choice(NARROW)) + "?"


def swap(q: str, rng: np.random.Generator, pool: list[str]) -> str | None:
    """Exchange two names, each said once and not one name's two parts: who does what to whom
    ("import from India, sell in Canada")."""
    found = re.findall(r"\b[A-Z][A-Za-z+#]*\b", q)
    once = [w for w in found[1:] if found.count(w) == 1 and w.lower() not in STOP]
    pairs = [(a, b) for i, a in enumerate(once) for b in once[i + 1 :] if not re.search(rf"\b{a}\W+{b}\b", q)]
    if not pairs:
        return None
    a, b = pairs[0]
    return re.sub(rf"\b({re.escape(a)}|{re.escape(b)})\b", lambda m: b if m.group() == a else a, q)


def _case(word: str, like: str) -> str:
    return word.capitalize() if like[:1].isupper() else word


Edit = Callable[[str, np.random.Generator, list[str]], str | None]
EDITS: dict[str, Edit] = {"negation": negation, "entity": entity, "number": number, "scope": scope, "swap": swap}


def names(questions: list[str], least: int = 5) -> list[str]:
    """Words seen capitalised inside questions (not opening them) at least `least` times, and
    almost never in lower case: names, roughly."""
    upper = Counter(w for q in questions for w in re.findall(r"(?<=[a-z,] )[A-Z][a-z]{2,}\b", q))
    lower = Counter(w for q in questions for w in re.findall(r"\b[a-z]{3,}\b", q))
    return sorted(w for w, n in upper.items() if n >= least and lower[w.lower()] <= n // 10)


def make_traps(questions: list[str], per_type: int, seed: int = 0) -> dict[str, list[tuple[int, str]]]:
    """Up to `per_type` traps of each type: (index of the source question, the edited question)."""
    rng = np.random.default_rng(seed)
    pool = names(questions)
    traps: dict[str, list[tuple[int, str]]] = {}
    for kind, edit in EDITS.items():
        found: list[tuple[int, str]] = []
        for i in rng.permutation(len(questions)):
            edited = edit(questions[i], rng, pool)
            if edited and edited.strip() != questions[i].strip():
                found.append((int(i), edited))
                if len(found) == per_type:
                    break
        traps[kind] = found
    return traps


# ---- what a lookup serves --------------------------------------------------------------------


@dataclass
class Served:
    """What a lookup serves each query at any threshold up to `score`: `entry` (-1: nothing)."""

    score: np.ndarray
    entry: np.ndarray
    refused: list[str | None]  # the guard that turned the nearest entry away


def nearest(qvecs: np.ndarray, svecs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k cosine neighbours (numpy, in blocks): ids and similarities, nearest first."""
    k = min(k, len(svecs))
    ids, sims = np.zeros((len(qvecs), k), int), np.zeros((len(qvecs), k), np.float32)
    for i in range(0, len(qvecs), 1024):
        s = qvecs[i : i + 1024] @ svecs.T
        top = np.argpartition(-s, k - 1, axis=1)[:, :k]
        part = np.take_along_axis(s, top, 1)
        order = np.argsort(-part, axis=1)
        ids[i : i + 1024], sims[i : i + 1024] = np.take_along_axis(top, order, 1), np.take_along_axis(part, order, 1)
    return ids, sims


def serve(queries: list[str], qvecs: np.ndarray, stored: list[str], svecs: np.ndarray, guards: bool) -> Served:
    """As SemanticCache.find does: the nearest candidates in order, the first no guard refuses."""
    k = SemanticCacheConfig().candidates if guards else 1
    ids, sims = nearest(qvecs, svecs, k)
    score, entry = np.full(len(queries), -1.0), np.full(len(queries), -1)
    refused: list[str | None] = [None] * len(queries)
    for i, query in enumerate(queries):
        for j in range(ids.shape[1]):
            guard = refusal(query, stored[ids[i, j]], tuple(GUARDS)) if guards else None
            if j == 0:
                refused[i] = guard
            if guard is None:
                score[i], entry[i] = sims[i, j], ids[i, j]
                break
    return Served(score, entry, refused)


@dataclass
class Traps:
    kind: np.ndarray  # each trap's type
    source: np.ndarray  # the stored question it was made from
    cat: np.ndarray  # its category
    plain: Served  # what a lookup serves it without guards
    guarded: Served
    examples: dict[str, tuple[str, str]]  # one (source, trap) per type
    texts: list[str]
    vecs: np.ndarray


def traps_for(test: Half, per_type: int, embed: Callable[[list[str]], np.ndarray], classify: Classifier) -> Traps:
    """Up to `per_type` traps of each type made from the stored questions, and what a lookup serves them."""
    made = make_traps(test.stored, per_type)
    flat = [(kind, src, text) for kind, found in made.items() for src, text in found]
    texts = [t for _, _, t in flat]
    vecs = embed(texts)
    cats = [c.name for c in classify.config.categories]
    return Traps(
        kind=np.array([k for k, _, _ in flat]),
        source=np.array([s for _, s, _ in flat], dtype=int),
        cat=np.array([cats.index(classify(t, v).name) for t, v in zip(texts, vecs, strict=True)], dtype=int),
        plain=serve(texts, vecs, test.stored, test.svecs, False),
        guarded=serve(texts, vecs, test.stored, test.svecs, True),
        examples={k: (test.stored[f[0][0]], f[0][1]) for k, f in made.items() if f},
        texts=texts,
        vecs=vecs,
    )


def served(s: Served, limit: np.ndarray | float, entry: np.ndarray) -> np.ndarray:
    """Whether each query is served `entry` at its threshold."""
    return (s.score >= limit) & (s.entry == entry)


def trap_rows(test: Half, plain: Served, guarded: Served, traps: Traps, settings: dict) -> list[list[str]]:
    """Per setting: % of paraphrases served their own pair's answer; % of traps served the answer of
    the question they were made from, by type; natural traps (QQP non-duplicates above NATURAL)."""
    natural = ~test.dup & (np.einsum("ij,ij->i", test.qvecs, test.svecs[test.own]) >= NATURAL)
    rows = []
    for name, (limits, guards) in settings.items():
        s, t = (guarded, traps.guarded) if guards else (plain, traps.plain)
        own = served(s, limits[test.cat], test.own)
        fooled = served(t, limits[traps.cat], traps.source)
        kinds = [pct(fooled[traps.kind == k].mean()) if (traps.kind == k).any() else "-" for k in EDITS]
        anyhit = (t.score >= limits[traps.cat]).mean()
        rows.append([name, pct(own[test.dup].mean()), *kinds, pct(fooled.mean()), pct(anyhit)])
        rows[-1].append(pct(own[natural].mean()) if natural.any() else "-")
    counts = [str(int((traps.kind == k).sum())) for k in EDITS]
    rows.append(["(questions)", str(int(test.dup.sum())), *counts, *[str(len(traps.kind))] * 2, str(natural.sum())])
    return rows


def guard_rows(test: Half, plain: Served, guarded: Served, traps: Traps, limits: np.ndarray) -> list[list[str]]:
    """What each guard turned away among nearest entries that clear the thresholds."""
    cleared = plain.score >= limits[test.cat]
    right = cleared & (plain.entry == test.own) & test.dup
    fooled = served(traps.plain, limits[traps.cat], traps.source)
    rows = []
    for g in GUARDS:
        ref = np.array([r == g for r in guarded.refused])
        t_ref = np.array([r == g for r in traps.guarded.refused]) & fooled
        kinds = [str(int(t_ref[traps.kind == k].sum())) for k in EDITS]
        rows.append([g, str(int((ref & right).sum())), str(int((ref & cleared & ~right).sum())), *kinds])
    kinds = [str(int(fooled[traps.kind == k].sum())) for k in EDITS]
    rows.append(["(above the threshold)", str(int(right.sum())), str(int((cleared & ~right).sum())), *kinds])
    return rows


def equal_paraphrase_rows(test: Half, plain: Served, guarded: Served, traps: Traps) -> list[list[str]]:
    """Without and with guards, the highest single threshold serving each share of paraphrases, and the
    natural and synthetic traps served there: do the guards beat a higher threshold?"""
    natural = ~test.dup & (np.einsum("ij,ij->i", test.qvecs, test.svecs[test.own]) >= NATURAL)
    rows = []
    for share in (0.4, 0.45, 0.5, 0.55, 0.6):
        row = [f"{100 * share:.0f}"]
        for s, t in ((plain, traps.plain), (guarded, traps.guarded)):
            own = np.sort(s.score[test.dup & (s.entry == test.own)])[::-1]
            if len(own) < share * test.dup.sum() or not natural.any():
                row += ["-", "-", "-"]
                continue
            limit = float(own[int(np.ceil(share * test.dup.sum())) - 1])
            fooled = served(t, limit, traps.source).mean()
            row += [f"{limit:.3f}", pct(served(s, limit, test.own)[natural].mean()), pct(fooled)]
        rows.append(row)
    return rows


def guard_cost(test: Half) -> tuple[list[float], list[float]]:
    """Seconds per refusal(query, cached) with every guard, first with an empty word cache, then warm."""
    pairs = [(q, test.stored[o]) for q, o in zip(test.queries, test.own, strict=True)]
    words.cache_clear()
    out: tuple[list[float], list[float]] = ([], [])
    for samples in out:
        for q, c in pairs:
            start = time.perf_counter()
            refusal(q, c, tuple(GUARDS))
            samples.append(time.perf_counter() - start)
    return out


def us(samples: list[float]) -> str:
    return f"{np.percentile(samples, 50) * 1e6:.0f} / {np.percentile(samples, 99) * 1e6:.0f}"


def section(test: Half, plain: Served, guarded: Served, traps: Traps, settings: dict, limits: np.ndarray) -> str:
    """The guards' and the traps' part of the report."""
    cold, warm = guard_cost(test)
    return (
        "### Guards\n\n"
        "Nearest entries above the fitted per-category thresholds that each guard turned away: right answers "
        "lost, wrong answers prevented (QQP), and synthetic traps refused, by type. Cost of `refusal(query, "
        f"cached)` with every guard, µs per check p50 / p99: {us(cold)} with an empty word cache, {us(warm)} "
        f"warm ({len(cold)} test pairs).\n\n"
        + table(
            ["guard", "right hits lost", "wrong hits prevented", *[f"{k} traps" for k in EDITS]],
            guard_rows(test, plain, guarded, traps, limits),
        )
        + "\n\n### Paraphrases against traps\n\n"
        "Paraphrases: the test half's duplicate pairs, served when their own `a` is served. Synthetic traps: "
        f"up to {max(np.unique(traps.kind, return_counts=True)[1], default=0)} per type, each a typed edit of a "
        "stored test-half question (negation put in or taken out; a name swapped for another of its kind or "
        "another name seen in the data; a number or year changed; scope narrowed or widened: only/all, for "
        "beginners, in 2010, without a degree...; two names exchanged), served when the question it was made "
        "from is served (any "
        "hit %: served any entry). The guards look for the same kinds of words the generator edits (circular), "
        "so the natural traps matter more: test-half non-duplicate pairs whose cosine is at least "
        f"{NATURAL}, served when their own `a` is served. Reported elsewhere: GPTCache's defaults 81% "
        "paraphrases / 81% traps, RedisVL's 51% / 11%. Target: at least 60% / at most 10%.\n\n"
        + table(
            ["setting", "paraphrases %", *[f"{k} %" for k in EDITS], "all synthetic %", "any hit %", "natural %"],
            trap_rows(test, plain, guarded, traps, settings),
        )
        + "\n\nEqual paraphrases: the highest single threshold that serves each share of the paraphrases, "
        "without and with guards, and the traps served there.\n\n"
        + table(
            ["paraphrases %", "threshold", "natural %", "synthetic %", "threshold + guards", "natural %"]
            + ["synthetic %"],
            equal_paraphrase_rows(test, plain, guarded, traps),
        )
        + "\n\nOne trap of each type:\n\n"
        + table(["type", "stored question", "trap"], [[k, s, t] for k, (s, t) in traps.examples.items()])
    )
