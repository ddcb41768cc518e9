"""How a prompt made of pieces gets its KV: full prefill, exact prefix reuse, naive reuse, blend.

Documents are looked up in the chunk store by content; a document not found is computed alone
(positions 0..T-1, as it will be found next time) and stored. Exact prefix reuse keeps, per
prompt, the KV of everything before its tail as computed in context, and finds it again at any
document boundary of a later prompt with the same leading pieces.
"""

from __future__ import annotations

import functools
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import NamedTuple

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvgate.chunk_cache import ChunkKV, ChunkStore, LoadFailed, Loading, chunk_key, fingerprint
from kvgate.runtime.blend import BlendConfig, Piece, Steps, blend, drain
from kvgate.runtime.kv import BLOCK, KVCache
from kvgate.runtime.model import Run, forward
from kvgate.runtime.rope import can_shift, rope_type, shift

MODES = ("full", "prefix", "naive", "blend")
EMPTY: Mapping[str, ChunkKV] = MappingProxyType({})


@dataclass(frozen=True)
class ReuseMode:
    mode: str = "blend"
    ratio: float | None = None  # None: the calibrated ratio


@dataclass
class Prefilled:
    """What a reuse prefill did. `logits` is None when the caller computes the remaining
    prompt tokens itself (from `len(kv)` on)."""

    logits: torch.Tensor | None
    mode: str  # the mode that ran, which may differ from the one asked (and `note` says why)
    reused: int = 0
    recomputed: int = 0
    deviation: float = 0.0
    note: str = ""
    ratio: float = 0.0  # the recompute ratio that ran (naive: 0)


@functools.lru_cache(maxsize=8)  # per tokenizer: serialising one takes ~0.3 s, and each engine asks twice
def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return fingerprint(backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items())))


def with_kv(
    pieces: list[list[int]], sources: list[tuple[ChunkKV | Loading, bool] | None]
) -> tuple[list[Piece], torch.Tensor]:
    """Blend pieces from each piece's cached KV (None: computed fresh), and a [N] mask of the
    tokens whose KV was found in the cache."""
    parts = [Piece(ids, source[0] if source else None) for ids, source in zip(pieces, sources)]
    found = torch.cat([torch.full((len(ids),), bool(source and source[1])) for ids, source in zip(pieces, sources)])
    return parts, found


def copy_prefix(kv: KVCache, entry: ChunkKV, n: int) -> int:
    """Read the entry's first `n` tokens into the empty `kv` (whole blocks by reference)."""
    for a in range(0, n, BLOCK):
        kv.share(entry.keys[:, :, a : min(n, a + BLOCK)], entry.values[:, :, a : min(n, a + BLOCK)])
    return n


class Attached(NamedTuple):
    """What a read of stored KV into a sequence's cache added: tokens, and where the rows that are full
    prefill's own, bit for bit, end (an absolute position; the tokens' end when all are)."""

    tokens: int
    exact: int
    matched: int = 0  # where the stored tokens the prompt begins with end, before the read was cut to a grid


def snapshot(
    kv: KVCache,
    key: str,
    token_ids: Sequence[int],
    cost: float,
    model: str,
    start: int = 0,
    exact: int | None = None,
) -> ChunkKV:
    """An entry holding a copy of the KV of `kv`'s tokens start..start+len(token_ids); `exact`: the absolute
    position where `kv`'s full-prefill rows end (None: all of them are)."""
    stop = start + len(token_ids)
    keys, values = kv.copy(start, stop)
    rows = None if exact is None or exact >= stop else max(0, exact - start)
    return ChunkKV(key, tuple(token_ids), keys, values, cost, model, rows)


