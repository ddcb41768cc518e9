"""A sequence's KV cache: per layer, K and V as [kv_heads, T, head_dim], post-RoPE."""

from __future__ import annotations

import torch


class KVCache:
    """Grows by doubling, so appending one decode token is amortised O(1); never past max_len
    (the sequence's context window; 0: no bound)."""

    def __init__(
        self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str, max_len: int = 0
    ) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device, self.max_len = dtype, device, max_len
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths = [0] * num_layers

    def __len__(self) -> int:
        return self.lengths[-1] if self.num_layers else 0

    @property
    def nbytes(self) -> int:
        item = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.kv_heads * self.head_dim * len(self) * item

    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` in every layer (call before a step)."""
        capacity = self.keys[0].shape[1] if self.keys else 0
        if tokens <= capacity:
            return
        new = max(tokens, 2 * capacity, 16)
        if self.max_len:
            new = max(tokens, min(new, self.max_len))
        shape = (self.kv_heads, new, self.head_dim)
        keys, values = [], []
        for i in range(self.num_layers):
            k = torch.empty(shape, dtype=self.dtype, device=self.device)
            v = torch.empty(shape, dtype=self.dtype, device=self.device)
            if self.keys:
                n = self.lengths[i]
                k[:, :n] = self.keys[i][:, :n]
                v[:, :n] = self.values[i][:, :n]
            keys.append(k)
            values.append(v)
        self.keys, self.values = keys, values

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add [kv_heads, n, head_dim] rows to a layer; return the layer's whole K and V."""
        start, n = self.lengths[layer], k.shape[1]
        self.reserve(start + n)
        self.keys[layer][:, start : start + n] = k
        self.values[layer][:, start : start + n] = v
        self.lengths[layer] = start + n
        return self.keys[layer][:, : start + n], self.values[layer][:, : start + n]

    def truncate(self, length: int) -> None:
        self.lengths = [min(n, length) for n in self.lengths]
