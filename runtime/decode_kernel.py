"""Decode attention on a GPU: every sequence's one new query over its rows of a native decode batch, as a Triton
kernel that splits each sequence's keys across programs (flash-decoding) and a merge of the splits.

At a decode step there is one query per head: a kernel that gives each (sequence, KV head) one program runs a
batch of 1 on 8 programs of a 132-multiprocessor GPU, reading the KV at a fraction of the memory's bandwidth.
Here each (sequence, KV head) reads its keys in `splits` parts side by side (at least ~512 programs in all), the
query heads of its group together (one `tl.dot` of [16, head_dim] by [head_dim, 64]); the parts' outputs are
merged by their log-sum-exp. Every shape depends on the batch's shape alone, so a CUDA graph replays it.
The torch twin, `decode_attention_torch`, is SDPA over the same mask (what a CPU runs); tests compare the two
under TRITON_INTERPRET=1 (tests/unit/test_kernels.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvgate.runtime.kernels import HAS_TRITON, INTERPRETING, triton, use_triton

BLOCK_N = 64  # keys a loop step reads
PROGRAMS = 512  # at least this many programs, where the keys allow


def decode_mask(ends: torch.Tensor, width: int, window: int | None) -> torch.Tensor:
    """[sequences, 1, 1, width] booleans: sequence b's new token sees keys 0..ends[b] (the last `window` of them)."""
    cols = torch.arange(width, device=ends.device)[None, :]
    allowed = cols <= ends[:, None]
    if window is not None:
        allowed &= cols > ends[:, None] - window
    return allowed[:, None, None, :]


def decode_attention_torch(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [sequences, heads, d] over keys, values [sequences, kv_heads, width, d] where `mask` (decode_mask) allows:
    [sequences, heads, d]. Query head h reads KV head h // (heads // kv_heads)."""
    batch, heads, d = q.shape
    grouped = q.to(keys.dtype).view(batch, keys.shape[1], heads // keys.shape[1], d)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(batch, heads, d).to(q.dtype)


if HAS_TRITON:
    import triton.language as tl

    @triton.jit
    def fold(q, k, v, nm, scale, m, total, acc, IEEE: tl.constexpr):
        """A block of keys k and values v (rows `nm` real) folded into the query rows' running softmax: its max `m`,
        its sum `total` and the weighted values `acc`, all float32. IEEE: float32 dots as float32 (not TF32), for
        float32 KV, and in the interpreter, whose dots of bf16 are wrong (its numpy has no bf16), for every dtype."""
        if IEEE:
            k, v = k.to(tl.float32), v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(nm[None, :], scores * scale, float("-inf"))
        top = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - top[:, None])
        alpha = tl.exp(m - top)
        total = total * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return top, total, acc

    @triton.jit
    def finish(m, total, acc):
        """A part's output and log-sum-exp; a part that read nothing (past the sequence's end, or before its
        window) has -inf, and weighs nothing in the merge."""
        some = total > 0
        out = acc / tl.where(some, total, 1.0)[:, None]
        lse = tl.where(some, m + tl.log(tl.where(some, total, 1.0)), float("-inf"))
        return out, lse

    @triton.jit
    def _decode_split_kernel(
        Q, K, V, Ends, Out, Lse, scale, window,
        sqb, sqh, skb, skh, skn, sob, soh, sos, slb, slh,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        SPLIT: tl.constexpr, BLOCK: tl.constexpr, WINDOWED: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        b, kh, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        end = tl.load(Ends + b)
        lo = s * SPLIT
        hi = tl.minimum(lo + SPLIT, end + 1)
        if WINDOWED:
            lo = tl.maximum(lo, end - window + 1)
        g, d = tl.arange(0, G_PAD), tl.arange(0, D_PAD)
        gm, dm = g < G, d < D
        heads = kh * G + g
        q = tl.load(Q + b * sqb + heads[:, None] * sqh + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
        if IEEE:
            q = q.to(tl.float32)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        total = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        base = b * skb + kh * skh
        for start in range(lo, hi, BLOCK):
            n = start + tl.arange(0, BLOCK)
            nm = n < hi
            at = base + n[:, None] * skn + d[None, :]
            k = tl.load(K + at, mask=nm[:, None] & dm[None, :], other=0.0)
            v = tl.load(V + at, mask=nm[:, None] & dm[None, :], other=0.0)
            m, total, acc = fold(q, k, v, nm, scale, m, total, acc, IEEE)
        out, lse = finish(m, total, acc)
        tl.store(Out + b * sob + heads[:, None] * soh + s * sos + d[None, :], out, mask=gm[:, None] & dm[None, :])
        tl.store(Lse + b * slb + heads * slh + s, lse, mask=gm)


def decode_attention_triton(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ends: torch.Tensor, scale: float, window: int | None
) -> torch.Tensor:
    """`decode_attention_torch` over decode_mask(ends, width, window), by the split kernel and a merge."""
    batch, heads, d = q.shape
    kv_heads, width = keys.shape[1], keys.shape[2]
    assert keys.stride() == values.stride() and keys.stride(3) == 1 and q.stride(2) == 1
    group = heads // kv_heads
    splits = max(1, min(triton.cdiv(width, BLOCK_N), triton.cdiv(PROGRAMS, batch * kv_heads)))
    split = triton.cdiv(triton.cdiv(width, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(width, split)
    out = torch.empty(batch, heads, splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    q = q.to(keys.dtype)
    _decode_split_kernel[(batch, kv_heads, splits)](
        q, keys, values, ends, out, lse, scale, window or 0,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        G=group, G_PAD=max(16, triton.next_power_of_2(group)), D=d, D_PAD=max(16, triton.next_power_of_2(d)),
        SPLIT=split, BLOCK=BLOCK_N, WINDOWED=window is not None, IEEE=keys.dtype == torch.float32 or INTERPRETING,
    )  # fmt: skip
    return merge_splits(out, lse).to(keys.dtype)


def merge_splits(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The splits' outputs out [sequences, heads, splits, d] merged by their log-sum-exps lse [sequences, heads,
    splits] (-inf: a split that read nothing): [sequences, heads, d], float32."""
    weights = (lse - lse.max(-1, keepdim=True).values).exp()  # the key `ends` itself is in some part: finite
    return (out * weights[..., None]).sum(2) / weights.sum(-1, keepdim=True)


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ends: torch.Tensor, mask: torch.Tensor,
    scale: float, window: int | None,
) -> torch.Tensor:  # fmt: skip
    """The split kernel where Triton runs (CUDA tensors), else the torch twin over `mask`."""
    if use_triton(keys):
        return decode_attention_triton(q, keys, values, ends, scale, window).to(q.dtype)
    return decode_attention_torch(q, keys, values, mask, scale)
