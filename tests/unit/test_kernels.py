"""runtime/kernels.py: each Triton kernel equals its torch twin; the RoPE shift equals a fresh RoPE.

Triton's interpreter is chosen when @triton.jit runs, i.e. when runtime.kernels is imported, and
only if TRITON_INTERPRET=1 is set by then. Other test modules may have imported it already, so the
CPU comparisons run this file as a script in a subprocess with that variable set, once per module.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":
    sys.path.append(str(ROOT))  # after PYTHONPATH: a kvgate it names (a checkout's own) before the root's

from kvgate.runtime import decode_kernel, kernels  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
T = 37  # not a multiple of any block size
H = 3


def _cos_sin(positions: torch.Tensor, D: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1e5 ** -(torch.arange(0, D, 2, dtype=torch.float32) / D)
    angles = positions.float()[:, None] * inv_freq[None]
    emb = torch.cat((angles, angles), dim=-1).to(device)
    return emb.cos(), emb.sin()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        # The interpreter rounds fp32 -> bf16 towards zero (GPUs round to nearest): one ulp apart.
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)


def check_rope_shift(device: str, dtype: torch.dtype, D: int) -> None:
    cache = torch.randn(H, T + 9, D, device=device).to(dtype)
    keys = cache[:, 4 : 4 + T]  # a view into a larger buffer, as a cache slice is
    for positions in (torch.tensor([1234]), torch.randint(0, 5000, (T,))):
        cos, sin = _cos_sin(positions, D, device)
        cos, sin = (cos[0], sin[0]) if len(positions) == 1 else (cos, sin)
        want = kernels.rope_shift_torch(keys, cos, sin)
        placed = cache.clone()  # written into other rows, as blend places a cached piece: the same values
        assert torch.equal(kernels.rope_shift_torch(keys, cos, sin, out=placed[:, 9:]), want)
        _close(kernels.rope_shift_triton(keys, cos, sin), want)
        buffer = cache.clone()
        inplace = buffer[:, 4 : 4 + T]
        kernels.rope_shift_triton(inplace, cos, sin, out=inplace)
        _close(inplace, want)
        assert torch.equal(buffer[:, :4], cache[:, :4]) and torch.equal(buffer[:, 4 + T :], cache[:, 4 + T :])
        # bf16 cos/sin, as a bf16 model's rotary_emb returns them, are read as they are.
        _close(
            kernels.rope_shift_triton(keys, cos.to(dtype), sin.to(dtype)),
            kernels.rope_shift_torch(keys, cos.to(dtype), sin.to(dtype)),
        )


def check_gather_rows(device: str, dtype: torch.dtype, D: int) -> None:
    x = torch.randn(H, T + 9, D, device=device).to(dtype)[:, 4 : 4 + T]
    for n in (0, 1, 19, 2 * T):  # with repeats
        index = torch.randint(0, T, (n,), device=device)
        assert torch.equal(kernels.gather_rows_triton(x, index), kernels.gather_rows_torch(x, index))


def check_scatter_rows(device: str, dtype: torch.dtype, D: int) -> None:
    buffer = torch.randn(H, T + 9, D, device=device).to(dtype)
    for n in (0, 1, 19, T):
        index = torch.randperm(T, device=device)[:n]
        src = torch.randn(H, n, D, device=device).to(dtype)
        got, want = buffer.clone(), buffer.clone()
        kernels.scatter_rows_triton(got[:, 4 : 4 + T], index, src)  # rows outside the view stay
        kernels.scatter_rows_torch(want[:, 4 : 4 + T], index, src)
        assert torch.equal(got, want)


def check_token_deviation(device: str, dtype: torch.dtype, D: int) -> None:
    a = torch.randn(H, T, D, device=device).to(dtype)
    b = (a.float() + 0.1 * torch.randn(H, T, D, device=device)).to(dtype)
    got, want = kernels.token_deviation_triton(a, b[:, :]), kernels.token_deviation_torch(a, b)
    assert got.dtype == torch.float32 and got.shape == (T,)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(kernels.token_deviation_triton(a, a), torch.zeros(T, device=device))


def check_decode_attention(device: str, dtype: torch.dtype, D: int) -> None:
    """Each sequence's query over its own keys, split across programs and merged: a sequence at its first key, one
    whose keys end inside a split and one at the room's last; GQA groups of 3; with and without a window."""
    batch, kv_heads, group, room = 3, 2, 3, 200  # a room not a multiple of the kernel's blocks
    keys, values = (torch.randn(batch, kv_heads, room, D, device=device).to(dtype) for _ in "kv")
    q = torch.randn(batch, kv_heads * group, D, device=device).to(dtype)
    ends = torch.tensor([0, 77, room - 1], device=device)
    for window in (None, 5):
        mask = decode_kernel.decode_mask(ends, room, window)
        want = decode_kernel.decode_attention_torch(q.float(), keys.float(), values.float(), mask, 0.3)
        got = decode_kernel.decode_attention_triton(q, keys, values, ends, 0.3, window)
        assert got.dtype == dtype and got.shape == q.shape
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want, rtol=0, atol=tolerance)


