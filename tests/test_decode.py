"""runtime/decode.py: a decode step's attention, batched, is each sequence's attention over its own cache."""

from __future__ import annotations

import pytest
import torch

from kvgate.runtime.decode import DecodeBatch
from kvgate.runtime.kv import KVCache
from kvgate.runtime.model import attend

LAYERS, KV_HEADS, HEADS, D = 2, 2, 6, 8


def cache(length: int, dtype: torch.dtype) -> KVCache:
    kv = KVCache(LAYERS, KV_HEADS, D, dtype, "cpu")
    kv.reserve(length + 1)
    assert kv.all_keys is not None and kv.all_values is not None
    kv.all_keys.fill_(float("nan"))  # storage past a cache's rows is never read
    kv.all_values.fill_(float("nan"))
    kv.extend(
        torch.randn(LAYERS, KV_HEADS, length, D, dtype=dtype), torch.randn(LAYERS, KV_HEADS, length, D, dtype=dtype)
    )
    return kv


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_sequence_attends_over_its_own_rows(window: int | None, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    lengths = [3, 17, 1, 9]
    caches = [cache(n, dtype) for n in lengths]
    batch = DecodeBatch(caches, {window})
    for layer in range(LAYERS):
        q = torch.randn(len(lengths), HEADS, D, dtype=dtype)
        k, v = torch.randn(len(lengths), KV_HEADS, D, dtype=dtype), torch.randn(len(lengths), KV_HEADS, D, dtype=dtype)
        together = batch.attend(layer, q, k, v, 0.3, window)
        for b, kv in enumerate(caches):
            keys = torch.cat((kv.keys[layer][:, : lengths[b]], k[b][:, None]), 1)
            values = torch.cat((kv.values[layer][:, : lengths[b]], v[b][:, None]), 1)
            alone = attend(q[b][:, None], keys, values, 0.3, window)[:, 0]
            torch.testing.assert_close(together[b], alone, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)
    batch.commit()
    assert [len(kv) for kv in caches] == [n + 1 for n in lengths]  # the new rows, of every layer, in each cache
    assert not any(kv.all_keys[:, :, : len(kv)].isnan().any() for kv in caches)  # type: ignore[union-attr]
