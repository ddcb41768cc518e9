"""Shared spans across agents (KVCOMM): message contents whose KV was computed under another prefix.

A span is one message's content, tokenized alone. The first time a span is computed its KV, keys
moved to positions 0..T-1, is stored as the span's source, under the slot it came from: said to
an agent (a message it read) or written by one (its answer). When another agent's prompt holds
the span, the source is reused, RoPE-shifted to its new place and corrected by an offset: the
deviation that agent's different prefix makes, estimated from anchors (`Offsets`, kept by the
agents package). A span the anchors cannot vouch for is computed densely in place, and the
deviation it shows (its KV minus its source's) becomes an anchor.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvgate.chunk_cache import ChunkKV
from kvgate.runtime.blend import BlendConfig, Piece, prefill
from kvgate.runtime.kernels import rope_shift
from kvgate.runtime.kv import KVCache
from kvgate.runtime.model import Run, forward
from kvgate.runtime.reuse import Prefilled, Reuser
from kvgate.runtime.rope import angles, rope_type


class Offsets(Protocol):
    """The anchor pool: deviations of spans' KV under an agent's prefix from their sources' KV."""

    def estimate(self, slot: str, reader: str, source: ChunkKV) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The offset [layers, kv_heads, T, head_dim] of keys and values to add to `source` when
        `reader` reads it; None when no anchor is close enough (the gate)."""
        ...

    def observe(self, slot: str, reader: str, source: ChunkKV, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The real deviation of `source`'s KV under `reader`'s prefix, from a dense prefill."""
        ...

    def forget(self, source: str) -> None:
        """The source with this key is replaced: deviations measured against the old one are void."""
        ...


@dataclass
class Corrected:
    """A source's KV plus an offset, handed out layer by layer like a stored entry."""

    source: ChunkKV
    keys: torch.Tensor
    values: torch.Tensor

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.source.layer(i)
        return k + self.keys[i], v + self.values[i]


@dataclass
class Span:
    start: int  # offset in the prompt
    token_ids: list[int]
    source: ChunkKV | None
    slot: str = ""
    # Who reads it, as the anchors know readers: the agent, and for a span the prompt already
    # holds (two agents wrote the same answer) which time it reads it, since the context differs.
    reader: str = ""
    context: str = ""  # a digest of the prompt's tokens before it
    exact: bool = False  # its source was computed after the very same tokens: its KV as it is
    dense: bool = True  # computed in this prompt, not reused: what it shows is learnt

    def computed(self, dense: bool) -> None:
        self.dense = dense


@dataclass
class Shared:
    """What a span prefill did, and what it leaves to learn once the prompt's KV is complete."""

    prefilled: Prefilled
    spans: list[Span] = field(default_factory=list)

    @property
    def gated(self) -> int:
        """Spans with a source that were computed densely (no anchor close enough, or mode full)."""
        return sum(s.dense and s.source is not None for s in self.spans)


