"""The error bound replayed, for `kvgate bench semantic`: the test half's questions and the synthetic
traps asked in one shuffled stream against the test half's entries, each decided as
`SemanticCache.find` decides (nearest candidates by cosine, the best verifier score among them, the
bound's verdict), with the verdicts the gateway would get from the model's own answer (here: QQP's
label; a trap is wrong for the question it was made from; a hit on another pair's entry has no
label, and teaches nothing). Misses teach the bound at their best candidate, and `verify_rate` of the
would-be hits are answered by the model instead, as the gateway does."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvgate.bench.data import Half
from kvgate.bench.semantic_latency import SEED
from kvgate.bench.traps import EDITS, NATURAL, Traps, nearest
from kvgate.runtime.report import pct, table
from kvgate.semantic_cache.bound import Bound, BoundConfig
from kvgate.semantic_cache.config import SemanticCacheConfig
from kvgate.semantic_cache.guards import refusal
from kvgate.semantic_cache.verifier import Verifier, normalised

DELTAS = (0.01, 0.05, 0.10)
FLOOR = 0.6  # cosine below which a candidate is not judged (the categories' floor in categories.yaml)
VERIFY = SemanticCacheConfig().verify_rate
CANDIDATES = 4
CURVE = (250, 500, 1000, 2000, 4000, 8000)
SHARES = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
REPLAYS = 8
GUARDED = True  # the guards veto before the verifier scores


@dataclass
class Asked:
    """One stream of questions: text, vector, category name, and whom each is right for."""

    texts: list[str]
    vecs: np.ndarray
    cats: list[str]
    own: np.ndarray  # the entry a right answer would come from (-1: none)
    kind: np.ndarray  # "paraphrase", "natural", "other" (QQP non-duplicates below NATURAL), or a trap type
    source: np.ndarray  # the entry it was asked beside (its QQP pair's, or the trap's original)


def stream(test: Half, traps: Traps, names: list[str], synthetic: bool = True) -> Asked:
    """The test half's questions and (`synthetic`) the traps, shuffled (seeded)."""
    cos = np.einsum("ij,ij->i", test.qvecs, test.svecs[test.own])
    kind = np.where(test.dup, "paraphrase", np.where(cos >= NATURAL, "natural", "other"))
    n = len(traps.texts) if synthetic else 0
    texts = list(test.queries) + traps.texts[:n]
    cats = [names[c] for c in test.cat] + [names[c] for c in traps.cat[:n]]
    order = np.random.default_rng(SEED).permutation(len(texts))
    return Asked(
        texts=[texts[i] for i in order],
        vecs=np.concatenate([test.qvecs, traps.vecs[:n]])[order],
        cats=[cats[i] for i in order],
        own=np.concatenate([np.where(test.dup, test.own, -1), np.full(n, -1)])[order],
        kind=np.concatenate([kind, traps.kind[:n]])[order],
        source=np.concatenate([test.own, traps.source[:n]])[order],
    )


@dataclass
class Judged:
    """Per question: the best candidate (-1: none), its score, and whether it is the same question."""

    entry: np.ndarray
    score: np.ndarray
    same: np.ndarray


def judge(test: Half, asked: Asked, verifier: Verifier | None, guards: bool) -> Judged:
    """As `SemanticCache.find` judges: the nearest candidates above FLOOR that no guard refuses, the
    same question at once, else the best score (the verifier's, or the cosine)."""
    ids, sims = nearest(asked.vecs, test.svecs, CANDIDATES)
    n = len(asked.texts)
    out = Judged(np.full(n, -1), np.zeros(n), np.zeros(n, bool))
    for i, text in enumerate(asked.texts):
        same = normalised(text)
        for e, s in zip(ids[i], sims[i], strict=True):
            cached = test.stored[e]
            if s < FLOOR or guards and refusal(text, cached) is not None:
                continue
            if normalised(cached) == same:
                out.entry[i], out.score[i], out.same[i] = e, 1.0, True
                break
            score = verifier.score(text, cached, float(s), asked.cats[i]) if verifier else float(s)
            if out.entry[i] < 0 or score > out.score[i]:
                out.entry[i], out.score[i] = e, score
    return out


