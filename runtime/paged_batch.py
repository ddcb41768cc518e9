"""A decode batch on a GPU over its sequences' KV blocks where they lie (runtime/paged_kernel.py): no copy of the
batch's KV, none made again when a sequence joins or leaves; per layer one kernel writes each new row into its
block and attends.

What a step reads besides the model's own tensors, each sequence's block table (`KVCache.located`) and the new
rows' positions, lives in `Tables` kept per shape (sequences, blocks padded to a multiple of TABLE_STEP), so that a
CUDA graph captured for one step replays for the next and for any later batch of that shape (runtime/graphs.py).
The host writes the tables only when the batch is made or a sequence's next row begins a block (every BLOCK
steps); `ends` moves on the device.
"""

from __future__ import annotations

import torch

from kvgate.runtime.kv import BLOCK, KVCache
from kvgate.runtime.paged_kernel import paged_decode

# A table's blocks are a multiple of this (512 positions): batches of similar lengths share a shape (and a graph),
# at the cost of programs that find their part past every sequence's end and return at once.
TABLE_STEP = 8


class Tables:
    """What every paged batch of one shape reads: `tables` [sequences, 2, 4, blocks] int64, each sequence's
    `KVCache.located()` (zero past its blocks), and `ends`, its new row's position (also the new token's)."""

    def __init__(self, sequences: int, blocks: int, device: torch.device) -> None:
        self.tables = torch.zeros(sequences, 2, 4, blocks, dtype=torch.int64, device=device)
        self.ends = torch.zeros(sequences, dtype=torch.long, device=device)

    @staticmethod
    def shape(caches: list[KVCache]) -> tuple[int, int]:
        """Sequences and blocks of the tables for these caches: a block for each one's next row, padded."""
        blocks = max(len(kv) for kv in caches) // BLOCK + 1
        return len(caches), -(-blocks // TABLE_STEP) * TABLE_STEP


class TableBatch:
    """Read through `Tables` of its shape; after the last layer only the lengths move."""

    native = True  # a fixed shape per batch: steps replayed from CUDA graphs

    def __init__(self, caches: list[KVCache], slots: Tables) -> None:
        self.caches, self.slots = caches, slots
        self.lengths = [len(kv) for kv in caches]
        self.dtype = caches[0].dtype
        slots.ends.copy_(torch.tensor(self.lengths))
        self.placed = False  # the tables hold these caches' blocks
        self.begin()

    @property
    def ends(self) -> torch.Tensor:
        return self.slots.ends

    @property
    def key(self) -> tuple[int, ...]:
        """What a captured step depends on: the tables' shape (the same tensors for every batch of that shape)."""
        return tuple(self.slots.tables.shape)

    def holds(self, caches: list[KVCache]) -> bool:
        """The same caches, nothing written to them since but by this batch, and a block in the tables for each
        one's next row."""
        same = len(caches) == len(self.caches) and all(a is b for a, b in zip(caches, self.caches))
        room = self.slots.tables.shape[3] * BLOCK
        return same and [len(kv) for kv in caches] == self.lengths and max(self.lengths) < room

    def begin(self) -> None:
        """Ready a step (host side): a block of each sequence's own for its new row, and the tables written where
        one is new (a sequence's row begins a block: every BLOCK steps)."""
        if self.placed and all(n % BLOCK for n in self.lengths):
            return
        for kv, n in zip(self.caches, self.lengths):
            kv.reserve(n + 1)
            kv.own(n // BLOCK)
        tables = torch.zeros(self.slots.tables.shape, dtype=torch.int64, device="cpu")
        for table, kv in zip(tables, self.caches):
            located = kv.located()
            table[:, :, : located.shape[2]] = located
        self.slots.tables.copy_(tables)
        self.placed = True

    def masks(self) -> None:
        """Nothing to ready: the kernel keeps each sequence to its rows and its window."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None
    ) -> torch.Tensor:
        """q [sequences, heads, d], the new k, v [sequences, kv_heads, d]: the attention output [sequences,
        heads, d], in q's dtype; k and v written into the caches' blocks."""
        slots = self.slots
        return paged_decode(q, k.to(self.dtype), v.to(self.dtype), slots.tables, layer, slots.ends, scale, window)

    def commit(self) -> None:
        """The new rows are in the caches: their lengths move on."""
        self.slots.ends.add_(1)
        self.lengths = [n + 1 for n in self.lengths]
        for kv, n in zip(self.caches, self.lengths):
            kv.written(n)
