"""What a pin saves and what it holds, as the engine in this process measures them (agents.Costs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvgate.runtime.engine import Engine


class EngineCosts:
    """Costs of the engine in this process. A tier below memory is taken to read at
    `reload_bytes_per_s` (benchmarks/BENCHMARKS.md, the tiers section, measures each one)."""

    def __init__(self, engine: Engine, reload_bytes_per_s: float = 1e9) -> None:
        self.engine, self.reload_bytes_per_s = engine, reload_bytes_per_s
        self.bytes_per_token = engine.kv_bytes_per_token
        store = engine.store
        self.memory_bytes, self.lower = store.memory_bytes, store.tiered

    def prefill_s(self, tokens: int) -> float:
        return self.engine.prefill_s(tokens)

    def queue_s(self) -> float:
        return self.engine.queue_s()

    def reload_s(self, nbytes: int) -> float | None:
        return nbytes / self.reload_bytes_per_s if self.lower else None
