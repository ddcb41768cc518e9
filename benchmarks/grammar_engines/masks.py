"""Token bitmasks: a fresh one, applying one to logits in plain torch, and each engine's kernel timed against it."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch

from .engines import Engine
from .stats import med, timed

_SHIFTS = torch.arange(32, dtype=torch.int32)
_BITS = torch.tensor([[(v >> k) & 1 for k in range(8)] for v in range(256)], dtype=torch.bool)


def new_bitmask(rows: int, vocab: int, fill: int = -1) -> torch.Tensor:
    """[rows, vocab/32] int32, every bit set (fill=-1) or clear (fill=0)."""
    return torch.full((rows, (vocab + 31) // 32), fill, dtype=torch.int32)


def apply_mask_shifts(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Engine-neutral: every engine here writes the same int32 bitmask (bit i of word j = token 32*j+i allowed)."""
    allowed = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).view(bitmask.shape[0], -1)[:, : logits.shape[1]]
    logits.masked_fill_(allowed == 0, float("-inf"))


def apply_mask_lut(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The same, one byte at a time through a 256 x 8 table (little-endian words)."""
    allowed = _BITS[bitmask.view(torch.uint8).long()].view(bitmask.shape[0], -1)[:, : logits.shape[1]]
    logits.masked_fill_(~allowed, float("-inf"))


def bench_apply(engines: Sequence[Engine], vocab: int, batch: int, iters: int) -> list[tuple[str, float, float]]:
    """[batch, vocab] float32 logits, a random bitmask: (kernel, first call ms, median us)."""
    g = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    base = torch.randn(batch, vocab, generator=g)
    kernels: list[tuple[str, Callable[[torch.Tensor, torch.Tensor], None]]] = [
        ("plain torch, shifts (eager)", apply_mask_shifts),
        ("plain torch, byte table (eager)", apply_mask_lut),
    ]
    kernels += [(f"{e.name}.apply_token_bitmask_inplace", e.apply) for e in engines]
    ref = base.clone()
    apply_mask_shifts(ref, bitmask)
    out: list[tuple[str, float, float]] = []
    for name, fn in kernels:
        logits = base.clone()
        try:
            first, _ = timed(fn, logits, bitmask)
        except Exception as exc:  # a kernel that cannot run here (e.g. no compiler) is reported
            print(f"  apply kernel {name}: failed: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
            continue
        if not torch.equal(torch.isinf(logits), torch.isinf(ref)):
            print(f"  apply kernel {name}: result differs from the reference", file=sys.stderr)
        times = []
        for _ in range(iters):
            logits = base.clone()
            times.append(timed(fn, logits, bitmask)[0])
        out.append((name, first * 1e3, med(times) * 1e6))
    return out
