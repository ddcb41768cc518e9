"""Cache-affinity routing over runtime workers: a consistent-hash ring sends a request to the worker
most likely to hold its documents' or program's KV; a long queue there spills it to the least loaded."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Sequence

import xxhash

VNODES = 64  # points per worker on the ring: keys spread evenly and move little when a worker joins


def point(text: str) -> int:
    return xxhash.xxh64_intdigest(text.encode())


class Ring:
    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        points = sorted((point(f"{name}#{v}"), name) for name in names for v in range(VNODES))
        self.points = [p for p, _ in points]
        self.owners = [n for _, n in points]

    def owner(self, key: str) -> str:
        i = bisect.bisect(self.points, point(key)) % len(self.points)
        return self.owners[i]

    def preferred(self, keys: Sequence[str]) -> str | None:
        """The worker owning most of `keys` (the first key's owner breaks a tie); None without keys."""
        if not keys:
            return None
        owners = [self.owner(k) for k in keys]
        votes = Counter(owners)
        best = max(votes.values())
        return next(o for o in owners if votes[o] == best)

    def order(self, keys: Sequence[str], load: Callable[[str], int], spill_at: int) -> list[str]:
        """Every worker, best first: the preferred one unless its load is at `spill_at` or more
        (then the least loaded goes first), the rest by load as fallbacks."""
        by_load = sorted(self.names, key=load)
        first = self.preferred(keys)
        if first is None or load(first) >= spill_at and load(by_load[0]) < load(first):
            return by_load
        return [first, *(n for n in by_load if n != first)]
