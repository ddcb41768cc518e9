"""Row invariance: how many rows a step must give each linear layer for every row's result to be what it
is among any other rows (the padding `forward` adds), measured once per machine.

CPU GEMMs take other paths for a few rows (measured here: float32 below 4 rows on one thread and below 12
on two; bfloat16 at one row for a 576 x 1536 weight), and their results differ in the last bits. A step
padded to the floor computes each row as it would in any larger step, so a prompt's KV, its first token and
its decode steps do not depend on what else the step carried.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel

from kvgate.runtime.weights import Linear, decoder_of

MOST = 64  # rows probed; a floor above it means the device's GEMMs are not row-invariant at any size tried
_floors: dict[str, int] = {}


def probe_floor(linears: Sequence[Linear], most: int = MOST) -> int:
    """The fewest rows from which each linear's rows equal, bit for bit, the same rows computed among 4 x `most`
    (most + 1: not even at `most`). Several windows of few rows are compared, since a bf16 output hides most
    differences in its rounding."""
    floor = 1
    generator = torch.Generator().manual_seed(0)
    for linear in linears:
        x = torch.randn(4 * most, linear.in_features, generator=generator).to(linear.dtype).to(linear.device)
        whole = linear(x)
        for m in [n for n in (most, 48, 32, 24, *range(16, 0, -1)) if floor <= n <= most]:
            starts = range(0, len(x) - m + 1, m)[: max(2, 32 // m)]
            if any(not torch.equal(linear(x[j : j + m]), whole[j : j + m]) for j in starts):
                floor = m + 1
                break
    return floor


@functools.cache
def device_name(kind: str) -> str:
    if kind == "cuda":
        return torch.cuda.get_device_name()
    cpu = Path("/proc/cpuinfo")
    text = cpu.read_text() if cpu.is_file() else platform.processor()
    return next((line for line in text.splitlines() if line.startswith("model name")), platform.machine())


def machine(kind: str = "cpu") -> str:
    """What a floor depends on besides the model: the device, its kernels' library and the thread count."""
    return f"{device_name(kind)}|torch {torch.__version__}|threads {torch.get_num_threads()}"


@functools.lru_cache(maxsize=64)
def _key(dtype: torch.dtype, kind: str, threads: int, shapes: str) -> str:
    return hashlib.sha256(f"{machine(kind)}|{dtype}|{kind}|{threads}|{shapes}".encode()).hexdigest()[:32]


def key_of(model: PreTrainedModel) -> str:
    config = model.config
    sizes = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    shapes = "|".join(str(getattr(config, name, "")) for name in sizes)
    kernels = "onednn" if decoder_of(model).head.packed else "torch"
    return _key(model.dtype, model.device.type, torch.get_num_threads(), f"{shapes}|{kernels}")


def row_floor(model: PreTrainedModel, cache_dir: Path | None = None) -> int:
    """The floor of the model's first layer's linears: kept in memory, and under `cache_dir` when given."""
    key = key_of(model)
    if key in _floors:
        return _floors[key]
    where = cache_dir / "floors" / f"{key}.json" if cache_dir is not None else None
    if where is not None and where.is_file():
        try:
            _floors[key] = int(json.loads(where.read_text())["floor"])
            return _floors[key]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # damaged: measured again
    decoder = decoder_of(model)
    with torch.inference_mode():
        _floors[key] = probe_floor([*decoder.layers[0].linears, decoder.head])
    if where is not None:
        try:
            where.parent.mkdir(parents=True, exist_ok=True)
            temp = where.with_suffix(f".{os.getpid()}.tmp")
            temp.write_text(json.dumps({"floor": _floors[key], "machine": machine(), "dtype": str(model.dtype)}))
            temp.replace(where)
        except OSError:
            pass  # a read-only cache: measured again next start
    return _floors[key]


def invariant(model: PreTrainedModel) -> bool:
    """Whether a step padded to the floor computes its rows as any other step would (else no reuse is exact)."""
    return row_floor(model) <= MOST
