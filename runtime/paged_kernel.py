"""Decode attention on a GPU over each sequence's KV blocks where they lie (runtime/kv.py): no copy of the batch's KV.

A program per (sequence, KV head, split) reads its sequence's blocks through the sequence's row of a block table,
`KVCache.located()` (what the CPU kernel, runtime/cpu_decode.c, reads): per block the byte addresses of its keys and
values at layer 0, the elements between two KV heads in each, and the bytes a layer adds. An address is cast to a
pointer (`tl.load(...).to(tl.pointer_type(...))`, as Triton's grouped-GEMM tutorial does), not an index into arenas:
a block shared from a store (`KVCache.share`) lies in no arena, and keys and values may lie with other strides.

The query heads of a KV head's group go together (one `tl.dot` of [16, head_dim] by [head_dim, 64] a block); each
(sequence, KV head) reads its keys in `splits` parts side by side, merged by their log-sum-exp as runtime/
decode_kernel.py's split kernel does, sliding windows honoured. The step's new key and value rows are read from the
step's tensors, not from memory, by the one program whose part holds the sequence's end, which also writes them into
their block: no program reads a row another writes, and nothing is copied after the step. Every shape depends on the
table's shape alone (sequences, blocks), so a CUDA graph captured for one step replays for the next.
"""

from __future__ import annotations

import torch

from kvgate.runtime.decode_kernel import PROGRAMS, merge_splits
from kvgate.runtime.kernels import HAS_TRITON, INTERPRETING, triton
from kvgate.runtime.kv import BLOCK

if HAS_TRITON:
    import triton.language as tl

    from kvgate.runtime.decode_kernel import finish, fold

    @triton.jit
    def _paged_decode_kernel(
        Q, NewK, NewV, Tables, Ends, Out, Lse, layer, scale, window, split,
        sqb, sqh, skb, skh, svb, svh, stb, blocks, sob, soh, sos, slb, slh,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK: tl.constexpr, WINDOWED: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        b, kh, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        end = tl.load(Ends + b)  # the new row's position: rows 0..end - 1 lie in the blocks
        first = s * split
        lo, hi = first, tl.minimum(first + split, end)
        if WINDOWED:
            lo = tl.maximum(lo, end - window + 1)
        g, d, r = tl.arange(0, G_PAD), tl.arange(0, D_PAD), tl.arange(0, BLOCK)
        gm, dm = g < G, d < D
        heads = kh * G + g
        q = tl.load(Q + b * sqb + heads[:, None] * sqh + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
        if IEEE:
            q = q.to(tl.float32)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        total = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        row = Tables + b * stb  # [2, 4, blocks]: addresses, head strides; what a layer adds
        dtype = NewK.dtype.element_ty
        for blk in range(lo // BLOCK, (hi + BLOCK - 1) // BLOCK):  # lo < hi: each block read holds some rows
            at = row + blk
            keys = (tl.load(at) + layer * tl.load(at + 4 * blocks)).to(tl.pointer_type(dtype))
            values = (tl.load(at + blocks) + layer * tl.load(at + 5 * blocks)).to(tl.pointer_type(dtype))
            n = blk * BLOCK + r
            nm = (n >= lo) & (n < hi)
            within = r[:, None] * D + d[None, :]
            k = tl.load(keys + kh * tl.load(at + 2 * blocks) + within, mask=nm[:, None] & dm[None, :], other=0.0)
            v = tl.load(values + kh * tl.load(at + 3 * blocks) + within, mask=nm[:, None] & dm[None, :], other=0.0)
            m, total, acc = fold(q, k, v, nm, scale, m, total, acc, IEEE)
        if (first <= end) & (end < first + split):  # the part holding the new row: read from the step, written
            new_k = tl.load(NewK + b * skb + kh * skh + d, mask=dm, other=0.0)
            new_v = tl.load(NewV + b * svb + kh * svh + d, mask=dm, other=0.0)
            score = tl.sum(q.to(tl.float32) * new_k.to(tl.float32)[None, :], 1) * scale
            top = tl.maximum(m, score)
            p = tl.exp(score - top)
            alpha = tl.exp(m - top)
            total = total * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * new_v.to(tl.float32)[None, :]
            m = top
            at = row + end // BLOCK
            keys = (tl.load(at) + layer * tl.load(at + 4 * blocks)).to(tl.pointer_type(dtype))
            values = (tl.load(at + blocks) + layer * tl.load(at + 5 * blocks)).to(tl.pointer_type(dtype))
            within = (end % BLOCK) * D + d
            tl.store(keys + kh * tl.load(at + 2 * blocks) + within, new_k, mask=dm)
            tl.store(values + kh * tl.load(at + 3 * blocks) + within, new_v, mask=dm)
        out, lse = finish(m, total, acc)
        tl.store(Out + b * sob + heads[:, None] * soh + s * sos + d[None, :], out, mask=gm[:, None] & dm[None, :])
        tl.store(Lse + b * slb + heads * slh + s, lse, mask=gm)


def runs_on(device: torch.device) -> bool:
    """Whether the paged kernel runs for tensors on `device`: CUDA where Triton is installed (a CPU only in
    Triton's interpreter, where tests opt in: runtime/kernels.py `use_triton`)."""
    from kvgate.runtime import kernels  # read at call time: tests set INTERPRET_ON_CPU after importing

    return HAS_TRITON and (device.type == "cuda" or (kernels.INTERPRETING and kernels.INTERPRET_ON_CPU))


def parts(sequences: int, kv_heads: int, blocks: int) -> tuple[int, int]:
    """How a table of `blocks` is read: splits a (sequence, KV head), and positions a split (a whole number of
    blocks), at least ~PROGRAMS programs in all where the blocks allow."""
    splits = max(1, min(blocks, -(-PROGRAMS // (sequences * kv_heads))))
    per = -(-blocks // splits)
    return -(-blocks // per), per * BLOCK


def paged_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, layer: int, ends: torch.Tensor,
    scale: float, window: int | None,
) -> torch.Tensor:  # fmt: skip
    """A decode step of a batch at `layer`: the new rows k, v [sequences, kv_heads, d] (the blocks' dtype) written
    into each sequence's block at position ends[b], and q [sequences, heads, d] attended over the sequence's rows
    0..ends[b] (the last `window` of them): [sequences, heads, d], in q's dtype. `tables` [sequences, 2, 4, blocks]
    int64 on q's device: each sequence's `KVCache.located()`, zero past its blocks, a block for its row ends[b]."""
    batch, heads, d = q.shape
    kv_heads, blocks = k.shape[1], tables.shape[3]
    assert k.stride(2) == v.stride(2) == q.stride(2) == 1 and tables.is_contiguous()
    group = heads // kv_heads
    splits, split = parts(batch, kv_heads, blocks)
    out = torch.empty(batch, heads, splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    queries = q.to(k.dtype)
    _paged_decode_kernel[(batch, kv_heads, splits)](
        queries, k, v, tables, ends, out, lse, layer, scale, window or 0, split, queries.stride(0), queries.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), tables.stride(0), blocks,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        G=group, G_PAD=max(16, triton.next_power_of_2(group)), D=d, D_PAD=max(16, triton.next_power_of_2(d)),
        BLOCK=BLOCK, WINDOWED=window is not None, IEEE=k.dtype == torch.float32 or INTERPRETING,
    )  # fmt: skip
    return merge_splits(out, lse).to(q.dtype)
