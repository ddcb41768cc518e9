"""What a pin saves and what it holds, as the runtime measures them."""

from __future__ import annotations

from typing import Protocol


class Costs(Protocol):
    bytes_per_token: int
    memory_bytes: int  # the budget of the first tier, where pins hold

    def prefill_s(self, tokens: int) -> float: ...

    def queue_s(self) -> float:
        """The queueing a pinned program's turn arriving now would pass (0 where it cannot pass)."""
        ...

    def reload_s(self, nbytes: int) -> float | None:
        """Reading KV back from the tier below memory; None when there is none."""
        ...
