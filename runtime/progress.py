"""Progress of long work (`kvgate calibrate`, `kvgate convert`, the benchmarks' items): items done, elapsed and an
estimate of what is left, redrawn on one line of a terminal; nothing where the output is a log or a pipe."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import IO, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def progress(items: Iterable[T], what: str, total: int | None = None, stream: IO[str] | None = None) -> Iterator[T]:
    """`items`, shown as they go on `stream` (standard error) where it is a terminal."""
    shown = stream if stream is not None else sys.stderr
    yield from tqdm(items, desc=what, total=total, file=shown, disable=not shown.isatty(), leave=False, ncols=100)
