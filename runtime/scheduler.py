"""Decide which tokens each step computes: continuous batching with chunked prefill, and the
order in which waiting requests are admitted."""

from __future__ import annotations

from kvgate.agents.queue import ProgramQueue
from kvgate.runtime.sequence import Sequence, Status


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, order: str = "fcfs") -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.order = order
        self.waiting: ProgramQueue[Sequence] = ProgramQueue(order)
        self.running: list[Sequence] = []
        self.waiting_tokens = 0  # prompt tokens waiting, read from other threads for cost estimates

    def __bool__(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        turn = seq.turn  # None: a program of its own
        program_arrival, pinned = (None, False) if turn is None else (turn.arrival, turn.pinned)
        self.waiting.push(seq, program_arrival, pinned, seq.arrival)
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
        seq = self.waiting.pop()
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
