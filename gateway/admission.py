"""Admission: what a request may ask of this server, decided before any work is done for it.

- `Admission` bounds sequences (prompts x n): one request's (over it: 400, retrying never helps),
  a tenant's waiting or running at once (429) and the server's (503). A request is admitted whole
  or refused whole; its sequences count until each ends (finished, failed, aborted when its client
  hangs up or its stream is closed). A refusal's `Retry-After` is the wait until enough of them
  end, at the rate they have been ending.
- `ConcurrencyGate`: program FCFS in front of an upstream: at most `limit` requests in flight to it, the rest
  wait and are let through by their program's first arrival (a request without a program: its own
  arrival), so an agent program that started earlier finishes earlier, as the runtime's own queue does."""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvgate.agents.queue import ProgramQueue
from kvgate.gateway.errors import APIError

WINDOW_S = 30.0  # ends counted for the drain rate
MAX_RETRY_S = 600  # the longest Retry-After said
HOLD_S = 1.0  # a tenant's refusal is answered after at most this long (its Retry-After, if shorter)


class Drain:
    """How fast sequences end: those that ended over the last `WINDOW_S`, since `since` (when the
    owner last went from idle to busy)."""

    __slots__ = ("ended", "total", "since")

    def __init__(self, now: float) -> None:
        self.ended: deque[list[float]] = deque()  # [time, count], a quarter second each at most
        self.total = 0.0
        self.since = now

    def busy(self, now: float) -> None:
        """Its owner went from idle to busy."""
        self.since = now

    def note(self, count: int, now: float) -> None:
        if self.ended and now - self.ended[-1][0] < 0.25:
            self.ended[-1][1] += count
        else:
            self.ended.append([now, count])
        self.total += count

    def rate(self, now: float) -> tuple[float, float]:
        """(sequences ended per second, or 0.0 when none did; the seconds that rate is over)."""
        while self.ended and self.ended[0][0] < now - WINDOW_S:
            self.total -= self.ended.popleft()[1]
        span = max(1.0, min(WINDOW_S, now - self.since))
        return (self.total / span if self.ended else 0.0), span


class Held:
    """A request's admitted sequences: `end` as each ends, `close` whatever is left (idempotent)."""

    __slots__ = ("admission", "tenant", "left")

    def __init__(self, admission: Admission, tenant: str, seqs: int) -> None:
        self.admission, self.tenant, self.left = admission, tenant, seqs

    def end(self, count: int = 1) -> None:
        count = min(count, self.left)
        if count > 0:
            self.left -= count
            self.admission.release(self.tenant, count)

    def close(self) -> None:
        self.end(self.left)