def local(model: torch.nn.Module, kv: KVCache, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the KV rows start..start+n of every layer, keys moved to positions 0..n-1:
    [layers, kv_heads, n, head_dim] each."""
    cos, sin = angles(model, -start, kv.device)
    keys, values = kv.copy(start, start + n)
    return torch.stack([rope_shift(k.contiguous(), cos, sin) for k in keys]), values


class Spans:
    """The sources of spans of one engine, and the prefill that reuses them."""

    def __init__(
        self,
        reuser: Reuser,
        offsets: Offsets | None = None,
        remembered: int = 65536,
        cost: Callable[[int], float] = lambda tokens: tokens / 300,
    ) -> None:
        self.reuser, self.offsets, self.cost = reuser, offsets, cost  # cost: seconds to compute n tokens
        # source key -> (slot, context it was computed in), the latest `remembered`
        self.slots: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self.remembered = remembered
        self.lock = threading.Lock()

    def key(self, token_ids: list[int], scope: str) -> str:
        return self.reuser.key(token_ids, "span:" + scope)

    def config(self, mode: str, ratio: float) -> BlendConfig:
        """How spans reused under `mode` are blended. With nothing to recompute, no layer needs to run
        over the reused tokens to pick some."""
        return self.reuser.config(0.0, "naive") if mode == "naive" or ratio == 0 else self.reuser.config(ratio, mode)

    def source(self, token_ids: list[int], scope: str) -> tuple[ChunkKV, str, str] | None:
        """A span's source on the model's device (a lower tier gives it on the CPU), its slot and
        the context it was computed in."""
        key = self.key(token_ids, scope)
        with self.lock:
            found = self.slots.get(key)
        entry = self.reuser.store.get(key, self.reuser.model_fp) if found is not None else None
        if found is None or entry is None or entry.token_ids != tuple(token_ids):
            return None
        return entry.to(self.reuser.model.device), *found

    def sourced(self, pieces: list[list[int]], spans: list[bool], head: int, scope: str) -> int:
        """How many tokens after `head` lie in spans this process holds a source of."""
        offset, tokens = 0, 0
        for ids, is_span in zip(pieces, spans):
            if is_span and offset >= head:
                with self.lock:
                    tokens += len(ids) if self.key(ids, scope) in self.slots else 0
            offset += len(ids)
        return tokens

    def store(self, kv: KVCache, start: int, token_ids: list[int], scope: str, slot: str, context: str = "") -> None:
        key = self.key(token_ids, scope)
        with self.lock:
            if key in self.slots and key in self.reuser.store:
                return
        keys, values = local(self.reuser.model, kv, start, len(token_ids))
        cost = self.cost(len(token_ids))
        self.reuser.store.put(ChunkKV(key, tuple(token_ids), keys, values, cost, self.reuser.model_fp))
        if self.offsets is not None:  # an evicted source computed anew, maybe elsewhere
            self.offsets.forget(key)
        with self.lock:
            self.slots[key] = (slot, context)
            self.slots.move_to_end(key)
            while len(self.slots) > self.remembered:
                self.slots.popitem(last=False)

    # ---- a prompt -----------------------------------------------------------------------

    def prefill(
        self, kv: KVCache, pieces: list[list[int]], spans: list[bool], mode: str, reader: str, scope: str, ratio: float
    ) -> Shared:
        """Continue the prompt's KV after the exact prefix `kv` holds: spans from their sources as
        `mode` says ("full": none), the rest computed. Logits are None when the caller is left to
        compute the prompt from `len(kv)` on (a dense prefill)."""
        done = len(kv)
        if not self.reuser.shiftable:  # no span can move: none is stored either
            note = f"rope type {rope_type(self.reuser.model)} cannot shift cached keys"
            return Shared(Prefilled(None, "full", reused=done, note=note))
        parts: list[tuple[list[int], Span | None]] = []
        offset = 0
        times: dict[tuple[int, ...], int] = {}  # span -> how often the prompt read it so far
        before = hashlib.blake2b(digest_size=16)  # the tokens before the current piece
        for ids, is_span in zip(pieces, spans):  # a span the exact prefix cuts into is computed
            n = 0
            if is_span:
                n = times[tuple(ids)] = times.get(tuple(ids), 0) + 1
            if is_span and offset >= done:
                source, slot, context = self.source(ids, scope) or (None, "", "")
                here = before.hexdigest()
                span = Span(offset, ids, source, slot, reader if n == 1 else f"{reader}#{n}", here, context == here)
                parts.append((ids, span))
            elif offset + len(ids) > done:
                parts.append((ids[max(0, done - offset) :], None))
            before.update(array("q", ids).tobytes())
            offset += len(ids)
        known = [s for _, s in parts if s is not None]
        sourced = [s for s in known if s.source is not None]
        note = ""
        cached: dict[int, Corrected | ChunkKV] = {}
        gated = 0
        for s in sourced if mode != "full" else []:
            assert s.source is not None
            if s.exact or mode != "kvcomm":
                cached[id(s)] = s.source
            elif (offset_kv := self.offsets.estimate(s.slot, s.reader, s.source) if self.offsets else None) is not None:
                cached[id(s)] = Corrected(s.source, *offset_kv)
            else:
                gated += 1
        if parts and parts[-1][1] is not None:  # the last token is computed: its logits start the answer
            cached.pop(id(parts[-1][1]), None)
        for s in known:
            s.computed(id(s) not in cached)
        if gated:
            note = f"kvcomm: {gated} of {len(sourced)} spans had no close anchor: computed, learnt"
        if not cached:  # nothing to reuse: the caller prefills the rest as usual
            return Shared(Prefilled(None, "full", reused=done, note=note), known)
        blend = self.config(mode, ratio)
        pieces_kv = [Piece(ids, cached.get(id(s)) if s is not None else None) for ids, s in parts]
        found = torch.cat([torch.full((len(ids),), s is not None and id(s) in cached) for ids, s in parts])
        out = prefill(self.reuser.model, kv, pieces_kv, blend)
        recomputed = int((found & out.recomputed_mask).sum())
        reused = done + int(found.sum()) - recomputed
        return Shared(Prefilled(out.logits, mode, reused, recomputed, out.deviation, note), known)

    def settle(self, kv: KVCache, shared: Shared, reader: str, scope: str) -> None:
        """The prompt's KV is complete: spans seen for the first time become sources said to
        `reader`; spans with a source that were computed here teach the anchors their deviation."""
        for s in shared.spans:
            if s.source is None:
                self.store(kv, s.start, s.token_ids, scope, f"said:{scope}:{reader}", s.context)
            elif s.dense and not s.exact and self.offsets is not None:
                keys, values = local(self.reuser.model, kv, s.start, len(s.token_ids))
                keys, values = keys - s.source.keys, values - s.source.values
                # Under the very context of its source, a span teaches nothing (and would vouch, with
                # a zero offset, for the contexts that do move it).
                if float(values.norm()) > 1e-3 * float(s.source.values.norm()):
                    self.offsets.observe(s.slot, s.reader, s.source, keys, values)

    def wrote(self, kv: KVCache, prompt_len: int, output_ids: list[int], text: str, reader: str, scope: str) -> None:
        """A finished turn's answer becomes a span written by `reader`, as a later prompt will
        hold it: its text tokenized alone, when that is how it was generated."""
        ids = self.reuser.tokenizer.encode(text, add_special_tokens=False) if text else []
        if not ids or output_ids[: len(ids)] != ids or not self.reuser.shiftable:
            return
        missing = prompt_len + len(ids) - len(kv)
        if missing > 0:  # the last sampled tokens never went through the model
            forward(self.reuser.model, [Run(kv, ids[-missing:], len(kv))])
        self.store(kv, prompt_len, ids, scope, f"wrote:{scope}:{reader}")
