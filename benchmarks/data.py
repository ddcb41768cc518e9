"""What several benchmarks share about their data: the usage error they raise (runtime's DataError), and
the QQP pairs and halves of `kvgate bench semantic` (built in semantic.py, read by traps.py and
semantic_latency.py). Ratio lists are read as `kvgate calibrate` reads them (gateway/cli.py `percentages`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvgate.runtime.errors import DataError

__all__ = ["DataError", "Half", "Pair"]

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
