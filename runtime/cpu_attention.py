"""Attention on a CPU in C kernels of kvgate's own, compiled here at first use: a prompt's rows over bf16 or float32
KV (runtime/cpu_attention.c with its kinds, cpu_attention_bf16.c and cpu_attention_f32.c) and a decode batch's step
(runtime/cpu_decode.c).

SDPA's CPU flash kernel reached ~130 GFLOP/s in bf16 on a 2-core AVX512-BF16 CPU, where the same CPU's bf16
linears run at ~420: attention was 60% of a cold 2.6k-token prefill. The C kernel computes its dots with
AVX512-BF16 instructions (float32: AVX512F fused multiply-adds in register tiles of 6 rows), and each row the same
way whatever rows share its call, so that a prompt's KV is the same bit for bit however its prefill is split
without cutting the call into a grid of chunks.

It is compiled for this very CPU (`-march=native`) with the system's C compiler into the user's kvgate cache,
once per source and machine, and loaded beside torch's OpenMP runtime (whose threads it shares). Where there is
no compiler, the CPU lacks the dtype's instructions, or SDPA is faster here (measured once a process and dtype, for
CPUs with AMX), the torch kernels serve. `load(fast=False)` gives the kernel's plain-C build on any CPU, which tests
use to check the method where the instructions are missing.

A decode step's attention in torch is a dozen small ops a layer, each dearer in dispatch than in arithmetic at a few
hundred keys; the decode kernel writes the step's new rows into each sequence's blocks and attends for every
sequence and KV head in one call, reading the KV where it lies (vector code for any CPU with AVX2 or NEON). A
layer's RMSNorms, rotation and SiLU-gated product are one call each too, for a decode step's rows and a prompt's
alike (`row_ops`: each torch op is a pass over the rows' memory, and a rotation alone was seven).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvgate.chunk_cache.config import user_cache_dir
from kvgate.runtime.kv import BLOCK

SIZES = {torch.bfloat16: 2, torch.float32: 4}
log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "cpu_attention.c",
        "cpu_attention_bf16.c",
        "cpu_attention_f32.c",
        "cpu_decode.c",
        "cpu_rows.c",
        "cpu_place.c",
    )
)
HEADERS = tuple(Path(__file__).with_name(name) for name in ("cpu_bf16.h", "cpu_block.h", "cpu_flash.h", "cpu_vec.h"))
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")


def bound(library: ctypes.CDLL, name: str, *argtypes: Any) -> Any:
    """`library`'s function `name` taking `argtypes` and returning an int, from a prototype (the library's own
    function object left as it is)."""
    return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)((name, library))


class Kernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        self.fast = {dtype: bool(library.fast(int(dtype == torch.bfloat16))) for dtype in SIZES}
        if library.block() != BLOCK:
            raise ImportError(f"cpu attention: a kernel of {library.block()}-position blocks for KV of {BLOCK}")
        i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
        tensors = [ptr, i64, i64, ptr, i64, ptr, i64, i64]  # q and strides, blocks table and stride, out and strides
        self._attend = bound(library, "attend", i32, *tensors, i32, i32, i32, i32, i32, f32, i32, ptr)
        self.decodes = bool(library.decode_fast())
        tensors = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, i32, ptr, ptr]  # q, k, v, strides; tables, layer, ends, out
        self._decode = bound(library, "decode", i32, *tensors, i32, i32, i32, i32, f32, i32, i32)
        self._norm = bound(library, "rms_norm", i32, ptr, i64, ptr, ptr, i32, i32, f32, i32)
        self._rope = bound(library, "rope", i32, ptr, i64, ptr, ptr, ptr, i32, i32, i32, i32)
        self._gated = bound(library, "silu_mul", i32, ptr, i64, ptr, i32, i32, i32)
        rows = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, i64, ptr]  # k, v, strides; cos, sin; table; positions
        self._write = bound(library, "write_rows", i32, *rows, i32, i32, i32, i32, i32)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Rows start..start+n of q [heads, n, d] over k, v [kv_heads, >= start + n, d], causal: [heads, n, d],
        all bf16 or float32; written into `out` where given (any strides but the last)."""
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise TypeError(f"cpu attention: bf16 or float32 alike, not {q.dtype}, {k.dtype}, {v.dtype}")
        d = q.shape[2]
        k, v = (x if x.stride(2) == 1 and x.stride(1) == d else x.contiguous() for x in (k, v))
        return self.paged(q, table_of(k, v, start + q.shape[1]), k.shape[0], start, scale, out)

    def paged(self, q: torch.Tensor, table: torch.Tensor, kv_heads: int, start: int, scale: float,
              out: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """`__call__` over keys and values in blocks of BLOCK positions where `table` (runtime/kv.py
        `KVCache.table`) says they lie. `positions` (int64 [n], ascending): each row's own position instead of
        start + i (`start` unused), each row computed as it would be among contiguous rows."""
        if q.dtype not in SIZES:
            raise TypeError(f"cpu attention: bf16 or float32, not {q.dtype}")
        heads, n, d = q.shape
        if positions is not None:
            if positions.dtype != torch.int64 or positions.shape != (n,) or positions.device.type != "cpu":
                raise ValueError(f"cpu attention: positions {positions.dtype} {tuple(positions.shape)} for {n} rows")
            positions = positions.contiguous()
            start = int(positions[-1]) + 1 - n if n else 0  # where the table must reach: start + n
        if q.stride(2) != 1:
            q = q.contiguous()
        if out is None:
            out = torch.empty(heads, n, d, dtype=q.dtype)
        elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
            raise ValueError(f"cpu attention: out {tuple(out.shape)} {out.dtype} for rows {tuple(q.shape)} {q.dtype}")
        if table.dtype != torch.int64 or table.shape[0] != 4 or table.shape[1] * BLOCK < start + n:
            raise ValueError(f"cpu attention: a table of {tuple(table.shape)} for {start + n} positions")
        if table.stride(1) != 1:
            table = table.contiguous()
        failed = self._attend(
            q.dtype == torch.bfloat16, q.data_ptr(), q.stride(0), q.stride(1), table.data_ptr(), table.stride(0),
            out.data_ptr(), out.stride(0), out.stride(1), heads, kv_heads, n, start, d, scale, torch.get_num_threads(),
            positions.data_ptr() if positions is not None else None,
        )  # fmt: skip
        if failed:
            raise MemoryError("cpu attention: out of memory for its buffers")
        return out

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, layer: int,
               ends: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:  # fmt: skip
        """A decode step of a batch at `layer`: the new rows k, v [sequences, kv_heads, d] written into each sequence's
        blocks at position ends[b], then q [sequences, heads, d] attended over each sequence's rows 0..ends[b] (the
        last `window`): [sequences, heads, d]. `tables` [sequences, 2, 4, blocks]: each sequence's
        `KVCache.located`; q, k, v and the blocks all bf16 or all float32."""
        batch, heads, d = q.shape
        if q.dtype not in SIZES or k.dtype != q.dtype or v.dtype != q.dtype:
            raise TypeError(f"cpu decode attention: bf16 or float32 alike, not {q.dtype}, {k.dtype}, {v.dtype}")
        q, k, v = (x if x.stride(2) == 1 and x.stride(1) == d else x.contiguous() for x in (q, k, v))
        tables = tables if tables.is_contiguous() else tables.contiguous()
        out = torch.empty(batch, heads, d, dtype=q.dtype)
        failed = self._decode(
            q.dtype == torch.bfloat16, q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
            v.stride(0), tables.data_ptr(), tables.shape[3], layer, ends.data_ptr(), out.data_ptr(), batch, heads,
            k.shape[1], d, scale, window or 0, torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError("cpu decode attention: out of memory for its buffers")
        return out

    def norm(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """An RMSNorm `module` (weight, variance_epsilon) of rows x [..., hidden]."""
        if x.dim() != 2:
            return self.norm(module, x.reshape(-1, x.shape[-1])).view(x.shape)
        weight, eps = module.weight, getattr(module, "variance_epsilon", None)
        if eps is None or x.stride(1) != 1 or weight.dtype != x.dtype or not weight.is_contiguous():
            return module(x)
        out = torch.empty(x.shape, dtype=x.dtype)
        n, d = x.shape
        self._norm(x.dtype == torch.bfloat16, x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), n, d,
                   eps, torch.get_num_threads())  # fmt: skip
        return out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [n, heads, d] (heads d apart) rotated by cos, sin [n, d], as model.py's apply_rope."""
        n, heads, d = x.shape
        if x.stride(2) != 1 or x.stride(1) != d:
            x = x.contiguous()
        cos, sin = cos.to(x.dtype).contiguous(), sin.to(x.dtype).contiguous()
        out = torch.empty(n, heads, d, dtype=x.dtype)
        self._rope(x.dtype == torch.bfloat16, x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(),
                   out.data_ptr(), n, heads, d, torch.get_num_threads())  # fmt: skip
        return out

    def write(self, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, start: int,
              positions: torch.Tensor | None = None, cos: torch.Tensor | None = None,
              sin: torch.Tensor | None = None) -> None:  # fmt: skip
        """Rows k, v [kv_heads, n, d] written into the blocks of a layer's `table` (runtime/kv.py `KVCache.writable`)
        at positions start..start+n, or at `positions` (int64 [n]); `cos`, `sin` ([n, d]): the keys RoPE-shifted as
        they are written, as runtime/kernels.py's rope_shift does (bit for bit). k, v and the blocks in one dtype."""
        kv_heads, n, d = k.shape
        if k.dtype not in SIZES or v.dtype != k.dtype or v.shape != k.shape:
            raise TypeError(f"cpu rows: k, v bf16 or float32 alike, not {k.dtype} {tuple(k.shape)}, {v.dtype}")
        k, v = (x if x.stride(2) == 1 else x.contiguous() for x in (k, v))
        last = start + n
        if positions is not None:
            if positions.dtype != torch.int64 or positions.shape != (n,):
                raise ValueError(f"cpu rows: positions {positions.dtype} {tuple(positions.shape)} for {n} rows")
            positions = positions.contiguous()
            last = int(positions.max()) + 1 if n else 0
        if table.dtype != torch.int64 or table.shape[0] != 4 or table.shape[1] * BLOCK < last:
            raise ValueError(f"cpu rows: a table of {tuple(table.shape)} for {last} positions")
        table = table if table.stride(1) == 1 else table.contiguous()
        if cos is not None and sin is not None:
            cos, sin = (x.to(torch.float32).contiguous() for x in (cos, sin))
            if cos.shape != (n, d) or sin.shape != (n, d):
                raise ValueError(f"cpu rows: cos, sin {tuple(cos.shape)} for {n} rows of {d}")
        self._write(
            k.element_size(), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
            cos.data_ptr() if cos is not None else None, sin.data_ptr() if sin is not None else None,
            table.data_ptr(), table.stride(0), positions.data_ptr() if positions is not None else None,
            n, start, kv_heads, d, torch.get_num_threads(),
        )  # fmt: skip

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for rows x [..., 2f] of gate and up side by side: [..., f]."""
        if x.dim() != 2:
            return self.gated(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], x.shape[-1] // 2)
        n, f = x.shape[0], x.shape[1] // 2
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty(n, f, dtype=x.dtype)
        self._gated(x.dtype == torch.bfloat16, x.data_ptr(), x.stride(0), out.data_ptr(), n, f,
                    torch.get_num_threads())  # fmt: skip
        return out


def table_of(k: torch.Tensor, v: torch.Tensor, total: int) -> torch.Tensor:
    """The blocks' table (`Kernel.paged`) of contiguous k, v [kv_heads, >= total, d] (rows d apart)."""
    item, blocks = k.element_size(), -(-total // BLOCK)
    step = torch.arange(blocks, dtype=torch.int64) * BLOCK
    return torch.stack(
        (
            k.data_ptr() + step * item * k.stride(1),
            v.data_ptr() + step * item * v.stride(1),
            torch.full((blocks,), k.stride(0), dtype=torch.int64),
            torch.full((blocks,), v.stride(0), dtype=torch.int64),
        )
    )


def machine_key() -> str:
    """What a build depends on: the source and the CPU's instruction sets."""
    cpu = Path("/proc/cpuinfo")
    lines = cpu.read_text().splitlines() if cpu.is_file() else []
    flags = next((line for line in lines if line.startswith("flags")), os.uname().machine)
    code = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS)) + " ".join(FLAGS).encode()
    return hashlib.sha256(code + flags.encode()).hexdigest()[:16]


def private(where: Path) -> bool:
    """Whether `where` (made if missing) can be written by this user alone: a library loaded from it runs as
    this process."""
    try:
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
        status = where.lstat()
    except OSError:
        return False
    return not where.is_symlink() and status.st_uid == os.getuid() and not status.st_mode & 0o022


@functools.cache
def load(fast: bool = True) -> Kernel | None:
    """The kernel built for this CPU (`fast`: for its own instructions; else plain C), or None where no C
    compiler builds it. Built once a machine into the user's kvgate cache (nothing goes to the temporary
    directory: the compiler's own files are made beside the library)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    where = user_cache_dir() / "kernels"
    if compiler is None or not private(where):
        return None
    try:
        key = machine_key()
    except OSError as exc:  # an install without the sources
        log.warning("cpu kernels not built: %s", exc)
        return None
    target = where / f"cpu_attention-{key}-{'native' if fast else 'plain'}.so"
    if not target.is_file():
        temp = target.with_suffix(f".{os.getpid()}.tmp")
        march = ["-march=native"] if fast else ["-march=x86-64-v2"] if os.uname().machine == "x86_64" else []
        argv = [compiler, *FLAGS, *march, *map(str, SOURCES), "-o", str(temp)]
        done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "TMPDIR": str(where)})
        if done.returncode != 0:
            log.warning("cpu attention kernel not built (%s): %s", compiler, done.stderr[-400:])
            temp.unlink(missing_ok=True)
            return None
        temp.replace(target)
    return Kernel(ctypes.CDLL(str(target)))


def faster(kernel: Kernel, dtype: torch.dtype, rows: int = 1024, rounds: int = 5) -> bool:
    """Whether the kernel attends a prompt in `dtype` faster than SDPA's flash kernel on this CPU (8 heads over 2
    KV heads): measured rather than assumed, since CPUs with AMX run SDPA's bf16 GEMMs on their tiles. The two
    alternate, the best of `rounds` each: a burst of other work on a shared machine slows both, not one."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(h, rows, 64, generator=g).to(dtype) for h in (8, 2, 2))
    ways = (
        lambda: kernel(q, k, v, 0, 0.125),
        lambda: F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True),
    )
    times: list[list[float]] = [[], []]
    for attend in ways:
        attend()
    for _ in range(rounds):
        for way, attend in zip(times, ways):
            began = time.perf_counter()
            attend()
            way.append(time.perf_counter() - began)
    ours, sdpa = min(times[0]), min(times[1])
    log.info("cpu attention: %.1f ms against SDPA's %.1f ms for %d rows in %s", 1e3 * ours, 1e3 * sdpa, rows, dtype)
    return ours < sdpa


