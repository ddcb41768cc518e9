"""Decide which tokens each step computes: continuous batching with chunked prefill."""

from __future__ import annotations

from collections import deque

from runtime.sequence import Sequence, Status


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def __bool__(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

    def schedule(self) -> list[tuple[Sequence, list[int]]]:
        """One step's work: every decoding sequence's next token first (so decodes never starve
        behind a long prompt), then prompt chunks within the token budget; waiting sequences
        join the running batch while there is room."""
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
            seq = self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            tokens = seq.next_run(budget)
            batch.append((seq, tokens))
            budget -= len(tokens)
        return batch