class Remembered:
    """Documents' tokens by key, kept to recompute a document whose KV every tier evicted; the
    newest first, `capacity` tokens in all (4 bytes each)."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.tokens = capacity, 0
        self.docs: OrderedDict[str, array[int]] = OrderedDict()

    def add(self, key: str, token_ids: Sequence[int]) -> None:
        self.pop(key)
        if len(token_ids) > self.capacity:
            return
        self.docs[key] = array("i", token_ids)
        self.tokens += len(token_ids)
        while self.tokens > self.capacity:
            self.tokens -= len(self.docs.popitem(last=False)[1])

    def get(self, key: str) -> tuple[int, ...] | None:
        found = self.docs.get(key)
        if found is None:
            return None
        self.docs.move_to_end(key)
        return tuple(found)

    def pop(self, key: str) -> bool:
        found = self.docs.pop(key, None)
        self.tokens -= len(found) if found is not None else 0
        return found is not None

    def __len__(self) -> int:
        return len(self.docs)


class Reuser:
    """Owns the document and prefix entries of one model in a chunk store."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        store: ChunkStore,
        model_fp: str,
        blend: BlendConfig,
        max_ratio: float = 0.5,
        deviation_limit: float | None = None,
        remembered_tokens: int = 1 << 22,
    ) -> None:
        self.model, self.tokenizer, self.store, self.blend = model, tokenizer, store, blend
        self.model_fp, self.tokenizer_fp = model_fp, tokenizer_fingerprint(tokenizer)
        self.shiftable = can_shift(model)
        # A request whose key deviation is above this (calibrated) limit gets `max_ratio`.
        self.max_ratio, self.deviation_limit = max_ratio, deviation_limit
        mc = model.config
        self.kv_shape = (mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim)
        # Every document seen, by key: its KV may be evicted, its tokens are kept to recompute it.
        self.known = Remembered(remembered_tokens)
        self.lock = threading.Lock()

    def key(self, token_ids: list[int], scope: str = "") -> str:
        return chunk_key(self.model_fp, self.tokenizer_fp, token_ids, scope)

    def new_kv(self) -> KVCache:
        return KVCache(*self.kv_shape, self.model.dtype, self.model.device)

    # ---- documents --------------------------------------------------------------------

    def document(self, token_ids: list[int], scope: str = "", remember: bool = False) -> tuple[ChunkKV, bool]:
        """The document's entry, computing (in one piece) and storing it when missing; and whether
        it was found. `remember` keeps its tokens to find it by key later, even once its KV is evicted."""
        key = self.key(token_ids, scope)
        if remember:
            self.remember(key, token_ids)
        entry = self.store.get(key, self.model_fp)
        if entry is not None and entry.token_ids == tuple(token_ids):
            return entry, True
        kv = self.new_kv()
        start = time.perf_counter()
        forward(self.model, [Run(kv, token_ids, 0)])
        entry = snapshot(kv, key, token_ids, time.perf_counter() - start, self.model_fp)
        self.store.put(entry)
        return entry, False

    def stored(self, key: str, token_ids: list[int], keys: torch.Tensor, values: torch.Tensor, cost: float) -> ChunkKV:
        """Keep the KV of a document computed alone (positions 0..T-1), [layers, kv_heads, T, head_dim]."""
        entry = ChunkKV(key, tuple(token_ids), keys, values, cost, self.model_fp)
        self.store.put(entry)
        return entry

    def keep_in_context(
        self,
        kv: KVCache,
        pieces: list[list[int]],
        documents: list[bool],
        wanted: set[str],
        scope: str,
        cost: Callable[[int], float],
    ) -> None:
        """Store the KV of the documents `wanted` (by key) as this prompt's `kv` holds it: computed
        after everything before them in this context, keys moved back to positions 0..T-1. Measured
        (`kvgate bench error-sources`): read later in another order, such KV moves the first token
        a third as far as KV computed alone."""
        offset, layers = 0, range(self.kv_shape[0])
        for ids, is_document in zip(pieces, documents):
            key = self.key(ids, scope) if is_document else ""
            n = len(ids)
            if key in wanted and len(kv) >= offset + n:
                wanted = wanted - {key}
                keys, values = kv.copy(offset, offset + n)
                keys = torch.stack([shift(self.model, keys[i], -offset) for i in layers])
                self.stored(key, ids, keys, values, cost(n))
            offset += n

    def remember(self, key: str, token_ids: list[int]) -> None:
        with self.lock:
            self.known.add(key, token_ids)

    def missing(self, pieces: list[list[int]], documents: list[bool], scope: str = "") -> list[tuple[str, list[int]]]:
        """The documents among `pieces` that no tier holds: (key, token ids), each once."""
        found: dict[str, list[int]] = {}
        for ids, is_document in zip(pieces, documents):
            key = self.key(ids, scope) if is_document else ""
            if is_document and key not in found and key not in self.store:
                found[key] = ids
        return list(found.items())

    def cached(
        self, token_ids: list[int], scope: str = "", fresh: Mapping[str, ChunkKV] = EMPTY
    ) -> tuple[ChunkKV | Loading, bool]:
        """The document's KV for a blend: computed for this prompt already (`fresh`), in memory,
        still loading from a lower tier, or computed now; and whether it was found in the cache."""
        key = self.key(token_ids, scope)
        if key in fresh:
            return fresh[key], False
        found = self.store.fetch(key, self.model_fp)
        if found is not None and found.token_ids == tuple(token_ids):
            return found, True
        return self.document(token_ids, scope)

    def tokens_of(self, key: str) -> tuple[int, ...] | None:
        """A stored document's tokens: remembered, or read from its entry's header in any tier
        (stored by another process, or before a restart); a hit there starts loading its KV."""
        with self.lock:
            tokens = self.known.get(key)
        if tokens is None and (found := self.store.fetch(key, self.model_fp)) is not None:
            tokens = found.token_ids
            with self.lock:
                self.known.add(key, tokens)
        return tokens

    def forget(self, key: str) -> bool:
        with self.lock:
            known = self.known.pop(key)
        return self.store.delete(key) or known

    # ---- agent programs ---------------------------------------------------------------

    def resume(self, kv: KVCache, prompt_ids: list[int], key: str) -> Attached:
        """Copy into the empty `kv` the part of a program's stored context (prompt and output of
        its previous turn) that this prompt begins with, token for token; return its length and
        where its full-prefill rows end (the output's were decoded).
        The last prompt token is always left to compute: its logits start the answer."""
        entry = self.store.get(key, self.model_fp) if key else None
        if entry is None:
            return Attached(0, 0)
        n = min(entry.tokens, len(prompt_ids) - 1)
        same = torch.tensor(entry.token_ids[:n]) == torch.tensor(prompt_ids[:n])
        if not bool(same.all()):
            n = int((~same).nonzero()[0])
        return Attached(copy_prefix(kv, entry, n), min(n, entry.exact_rows)) if n else Attached(0, 0)

    def keep(
        self, kv: KVCache, token_ids: list[int], key: str, cost: float, until: float | None, exact: int | None = None
    ) -> bool:
        """Store the KV of `token_ids` (a whole turn: prompt and output) under `key`, pinned until `until`;
        `exact`: where its full-prefill rows end."""
        n = min(len(kv), len(token_ids))
        if n == 0:
            return False
        return self.store.put(snapshot(kv, key, token_ids[:n], cost, self.model_fp, 0, exact), until)

    # ---- the modes ----------------------------------------------------------------------

    def prefill(
        self, kv: KVCache, pieces: list[list[int]], documents: list[bool], reuse: ReuseMode, scope: str = ""
    ) -> Prefilled:
        return drain(self.prefilling(kv, pieces, documents, reuse, scope))

    def prefilling(
        self,
        kv: KVCache,
        pieces: list[list[int]],
        documents: list[bool],
        reuse: ReuseMode,
        scope: str = "",
        fresh: Mapping[str, ChunkKV] = EMPTY,
    ) -> Steps[Prefilled]:
        """Start the prompt's KV in the empty `kv`, stepwise (a blend yields after each layer).
        pieces: token ids; documents: which are documents; fresh: keys of documents computed for
        this very prompt (stored, but not reused)."""
        if reuse.mode == "full":
            return Prefilled(None, "full")
        if reuse.mode == "prefix":  # the exact prefix: prefix blocks (runtime/prefix.py), read before this
            return Prefilled(None, "prefix")
        if not self.shiftable:
            return Prefilled(None, "full", note=f"rope type {rope_type(self.model)} cannot shift cached keys")
        ratio = 0.0 if reuse.mode == "naive" else (reuse.ratio if reuse.ratio is not None else self.blend.ratio)
        sources = [self.cached(ids, scope, fresh) if d else None for ids, d in zip(pieces, documents)]
        parts, found = with_kv(pieces, sources)
        notes = []
        try:
            done = yield from blend(self.model, kv, parts, self.config(ratio, reuse.mode))
        except LoadFailed as e:
            # A stored document turned out damaged or unreachable halfway: it is a miss after all.
            notes.append(f"a stored document could not be read ({e}); recomputed")
            computed = [self.document(ids, scope) if d else None for ids, d in zip(pieces, documents)]
            parts, found = with_kv(pieces, computed)
            kv.truncate(0)
            done = yield from blend(self.model, kv, parts, self.config(ratio, reuse.mode))
        if (
            reuse.mode == "blend"
            and reuse.ratio is None
            and self.deviation_limit is not None
            and done.deviation > self.deviation_limit
            and ratio < self.max_ratio
        ):
            # Far outside what calibration saw: redo with the larger ratio.
            notes.append(f"deviation {done.deviation:.3g} above the calibrated {self.deviation_limit:.3g}")
            kv.truncate(0)
            ratio = self.max_ratio
            done = yield from blend(self.model, kv, parts, self.config(ratio, "blend"))
        # Only KV that came from the cache counts as reused; a document computed for this request is not.
        recomputed = int((found & done.recomputed_mask).sum())
        reused = int(found.sum()) - recomputed
        return Prefilled(done.logits, reuse.mode, reused, recomputed, done.deviation, "; ".join(notes), ratio)

    def config(self, ratio: float, mode: str) -> BlendConfig:
        if mode == "naive":  # no layer runs over the reused tokens at all
            return BlendConfig(ratio=0.0, check_layers=(0,))
        return replace(self.blend, ratio=ratio)
