"""Program FCFS in front of an upstream: at most `limit` requests in flight to it, the rest wait and
are let through by their program's first arrival (a request without a program: its own arrival), so
an agent program that started earlier finishes earlier, as the runtime's own queue does."""

from __future__ import annotations

import asyncio
import time

from kvgate.agents.queue import ProgramQueue


class Gate:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.busy = 0
        self.waiting: ProgramQueue[asyncio.Future[None]] = ProgramQueue("program")

    @property
    def load(self) -> int:
        return self.busy + len(self.waiting)

    async def acquire(self, program_arrival: float | None) -> None:
        """A slot; `program_arrival`: the first arrival of the request's program (None: its own)."""
        if self.busy < self.limit and not self.waiting:
            self.busy += 1
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.push(turn, program_arrival)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release()  # the slot was handed over as the waiter gave up: pass it on
            raise

    def release(self) -> None:
        """Hand the slot to the earliest waiter still waiting, or free it."""
        while self.waiting:
            turn = self.waiting.pop()
            if not turn.done():
                turn.set_result(None)
                return
        self.busy -= 1


class ProgramClock:
    """The first arrival of each live program; a program idle for `idle_s` is forgotten."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.first: dict[str, tuple[float, float]] = {}  # program -> (first arrival, last seen)

    def rank(self, program: str | None) -> float:
        now = time.monotonic()
        if program is None:
            return now
        if len(self.first) > 4096:
            self.first = {p: seen for p, seen in self.first.items() if now - seen[1] < self.idle_s}
        seen = self.first.get(program)
        first = seen[0] if seen is not None and now - seen[1] < self.idle_s else now
        self.first[program] = (first, now)
        return first
