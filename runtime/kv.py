"""A sequence's KV cache: per layer, K and V as [kv_heads, T, head_dim], post-RoPE.

All layers live in one keys and one values tensor, [layers, kv_heads, capacity, head_dim]; each
layer's K and V are views of them, so a run of rows is copied in or out of every layer at once."""

from __future__ import annotations

import torch


class Pool:
    """The storage of finished caches, handed to new ones (one thread: the engine's). Fresh memory is
    paid for on first touch, a page fault per page: measured on CPU, copying a 2.8k-token prompt's
    prefix blocks (130 MB) into new storage ran at 4 GB/s, into used storage at 3x that."""

    def __init__(self, max_bytes: int = 1 << 30, max_entries: int = 16) -> None:
        self.max_bytes, self.max_entries, self.bytes = max_bytes, max_entries, 0
        self.free: list[tuple[torch.Tensor, torch.Tensor]] = []

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The smallest free storage of this dtype, device and layout holding at least shape[2] tokens."""
        where = torch.device(device)  # "cuda" is whichever CUDA device is current: its storage says "cuda:0"
        fits = [
            (k.shape[2], i)
            for i, (k, _) in enumerate(self.free)
            if k.shape[2] >= shape[2]
            and k.shape[:2] + k.shape[3:] == shape[:2] + shape[3:]
            and k.dtype == dtype
            and k.device.type == where.type
            and (where.index is None or k.device.index == where.index)
        ]
        if not fits:
            return None
        keys, values = self.free.pop(min(fits)[1])
        self.bytes -= 2 * keys.nbytes
        return keys, values

    def give(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        size = 2 * keys.nbytes
        if size > self.max_bytes:
            return
        while self.free and (self.bytes + size > self.max_bytes or len(self.free) >= self.max_entries):
            dropped = self.free.pop(0)  # the oldest
            self.bytes -= 2 * dropped[0].nbytes
        self.free.append((keys, values))
        self.bytes += size


class KVCache:
    """Grows by doubling, so appending one decode token is amortised O(1); never past max_len
    (the sequence's context window; 0: no bound). With a `pool`, storage comes from it and goes
    back to it when outgrown or `release`d."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str,
        max_len: int = 0,
        pool: Pool | None = None,
    ) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device, self.max_len, self.pool = dtype, device, max_len, pool
        self.all_keys: torch.Tensor | None = None  # [layers, kv_heads, capacity, head_dim]
        self.all_values: torch.Tensor | None = None
        self.keys: list[torch.Tensor] = []  # views of all_keys, one per layer
        self.values: list[torch.Tensor] = []
        self.lengths = [0] * num_layers

    def __len__(self) -> int:
        return self.lengths[-1] if self.num_layers else 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    @property
    def nbytes(self) -> int:
        item = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.kv_heads * self.head_dim * len(self) * item

    def adopt(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Take [layers, kv_heads, T, head_dim] tensors as this (empty) cache's storage."""
        self.all_keys, self.all_values = keys, values
        self.keys, self.values = list(keys.unbind(0)), list(values.unbind(0))

    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` in every layer (call before a step)."""
        capacity = self.capacity
        if tokens <= capacity:
            return
        new = max(tokens, 2 * capacity, 16)
        if self.max_len:
            new = max(tokens, min(new, self.max_len))
        shape = (self.num_layers, self.kv_heads, new, self.head_dim)
        taken = self.pool.take((*shape[:2], tokens, shape[3]), self.dtype, self.device) if self.pool else None
        # Never an inference tensor, though a forward asks from inference mode: pooled storage may be
        # written later outside it (prefix blocks read in before any forward).
        with torch.inference_mode(False):
            keys, values = taken or (torch.empty(shape, dtype=self.dtype, device=self.device) for _ in "kv")
        old = self.all_keys, self.all_values
        if old[0] is not None and old[1] is not None:
            n = max(self.lengths)
            keys[:, :, :n] = old[0][:, :, :n]
            values[:, :, :n] = old[1][:, :, :n]
            if self.pool is not None:
                self.pool.give(*old)
        self.adopt(keys, values)

    def release(self) -> None:
        """Hand the storage back to the pool; the cache is empty after."""
        if self.pool is not None and self.all_keys is not None and self.all_values is not None:
            self.pool.give(self.all_keys, self.all_values)
        self.all_keys = self.all_values = None
        self.keys, self.values, self.lengths = [], [], [0] * self.num_layers

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add [kv_heads, n, head_dim] rows to a layer; return the layer's whole K and V."""
        start, n = self.lengths[layer], k.shape[1]
        self.reserve(start + n)
        self.keys[layer][:, start : start + n] = k
        self.values[layer][:, start : start + n] = v
        self.lengths[layer] = start + n
        return self.keys[layer][:, : start + n], self.values[layer][:, : start + n]

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append rows to every layer at once: [layers, kv_heads, n, head_dim] (the layers all at
        one length)."""
        start, n = len(self), keys.shape[2]
        self.reserve(start + n)
        assert self.all_keys is not None and self.all_values is not None
        self.all_keys[:, :, start : start + n] = keys
        self.all_values[:, :, start : start + n] = values
        self.lengths = [start + n] * self.num_layers

    def rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of rows start..stop of every layer: [layers, kv_heads, stop - start, head_dim]."""
        assert self.all_keys is not None and self.all_values is not None
        return self.all_keys[:, :, start:stop], self.all_values[:, :, start:stop]

    def truncate(self, length: int) -> None:
        self.lengths = [min(n, length) for n in self.lengths]


def extend_each(caches: list[KVCache], keys: torch.Tensor, values: torch.Tensor) -> None:
    """Append one row to each cache, every layer: keys, values [layers, len(caches), kv_heads, head_dim] (each
    cache's layers at one length). The copies go in one call: a decode step of 64 sequences wrote its rows in
    0.69 ms cache by cache, 0.31 ms so (measured, 2 cores)."""
    targets, rows = [], []
    for kv, k, v in zip(caches, keys.unbind(1), values.unbind(1)):
        n = kv.lengths[-1]
        kv.reserve(n + 1)
        assert kv.all_keys is not None and kv.all_values is not None
        targets += (kv.all_keys.select(2, n), kv.all_values.select(2, n))
        rows += (k, v)
        kv.lengths = [n + 1] * kv.num_layers
    torch._foreach_copy_(targets, rows)
