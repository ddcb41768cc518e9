"""runtime/decode.py: a decode step's attention, batched, is each sequence's attention over its own cache."""

from __future__ import annotations

import pytest
import torch

from kvgate.runtime import cpu_attention
from kvgate.runtime.decode import Batches, PagedBatch
from kvgate.runtime.kv import BLOCK, KVCache
from kvgate.runtime.model import attend

LAYERS, KV_HEADS, HEADS, D = 2, 2, 6, 8  # head size 8: torch's ops; 64: runtime/cpu_decode.c where it is built


def cache(length: int, dtype: torch.dtype, d: int = D) -> KVCache:
    kv = KVCache(LAYERS, KV_HEADS, d, dtype, "cpu")
    kv.reserve(length + 1)
    for block in kv.blocks:  # storage past a cache's rows is never read
        block.keys.fill_(float("nan")), block.values.fill_(float("nan"))
    kv.extend(
        torch.randn(LAYERS, KV_HEADS, length, d, dtype=dtype), torch.randn(LAYERS, KV_HEADS, length, d, dtype=dtype)
    )
    return kv


def step(batches: Batches, caches: list[KVCache], window: int | None, dtype: torch.dtype) -> None:
    """One decode step of every layer through `batches`, each sequence's output checked against its own attention."""
    lengths, d = [len(kv) for kv in caches], caches[0].head_dim
    batch = batches.of(caches, {window})
    assert batch is not None
    batch.masks()
    for layer in range(LAYERS):
        q = torch.randn(len(caches), HEADS, d, dtype=dtype)
        k, v = torch.randn(len(caches), KV_HEADS, d, dtype=dtype), torch.randn(len(caches), KV_HEADS, d, dtype=dtype)
        together = batch.attend(layer, q, k, v, 0.3, window)
        for b, kv in enumerate(caches):
            keys, values = kv.layer(layer, lengths[b])
            keys, values = torch.cat((keys, k[b][:, None]), 1), torch.cat((values, v[b][:, None]), 1)
            alone = attend(q[b][:, None], keys, values, 0.3, window)[:, 0]
            torch.testing.assert_close(together[b], alone, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)
    batch.commit()
    assert [len(kv) for kv in caches] == [n + 1 for n in lengths]  # the new rows, of every layer, in each cache
    assert not any(kv.rows(0, len(kv))[0].isnan().any() for kv in caches)


@pytest.mark.parametrize("native,d", [(False, D), (False, 64), (True, D)])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_sequence_attends_over_its_own_rows_step_after_step(
    window: int | None, dtype: torch.dtype, native: bool, d: int
) -> None:
    """Every way a batch is held: over its sequences' own blocks (head size 64: one call a layer of
    runtime/cpu_decode.c, where it is built), a float32 copy over the rows in use (torch's ops), or native (the
    caches' dtype, SDPA over the whole room, as on a GPU)."""
    torch.manual_seed(0)
    caches, batches = [cache(n, dtype, d) for n in (3, 17, 1, 9)], Batches(native=native)
    step(batches, caches, window, dtype)
    kept = batches.last
    step(batches, caches, window, dtype)
    assert batches.last is kept  # the same sequences, as it left them: its copy of their K and V goes on


def test_a_cache_written_by_another_is_copied_again() -> None:
    torch.manual_seed(0)
    caches, batches = [cache(n, torch.float32) for n in (5, 8)], Batches()
    step(batches, caches, None, torch.float32)
    kept = batches.last
    caches[1].truncate(4)  # e.g. rows given back: its copy in the batch is stale
    step(batches, caches, None, torch.float32)
    assert batches.last is not kept
    step(batches, caches[:1], None, torch.float32)  # another set of sequences
    assert batches.last is not kept


def test_a_new_batch_that_fits_reuses_the_storage() -> None:
    """Memory stays at its peak under load rather than being allocated again at each new batch."""
    torch.manual_seed(0)
    batches = Batches()
    step(batches, [cache(n, torch.float32) for n in (30, 20)], None, torch.float32)
    storage = batches.storage
    step(batches, [cache(n, torch.float32) for n in (7, 9, 11)], None, torch.float32)  # fewer rows in all
    assert batches.storage is storage


def test_native_batches_of_one_shape_share_their_addresses() -> None:
    """What lets a CUDA graph captured for one batch replay for the next (runtime/graphs.py): another set of as
    many sequences, of lengths in the same room, is carved at the same address with the same slots."""
    torch.manual_seed(0)
    batches = Batches(native=True)
    step(batches, [cache(n, torch.bfloat16) for n in (30, 20)], None, torch.bfloat16)
    first = batches.last
    step(batches, [cache(n, torch.bfloat16) for n in (7, 41)], None, torch.bfloat16)
    second = batches.last
    assert first is not None and second is not None and first is not second
    assert first.key == second.key and first.slots is second.slots
    step(batches, [cache(n, torch.bfloat16) for n in (7, 41, 3)], None, torch.bfloat16)
    assert batches.last is not None and batches.last.key != first.key  # another shape: another graph


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_paged_batch_writes_its_rows_into_the_caches_blocks_across_their_ends(dtype: torch.dtype) -> None:
    """Over the caches' own blocks (runtime/cpu_decode.c): no copy of their KV; a sequence whose next row begins a
    block gets one, and a block read by reference from a store is copied before its first write."""
    if cpu_attention.decoding(dtype, 64, HEADS // KV_HEADS) is None:
        pytest.skip("no decode kernel built here")
    torch.manual_seed(0)
    caches = [cache(n, dtype, 64) for n in (BLOCK - 1, 2 * BLOCK - 2, 5)]
    stored = tuple(torch.randn(LAYERS, KV_HEADS, BLOCK, 64, dtype=dtype) for _ in "kv")
    kept = stored[0].clone()
    shared = KVCache(LAYERS, KV_HEADS, 64, dtype, "cpu")
    shared.share(*stored)  # a whole stored block, by reference...
    shared.truncate(BLOCK - 4)  # ...whose rows from here on are the decode's to write
    wide = torch.randn(LAYERS, KV_HEADS, 2 * BLOCK, 64, dtype=dtype)[:, :, :BLOCK]  # values heads 2 blocks apart
    read = KVCache(LAYERS, KV_HEADS, 64, dtype, "cpu")
    read.share(stored[0], wide)  # read where it lies, keys and values with their own head strides
    caches += [shared, read]
    batches = Batches(native=False)
    for _ in range(3):
        step(batches, caches, None, dtype)
        assert isinstance(batches.last, PagedBatch)
    assert [len(kv) for kv in caches] == [BLOCK + 2, 2 * BLOCK + 1, 8, BLOCK - 1, BLOCK + 3]
    assert [len(kv.blocks) for kv in caches] == [2, 3, 1, 1, 2] and read.blocks[0].values is wide
    assert torch.equal(stored[0], kept) and shared.blocks[0].keys is not stored[0]
