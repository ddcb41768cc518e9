"""What a blend asks of the CPU kernels (runtime/cpu_place.c, runtime/cpu_attention.c): reused KV written into a
sequence's blocks with its keys RoPE-shifted in one pass, bit for bit what runtime/kernels.py's rope_shift makes;
recomputed rows scattered to their positions; and rows at any positions attended as the same rows of a contiguous
call, bit for bit. Both builds (plain C, this CPU's own instructions) in both dtypes."""

from __future__ import annotations

import pytest
import torch

from kvgate.runtime import cpu_attention
from kvgate.runtime.cpu_attention import Kernel
from kvgate.runtime.kernels import rope_shift_torch
from kvgate.runtime.kv import BLOCK, KVCache

builds = [pytest.param(False, id="plain"), pytest.param(True, id="native")]
dtypes = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]


def kernel(fast: bool, dtype: torch.dtype) -> Kernel:
    built = cpu_attention.load(fast)
    if built is None:
        pytest.skip("no C compiler here")
    if fast and not built.fast[dtype]:
        pytest.skip(f"this CPU (or its compiler) has no vector instructions for {dtype}")
    return built


def cache_after_a_shared_block(dtype: torch.dtype) -> tuple[KVCache, torch.Tensor]:
    """A cache of 3 layers, 2 KV heads, whose first block is a stored one read by reference; and that block's keys."""
    kv = KVCache(3, 2, 64, dtype, "cpu")
    stored = torch.randn(3, 2, BLOCK, 64).to(dtype)
    kv.share(stored, stored.clone())
    return kv, stored


@pytest.mark.parametrize("dtype", dtypes)
@pytest.mark.parametrize("fast", builds)
def test_keys_shifted_as_written_are_rope_shift_bit_for_bit(fast: bool, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    n, start = 2 * BLOCK + 7, BLOCK - 5  # from inside the shared block across two more
    keys, values = (torch.randn(2, n, 64, generator=g).to(dtype) for _ in "kv")
    angle = torch.arange(n)[:, None] * 0.37 + torch.linspace(0, 3, 64)[None, :]  # a different shift per row
    cos, sin = angle.cos(), angle.sin()
    kv, stored = cache_after_a_shared_block(dtype)
    before = stored.clone()
    kernel(fast, dtype).write(keys, values, kv.writable(1, start, start + n), start, None, cos, sin)
    kv.written(start + n)
    placed_keys, placed_values = kv.layer(1)
    assert torch.equal(placed_keys[:, start:], rope_shift_torch(keys, cos, sin))
    assert torch.equal(placed_values[:, start:], values)
    assert torch.equal(stored, before)  # the stored block was copied before the write, never written


@pytest.mark.parametrize("dtype", dtypes)
@pytest.mark.parametrize("fast", builds)
def test_rows_written_at_positions_land_there_and_nowhere_else(fast: bool, dtype: torch.dtype) -> None:
    kv, _ = cache_after_a_shared_block(dtype)
    total = 3 * BLOCK
    zeros = torch.zeros(3, 2, total - BLOCK, 64, dtype=dtype)
    kv.extend(zeros, zeros)
    positions = torch.tensor([3, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 40, total - 1])
    keys, values = torch.randn(2, 2, len(positions), 64).to(dtype).unbind(0)
    expected_keys, expected_values = (x.clone() for x in kv.layer(2))
    expected_keys[:, positions], expected_values[:, positions] = keys, values
    kernel(fast, dtype).write(keys, values, kv.writable(2, 0, total), 0, positions)
    assert torch.equal(kv.layer(2)[0], expected_keys) and torch.equal(kv.layer(2)[1], expected_values)


@pytest.mark.parametrize("dtype", dtypes)
@pytest.mark.parametrize("fast", builds)
def test_rows_at_any_positions_attend_as_in_a_contiguous_call(fast: bool, dtype: torch.dtype) -> None:
    """A blend's recomputed rows (sorted, anywhere; a row repeated, as padding repeats one) over the blocks: each the
    same bits as that row of the whole prompt's call."""
    g = torch.Generator().manual_seed(2)
    total = 3 * BLOCK + 9
    q = torch.randn(6, total, 64, generator=g).to(dtype)
    keys, values = (torch.randn(2, total, 64, generator=g).to(dtype) for _ in "kv")
    kv = KVCache(1, 2, 64, dtype, "cpu")
    kv.extend(keys[None], values[None])
    built = kernel(fast, dtype)
    whole = built.paged(q, kv.table(0, total), 2, 0, 0.125)
    for rows in ([0, 0, 0, 5], [1, 63, 64, 65, 130, 131, 200], [total - 1], list(range(40, 140, 3))):
        at = torch.tensor(rows)
        part = built.paged(q[:, at], kv.table(0, total), 2, 0, 0.125, None, at)
        assert torch.equal(part, whole[:, at])
