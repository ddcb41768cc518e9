"""The verifier: the probability that a cached question's answer is right for a new question, from
features of the pair (the embeddings' cosine, word overlap weighted by rarity, the guards' signals,
the category), by a small network fitted on labelled question pairs (`kvgate bench semantic
--fit-verifier`) and shipped as a file of a few kilobytes. Its score is what the error bound
(bound.py) learns over."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from kvgate.semantic_cache.guards import GUARDS, words

SHIPPED = Path(__file__).with_name("verifier.npz")
BUCKETS = 1 << 14  # word rarity is kept per hash bucket: no vocabulary to ship
STOP = frozenset(
    "a an the of to in on for and or is are was were be been do does did how what why when where which who whom "
    "can could should would will i you we my your me it its this that there their they with as at by from about "
    "into than then so if".split()
)
NAMES = (
    "cosine",
    "word_jaccard",
    "content_jaccard",
    "unmatched_rarity_query",
    "unmatched_rarity_cached",
    "unmatched_query",
    "unmatched_cached",
    "rarest_unmatched",
    "length_gap",
    "same_opening",
    *(f"guard_{g}" for g in GUARDS),
)


def bucket(word: str) -> int:
    return xxhash.xxh3_64_intdigest(word.encode()) % BUCKETS


def rarity_table(texts: list[str]) -> np.ndarray:
    """Inverse document frequency per word bucket over `texts` (what `fit` ships)."""
    df = np.zeros(BUCKETS, np.float64)
    for text in texts:
        for b in {bucket(w) for w in words(text)}:
            df[b] += 1
    return np.log((len(texts) + 1) / (df + 1)).astype(np.float16)


def pair_features(query: str, cached: str, cosine: float, rarity: np.ndarray) -> list[float]:
    """The features of NAMES, for one (query, cached question) pair."""
    wq, wc = set(words(query)), set(words(cached))
    cq, cc = wq - STOP, wc - STOP
    uq, uc = cq - cc, cc - cq

    def rare(ws: set[str]) -> float:
        return float(sum(rarity[bucket(w)] for w in ws))

    first_q, first_c = words(query)[:1], words(cached)[:1]
    return [
        cosine,
        len(wq & wc) / max(len(wq | wc), 1),
        len(cq & cc) / max(len(cq | cc), 1),
        rare(uq) / max(rare(cq), 1e-6),
        rare(uc) / max(rare(cc), 1e-6),
        float(len(uq)),
        float(len(uc)),
        max((float(rarity[bucket(w)]) for w in uq | uc), default=0.0),
        abs(len(wq) - len(wc)) / max(len(wq), len(wc), 1),
        float(first_q == first_c),
        *(float(not guard(query, cached)) for guard in GUARDS.values()),
    ]


@dataclass(frozen=True)
class Verifier:
    """features -> standardised -> [categories one-hot] -> Linear -> ReLU -> Linear -> sigmoid."""

    rarity: np.ndarray
    categories: tuple[str, ...]
    mean: np.ndarray
    scale: np.ndarray
    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    b2: float

    def inputs(self, query: str, cached: str, cosine: float, category: str) -> np.ndarray:
        x = (np.asarray(pair_features(query, cached, cosine, self.rarity), np.float32) - self.mean) / self.scale
        onehot = np.asarray([c == category for c in self.categories], np.float32)
        return np.concatenate([x, onehot])

    def probability(self, inputs: np.ndarray) -> np.ndarray:
        """P(right) for rows of `inputs` ([n, features] or one row)."""
        hidden = np.maximum(inputs @ self.w1 + self.b1, 0.0)
        logit = np.clip(hidden @ self.w2 + self.b2, -30.0, 30.0)
        return 1.0 / (1.0 + np.exp(-logit))

    def score(self, query: str, cached: str, cosine: float, category: str) -> float:
        return float(self.probability(self.inputs(query, cached, cosine, category)))

    def save(self, path: Path) -> None:
        meta = json.dumps({"features": NAMES, "categories": self.categories})
        arrays = {k: getattr(self, k) for k in ("rarity", "mean", "scale", "w1", "b1", "w2")}
        np.savez_compressed(path, meta=np.array(meta), b2=np.array(self.b2), **arrays)

    @classmethod
    def load(cls, path: Path = SHIPPED) -> Verifier:
        with np.load(path, allow_pickle=False) as f:
            meta = json.loads(str(f["meta"]))
            if tuple(meta["features"]) != NAMES:
                found = meta["features"]
                raise ValueError(f"{path}: fitted on other features {found}; refit it (bench semantic --fit-verifier)")
            return cls(
                rarity=f["rarity"].astype(np.float32),
                categories=tuple(meta["categories"]),
                mean=f["mean"].astype(np.float32),
                scale=f["scale"].astype(np.float32),
                w1=f["w1"].astype(np.float32),
                b1=f["b1"].astype(np.float32),
                w2=f["w2"].astype(np.float32),
                b2=float(f["b2"]),
            )


def normalised(text: str) -> str:
    """A question's words, lower-cased: two questions that agree here are the same question."""
    return " ".join(words(text))


_SPACE = re.compile(r"\s+")


def same_answer(a: str, b: str) -> bool:
    """Exactly the same answer, up to white space."""
    return _SPACE.sub(" ", a).strip() == _SPACE.sub(" ", b).strip()
