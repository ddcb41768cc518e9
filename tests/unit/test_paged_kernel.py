"""runtime/paged_kernel.py and runtime/paged_batch.py: a decode step over each sequence's KV blocks where they lie
equals attention over the sequence's gathered rows, and its new rows land in the blocks as KVCache.append puts them.

As tests/unit/test_kernels.py does, the kernel runs in Triton's interpreter on CPU tensors, in a subprocess (this
file as a script, TRITON_INTERPRET=1 set before Triton is imported). Interpreted programs cost milliseconds each:
the tables are padded to fewer blocks and the keys split in fewer parts than on a GPU, still several of each.
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

from kvgate.runtime import decode_kernel, kernels, paged_batch, paged_kernel  # noqa: E402
from kvgate.runtime.decode import Batches, DecodeBatch, PagedBatch  # noqa: E402
from kvgate.runtime.kv import BLOCK, KVCache, Pool  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
LAYERS, KV_HEADS = 2, 2
WHERE = ["cpu"]  # the device the checks run on (run_checks'); tensors made there by default


def cache(length: int, dtype: torch.dtype, d: int) -> KVCache:
    """A cache of `length` random rows, NaN past them in its blocks (storage a kernel must never read)."""
    kv = KVCache(LAYERS, KV_HEADS, d, dtype, WHERE[0])
    kv.reserve(length + 1)
    for block in kv.blocks:
        block.keys.fill_(float("nan")), block.values.fill_(float("nan"))
    kv.extend(*(torch.randn(LAYERS, KV_HEADS, length, d).to(dtype) for _ in "kv"))
    return kv


def wanted(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: list[tuple[torch.Tensor, torch.Tensor]],
           window: int | None) -> torch.Tensor:  # fmt: skip
    """Each sequence's query over its rows (keys, values [kv_heads, n, d]) and then its new row: the torch twin of
    runtime/decode_kernel.py over them gathered, in float32."""
    sequences, _, d = q.shape
    ends = torch.tensor([x.shape[1] for x, _ in rows])
    width = int(ends.max()) + 1
    keys, values = (torch.zeros(sequences, KV_HEADS, width, d) for _ in "kv")
    for b, (x, y) in enumerate(rows):
        n = x.shape[1]
        keys[b, :, :n], values[b, :, :n], keys[b, :, n], values[b, :, n] = x, y, k[b], v[b]
    mask = decode_kernel.decode_mask(ends, width, window)
    return decode_kernel.decode_attention_torch(q.float(), keys, values, mask, 0.3)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype in (torch.float32, torch.bfloat16) and got.shape == want.shape
    tolerance = 1e-5 if got.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=0, atol=tolerance)


def caches_of(dtype: torch.dtype, d: int) -> tuple[list[KVCache], torch.Tensor, torch.Tensor]:
    """Sequences whose new rows fall everywhere a block allows: at a sequence's first row, a block's last, a block's
    and a part's first (a block of its own taken for it), past two block boundaries, after a stored block read by
    reference (its values' heads two blocks apart), and inside a stored block (copied first). Pool blocks lie in
    arenas (heads an arena apart), the others alone. Also the stored block's keys and a copy: they must stay alike."""
    pool, caches = Pool(), []
    for n, pooled in ((1, True), (BLOCK - 1, True), (2 * BLOCK, False), (2 * BLOCK + 2, True)):
        kv = KVCache(LAYERS, KV_HEADS, d, dtype, WHERE[0], pool=pool if pooled else None)
        kv.extend(*(torch.randn(LAYERS, KV_HEADS, n, d).to(dtype) for _ in "kv"))
        caches.append(kv)
    stored = torch.randn(LAYERS, KV_HEADS, BLOCK, d).to(dtype)
    wide = torch.randn(LAYERS, KV_HEADS, 2 * BLOCK, d).to(dtype)[:, :, :BLOCK]
    after, inside = (KVCache(LAYERS, KV_HEADS, d, dtype, WHERE[0], pool=pool) for _ in "ab")
    after.share(stored, wide)
    after.extend(*(torch.randn(LAYERS, KV_HEADS, 3, d).to(dtype) for _ in "kv"))
    inside.share(stored, wide)
    inside.truncate(BLOCK - 4)
    return caches + [after, inside], stored, stored.clone()


def twin(kv: KVCache) -> KVCache:
    """A copy of a cache's rows, in blocks of its own."""
    other = KVCache(kv.num_layers, kv.kv_heads, kv.head_dim, kv.dtype, WHERE[0])
    other.extend(*kv.rows(0, len(kv)))
    return other


def check_kernel(dtype: torch.dtype, d: int, group: int, window: int | None) -> None:
    """One layer (not the first: a layer's step in the table) of a step; the tables a block wider than the longest
    sequence needs (zero there)."""
    paged_batch.TABLE_STEP, paged_kernel.PROGRAMS = 4, 24  # two parts a (sequence, KV head), of two blocks each
    caches, stored, kept = caches_of(dtype, d)
    twins = [twin(kv) for kv in caches]
    batch = Batches(native=True, paged=True).of(caches, {window}, group)
    assert isinstance(batch, paged_batch.TableBatch) and batch.key == (len(caches), 2, 4, 4)
    q = torch.randn(len(caches), KV_HEADS * group, d).to(dtype)
    k, v = (torch.randn(len(caches), KV_HEADS, d).to(dtype) for _ in "kv")
    got = batch.attend(1, q, k, v, 0.3, window)
    close(got, wanted(q, k.float(), v.float(), [tuple(x.float() for x in t.layer(1)) for t in twins], window))
    for b, (kv, alike) in enumerate(zip(caches, twins)):
        alike.append(1, k[b][:, None], v[b][:, None])
        for layer in range(LAYERS):  # the new row where append puts it, every other row and layer as it was
            for x, y in zip(kv.layer(layer, alike.lengths[layer]), alike.layer(layer)):
                assert torch.equal(x, y), f"sequence {b}, layer {layer}"
    assert caches[-2].blocks[0].keys is stored and caches[-1].blocks[0].keys is not stored  # copied, then written
    assert torch.equal(stored, kept)


def step(batches: Batches, caches: list[KVCache], window: int | None, group: int) -> None:
    """A decode step of every layer through `batches`, each sequence's output against its own attention."""
    lengths, (dtype, d) = [len(kv) for kv in caches], (caches[0].dtype, caches[0].head_dim)
    batch = batches.of(caches, {window}, group)
    assert batch is not None
    batch.masks()
    for layer in range(LAYERS):
        rows = [tuple(x.float() for x in kv.layer(layer, n)) for kv, n in zip(caches, lengths)]
        q = torch.randn(len(caches), KV_HEADS * group, d).to(dtype)
        k, v = (torch.randn(len(caches), KV_HEADS, d).to(dtype) for _ in "kv")
        close(batch.attend(layer, q, k, v, 0.3, window), wanted(q, k.float(), v.float(), rows, window))
    batch.commit()
    assert [len(kv) for kv in caches] == [n + 1 for n in lengths]  # the new rows, of every layer, in each cache
    assert not any(kv.rows(0, len(kv))[0].isnan().any() for kv in caches)


def check_steps(dtype: torch.dtype, d: int, group: int, window: int | None) -> None:
    """Steps of every layer through `Batches` (nothing read past a cache's rows, which are NaN): the batch kept
    while a sequence gains a block in place, made anew when one outgrows the tables, and batches of one shape
    reading the same tables."""
    paged_batch.TABLE_STEP, paged_kernel.PROGRAMS = 1, 6  # tables a block past the longest's next row, one part
    batches = Batches(native=True, paged=True)
    caches = [cache(n, dtype, d) for n in (BLOCK - 1, 3 * BLOCK - 2, 5)]
    step(batches, caches, None, group)
    first = batches.last
    assert isinstance(first, paged_batch.TableBatch) and first.key == (3, 2, 4, 3)
    step(batches, caches, window, group)  # the first sequence's row begins its second block
    assert batches.last is first and first.key == (3, 2, 4, 3)
    step(batches, caches, None, group)  # the second's begins a fourth block: past its tables
    grown = batches.last
    assert isinstance(grown, paged_batch.TableBatch) and grown is not first and grown.key == (3, 2, 4, 4)
    step(batches, [cache(n, dtype, d) for n in (7, 40, 3 * BLOCK + 9)], window, group)
    other = batches.last
    assert isinstance(other, paged_batch.TableBatch) and other is not grown
    assert other.slots is grown.slots  # one shape, one set of tables (one graph)


# (dtype, head size, query heads a KV head, window): bf16 and float32 each with both head sizes, both groups, with
# and without a window (70 reaches back past a block boundary; 2 leaves a part before it with nothing to read), not
# every combination (interpreted: slow).
Case = tuple[torch.dtype, int, int, int | None]
CHECKS: dict[str, tuple[Callable[..., None], list[Case]]] = {
    "kernel": (
        check_kernel,
        [
            (torch.float32, 64, 3, None),
            (torch.bfloat16, 64, 1, 70),
            (torch.float32, 32, 1, 2),
            (torch.bfloat16, 32, 3, None),
        ],
    ),  # fmt: skip
    "steps": (check_steps, [(torch.bfloat16, 16, 3, 4)]),
}


def run_checks(name: str, device: str) -> list[str]:
    check, cases = CHECKS[name]
    failures, sizes = [], (paged_batch.TABLE_STEP, paged_kernel.PROGRAMS)
    WHERE[0] = device
    try:
        for case in cases:
            torch.manual_seed(0)
            try:
                with torch.device(device):
                    check(*case)
            except Exception as e:  # noqa: BLE001 -- collected, reported by the test
                dtype, d, group, window = case
                failures.append(f"{dtype}, head_dim {d}, group {group}, window {window}: {type(e).__name__}: {e}")
    finally:
        (paged_batch.TABLE_STEP, paged_kernel.PROGRAMS), WHERE[0] = sizes, "cpu"
    return failures


@pytest.fixture(scope="module")
def interpreted() -> dict[str, list[str]]:
    from tests.helpers.interpreter import interpreted  # not in the script's own process (a `tests` elsewhere)

    return interpreted(__file__)


@pytest.mark.parametrize("name", CHECKS)
def test_paged_decode_interpreted_matches_torch(interpreted: dict[str, list[str]], name: str) -> None:
    assert not interpreted[name], "\n".join(interpreted[name])


@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and a CUDA device")
@pytest.mark.parametrize("name", CHECKS)
def test_paged_decode_on_cuda_matches_torch(name: str) -> None:
    failures = run_checks(name, "cuda")
    assert not failures, "\n".join(failures)


def test_a_cpu_never_takes_the_paged_kernel_unless_interpreting() -> None:
    """On a CPU the paged setting changes nothing: its own kernel (runtime/cpu_decode.c) or a copy serves."""
    if kernels.INTERPRETING and kernels.INTERPRET_ON_CPU:
        pytest.skip("this process interprets Triton on the CPU")
    batch = Batches(native=True, paged=True).of([cache(n, torch.float32, 64) for n in (3, 9)], {None})
    assert isinstance(batch, DecodeBatch | PagedBatch)


if __name__ == "__main__":
    # Run by the `interpreted` fixture, under TRITON_INTERPRET=1.
    assert kernels.INTERPRETING and kernels.HAS_TRITON, "set TRITON_INTERPRET=1 and install triton"
    kernels.INTERPRET_ON_CPU = True
    print(json.dumps({name: run_checks(name, "cpu") for name in CHECKS}))
