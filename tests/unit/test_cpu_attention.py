"""The CPU prompt-attention kernel (runtime/cpu_attention.py): causal attention of a prompt's rows over bf16 or
float32 KV, every row computed alike whatever its call, so that a prefill split anywhere is the whole prefill bit
for bit.

Both builds are checked in both dtypes: the plain-C one on any CPU with a C compiler (the method: blocks, masks,
the online softmax, GQA groups), the one for this CPU's own instructions where it has them (AVX512-BF16 for bf16,
AVX512F for float32: what the engine runs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvgate.runtime import cpu_attention
from kvgate.runtime.cpu_attention import Kernel
from kvgate.runtime.kv import BLOCK, KVCache

builds = [pytest.param(False, id="plain"), pytest.param(True, id="native")]
dtypes = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]
# bf16 inputs, float32 sums, weights rounded to bf16 before the values' sum: SDPA's own bf16 error
TOLERANCE = {torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}, torch.float32: {"atol": 2e-6, "rtol": 1e-5}}


def kernel(fast: bool, dtype: torch.dtype) -> Kernel:
    built = cpu_attention.load(fast)
    if built is None:
        pytest.skip("no C compiler here")
    if fast and not built.fast[dtype]:
        pytest.skip(f"this CPU (or its compiler) has no vector instructions for {dtype} (AVX512-BF16, AVX512F)")
    return built


def qkv(
    total: int, heads: int = 6, kv_heads: int = 2, d: int = 64, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(h, total, d, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))


def truth(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """float32 masked attention of q's rows at start.. over every key up to each."""
    n, total = q.shape[1], k.shape[1]
    mask = torch.arange(total)[None, :] <= torch.arange(start, start + n)[:, None]
    out = F.scaled_dot_product_attention(
        q.float()[None], k.float()[None], v.float()[None], attn_mask=mask, scale=scale, enable_gqa=True
    )  # fmt: skip
    return out[0]


