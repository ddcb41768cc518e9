"""A sequence's KV for the tests that drive the model directly: empty, or a prompt prefilled in full."""

from __future__ import annotations

from kvgate.runtime.kv import KVCache
from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.model import Run, forward


def new_kv(loaded: LoadedModel) -> KVCache:
    c = loaded.model.config
    return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, loaded.model.dtype, "cpu")


def prefilled(loaded: LoadedModel, ids: list[int]) -> KVCache:
    kv = new_kv(loaded)
    forward(loaded.model, [Run(kv, ids, 0)])
    return kv
