"""runtime/rope.py: keys cached at 0..T-1 and shifted by d equal keys computed at d..d+T-1."""

from __future__ import annotations

import torch

from kvgate.runtime.kv import KVCache
from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.model import Run, forward
from kvgate.runtime.rope import can_shift, shift


def keys_at(loaded: LoadedModel, prefix: list[int], doc: list[int]) -> list[torch.Tensor]:
    """Each layer's keys of `doc`, computed after `prefix` (so at positions len(prefix)..)."""
    c = loaded.model.config
    kv = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, loaded.model.dtype, "cpu")
    forward(loaded.model, [Run(kv, prefix + doc, 0)])
    return [kv.layer(i)[0][:, len(prefix) : len(kv)] for i in range(kv.num_layers)]


def test_shift_identity_on_the_first_layer(loaded: LoadedModel) -> None:
    assert can_shift(loaded.model)
    doc = loaded.tokenizer.encode("The Eiffel Tower is in Paris, France.", add_special_tokens=False)
    prefix = loaded.tokenizer.encode("Some unrelated earlier text " * 20, add_special_tokens=False)
    # Layer 0's keys depend only on each token itself and its position: the identity is exact there.
    alone, after = keys_at(loaded, [], doc)[0], keys_at(loaded, prefix, doc)[0]
    moved = shift(loaded.model, alone, len(prefix))
    assert (moved - after).abs().max() < 1e-4
    assert (alone - after).abs().max() > 0.1  # without the shift the keys are far off


def test_shift_composes(loaded: LoadedModel) -> None:
    keys = torch.randn(3, 5, loaded.model.config.head_dim)
    twice = shift(loaded.model, shift(loaded.model, keys, 100), 23)
    assert torch.allclose(twice, shift(loaded.model, keys, 123), atol=1e-4)
    assert torch.allclose(shift(loaded.model, keys, 0), keys)
