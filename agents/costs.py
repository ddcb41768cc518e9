"""What a pin saves and what it holds, as the runtime measures them."""

from __future__ import annotations

from typing import Protocol

from runtime.engine import Engine


class Costs(Protocol):
    bytes_per_token: int
    memory_bytes: int  # the budget of the first tier, where pins hold

    def prefill_s(self, tokens: int) -> float: ...

    def queue_s(self) -> float:
        """How long a request arriving now would wait to be admitted."""
        ...

    def reload_s(self, nbytes: int) -> float | None:
        """Reading KV back from the tier below memory; None when there is none."""
        ...


class EngineCosts:
    """Costs of the engine in this process. A tier below memory is taken to read at
    `reload_bytes_per_s` (benchmarks/BENCHMARKS.md, the tiers section, measures each one)."""

    def __init__(self, engine: Engine, reload_bytes_per_s: float = 1e9) -> None:
        self.engine, self.reload_bytes_per_s = engine, reload_bytes_per_s
        layers, kv_heads, head_dim = engine.kv_shape
        item = engine.model.dtype.itemsize
        self.bytes_per_token = 2 * layers * kv_heads * head_dim * item
        tiers = engine.reuser.store.tiers
        self.memory_bytes = tiers[0].budget
        self.lower = len(tiers) > 1

    def prefill_s(self, tokens: int) -> float:
        return self.engine.prefill_s(tokens)

    def queue_s(self) -> float:
        # Only program FCFS lets a pinned program's turn pass the queue.
        return self.engine.queue_s() if self.engine.scheduler.order == "program" else 0.0

    def reload_s(self, nbytes: int) -> float | None:
        return nbytes / self.reload_bytes_per_s if self.lower else None