def check_dispatch(device: str, dtype: torch.dtype, D: int) -> None:
    x = torch.randn(H, T, D, device=device).to(dtype)
    assert kernels.use_triton(x)
    cos, sin = _cos_sin(torch.tensor([7]), D, device)
    _close(kernels.rope_shift(x, cos[0], sin[0]), kernels.rope_shift_torch(x, cos[0], sin[0]))
    index = torch.tensor([5, 0, 36], device=device)
    assert torch.equal(kernels.gather_rows(x, index), x[:, index])
    torch.testing.assert_close(kernels.token_deviation(x, 2 * x), x.float().square().sum((0, 2)), rtol=1e-5, atol=0)


CHECKS: dict[str, Callable[[str, torch.dtype, int], None]] = {
    "rope_shift": check_rope_shift,
    "gather_rows": check_gather_rows,
    "scatter_rows": check_scatter_rows,
    "token_deviation": check_token_deviation,
    "decode_attention": check_decode_attention,
    "dispatch": check_dispatch,
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CASES = [(dtype, D) for dtype in DTYPES for D in (64, 128, 96)]


def run_checks(name: str, device: str) -> list[str]:
    """Failures of one check over every dtype and head_dim."""
    failures = []
    for dtype, D in CASES:
        torch.manual_seed(0)
        try:
            CHECKS[name](device, DTYPES[dtype], D)
        except Exception as e:  # noqa: BLE001 -- collected, reported by the test
            failures.append(f"{dtype}, head_dim {D}: {type(e).__name__}: {e}")
    return failures


@pytest.fixture(scope="module")
def interpreted() -> dict[str, list[str]]:
    from tests.helpers.interpreter import interpreted  # not in the script's own process (a `tests` elsewhere)

    return interpreted(__file__)


@pytest.mark.parametrize("name", CHECKS)
def test_triton_interpreted_matches_torch(interpreted: dict[str, list[str]], name: str) -> None:
    assert not interpreted[name], "\n".join(interpreted[name])


@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and a CUDA device")
@pytest.mark.parametrize("name", CHECKS)
def test_triton_on_cuda_matches_torch(name: str) -> None:
    failures = run_checks(name, "cuda")
    assert not failures, "\n".join(failures)


def test_cpu_uses_torch_unless_asked() -> None:
    x = torch.randn(H, T, 64)
    assert kernels.use_triton(x) == (kernels.HAS_TRITON and kernels.INTERPRETING and kernels.INTERPRET_ON_CPU)


def test_rope_shift_equals_fresh_rope() -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=192, num_attention_heads=3, num_key_value_heads=H, head_dim=64, rope_theta=1e5)
    rotary = LlamaRotaryEmbedding(config)

    def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary(x, positions[None])  # [1, T, D]
        return kernels.rope_shift_torch(x, cos[0], sin[0])  # the shift from 0 is RoPE itself

    torch.manual_seed(0)
    raw = torch.randn(H, T, 64)
    p = torch.arange(T)
    cached = rope(raw, p)
    # fp32 angles round to ~ulp(position): the two sides drift apart by ~1e-7 x position.
    for delta, tolerance in ((0, 1e-6), (1, 1e-4), (517, 1e-4), (1000, 1e-4), (30000, 1e-2)):
        cos, sin = rotary(raw, torch.tensor([[delta]]))
        moved = kernels.rope_shift_torch(cached, cos[0, 0], sin[0, 0])  # one [D] shift for every token
        assert (moved - rope(raw, p + delta)).abs().max() < tolerance
    deltas = torch.randint(0, 1000, (T,))
    cos, sin = rotary(raw, deltas[None])
    moved = kernels.rope_shift_torch(cached, cos[0], sin[0])  # a [T, D] shift, one per token
    assert (moved - rope(raw, p + deltas)).abs().max() < 1e-4
    assert (cached - rope(raw, p + 517)).abs().max() > 0.1
    bf16 = kernels.rope_shift_torch(cached.bfloat16(), cos[0], sin[0])
    assert bf16.dtype == torch.bfloat16 and (bf16.float() - rope(raw, p + deltas)).abs().max() < 0.05


def test_rope_shift_rejects_bad_cos_shape() -> None:
    keys = torch.randn(H, T, 64)
    with pytest.raises(ValueError):
        kernels.rope_shift_torch(keys, torch.ones(5, 64), torch.ones(5, 64))


if __name__ == "__main__":
    # Run by the `interpreted` fixture, under TRITON_INTERPRET=1: every case on CPU tensors.
    assert kernels.INTERPRETING and kernels.HAS_TRITON, "set TRITON_INTERPRET=1 and install triton"
    assert type(kernels._rope_shift_kernel).__name__ == "InterpretedFunction", "triton imported too early"
    kernels.INTERPRET_ON_CPU = True
    print(json.dumps({name: run_checks(name, "cpu") for name in CHECKS}))
