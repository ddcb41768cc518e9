"""Timing a call, and the order statistics reported."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def timed(fn: Callable[..., T], *args: Any) -> tuple[float, T]:
    """(seconds, result) of fn(*args)."""
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))] if s else float("nan")
