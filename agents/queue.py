"""Program FCFS, the one queue: waiting work is let through pinned programs first, then by its
program's first arrival, then by its own (an agent's later turns do not queue behind programs that
started after it); or in arrival order ("fcfs"). The runtime's scheduler queues sequences in it, the
gateway's gate in front of an upstream queues requests in it."""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
ORDERS = ("fcfs", "program")


class ProgramQueue(Generic[T]):
    def __init__(self, order: str = "program") -> None:
        if order not in ORDERS:
            raise ValueError(f"unknown queue order {order!r}; one of {', '.join(ORDERS)}")
        self.order = order
        self.heap: list[tuple[tuple[bool, float, float, int], T]] = []
        self.count = itertools.count()

    def push(
        self, item: T, program_arrival: float | None = None, pinned: bool = False, arrival: float | None = None
    ) -> None:
        """`program_arrival`: the first arrival of the item's program (None: it is a program of its own)."""
        arrival = time.monotonic() if arrival is None else arrival
        n = next(self.count)
        key = (not pinned, arrival if program_arrival is None else program_arrival, arrival, n)
        heapq.heappush(self.heap, ((False, 0.0, 0.0, n) if self.order == "fcfs" else key, item))

    def pop(self) -> T:
        return heapq.heappop(self.heap)[1]

    def remove(self, item: T) -> bool:
        found = next((i for i, (_, it) in enumerate(self.heap) if it is item), None)
        if found is None:
            return False
        self.heap[found] = self.heap[-1]
        self.heap.pop()
        heapq.heapify(self.heap)
        return True

    def __len__(self) -> int:
        return len(self.heap)

    def __iter__(self) -> Iterator[T]:
        return (item for _, item in self.heap)

    def __contains__(self, item: object) -> bool:
        return any(it is item for _, it in self.heap)