class Admission:
    """Sequences waiting or running, per tenant and in all, against the three bounds."""

    def __init__(
        self,
        max_request_seqs: int,
        max_waiting_seqs: int,
        max_waiting_seqs_per_tenant: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_total, self.max_tenant = max_waiting_seqs, max_waiting_seqs_per_tenant
        # A request over a tenant's share (or the server's) could never be admitted: a 400 too.
        self.max_request = min(max_request_seqs, max_waiting_seqs, max_waiting_seqs_per_tenant)
        self.clock = clock
        self.total = 0
        self.tenants: dict[str, int] = {}  # tenants with sequences in flight -> how many
        self.drains: dict[str, Drain] = {}  # and how fast theirs end
        self.drain = Drain(clock())  # the server's
        self.refused = {400: 0, 429: 0, 503: 0}

    def check(self, tenant: str, prompts: int = 1, n: int = 1) -> int:
        """Raise the refusal this request gets now, if any (before any work is done for it);
        the sequences it asks for."""
        seqs = prompts * n
        if seqs > self.max_request:
            self.refused[400] += 1
            what = f"{seqs} sequences ({prompts} prompts x n={n})" if prompts > 1 else f"{seqs} sequences (n={n})"
            raise APIError(
                400,
                f"this request asks for {what}; at most {self.max_request} are allowed per request "
                "(prompts x n); split it into smaller requests",
                "prompt" if prompts > self.max_request else "n",
                "too_many_sequences",
            )
        held = self.tenants.get(tenant, 0)
        if held + seqs > self.max_tenant:
            self.refused[429] += 1
            wait = self.wait_s(held + seqs - self.max_tenant, tenant)
            raise APIError(
                429,
                f"too many sequences in flight for this tenant: {held} waiting or running, this request asks "
                f"for {seqs}, the limit is {self.max_tenant}; retry after {wait} s",
                code="tenant_queue_full",
                headers={"retry-after": str(wait)},
            )
        if self.total + seqs > self.max_total:
            self.refused[503] += 1
            wait = self.wait_s(self.total + seqs - self.max_total, None)
            raise APIError(
                503,
                f"the server is at capacity: {self.total} sequences waiting or running, this request asks for "
                f"{seqs}, the limit is {self.max_total}; retry after {wait} s",
                code="server_queue_full",
                headers={"retry-after": str(wait)},
            )
        return seqs

    async def screen(self, tenant: str, prompts: int = 1, n: int = 1) -> None:
        """`check`, its 429 answered only after `HOLD_S` (or the Retry-After, if shorter): a client that
        sends again at once whatever Retry-After says gets at most one refusal a second per connection,
        and the server's event loop stays free for the engine and other tenants. The 503 and 400 are
        answered at once (a front may try another server; retrying a 400 never helps)."""
        try:
            self.check(tenant, prompts, n)
        except APIError as exc:
            if exc.status != 429:
                raise
            wait = int(exc.headers["retry-after"])
            hold = min(HOLD_S, wait)
            await asyncio.sleep(hold)
            exc.headers["retry-after"] = str(max(1, wait - math.floor(hold)))
            raise

    def admit(self, tenant: str, prompts: int = 1, n: int = 1) -> Held:
        """The request's sequences, counted from now until each ends; or its refusal (APIError)."""
        seqs = self.check(tenant, prompts, n)
        now = self.clock()
        if self.total == 0:
            self.drain.busy(now)
        if tenant not in self.tenants:
            self.drains[tenant] = Drain(now)
        self.total += seqs
        self.tenants[tenant] = self.tenants.get(tenant, 0) + seqs
        return Held(self, tenant, seqs)

    def release(self, tenant: str, count: int) -> None:
        now = self.clock()
        self.total -= count
        self.drain.note(count, now)
        left = self.tenants[tenant] - count
        if left > 0:
            self.tenants[tenant] = left
            self.drains[tenant].note(count, now)
        else:
            del self.tenants[tenant], self.drains[tenant]

    def wait_s(self, excess: int, tenant: str | None) -> int:
        """Seconds until `excess` more sequences (the tenant's, or the server's) have ended, at the
        rate they have been ending; a tenant whose own have not ended yet: its share of the server's
        rate; none ended at all yet: as long again as they have been running."""
        now = self.clock()
        rate, span = self.drain.rate(now)
        if tenant is not None:
            own, span = self.drains[tenant].rate(now)
            rate = own or rate * self.tenants[tenant] / max(1, self.total)
        seconds = excess / rate if rate > 0 else span
        return max(1, min(MAX_RETRY_S, math.ceil(seconds)))

    def stats(self) -> dict[str, int]:
        return {"in_flight": self.total, "tenants": len(self.tenants)}


def fan_out(body: dict[str, Any]) -> tuple[int, int]:
    """(prompts, sequences per prompt) a request body asks for, read loosely (a proxy forwards bodies
    kvgate's protocol would refuse): n, or best_of where larger; a completion's list of prompts."""

    def count(value: Any) -> int:
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1

    prompt = body.get("prompt")
    listed = isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt)
    return (len(prompt) if listed else 1), max(count(body.get("n")), count(body.get("best_of")))


class ConcurrencyGate:
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
