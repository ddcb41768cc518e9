"""runtime/kv.py: a sequence's KV in one keys and one values tensor, and the pool that hands finished caches'
storage to new ones (fresh memory costs a page fault per page on first touch), within its bounds."""

from __future__ import annotations

import torch

from kvgate.runtime.kv import KVCache, Pool


def cache(pool: Pool | None = None, max_len: int = 0) -> KVCache:
    return KVCache(2, 1, 4, torch.float32, "cpu", max_len, pool)


def test_layers_are_views_of_one_tensor_and_rows_move_in_one_copy() -> None:
    kv = cache()
    kv.extend(torch.ones(2, 1, 3, 4), torch.full((2, 1, 3, 4), 2.0))
    assert len(kv) == 3 and kv.keys[1].data_ptr() == kv.all_keys[1].data_ptr()
    kv.append(0, torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    kv.append(1, torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    keys, values = kv.rows(2, 4)
    assert keys[:, :, 0].eq(1).all() and keys[:, :, 1].eq(0).all() and values[:, :, 0].eq(2).all()


def test_a_released_cache_gives_its_storage_to_the_next_one() -> None:
    pool = Pool()
    first = cache(pool)
    first.reserve(100)
    storage = first.all_keys.data_ptr()
    first.release()
    assert len(first) == 0 and first.all_keys is None
    second = cache(pool)
    second.reserve(50)  # it fits: taken, not allocated
    assert second.all_keys.data_ptr() == storage and second.capacity >= 100
    third = cache(pool)
    third.reserve(10)
    assert third.all_keys.data_ptr() != storage  # nothing left in the pool


def test_growing_gives_the_outgrown_storage_back_and_keeps_the_rows() -> None:
    pool = Pool()
    kv = cache(pool)
    kv.extend(torch.ones(2, 1, 16, 4), torch.ones(2, 1, 16, 4))
    kv.reserve(40)
    assert len(pool.free) == 1 and pool.free[0][0].shape[2] == 16
    assert kv.all_keys[:, :, :16].eq(1).all() and len(kv) == 16


def test_the_pool_is_bounded_in_bytes_and_entries() -> None:
    pool = Pool(max_bytes=2 * 2 * (2 * 1 * 64 * 4) * 4, max_entries=3)  # two caches of 64 tokens
    for _ in range(5):
        kv = cache(pool)
        kv.reserve(64)
        kv.release()
    # Released one after another, each taken again by the next: one in the pool.
    assert len(pool.free) == 1
    held = [cache(pool) for _ in range(5)]
    for kv in held:
        kv.reserve(64)
    for kv in held:
        kv.release()
    assert len(pool.free) == 2 and pool.bytes <= pool.max_bytes
    big = cache(pool)
    big.reserve(10_000)
    big.release()  # larger than the whole pool: dropped, the others kept
    assert len(pool.free) == 2 and pool.bytes <= pool.max_bytes


def test_storage_made_under_inference_mode_is_written_outside_it_when_reused() -> None:
    """A forward reserves under torch.inference_mode; the next sequence may take that storage and have
    prefix blocks copied into it before any forward (an inference tensor would refuse the write)."""
    pool = Pool()
    kv = cache(pool)
    with torch.inference_mode():
        kv.reserve(32)
    assert not kv.all_keys.is_inference()
    kv.release()
    reused = cache(pool)
    reused.extend(torch.ones(2, 1, 5, 4), torch.ones(2, 1, 5, 4))
    assert len(reused) == 5
