"""Decide which tokens each step computes: continuous batching with chunked prefill, and the
order in which waiting requests are admitted.

Admission is fair between tenants (agents/queue.py, FairQueue): when a slot frees, the tenant with
the fewest running sequences goes next, ties broken by `order`; within a tenant, `order` alone:
"program" (pinned programs, then program arrival, then arrival) or "fcfs" (arrival). With one tenant
(a server without keys) both mean exactly what they did before tenants were counted.

Fairness alone lets a tenant that floods an idle server fill every slot, and then another tenant's
short request waits for one of those generations to end (seconds). So once the server has seen more
than one tenant, the last `reserve` slots are kept for tenants with nothing running: a newcomer
starts at the next step.

With a `gate` (agents/flight.py), a new program's first turn is held outside the queue until the
gate has room among the programs in flight, or until nothing else would run (work-conserving); the
held are let through fairly between tenants too (fewest released first turns still running), then
queue like any turn."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Protocol

from kvgate.agents.queue import FairQueue
from kvgate.runtime.sequence import Sequence, Status


class FlightGate(Protocol):
    def room(self) -> bool: ...

    def start(self, scope: str, program: str) -> None: ...


def default_reserve(max_num_seqs: int) -> int:
    """Slots kept for a tenant with nothing running: an eighth of the batch, at least one."""
    return max(1, max_num_seqs // 8) if max_num_seqs > 1 else 0


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        order: str = "fcfs",
        reserve: int | None = None,
        gate: FlightGate | None = None,
        grid: int = 1,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.grid = grid  # prompt chunks stop at multiples of it (Sequence.next_run)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.order = order
        self.waiting: FairQueue[Sequence] = FairQueue(order)
        self.running: list[Sequence] = []
        self.waiting_tokens = 0  # prompt tokens waiting, read from other threads for cost estimates
        self.reserve = default_reserve(max_num_seqs) if reserve is None else min(reserve, max_num_seqs - 1)
        self.first_tenant: str | None = None
        self.shared = False  # a second tenant has been seen: the reserve applies
        self.gate = gate
        self.held: FairQueue[Sequence] = FairQueue("fcfs")  # first turns waiting for the gate
        self.released: set[int] = set()  # ids of first turns let through, until they finish

    def __bool__(self) -> bool:
        """Whether there is work for a step (a held first turn is: the gate lets one through when idle)."""
        return bool(self.waiting or self.running or self.held)

    def __iter__(self) -> Iterator[Sequence]:
        """Every sequence it holds: running, waiting, held."""
        return itertools.chain(self.running, self.waiting, self.held)

    def add(self, seq: Sequence) -> None:
        tenant = seq.tenant
        if self.first_tenant is None:
            self.first_tenant = tenant
        elif tenant != self.first_tenant:
            self.shared = True
        if self.gate is not None and seq.turn is not None and seq.turn.first:
            self.held.push(seq, tenant)  # in the order they came (FCFS)
        else:
            self.queue(seq)

    def queue(self, seq: Sequence) -> None:
        turn = seq.turn  # None: a program of its own
        program_arrival, pinned = (None, False) if turn is None else (turn.arrival, turn.pinned)
        self.waiting.push(seq, seq.tenant, program_arrival, pinned, seq.arrival)
        self.waiting_tokens += len(seq.prompt_ids)

    def release(self) -> None:
        """Let held first turns into the queue while the gate has room, and one whenever nothing else
        would run: the gate counts programs whose end it cannot see until their tools are late (a
        client may end a program after a tool call), and an idle engine serves no program sooner."""
        gate = self.gate
        while self.held and (gate is None or gate.room() or not (self.waiting or self.running)):
            seq = self.held.pop()
            self.released.add(id(seq))
            if gate is not None:
                gate.start(seq.turn.tenant, seq.turn.program)
            self.queue(seq)

    def remove(self, seq: Sequence) -> None:
        if id(seq) in self.released:
            self.released.discard(id(seq))
            self.held.done(seq.tenant)
        if seq.status is Status.RUNNING and seq in self.running:
            self.running.remove(seq)
            self.waiting.done(seq.tenant)
        elif self.waiting.remove(seq):
            self.waiting_tokens -= len(seq.prompt_ids)
        else:
            self.held.remove(seq)  # withdrawn before the gate let it through, if it was held
        seq.end()

    @property
    def passable_tokens(self) -> int:
        """Waiting prompt tokens that a turn whose program is pinned is admitted ahead of
        (program FCFS only; FCFS admits it behind them all)."""
        return self.waiting_tokens if self.order == "program" else 0

    def admittable(self) -> bool:
        """Whether the next waiting sequence may take a free slot now."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        if not self.shared or len(self.running) < self.max_num_seqs - self.reserve:
            return True
        found = self.waiting.peek()
        return found is not None and found[1] == 0  # the reserved slots: a tenant with nothing running

    def admit(self) -> Sequence:
        seq = self.waiting.pop()
        self.waiting_tokens -= len(seq.prompt_ids)
        return seq

    def schedule(self) -> list[tuple[Sequence, list[int]]]:
        """One step's work: every decoding sequence's next token first (so decodes never starve
        behind a long prompt), then prompt chunks within the token budget, each ending at a multiple of
        `grid` unless it ends the prompt (a prompt with no room for one waits for the next step); waiting
        sequences join the running batch while there is room, fairly between tenants."""
        self.release()
        budget = self.max_num_batched_tokens
        batch = []
        decoding: list[Sequence] = []
        prefilling: list[Sequence] = []
        for seq in self.running:
            (prefilling if seq.prefilling else decoding).append(seq)
        for seq in decoding + prefilling:
            if budget <= 0:
                break
            if tokens := seq.next_run(budget, self.grid):
                batch.append((seq, tokens))
                budget -= len(tokens)
        while budget >= self.grid and self.admittable():
            seq = self.admit()
            seq.admit()
            self.running.append(seq)
            if tokens := seq.next_run(budget, self.grid):
                batch.append((seq, tokens))
                budget -= len(tokens)
        return batch
