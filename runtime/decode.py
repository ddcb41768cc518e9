"""Attention for decode steps: every sequence's one new token, all sequences in one call per layer.

Per sequence and layer, attention over the sequence's own cache took some twenty small ops (write the new K and
V, convert K and V to float32, two matmuls, softmax, copy out). A batch is kept from step to step while the same
sequences decode; the sums run over other lengths than one sequence's alone, so a token's logits may differ in
their last bits with the batch (decode steps that must not: `deterministic`, runtime/model.py).

Four ways to hold it:
- `PagedBatch`, on a CPU where runtime/cpu_decode.c is built: each sequence's KV where it lies, its blocks in the
  model's dtype (runtime/kv.py); one call a layer writes the new rows into the blocks and attends, reading bf16 as
  it is: no copy of the batch's KV, none made again when a sequence joins or leaves;
- `DecodeBatch`, a copy of the batch's K and V, every layer ([layers, sequences, kv_heads, room, head_dim], zero past
  each sequence's rows): a step writes each layer's new row into it and attends for the whole batch in a few ops, and
  the caches get the new rows once, after the last layer. On a CPU without the kernel, in float32 over the rows in
  use (half-precision batched matmuls are slow on CPUs), by two matmuls;
- `native` (any other device): a `DecodeBatch` in the caches' dtype, by a split kernel over the whole room
  (runtime/decode_kernel.py; SDPA where Triton does not run), every shape and address fixed while the batch lives and
  the same for any batch of as many sequences in as much room, so that a CUDA graph captured for one replays for the
  next (runtime/graphs.py);
- `TableBatch` (runtime/paged_batch.py), on CUDA where asked (`Batches(paged=True)`: EngineConfig.decode_batch):
  each sequence's KV where it lies, read through block tables by a Triton kernel that also writes the new rows into
  the blocks (runtime/paged_kernel.py): no copy, and its steps replayed from CUDA graphs keyed by the tables' shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvgate.runtime import cpu_attention
from kvgate.runtime.decode_kernel import decode_attention, decode_mask
from kvgate.runtime.graphs import Graphs
from kvgate.runtime.kv import BLOCK, KVCache, extend_each
from kvgate.runtime.paged_batch import TableBatch, Tables
from kvgate.runtime.paged_kernel import runs_on

# Steps a batch's copy has room for before it is made again, larger.
ROOM = 64
# A native batch's room is a multiple of this, so that batches of similar lengths share shapes (and graphs).
ROOM_STEP = 128
# On a CPU, a batch whose copy would take more is not batched (its sequences attend one by one); the most the
# copy holds. Elsewhere the bound is half the device's free memory.
MOST_BYTES = 1 << 29


class Slots:
    """What every batch of one shape reads and writes besides the copy: where each new row goes (`ends`, also
    the new tokens' positions) and the new rows of every layer. Kept per shape, so that a graph captured for a
    batch reads the same tensors when a later batch of that shape replays it."""

    def __init__(self, layers: int, sequences: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:  # fmt: skip
        self.ends = torch.zeros(sequences, dtype=torch.long, device=device)
        self.new_keys = torch.zeros(layers, sequences, kv_heads, head_dim, dtype=dtype, device=device)
        self.new_values = torch.zeros_like(self.new_keys)
        self.rows = torch.arange(sequences, device=device)  # each sequence's row of the batch


class DecodeBatch:
    def __init__(self, caches: list[KVCache], windows: set[int | None], storage: torch.Tensor, native: bool,
                 slots: Slots) -> None:  # fmt: skip
        """`storage`: at least `elements(caches, native)` long, of `dtype_of(caches, native)` (what the batch's
        copy is carved from); `slots` of the batch's shape."""
        self.caches, self.windows, self.native, self.slots = caches, windows, native, slots
        self.lengths = [len(kv) for kv in caches]
        both = storage[: self.elements(caches, native)].zero_().view(2, *self.shape(caches, native))
        self.keys, self.values = both[0], both[1]
        for b, kv in enumerate(caches):
            kv.read(self.keys[:, b], self.values[:, b])
        slots.ends.copy_(torch.tensor(self.lengths), non_blocking=True)
        self.begin()

    @staticmethod
    def shape(caches: list[KVCache], native: bool) -> tuple[int, int, int, int, int]:
        first, room = caches[0], max(len(kv) for kv in caches) + ROOM
        if native:
            room = -(-room // ROOM_STEP) * ROOM_STEP
        return first.num_layers, len(caches), first.kv_heads, room, first.head_dim

    @classmethod
    def elements(cls, caches: list[KVCache], native: bool) -> int:
        layers, sequences, kv_heads, room, head_dim = cls.shape(caches, native)
        return 2 * layers * sequences * kv_heads * room * head_dim

    @staticmethod
    def dtype_of(caches: list[KVCache], native: bool) -> torch.dtype:
        return caches[0].dtype if native else torch.float32

    @property
    def key(self) -> tuple[int, ...]:
        """What a captured step depends on: the copy's address and shape (the slots follow from the shape)."""
        return (self.keys.data_ptr(), *self.keys.shape)

    def holds(self, caches: list[KVCache]) -> bool:
        """The same caches, nothing written to them since but by this batch, and room for a row more."""
        return (
            len(caches) == len(self.caches)
            and all(a is b for a, b in zip(caches, self.caches))
            and [len(kv) for kv in caches] == self.lengths
            and max(self.lengths) < self.keys.shape[3]
        )

    @property
    def ends(self) -> torch.Tensor:
        return self.slots.ends

    def begin(self) -> None:
        """Ready a step (host side): how many columns attention reads."""
        self.width = self.keys.shape[3] if self.native else max(self.lengths) + 1

    def masks(self) -> None:
        """Per window, what each new token may not see (device ops on `ends`: a captured step recomputes them)."""
        self.mask: dict[int | None, torch.Tensor] = {}
        for window in self.windows:
            allowed = decode_mask(self.slots.ends, self.width, window)
            if self.native:
                self.mask[window] = allowed
            else:
                mask = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
                self.mask[window] = mask.masked_fill_(~allowed, float("-inf"))

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None
    ) -> torch.Tensor:
        """q [sequences, heads, d], the new k, v [sequences, kv_heads, d]: the attention output [sequences,
        heads, d], in q's dtype. `masks()` first, once a step."""
        slots = self.slots
        slots.new_keys[layer].copy_(k)
        slots.new_values[layer].copy_(v)
        keys, values = self.keys[layer], self.values[layer]
        keys[slots.rows, :, slots.ends] = k.to(keys.dtype)
        values[slots.rows, :, slots.ends] = v.to(values.dtype)
        keys, values = keys[:, :, : self.width], values[:, :, : self.width]
        if self.native:  # on CUDA the split kernel (runtime/decode_kernel.py), else SDPA
            return decode_attention(q, keys, values, slots.ends, self.mask[window], scale, window)
        batch, heads, d = q.shape
        grouped = q.float().view(batch, keys.shape[1], heads // keys.shape[1], d)  # head h reads KV head h // group
        scores = torch.matmul(grouped, keys.transpose(2, 3)).mul_(scale).add_(self.mask[window])
        return torch.matmul(scores.softmax(-1), values).reshape(batch, heads, d).to(q.dtype)

    def commit(self) -> None:
        """Write each sequence's new K and V, of every layer, to its cache."""
        extend_each(self.caches, self.slots.new_keys, self.slots.new_values)
        self.slots.ends.add_(1)
        self.lengths = [n + 1 for n in self.lengths]


class PagedBatch:
    """A CPU decode batch over its sequences' blocks (runtime/cpu_decode.c): per layer one call writes each new row
    into its sequence's block and attends; after the last layer only the lengths move."""

    native = False

    def __init__(self, caches: list[KVCache], kernel: cpu_attention.Kernel) -> None:
        self.caches, self.kernel = caches, kernel
        self.lengths = [len(kv) for kv in caches]
        self.ends = torch.tensor(self.lengths)
        self.tables: torch.Tensor | None = None  # [sequences, 2, 4, blocks]: each cache's `located()`
        self.begin()

    def holds(self, caches: list[KVCache]) -> bool:
        """The same caches, nothing written to them since but by this batch."""
        same = len(caches) == len(self.caches) and all(a is b for a, b in zip(caches, self.caches))
        return same and [len(kv) for kv in caches] == self.lengths

    def begin(self) -> None:
        """Ready a step (host side): a block of each sequence's own for its new row, and the tables where one is new
        (a sequence's row begins a block: every BLOCK steps)."""
        if self.tables is not None and all(n % BLOCK for n in self.lengths):
            return
        for kv, n in zip(self.caches, self.lengths):
            kv.reserve(n + 1)
            kv.own(n // BLOCK)
        located = [kv.located() for kv in self.caches]
        self.tables = torch.zeros(len(located), 2, 4, max(x.shape[2] for x in located), dtype=torch.int64)
        for table, x in zip(self.tables, located):
            table[:, :, : x.shape[2]] = x

    def masks(self) -> None:
        """Nothing to ready: the kernel keeps each sequence to its rows and its window."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None
    ) -> torch.Tensor:
        """q [sequences, heads, d], the new k, v [sequences, kv_heads, d]: the attention output [sequences,
        heads, d], in q's dtype."""
        assert self.tables is not None
        return self.kernel.decode(q, k, v, self.tables, layer, self.ends, scale, window)

    def commit(self) -> None:
        """The new rows are in the caches: their lengths move on."""
        self.ends.add_(1)
        self.lengths = [n + 1 for n in self.lengths]
        for kv, n in zip(self.caches, self.lengths):
            kv.written(n)


Batch = DecodeBatch | PagedBatch | TableBatch


class Batches:
    """A decode step's batch, the last one kept for the next step, and the storage batches are carved from: kept
    and reused, so that memory stays at its peak instead of being allocated again at each new batch (one owner:
    the engine's thread). `native`: batches held as runtime/decode.py's docstring says (None: where the device
    is not a CPU); `graphs`: native steps on CUDA replayed from CUDA graphs (None: so where CUDA runs them);
    `paged`: native batches over the caches' blocks where the paged kernel runs (`TableBatch`), not a copy.
    """

    def __init__(self, native: bool | None = None, graphs: bool | None = None, paged: bool = False) -> None:
        self.native, self.graphs, self.paged = native, graphs, paged
        self.captured = Graphs()
        self.last: Batch | None = None
        self.storage: torch.Tensor | None = None
        self.slots: dict[tuple, Slots] = {}
        self.tables: dict[tuple, Tables] = {}  # a paged batch's, per shape and device: kept, as `slots` are

    def of(self, caches: list[KVCache], windows: set[int | None], group: int = 1) -> Batch | None:
        """The batch of these caches (`group` query heads a KV head): the last one where it holds them as they are,
        else a new one (None: too large to batch)."""
        if self.last is not None and self.last.holds(caches):
            self.last.begin()
            return self.last
        self.last = None
        first = caches[0]
        native = torch.device(first.device).type != "cpu" if self.native is None else self.native
        kernel = None if native else cpu_attention.decoding(first.dtype, first.head_dim, group)
        if kernel is not None:
            self.last = PagedBatch(caches, kernel)
            return self.last
        if native and self.paged and runs_on(first.device):
            key = (*Tables.shape(caches), str(first.device))
            tables = self.tables.get(key)
            if tables is None:
                tables = self.tables[key] = Tables(*key[:2], first.device)
            self.last = TableBatch(caches, tables)
            return self.last
        needed, dtype = DecodeBatch.elements(caches, native), DecodeBatch.dtype_of(caches, native)
        size = torch.empty((), dtype=dtype).element_size()
        held = 0 if self.storage is None or self.storage.dtype != dtype else len(self.storage)
        if needed * size > self.most_bytes(first.device, held * size):
            return None
        if held < needed:
            self.storage = None  # its memory, before the new one's
            self.captured.clear()  # their addresses with it
            most = self.most_bytes(first.device, 0) // size
            self.storage = torch.empty(max(needed, min(2 * needed, most)), dtype=dtype, device=first.device)
        assert self.storage is not None
        shape = DecodeBatch.shape(caches, native)
        key = (shape[:3], shape[4], dtype, str(first.device))
        slots = self.slots.get(key)
        if slots is None:
            slots = self.slots[key] = Slots(shape[0], shape[1], shape[2], shape[4], first.dtype, self.storage.device)
        self.last = DecodeBatch(caches, windows, self.storage, native, slots)
        return self.last

    def step(self, model: object, batch: Batch, tokens: list[int],
             layers: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:  # fmt: skip
        """`layers(ids)` for the step's tokens: from a graph of the batch's shape where native steps run as
        graphs, else eagerly."""
        device = batch.ends.device
        graphs = device.type == "cuda" and batch.native if self.graphs is None else self.graphs
        if not graphs or isinstance(batch, PagedBatch):
            return layers(torch.tensor(tokens, device=device))
        return self.captured.run((id(model), type(batch).__name__, *batch.key), tokens, layers)

    @staticmethod
    def most_bytes(device: str | torch.device, held: int) -> int:
        """The most a batch's copy may take: MOST_BYTES on a CPU, else half of what the device has free (counting
        the storage held now, `held` bytes, as free)."""
        device = torch.device(device)
        if device.type != "cuda":
            return MOST_BYTES
        free, _ = torch.cuda.mem_get_info(device)
        return (free + held) // 2