@functools.cache
def serving(dtype: torch.dtype) -> Kernel | None:
    """The kernel the engine uses for prompts in `dtype` (bf16, float32): built for this CPU's own instructions
    and faster than SDPA here (measured once a process and dtype, ~0.1 s); else None."""
    kernel = load()
    return kernel if kernel is not None and kernel.fast.get(dtype, False) and faster(kernel, dtype) else None


def decoding(dtype: torch.dtype, head_dim: int, group: int) -> Kernel | None:
    """The kernel for a CPU decode batch's attention over its sequences' blocks (runtime/decode.py), where it was
    built for vector instructions: bf16 or float32 KV, head sizes a multiple of 16 up to 256, at most 16 query heads
    a KV head."""
    if dtype not in SIZES or head_dim % 16 or head_dim > 256 or group > 16:
        return None
    kernel = load()
    return kernel if kernel is not None and kernel.decodes else None


def row_ops(h: torch.Tensor) -> Kernel | None:
    """The kernel for a layer's row-wise ops (runtime/cpu_rows.c: norms, rotations, the MLP's gated product), where
    it was built for vector instructions."""
    if h.device.type != "cpu" or h.dtype not in SIZES:
        return None
    kernel = load()
    return kernel if kernel is not None and kernel.decodes else None


def writer(k: torch.Tensor, v: torch.Tensor, blocks: torch.dtype) -> Kernel | None:
    """The kernel that writes rows k, v into a cache's blocks of dtype `blocks` (`Kernel.write`): all three bf16 or
    all float32, on a CPU, where a kernel was built."""
    if k.device.type != "cpu" or k.dtype not in SIZES or not k.dtype == v.dtype == blocks:
        return None
    return load()


def usable(q: torch.Tensor, window: int | None) -> Kernel | None:
    """The serving kernel where it computes these rows: bf16 or float32 on a CPU, full attention, head sizes a
    multiple of 64, GQA groups whole."""
    if q.device.type != "cpu" or q.dtype not in SIZES or window is not None or q.shape[-1] % 64:
        return None
    return serving(q.dtype)
