"""What several benchmarks share about their data: the usage error they raise (runtime's DataError), and
the QQP pairs (read here) and halves of `kvgate bench semantic` (built in semantic.py, read by traps.py and
semantic_latency.py). Ratio lists are read as `kvgate calibrate` reads them (gateway/cli.py `percentages`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvgate.runtime.errors import DataError

__all__ = ["DataError", "Half", "Pair", "load_pairs"]

Pair = tuple[str, str, bool]  # a QQP row: question a, question b, duplicate


@dataclass
class Half:
    """One half of the pairs as a cache: the distinct `a` questions stored, each `b` asked."""

    stored: list[str]
    svecs: np.ndarray
    queries: list[str]
    qvecs: np.ndarray
    own: np.ndarray  # each query's own `a`, as a row of `stored`
    dup: np.ndarray  # bool: the pair is a duplicate
    cat: np.ndarray  # the query's category, as an index into the config's categories
    left_out: int  # queries asked verbatim as some stored question (an exact hit, not a test)


def load_pairs(path: Path, limit: int) -> list[Pair]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file (the shared QQP pairs)")
    pairs: list[Pair] = []
    with path.open() as f:
        for line in f:
            if len(pairs) == limit:
                break
            row = json.loads(line)
            pairs.append((row["a"], row["b"], bool(row["duplicate"])))
    if len(pairs) < 20:
        raise DataError(f"{path}: {len(pairs)} pairs; need at least 20")
    return pairs
