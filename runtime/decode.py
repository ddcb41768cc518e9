"""Attention for decode steps: every sequence's one new token, all sequences in one call per layer.

Per sequence and layer, attention over the sequence's own cache took some twenty small ops (write the new K and
V, convert K and V to float32, two matmuls, softmax, copy out). A `DecodeBatch` holds a float32 copy of the
batch's K and V, every layer ([layers, sequences, kv_heads, room, head_dim], zero past each sequence's rows),
kept from step to step while the same sequences decode: a step writes each layer's new row into it and attends
for the whole batch in a few ops, and the caches get the new rows once, after the last layer. The padding is
masked; the sums run over other lengths than one sequence's alone, so a token's logits may differ in their
last bits with the batch (decode steps that must not: `deterministic`, runtime/model.py).
"""

from __future__ import annotations

import torch

from kvgate.runtime.kv import KVCache

# Steps a batch's copy has room for before it is made again, larger.
ROOM = 64
# A batch whose copy would take more is not batched (its sequences attend one by one); the most the copy holds.
MOST_BYTES = 1 << 29


class DecodeBatch:
    def __init__(self, caches: list[KVCache], windows: set[int | None], storage: torch.Tensor) -> None:
        """`storage`: float32, at least `elements(caches)` long (what the batch's copy is carved from)."""
        first = caches[0]
        self.caches, self.windows = caches, windows
        self.lengths = [len(kv) for kv in caches]
        shape = (first.num_layers, len(caches), first.kv_heads, max(self.lengths) + ROOM, first.head_dim)
        both = storage[: 2 * shape[0] * shape[1] * shape[2] * shape[3] * shape[4]].zero_().view(2, *shape)
        self.keys, self.values = both[0], both[1]
        self.rows = torch.arange(len(caches), device=first.device)  # each sequence's row of the batch
        for b, (kv, n) in enumerate(zip(caches, self.lengths)):
            keys, values = kv.rows(0, n)
            self.keys[:, b, :, :n] = keys
            self.values[:, b, :, :n] = values
        self.begin()

    @staticmethod
    def elements(caches: list[KVCache]) -> int:
        first = caches[0]
        rows = len(caches) * (max(len(kv) for kv in caches) + ROOM)
        return 2 * first.num_layers * first.kv_heads * first.head_dim * rows

    def holds(self, caches: list[KVCache]) -> bool:
        """The same caches, nothing written to them since but by this batch, and room for a row more."""
        return (
            len(caches) == len(self.caches)
            and all(a is b for a, b in zip(caches, self.caches))
            and [len(kv) for kv in caches] == self.lengths
            and max(self.lengths) < self.keys.shape[3]
        )

    def begin(self) -> None:
        """Ready a step: where each new row goes, and per window what each new token may not see."""
        device = self.keys.device
        self.width = max(self.lengths) + 1
        self.ends = torch.tensor(self.lengths, device=device)
        cols = torch.arange(self.width, device=device)[None, :]
        ends = self.ends[:, None]
        self.masks = {}
        for window in self.windows:
            allowed = cols <= ends if window is None else (cols <= ends) & (cols > ends - window)
            mask = torch.zeros(allowed.shape, dtype=torch.float32, device=device)
            self.masks[window] = mask.masked_fill_(~allowed, float("-inf"))[:, None, None, :]
        self.new_keys: list[torch.Tensor] = []
        self.new_values: list[torch.Tensor] = []

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None
    ) -> torch.Tensor:
        """q [sequences, heads, d], the new k, v [sequences, kv_heads, d]: the attention output [sequences,
        heads, d], in q's dtype."""
        self.new_keys.append(k)
        self.new_values.append(v)
        keys, values = self.keys[layer], self.values[layer]
        keys[self.rows, :, self.ends] = k.float()
        values[self.rows, :, self.ends] = v.float()
        keys, values = keys[:, :, : self.width], values[:, :, : self.width]
        batch, heads, d = q.shape
        grouped = q.float().view(batch, keys.shape[1], heads // keys.shape[1], d)  # head h reads KV head h // group
        scores = torch.matmul(grouped, keys.transpose(2, 3)).mul_(scale).add_(self.masks[window])
        return torch.matmul(scores.softmax(-1), values).view(batch, heads, d).to(q.dtype)

    def commit(self) -> None:
        """Write each sequence's new K and V, of every layer, to its cache."""
        keys, values = torch.stack(self.new_keys), torch.stack(self.new_values)  # [layers, sequences, kv_heads, d]
        for b, kv in enumerate(self.caches):
            kv.extend(keys[:, b, :, None], values[:, b, :, None])
        self.lengths = [n + 1 for n in self.lengths]


class Batches:
    """A decode step's batch, the last one kept for the next step, and the storage batches are carved from: kept
    and reused, so that memory stays at its peak instead of being allocated again at each new batch (one owner:
    the engine's thread)."""

    def __init__(self) -> None:
        self.last: DecodeBatch | None = None
        self.storage: torch.Tensor | None = None

    def of(self, caches: list[KVCache], windows: set[int | None]) -> DecodeBatch | None:
        """The batch of these caches: the last one where it holds them as they are, else a new one (None: too
        large to batch)."""
        if self.last is not None and self.last.holds(caches):
            self.last.begin()
            return self.last
        self.last = None
        needed = DecodeBatch.elements(caches)
        if needed * 4 > MOST_BYTES:
            return None
        if self.storage is None or len(self.storage) < needed:
            self.storage = None  # its memory, before the new one's
            self.storage = torch.empty(min(2 * needed, MOST_BYTES // 4), dtype=torch.float32, device=caches[0].device)
        self.last = DecodeBatch(caches, windows, self.storage)
        return self.last
