"""Programs in flight: a new program starts only while fewer are in flight than `per_context` times
the contexts memory holds (its bytes over the running mean of a turn's context).

Past what memory holds, each program admitted evicts the context of one waiting on its tools, whose
next turn then prefills it again: more programs in flight add work, not throughput, and every turn
waits longer. Held at the door instead, a new program waits once, for a program to end.

A program is in flight from the admission of its first turn (the scheduler asks `room` and calls
`start`, runtime/scheduler.py) until its last turn ends (one that calls no tool), or until its tools
are late: past the wait by which most returns after such calls have come (agents/programs.py), at
most `linger_s` (its client may have ended it after a tool call, or gone). Thread-safe: the engine's
thread admits, the gateway's begins and ends turns."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

Key = tuple[str, str]  # (tenant, program id)


class Flight:
    def __init__(
        self,
        memory_bytes: int,
        per_context: float = 0.0,
        linger_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.memory_bytes, self.per_context, self.linger_s, self.clock = memory_bytes, per_context, linger_s, clock
        self.flying: dict[Key, float] = {}  # -> until when it counts: inf while a turn of it is out
        self.context_bytes: float | None = None  # running mean of a turn's context
        self.lock = threading.Lock()

    def measure(self, nbytes: int, recent: float) -> None:
        """A turn's context of `nbytes`; `recent`: the new sample's weight in the running mean."""
        with self.lock:
            mean = self.context_bytes
            self.context_bytes = float(nbytes) if mean is None else mean + recent * (nbytes - mean)

    def limit(self) -> int | None:
        """How many programs may be in flight; None: no limit (off, or nothing measured yet)."""
        if self.per_context <= 0 or not self.context_bytes:
            return None
        return max(1, int(self.per_context * self.memory_bytes / self.context_bytes))

    def room(self) -> bool:
        """Whether a new program may start now."""
        limit = self.limit()
        if limit is None:
            return True
        with self.lock:
            if len(self.flying) >= limit:
                now = self.clock()
                for key in [k for k, until in self.flying.items() if until <= now]:
                    del self.flying[key]
            return len(self.flying) < limit

    def start(self, tenant: str, program: str) -> None:
        """The program's first turn was admitted."""
        with self.lock:
            self.flying[(tenant, program)] = math.inf

    def back(self, tenant: str, program: str) -> None:
        """A later turn of the program arrived: it counts until that turn ends."""
        with self.lock:
            if (tenant, program) in self.flying:
                self.flying[(tenant, program)] = math.inf

    def wait(self, tenant: str, program: str, late_s: float = math.inf) -> None:
        """A turn ended calling tools: the program counts until their results are `late_s` late (as
        the tools' durations tell), or `linger_s`. (Counting it only while memory holds its context,
        pinned or resident, the simulator's gains shrank and at load 1.2 with 128 MiB it lost 4-8%.)"""
        with self.lock:
            if (tenant, program) in self.flying:
                self.flying[(tenant, program)] = self.clock() + min(late_s, self.linger_s)

    def land(self, tenant: str, program: str) -> None:
        """The program ended (or was forgotten): its place goes to the next."""
        with self.lock:
            self.flying.pop((tenant, program), None)

    def __len__(self) -> int:
        return len(self.flying)
