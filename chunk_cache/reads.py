"""What one reader's fetches hit, by tier: entries and the bytes of their KV. The engine counts a prompt's own
reads (`reading` around them, on its thread) for its trace; nothing is counted outside such a block."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar


class Reads:
    def __init__(self) -> None:
        self.entries: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def hit(self, tier: str, nbytes: int) -> None:
        self.entries[tier] += 1
        self.bytes[tier] += nbytes

    def by_tier(self) -> tuple[tuple[str, int, int], ...]:
        """(tier, entries, bytes) of each tier hit, in the order first hit."""
        return tuple((tier, n, self.bytes[tier]) for tier, n in self.entries.items())


_reading: ContextVar[Reads | None] = ContextVar("kvgate_chunk_reads", default=None)


@contextmanager
def reading(reads: Reads) -> Iterator[None]:
    """Count into `reads` what this thread's fetches (ChunkStore.fetch) hit within the block."""
    token = _reading.set(reads)
    try:
        yield
    finally:
        _reading.reset(token)


def counted(tier: str, nbytes: int) -> None:
    """A fetch hit `tier`: counted for the reader, if one is counting."""
    if (reads := _reading.get()) is not None:
        reads.hit(tier, nbytes)
