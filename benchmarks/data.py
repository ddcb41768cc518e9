"""What several benchmarks share about their data and options: the usage error they raise, ratio lists
as the command line gives them, and the QQP pairs and halves of `kvgate bench semantic` (built in
semantic.py, read by traps.py and semantic_latency.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvgate.runtime.errors import DataError

__all__ = ["DataError", "Half", "Pair", "parse_ratios"]

Pair = tuple[str, str, bool]  # a QQP row: question a, question b, duplicate


def parse_ratios(text: str) -> list[float]:
    """Percentages, comma-separated, as fractions: "0,5,10" -> [0.0, 0.05, 0.1]."""
    try:
        ratios = [float(x) / 100 for x in text.split(",") if x.strip()]
    except ValueError:
        ratios = []
    if not ratios or any(not 0.0 <= r <= 1.0 for r in ratios):
        raise DataError(f"ratios {text!r}: percentages between 0 and 100, comma-separated")
    return ratios


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