def replay(asked: Asked, judged: Judged, delta: float, seed: int) -> tuple[np.ndarray, Bound]:
    """Serve the stream under one delta from a cold start: the entry each question is served (-1: none)."""
    bound = Bound(dict.fromkeys(set(asked.cats), delta), BoundConfig())
    rng = np.random.default_rng(seed)
    served = np.full(len(asked.texts), -1)
    for i, (entry, score, cat) in enumerate(zip(judged.entry, judged.score, asked.cats, strict=True)):
        if entry < 0:
            continue
        if judged.same[i]:
            served[i] = entry
            continue
        labelled = entry == asked.source[i]
        if labelled:  # the bound sees what it can be judged on: questions whose candidate QQP labels
            bound.asked(cat, score)
        if bound.allows(cat, str(entry), score) and rng.random() >= VERIFY:
            served[i] = entry
        elif labelled:  # the model answers: a verdict on the candidate
            bound.learn(cat, str(entry), score, bool(entry == asked.own[i]))
    return served, bound


def verdicts(asked: Asked, judged: Judged, served: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hits; right hits (on the question's own duplicate pair, or the same question); labelled hits
    (on the entry it was asked beside, or the same question)."""
    hit = served >= 0
    right = hit & ((served == asked.own) | judged.same)
    return hit, right, hit & ((served == asked.source) | judged.same)


def outcome(asked: Asked, judged: Judged, served: np.ndarray) -> list[str]:
    """Paraphrases, natural and synthetic traps served their source's answer; hits; the error over
    labelled hits, and with every hit on another pair's entry counted wrong."""
    hit, right, labelled = verdicts(asked, judged, served)
    mine = served == asked.source

    def share(kinds: str | tuple[str, ...]) -> str:
        m = np.isin(asked.kind, kinds)
        return pct(float((hit & mine & m).sum() / max(int(m.sum()), 1)))

    hits, good = int(hit.sum()), int(right.sum())
    return [
        share("paraphrase"),
        share("natural"),
        share(tuple(EDITS)),
        *(share(k) for k in EDITS),
        str(hits),
        pct((int(labelled.sum()) - good) / max(int(labelled.sum()), 1)),
        pct((hits - good) / max(hits, 1)),
    ]


def fixed(asked: Asked, judged: Judged, share: float) -> tuple[float, np.ndarray] | None:
    """The highest fixed threshold on the score that serves `share` of the paraphrases, and what it serves."""
    para = asked.kind == "paraphrase"
    own = np.sort(judged.score[para & (judged.entry == asked.own)])[::-1]
    need = int(np.ceil(share * para.sum()))
    if need < 1 or len(own) < need:
        return None
    limit = float(own[need - 1])
    return limit, np.where((judged.score >= limit) | judged.same, judged.entry, -1)


def curve_rows(asked: Asked, judged: Judged, served: np.ndarray, delta: float) -> list[list[str]]:
    """Hits, paraphrases served and the error over labelled hits, over consecutive stretches of the stream."""
    hit, right, labelled = verdicts(asked, judged, served)
    got = (served == asked.own) & (asked.kind == "paraphrase")
    rows, start = [], 0
    for end in [n for n in CURVE if n < len(asked.texts)] + [len(asked.texts)]:
        part = slice(start, end)
        paraphrases = max(int((asked.kind[part] == "paraphrase").sum()), 1)
        wrong = int(labelled[part].sum() - right[part].sum())
        rows.append([f"{100 * delta:g}%", f"{start + 1}-{end}", pct(float(hit[part].mean()))])
        rows[-1] += [pct(int(got[part].sum()) / paraphrases), pct(wrong / max(int(labelled[part].sum()), 1))]
        start = end
    return rows


def bound_section(test: Half, traps: Traps, names: list[str], verifier: Verifier) -> str:
    """Signals side by side at fixed thresholds, then the bound replayed at each delta."""
    asked = stream(test, traps, names)
    judged = {
        (signal, guards): judge(test, asked, verifier if signal == "verifier" else None, guards)
        for signal in ("cosine", "verifier")
        for guards in (False, True)
    }
    outcome_head = ["paraphrases %", "natural traps %", "synthetic traps %", *(f"{k} %" for k in EDITS)]
    outcome_head += ["hits", "realised error %", "error, other pairs' entries counted wrong %"]
    side = []
    for share in SHARES:
        for (signal, guards), j in judged.items():
            found = fixed(asked, j, share)
            name = signal + (" + guards" if guards else "")
            side.append([f"{100 * share:g}", name, *(["-"] * 11 if found is None else [f"{found[0]:.3f}"])])
            if found is not None:
                side[-1] += outcome(asked, j, found[1])
    rows, curve = [], []
    plain = stream(test, traps, names, synthetic=False)
    for name, (one, chosen) in {
        "QQP": (plain, judge(test, plain, verifier, GUARDED)),
        "QQP + synthetic traps": (asked, judged[("verifier", GUARDED)]),
    }.items():
        for delta in DELTAS:
            runs = [replay(one, chosen, delta, seed=SEED + 1 + k)[0] for k in range(REPLAYS)]
            worst = max(float(outcome(one, chosen, served)[-2]) for served in runs)
            rows.append([name, f"{100 * delta:g}%", *outcome(one, chosen, runs[0]), f"{worst:.1f}"])
            curve += [[name, *r] for r in curve_rows(one, chosen, runs[0], delta)]
    return (
        "### The error bound\n\n"
        f"One shuffled stream of {len(asked.texts)} questions: the test half's {len(test.queries)} and "
        f"{len(traps.texts)} synthetic traps, asked against the test half's {len(test.stored)} entries. A question "
        f"is judged as `SemanticCache.find` judges it: the {CANDIDATES} nearest entries with cosine >= {FLOOR} "
        "(and that no guard refuses, where guards are on); the same question (same words) is served at once; "
        "otherwise the candidate with the best score. A hit is labelled when it serves the entry the question "
        "was asked beside (its QQP pair's `a`, or the question a trap was made from) or the same question, and "
        "right on a duplicate pair's `a` or the same question. Realised error = wrong labelled hits / labelled "
        "hits. QQP does not label a hit on another pair's entry: most of those read as paraphrases (QQP repeats "
        "popular questions), some do not; the last column counts them all wrong.\n\n"
        "Signals side by side: the highest fixed threshold on each score that serves a share of the "
        "paraphrases (chosen on this stream: the best each score can do), and what it serves besides. The "
        "verifier is fitted on the fit half (`--fit-verifier semantic_cache/verifier.npz` wrote the shipped "
        "one).\n\n"
        + table(["paraphrases served %", "score", "threshold", *outcome_head], side)
        + "\n\nThe bound: the stream from a cold start (no verdicts), and the test half's questions alone "
        "(no synthetic traps; natural ones stay), every category given the same "
        f"max_error_rate, scored by the verifier{' with the guards' if GUARDED else ''}; a question the bound "
        f"does not serve, and {VERIFY:.0%} of those it would, are answered by the model, whose verdict "
        f"(here: the label, where there is one) it learns from. The last column replays each {REPLAYS} times, "
        "the would-be hits checked drawn anew.\n\n"
        + table(["stream", "max_error_rate", *outcome_head, f"realised error, worst of {REPLAYS} replays %"], rows)
        + "\n\nLearning curve: the same replays over consecutive stretches of the stream.\n\n"
        + table(["stream", "max_error_rate", "questions", "hits %", "paraphrases served %", "realised error %"], curve)
    )
