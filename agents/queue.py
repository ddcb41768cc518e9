"""Program FCFS, the one queue: waiting work is let through pinned programs first, then by its
program's first arrival, then by its own (an agent's later turns do not queue behind programs that
started after it); or in arrival order ("fcfs"). The runtime's scheduler queues sequences in it, the
gateway's gate in front of an upstream queues requests in it.

`FairQueue` shares it between tenants: one such queue per tenant, and the next item comes from the
tenant with the fewest items running, ties broken by the queue's own order (program FCFS, or
arrival). Within a tenant the order is the queue's; with a single tenant it is exactly that order.
Every operation is O(log n): removal marks an item and the heaps skip it when it surfaces."""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
ORDERS = ("fcfs", "program")
Key = tuple[bool, float, float, int]


class _Entry(Generic[T]):
    __slots__ = ("key", "item", "live")

    def __init__(self, key: Key, item: T) -> None:
        self.key, self.item, self.live = key, item, True

    def __lt__(self, other: _Entry[T]) -> bool:
        return self.key < other.key

    def drop(self) -> None:
        """Removed: left in the heap, skipped when it comes up."""
        self.live = False


class ProgramQueue(Generic[T]):
    """Items by program order (or arrival, "fcfs"). An item is held once at a time; `remove` is lazy."""

    def __init__(self, order: str = "program", count: Iterator[int] | None = None) -> None:
        if order not in ORDERS:
            raise ValueError(f"unknown queue order {order!r}; one of {', '.join(ORDERS)}")
        self.order = order
        self.heap: list[_Entry[T]] = []
        self.entries: dict[int, _Entry[T]] = {}  # id(item) -> its entry, while it waits
        self.count = count or itertools.count()  # shared by a FairQueue's tenants: arrival across them

    def key(self, program_arrival: float | None, pinned: bool, arrival: float | None) -> Key:
        n = next(self.count)
        if self.order == "fcfs":
            return (False, 0.0, 0.0, n)
        arrival = time.monotonic() if arrival is None else arrival
        return (not pinned, arrival if program_arrival is None else program_arrival, arrival, n)

    def push(
        self, item: T, program_arrival: float | None = None, pinned: bool = False, arrival: float | None = None
    ) -> None:
        """`program_arrival`: the first arrival of the item's program (None: it is a program of its own)."""
        if id(item) in self.entries:
            raise ValueError("the item is already waiting")  # keyed by identity: a second copy would corrupt it
        entry = _Entry(self.key(program_arrival, pinned, arrival), item)
        self.entries[id(item)] = entry
        heapq.heappush(self.heap, entry)

    def head(self) -> Key | None:
        """The key of the item `pop` would return; None when empty."""
        heap = self.heap
        while heap and not heap[0].live:
            heapq.heappop(heap)
        return heap[0].key if heap else None

    def pop(self) -> T:
        if self.head() is None:
            raise IndexError("pop from an empty queue")
        entry = heapq.heappop(self.heap)
        del self.entries[id(entry.item)]
        return entry.item

    def remove(self, item: T) -> bool:
        entry = self.entries.pop(id(item), None)
        if entry is None:
            return False
        entry.drop()
        if len(self.heap) > 64 and len(self.heap) > 2 * len(self.entries):  # mostly removed: compact
            self.heap = [e for e in self.heap if e.live]
            heapq.heapify(self.heap)
        return True

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[T]:
        return (entry.item for entry in list(self.entries.values()))

    def __contains__(self, item: object) -> bool:
        return id(item) in self.entries


class FairQueue(Generic[T]):
    """A ProgramQueue per tenant. `pop` takes from the tenant with the fewest items running (those
    popped and not yet `done`), ties by each tenant's head in the queue's order; a tenant heap keyed by
    (running, head) finds it, its stale entries skipped by a version number."""

    def __init__(self, order: str = "program") -> None:
        ProgramQueue(order)  # the order is checked once, here
        self.order = order
        self.count = itertools.count()
        self.queues: dict[str, ProgramQueue[T]] = {}  # tenants with items waiting
        self.tenant_of: dict[int, str] = {}  # id(item) -> its tenant, while it waits
        self.running: dict[str, int] = {}  # tenants with items running -> how many
        self.heap: list[tuple[int, Key, int, str]] = []  # (running, head key, version, tenant)
        self.version: dict[str, int] = {}  # tenants with items waiting -> the version of their heap entry
        self.versions = itertools.count()

    def push(
        self,
        item: T,
        tenant: str = "",
        program_arrival: float | None = None,
        pinned: bool = False,
        arrival: float | None = None,
    ) -> None:
        queue = self.queues.get(tenant)
        if queue is None:
            queue = self.queues[tenant] = ProgramQueue(self.order, self.count)
        before = queue.head()
        queue.push(item, program_arrival, pinned, arrival)
        self.tenant_of[id(item)] = tenant
        if before is None or queue.head() != before:  # a new head: the tenant's place changes
            self._touch(tenant)

    def peek(self) -> tuple[str, int] | None:
        """The tenant `pop` takes from next and how many of its items run now; None when empty."""
        heap = self.heap
        while heap:
            running, head, version, tenant = heap[0]
            if self.version.get(tenant) == version:
                return tenant, running
            heapq.heappop(heap)
        return None

    def pop(self) -> T:
        found = self.peek()
        if found is None:
            raise IndexError("pop from an empty queue")
        tenant = found[0]
        item = self.queues[tenant].pop()
        del self.tenant_of[id(item)]
        self.running[tenant] = self.running.get(tenant, 0) + 1
        self._touch(tenant)
        return item

    def done(self, tenant: str) -> None:
        """An item `pop` returned stopped running."""
        left = self.running.get(tenant, 0) - 1
        if left > 0:
            self.running[tenant] = left
        else:
            self.running.pop(tenant, None)
        if tenant in self.queues:
            self._touch(tenant)

    def remove(self, item: T) -> bool:
        """Withdraw a waiting item (False: it is not waiting)."""
        tenant = self.tenant_of.pop(id(item), None)
        if tenant is None:
            return False
        queue = self.queues[tenant]
        before = queue.head()
        queue.remove(item)
        if queue.head() != before:
            self._touch(tenant)
        return True

    def _touch(self, tenant: str) -> None:
        """The tenant's running count or head changed: a fresh heap entry (the old one goes stale)."""
        version = next(self.versions)
        head = self.queues[tenant].head()  # every caller touches a tenant with a queue
        if head is None:
            del self.queues[tenant], self.version[tenant]
        else:
            self.version[tenant] = version
            heapq.heappush(self.heap, (self.running.get(tenant, 0), head, version, tenant))
        if len(self.heap) > 64 and len(self.heap) > 4 * len(self.version):  # mostly stale: rebuild
            self.heap = [(self.running.get(t, 0), q.head(), self.version[t], t) for t, q in self.queues.items()]
            heapq.heapify(self.heap)

    def __len__(self) -> int:
        return len(self.tenant_of)

    def __bool__(self) -> bool:
        return bool(self.tenant_of)

    def __iter__(self) -> Iterator[T]:
        return (item for queue in list(self.queues.values()) for item in queue)

    def __contains__(self, item: object) -> bool:
        return id(item) in self.tenant_of
