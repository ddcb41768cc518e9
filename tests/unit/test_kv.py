"""runtime/kv.py: a sequence's KV in blocks of BLOCK positions; stored blocks read by reference and copied only
when written; the pool that hands finished caches' blocks to new ones, within its bound."""

from __future__ import annotations

import torch

from kvgate.runtime.kv import BLOCK, KVCache, Pool


def cache(pool: Pool | None = None, max_len: int = 0) -> KVCache:
    return KVCache(2, 1, 4, torch.float32, "cpu", max_len, pool)


def rows(n: int, first: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.arange(first, first + 2 * n * 4).view(2, 1, n, 4)
    return keys, -keys


def test_rows_cross_blocks_as_one_sequence() -> None:
    kv = cache()
    keys, values = rows(BLOCK + 40)
    kv.extend(keys, values)
    for layer in range(2):
        kv.append(layer, torch.full((1, 1, 4), 7.0), torch.full((1, 1, 4), 8.0))
    assert len(kv) == BLOCK + 41 and len(kv.blocks) == 2 and kv.capacity == 2 * BLOCK
    got_keys, got_values = kv.rows(BLOCK - 3, BLOCK + 41)
    assert torch.equal(got_keys[:, :, :-1], keys[:, :, BLOCK - 3 :])
    assert torch.equal(got_values[:, :, :-1], values[:, :, BLOCK - 3 :])
    assert got_keys[:, :, -1].eq(7).all() and got_values[:, :, -1].eq(8).all()
    layer_keys, layer_values = kv.layer(1)
    assert torch.equal(layer_keys[:, :-1], keys[1]) and layer_values[:, -1].eq(8).all()
    copied, _ = kv.copy(0, 5)  # within one block: a copy of its own, not a view
    assert copied.data_ptr() != kv.blocks[0].keys.data_ptr()


def test_scattered_rows_land_in_their_blocks() -> None:
    kv = cache()
    kv.extend(*rows(2 * BLOCK))
    at = torch.tensor([3, BLOCK - 1, BLOCK, 2 * BLOCK - 2])
    kv.scatter(1, at, torch.zeros(1, 4, 4), torch.ones(1, 4, 4))
    keys, values = kv.layer(1)
    assert keys[:, at].eq(0).all() and values[:, at].eq(1).all()
    assert keys[:, 4].ne(0).all() and torch.equal(kv.layer(0)[0], rows(2 * BLOCK)[0][0])


def test_a_stored_block_is_read_by_reference_and_copied_before_a_write() -> None:
    stored_keys, stored_values = rows(BLOCK)
    kv = cache()
    kv.share(stored_keys, stored_values)  # a whole block where the cache's block begins: no copy
    assert kv.blocks[0].keys is stored_keys and not kv.blocks[0].own and len(kv) == BLOCK
    kv.share(*rows(10))  # not a whole block: copied
    assert kv.blocks[1].own and len(kv) == BLOCK + 10
    kv.share(*rows(BLOCK, first=0.5))  # a whole block's rows, but not where a block of the cache begins: copied
    assert [b.own for b in kv.blocks] == [False, True, True] and len(kv) == 2 * BLOCK + 10
    assert torch.equal(kv.rows(BLOCK + 10, 2 * BLOCK + 10)[0], rows(BLOCK, first=0.5)[0])
    before = stored_keys.clone()
    kv.truncate(BLOCK - 2)
    for layer in range(2):
        kv.append(layer, torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    assert torch.equal(stored_keys, before)  # the stored block untouched: the cache wrote a copy of its own
    assert kv.blocks[0].own and kv.layer(0)[0][:, BLOCK - 2].eq(0).all()
    assert torch.equal(kv.layer(0)[0][:, : BLOCK - 2], before[0, :, : BLOCK - 2])


def test_a_released_cache_gives_its_blocks_to_the_next_one() -> None:
    pool = Pool()
    first = cache(pool)
    first.reserve(3 * BLOCK)
    slots = [b.slot for b in first.blocks]
    first.release()
    assert len(first) == 0 and first.blocks == []
    second = cache(pool)
    second.reserve(2 * BLOCK)  # taken again, the first in order
    assert [b.slot for b in second.blocks] == slots[:2]
    arena_keys = next(iter(pool.arenas.values()))[0][0]
    assert second.blocks[0].keys.data_ptr() == arena_keys.data_ptr()


def test_a_prompts_blocks_are_one_run_of_rows_a_head() -> None:
    """Taken in order from one arena: block b + 1's rows follow block b's in every layer and KV head."""
    pool = Pool()
    kv = cache(pool)
    kv.extend(*rows(3 * BLOCK))
    for before, after in zip(kv.blocks, kv.blocks[1:]):
        step = after.keys.data_ptr() - before.keys.data_ptr()
        assert step == BLOCK * kv.head_dim * kv.blocks[0].keys.element_size()


def test_the_pool_is_bounded_in_bytes_and_blocks_past_it_are_the_caches_own() -> None:
    block = 2 * 2 * 1 * BLOCK * 4 * 4  # one block's keys and values
    pool = Pool(max_bytes=20 * block)
    kv = cache(pool)
    kv.reserve(30 * BLOCK)
    assert pool.bytes <= pool.max_bytes and sum(b.slot is not None for b in kv.blocks) == 20
    assert len(kv.blocks) == 30  # ten allocated alone
    kv.release()
    assert len(next(iter(pool.free.values()))) == 20


def test_blocks_stop_at_the_context_window() -> None:
    kv = cache(max_len=BLOCK + 1)
    kv.reserve(10 * BLOCK)
    assert len(kv.blocks) == 2


def test_blocks_made_under_inference_mode_are_written_outside_it_when_reused() -> None:
    """A forward reserves under torch.inference_mode; the next sequence may take those blocks and have prefix
    blocks copied into them before any forward (an inference tensor would refuse the write)."""
    pool = Pool()
    kv = cache(pool)
    with torch.inference_mode():
        kv.reserve(32)
    assert not kv.blocks[0].keys.is_inference()
    kv.release()
    reused = cache(pool)
    reused.extend(torch.ones(2, 1, 5, 4), torch.ones(2, 1, 5, 4))
    assert len(reused) == 5