@pytest.mark.parametrize("dtype", dtypes)
@pytest.mark.parametrize("fast", builds)
@pytest.mark.parametrize("heads,kv_heads,d", [(6, 2, 64), (4, 4, 64), (4, 1, 128)])
def test_rows_after_cached_keys_equal_masked_attention(
    fast: bool, heads: int, kv_heads: int, d: int, dtype: torch.dtype
) -> None:
    q, k, v = qkv(200, heads, kv_heads, d, dtype=dtype)
    for start, n in [(0, 200), (0, 1), (0, 70), (63, 1), (64, 65), (130, 70), (199, 1)]:
        rows = q[:, start : start + n]
        out = kernel(fast, dtype)(rows, k[:, : start + n], v[:, : start + n], start, d**-0.5)
        assert out.shape == rows.shape and out.dtype == dtype
        torch.testing.assert_close(out.float(), truth(rows, k, v, start, d**-0.5), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", dtypes)
@pytest.mark.parametrize("fast", builds)
def test_a_prefill_split_anywhere_is_the_whole_prefill_bit_for_bit(fast: bool, dtype: torch.dtype) -> None:
    q, k, v = qkv(300, dtype=dtype)
    attend = kernel(fast, dtype)
    whole = attend(q, k, v, 0, 0.125)
    for cuts in [(1,), (63,), (64,), (100, 101), (37, 128, 250)]:
        parts, a = [], 0
        for b in (*cuts, 300):
            parts.append(attend(q[:, a:b], k[:, :b], v[:, :b], a, 0.125))
            a = b
        assert torch.equal(torch.cat(parts, 1), whole), cuts


@pytest.mark.parametrize("dtype", dtypes)
@pytest.mark.parametrize("fast", builds)
def test_keys_past_the_rows_and_strided_inputs_change_nothing(fast: bool, dtype: torch.dtype) -> None:
    q, k, v = qkv(150, dtype=dtype)
    attend = kernel(fast, dtype)
    whole = attend(q[:, 20:100], k[:, :100], v[:, :100], 20, 0.125)
    # a cache's storage: longer than the prompt, rows of q from a [n, heads, d] projection's transpose
    wider = torch.cat((k, torch.full_like(k, float("nan"))), 1), torch.cat((v, torch.full_like(v, float("nan"))), 1)
    rows = q.transpose(0, 1).contiguous().transpose(0, 1)[:, 20:100]
    assert torch.equal(attend(rows, wider[0][:, :100], wider[1][:, :100], 20, 0.125), whole)


@pytest.mark.parametrize("dtype", dtypes)
def test_the_fast_kernel_serves_only_what_it_computes(dtype: torch.dtype) -> None:
    q = torch.zeros(4, 8, 64, dtype=dtype)
    served = cpu_attention.serving(dtype)
    assert served is None or served.fast[dtype]  # built for this CPU's own instructions (and faster than SDPA here)
    assert cpu_attention.usable(q, None) is served
    assert cpu_attention.usable(q.half(), None) is None
    assert cpu_attention.usable(q, 16) is None  # a sliding window
    assert cpu_attention.usable(q[..., :32], None) is None


def test_kv_in_another_dtype_than_the_rows_is_refused_not_misread() -> None:
    q = torch.zeros(4, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="alike"):
        kernel(False, torch.bfloat16)(q, q.float(), q.float(), 0, 0.125)


@pytest.mark.parametrize("dtype", dtypes)
def test_a_layers_row_ops_are_torchs_and_each_row_alike_in_any_call(dtype: torch.dtype) -> None:
    """runtime/cpu_rows.c's RMSNorm, RoPE and SiLU-gated product: transformers' and model.py's to the last bit or two
    of the element type (their sums run in another order), and a row the same bit for bit whatever rows share its
    call (a decode step's few, a prompt's thousands, split anywhere)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from kvgate.runtime.model import apply_rope

    built = cpu_attention.load()
    if built is None or not built.decodes:
        pytest.skip("no C compiler here, or no vector instructions it builds for")
    g = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(96, generator=g).to(dtype)
    x = (3 * torch.randn(300, 2 * 96, generator=g)).to(dtype)[:, :96]  # rows of a wider tensor
    qkv = torch.randn(300, 7, 64, generator=g).to(dtype)  # 4 query heads and a KV head rotated, 2 value heads not
    cos, sin = torch.randn(300, 64, generator=g).to(dtype), torch.randn(300, 64, generator=g).to(dtype)
    both = (4 * torch.randn(300, 2 * 200, generator=g)).to(dtype)  # gate and up, 200 wide: a tail past the vectors
    gate, up = both.chunk(2, dim=-1)
    tolerance = {"atol": 2e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    with torch.inference_mode():
        for ours, theirs in [
            (lambda a, b: built.norm(norm, x[a:b]), lambda a, b: norm(x[a:b])),
            (lambda a, b: built.rope(qkv[a:b, :5], cos[a:b], sin[a:b]),
             lambda a, b: apply_rope(qkv[a:b, :5], cos[a:b], sin[a:b])),
            (lambda a, b: built.gated(both[a:b]), lambda a, b: F.silu(gate[a:b]) * up[a:b]),
        ]:  # fmt: skip
            whole = ours(0, 300)
            torch.testing.assert_close(whole, theirs(0, 300), **tolerance)
            assert torch.equal(torch.cat([ours(0, 1), ours(1, 7), ours(7, 300)]), whole)


@pytest.mark.parametrize("dtype", dtypes)
@pytest.mark.parametrize("fast", builds)
def test_keys_in_blocks_anywhere_attend_as_the_same_keys_in_one_tensor(fast: bool, dtype: torch.dtype) -> None:
    """A sequence's KV in blocks (runtime/kv.py), one of them a view of a stored tensor with another stride between
    heads: the kernel reads each block where it lies, and the rows are those of the same keys in one tensor, bit
    for bit."""
    q, k, v = qkv(3 * BLOCK + 9, dtype=dtype)
    total = k.shape[1]
    kv = KVCache(3, 2, 64, dtype, "cpu")
    stored = torch.randn(3, 2, 5 * BLOCK, 64).to(dtype)  # a stored entry, its head stride 5 blocks long
    stored[1, :, BLOCK : 2 * BLOCK], values = k[:, :BLOCK], torch.zeros_like(stored)
    values[1, :, BLOCK : 2 * BLOCK] = v[:, :BLOCK]
    kv.share(stored[:, :, BLOCK : 2 * BLOCK], values[:, :, BLOCK : 2 * BLOCK])
    kv.extend(torch.stack((k, k, k))[:, :, BLOCK:], torch.stack((v, v, v))[:, :, BLOCK:])
    assert not kv.blocks[0].own
    built = kernel(fast, dtype)
    for start in (0, BLOCK - 1, BLOCK + 5, total - 1):
        rows = q[:, start:]
        out = torch.empty_like(rows)
        built.paged(rows, kv.table(1, total), 2, start, 0.125, out)
        assert torch.equal(out, built(rows, k, v, start, 0.125))
