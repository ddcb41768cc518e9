"""Kernels for the hot KV operations of blend reuse, each a Triton kernel with a plain-torch twin.

Layout: per layer K and V as [kv_heads, T, head_dim]; keys post-RoPE (rotate_half convention).
The public functions dispatch: Triton for CUDA tensors, torch otherwise. For CPU tensors the
Triton kernels run only in Triton's interpreter (TRITON_INTERPRET=1 before this module is
imported, since @triton.jit decides at decoration time) and only when INTERPRET_ON_CPU is set;
tests use this to check each kernel against its twin without a GPU.

Indices must lie in [0, T): the Triton kernels do not check them (a check would cost a sync).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch twins serve
    triton = None

HAS_TRITON = triton is not None
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
INTERPRET_ON_CPU = False  # the interpreter is slow: opt in (tests do)


def use_triton(x: torch.Tensor) -> bool:
    return HAS_TRITON and (x.is_cuda or (INTERPRETING and INTERPRET_ON_CPU))


# ---- torch twins ----


def _cos_sin_rows(cos: torch.Tensor, sin: torch.Tensor, T: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin as [1, D] (one shift for all tokens) or [T, D] (one per token)."""
    cos, sin = cos.reshape(-1, D), sin.reshape(-1, D)
    if cos.shape != sin.shape or cos.shape[0] not in (1, T):
        raise ValueError(f"cos/sin must be [{D}] or [{T}, {D}], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    return cos, sin


def rope_shift_torch(
    keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    H, T, D = keys.shape
    cos, sin = _cos_sin_rows(cos, sin, T, D)
    # fp32 whatever the cache dtype: rounding the rotation would grow the error with the shift.
    x = keys.float()
    rotated = torch.cat((-x[..., D // 2 :], x[..., : D // 2]), dim=-1)
    shifted = x * cos.float() + rotated * sin.float()
    if out is None:
        return shifted.to(keys.dtype)
    return out.copy_(shifted.to(out.dtype))  # converted whole first: a converting copy into strided rows is slow


def gather_rows_torch(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.index_select(1, index)


def scatter_rows_torch(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    dst[:, index] = src


def token_deviation_torch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() - b.float()).square().sum(dim=(0, 2))


# ---- Triton kernels ----

if HAS_TRITON:

    @triton.jit
    def _rope_shift_kernel(
        k_ptr, out_ptr, cos_ptr, sin_ptr,
        T, k_sh, k_st, o_sh, o_st, cs_st,
        HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        h, tb = tl.program_id(0), tl.program_id(1)
        t = tb * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (t < T) & (d < HALF)
        k = k_ptr + h * k_sh + t * k_st + d
        x1 = tl.load(k, mask=mask).to(tl.float32)
        x2 = tl.load(k + HALF, mask=mask).to(tl.float32)
        cs = t * cs_st + d  # cs_st == 0 broadcasts one shift to every token
        c1 = tl.load(cos_ptr + cs, mask=mask).to(tl.float32)
        c2 = tl.load(cos_ptr + cs + HALF, mask=mask).to(tl.float32)
        s1 = tl.load(sin_ptr + cs, mask=mask).to(tl.float32)
        s2 = tl.load(sin_ptr + cs + HALF, mask=mask).to(tl.float32)
        # Both halves are loaded before either is stored, so out may alias keys.
        o = out_ptr + h * o_sh + t * o_st + d
        tl.store(o, (x1 * c1 - x2 * s1).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(o + HALF, (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _copy_rows_kernel(
        src_ptr, dst_ptr, index_ptr,
        n, D, s_sh, s_st, d_sh, d_st,
        GATHER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # GATHER: dst[:, i] = src[:, index[i]]; otherwise dst[:, index[i]] = src[:, i].
        h, nb = tl.program_id(0), tl.program_id(1)
        i = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.load(index_ptr + i, mask=i < n, other=0).to(tl.int64)
        if GATHER:
            s_rows, d_rows = rows, i.to(tl.int64)
        else:
            s_rows, d_rows = i.to(tl.int64), rows
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (i[:, None] < n) & (d < D)
        v = tl.load(src_ptr + h * s_sh + s_rows[:, None] * s_st + d, mask=mask)
        tl.store(dst_ptr + h * d_sh + d_rows[:, None] * d_st + d, v.to(dst_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _token_deviation_kernel(
        a_ptr, b_ptr, out_ptr,
        T, D, a_sh, a_st, b_sh, b_st,
        H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (t[:, None] < T) & (d < D)
        acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        for h in range(H):  # H constexpr: unrolled, and Triton 3.6's interpreter needs it
            a = tl.load(a_ptr + h * a_sh + t[:, None] * a_st + d, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + h * b_sh + t[:, None] * b_st + d, mask=mask, other=0.0).to(tl.float32)
            acc += (a - b) * (a - b)
        tl.store(out_ptr + t, tl.sum(acc, axis=1), mask=t < T)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """Any strides over heads and tokens (cache views); the last dimension must be dense."""
    if x.dim() != 3:
        raise ValueError(f"expected [heads, tokens, head_dim], got {tuple(x.shape)}")
    return x if x.stride(2) == 1 else x.contiguous()


def rope_shift_triton(
    keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    keys = _rows(keys)
    H, T, D = keys.shape
    cos, sin = _cos_sin_rows(cos, sin, T, D)
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty_like(keys) if out is None else out
    if out.shape != keys.shape or out.stride(2) != 1:
        raise ValueError("out must have the keys' shape and a dense last dimension")
    if T == 0:
        return out
    BLOCK_T = 16
    grid = (H, triton.cdiv(T, BLOCK_T))
    _rope_shift_kernel[grid](
        keys, out, cos, sin,
        T, keys.stride(0), keys.stride(1), out.stride(0), out.stride(1), cos.stride(0) if cos.shape[0] > 1 else 0,
        HALF=D // 2, BLOCK_T=BLOCK_T, BLOCK_D=triton.next_power_of_2(D // 2),
    )  # fmt: skip
    return out


def _copy_rows(src: torch.Tensor, dst: torch.Tensor, index: torch.Tensor, gather: bool) -> None:
    n, (H, _, D) = index.numel(), dst.shape
    if n == 0:
        return
    BLOCK_N = 16
    _copy_rows_kernel[(H, triton.cdiv(n, BLOCK_N))](
        src, dst, index.contiguous(),
        n, D, src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
        GATHER=gather, BLOCK_N=BLOCK_N, BLOCK_D=triton.next_power_of_2(D),
    )  # fmt: skip


def gather_rows_triton(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    x = _rows(x)
    H, _, D = x.shape
    out = x.new_empty(H, index.numel(), D)
    _copy_rows(x, out, index, gather=True)
    return out


def scatter_rows_triton(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    if dst.stride(2) != 1:
        raise ValueError("dst must have a dense last dimension")  # in place: no contiguous copy
    src = _rows(src)
    if src.shape != (dst.shape[0], index.numel(), dst.shape[2]):
        raise ValueError(f"src {tuple(src.shape)} does not fit dst {tuple(dst.shape)} at {index.numel()} rows")
    _copy_rows(src, dst, index, gather=False)


def token_deviation_triton(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = _rows(a), _rows(b)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} and {tuple(b.shape)}")
    H, T, D = a.shape
    out = torch.empty(T, dtype=torch.float32, device=a.device)
    if T == 0:
        return out
    BLOCK_T = 16
    _token_deviation_kernel[(triton.cdiv(T, BLOCK_T),)](
        a, b, out,
        T, D, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        H=H, BLOCK_T=BLOCK_T, BLOCK_D=triton.next_power_of_2(D),
    )  # fmt: skip
    return out


# ---- dispatch ----


def rope_shift(
    keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """keys [H, T, D] rotated by a position delta: cos, sin [D] (one delta, as the model's
    rotary_emb gives for position delta) or [T, D] (one per token). Computed in fp32; the result
    has keys' dtype, or is written into `out` (which may be `keys` itself) and returned."""
    return (rope_shift_triton if use_triton(keys) else rope_shift_torch)(keys, cos, sin, out)


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [H, T, D], index int [n] -> x[:, index], [H, n, D]."""
    return (gather_rows_triton if use_triton(x) else gather_rows_torch)(x, index)


def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """In place: dst[:, index] = src, with src [H, n, D]. Duplicate indices: one of them wins."""
    (scatter_rows_triton if use_triton(dst) else scatter_rows_torch)(dst, index, src)


def token_deviation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per token, sum over heads and head_dim of (a - b)^2: a, b [H, T, D] -> [T] fp32."""
    return (token_deviation_triton if use_triton(a) else token_deviation_torch)(a, b)
