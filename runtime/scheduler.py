"""Decide which tokens each step computes: continuous batching with chunked prefill, and the
order in which waiting requests are admitted."""

from __future__ import annotations

from kvgate.runtime.sequence import Sequence, Status

ORDERS = ("fcfs", "program")


def program_order(pinned: bool, program_arrival: float, arrival: float) -> tuple[bool, float, float]:
    """Program FCFS: requests whose program's KV is pinned first, then by their program's first
    arrival (an agent's later turns do not queue behind programs that started after it)."""
    return (not pinned, program_arrival, arrival)


def rank(seq: Sequence) -> tuple[bool, float, float]:
    turn = seq.turn
    if turn is None:  # its own program
        return program_order(False, seq.arrival, seq.arrival)
    return program_order(turn.pinned, turn.arrival, seq.arrival)


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, order: str = "fcfs") -> None:
        if order not in ORDERS:
            raise ValueError(f"unknown queue order {order!r}; one of {', '.join(ORDERS)}")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.order = order
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.waiting_tokens = 0  # prompt tokens waiting, read from other threads for cost estimates

    def __bool__(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.waiting_tokens += len(seq.prompt_ids)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.waiting_tokens -= len(seq.prompt_ids)
        seq.status = Status.FINISHED

    @property
    def passable_tokens(self) -> int:
        """Waiting prompt tokens that a turn whose program is pinned is admitted ahead of
        (program FCFS only; FCFS admits it behind them all)."""
        return self.waiting_tokens if self.order == "program" else 0

    def admit(self) -> Sequence:
        i = 0 if self.order == "fcfs" else min(range(len(self.waiting)), key=lambda j: rank(self.waiting[j]))
        seq = self.waiting.pop(i)
        self.waiting_tokens -= len(seq.prompt_ids)
        return seq

    def schedule(self) -> list[tuple[Sequence, list[int]]]:
        """One step's work: every decoding sequence's next token first (so decodes never starve
        behind a long prompt), then prompt chunks within the token budget; waiting sequences
        join the running batch while there is room, in the queue's order."""
        budget = self.max_num_batched_tokens
        batch = []
        decoding = [s for s in self.running if not s.prefilling]
        prefilling = [s for s in self.running if s.prefilling]
        for seq in decoding + prefilling:
            if budget <= 0:
                break
            tokens = seq.next_run(budget)
            batch.append((seq, tokens))
            budget -= len(tokens)
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.admit()
            seq.status = Status.RUNNING
            self.running.append(seq)
            tokens = seq.next_run(budget)
            batch.append((seq, tokens))
            budget -= len(tokens)
        return batch
