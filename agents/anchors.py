"""The anchor pool of KVCOMM: how far an agent's prefix moves a shared span's KV, learnt from
dense prefills and lent to new spans of the same slot.

An anchor is one span (its source's key) of a slot ("said to agent A", "written by agent B"),
with a feature of its source KV and, per reading agent, the deviation a dense prefill showed:
its KV under that agent's prefix minus the source KV, per layer, head and token. A new span's
offset mixes the deviations of its slot's anchors read by the same agent, weighted by a softmax
over the distance between its source's feature and theirs. The gate: when the nearest anchor is
farther than `max_distance`, there is no estimate and the prompt is prefilled densely, which adds
an anchor. The pool holds at most `max_anchors` and `max_bytes` of deviations; past either, the
least used anchor goes, the newest few excepted (they have had no time to be used yet).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from kvgate.agents.config import AnchorConfig
from kvgate.chunk_cache import ChunkKV


@dataclass
class Anchor:
    slot: str
    content: str  # the source's key
    feature: torch.Tensor
    deviations: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # reader -> K, V
    uses: int = 0
    born: int = 0

    def use(self) -> None:
        self.uses += 1

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.deviations.values())


def feature(source: ChunkKV) -> torch.Tensor:
    """A span's fingerprint: the mean over its tokens of its keys and values, [layers, 2, heads * dim]."""
    keys = source.keys.float().mean(2).flatten(1)
    values = source.values.float().mean(2).flatten(1)
    return torch.stack([keys, values], 1)


def distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Relative distances of feature `a` [L, 2, F] from each of `b` [n, L, 2, F], averaged over
    layers and K/V so that no layer's scale dominates: [n]."""
    return ((b - a).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)).mean((1, 2))


def aligned(deviation: torch.Tensor, tokens: int) -> torch.Tensor:
    """An anchor's deviation [L, H, T, D] for a span of `tokens` tokens: token i takes the
    anchor's token i, or its last one past its end."""
    index = torch.arange(tokens, device=deviation.device).clamp(max=deviation.shape[2] - 1)
    return deviation.index_select(2, index)


class AnchorPool:
    """Thread-safe; implements runtime.shared.Offsets."""

    def __init__(self, config: AnchorConfig = AnchorConfig()) -> None:
        self.config = config
        self.anchors: dict[tuple[str, str], Anchor] = {}
        self.births = 0
        self.lock = threading.Lock()
        self.estimates = self.gated = self.added = self.evicted = 0

    def __len__(self) -> int:
        return len(self.anchors)

    @property
    def nbytes(self) -> int:
        with self.lock:
            return sum(a.nbytes for a in self.anchors.values())

    def nearest(self, slot: str, reader: str, source: ChunkKV) -> tuple[list[Anchor], torch.Tensor]:
        """The slot's anchors read by `reader` and their distances from `source` (lock held)."""
        found = [a for a in self.anchors.values() if a.slot == slot and reader in a.deviations]
        if not found:
            return [], torch.empty(0)
        return found, distance(feature(source), torch.stack([a.feature for a in found]))

    def estimate(self, slot: str, reader: str, source: ChunkKV) -> tuple[torch.Tensor, torch.Tensor] | None:
        with self.lock:
            found, d = self.nearest(slot, reader, source)
            if not found or float(d.min()) > self.config.max_distance:
                self.gated += 1
                return None
            self.estimates += 1
            weights = torch.softmax(-d / self.config.temperature, 0).tolist()
            chosen = [(a, w) for a, w in zip(found, weights) if w > 1e-4]
            for a, _ in chosen:
                a.use()
            tokens = source.tokens
            keys = sum(w * aligned(a.deviations[reader][0], tokens) for a, w in chosen)
            values = sum(w * aligned(a.deviations[reader][1], tokens) for a, w in chosen)
        return keys, values

    def observe(self, slot: str, reader: str, source: ChunkKV, keys: torch.Tensor, values: torch.Tensor) -> None:
        with self.lock:
            anchor = self.anchors.get((slot, source.key))
            if anchor is None:
                anchor = Anchor(slot, source.key, feature(source), born=self.births)
                self.anchors[(slot, source.key)] = anchor
                self.births += 1
                self.added += 1
            anchor.deviations[reader] = (keys, values)
            self.shrink()

    def shrink(self) -> None:
        """Evict the least used anchors, sparing the newest, until the pool is within bounds (lock held)."""
        c = self.config
        held = sum(a.nbytes for a in self.anchors.values())
        while self.anchors and (len(self.anchors) > c.max_anchors or held > c.max_bytes):
            old = [a for a in self.anchors.values() if a.born < self.births - c.grace]
            least = min(old or self.anchors.values(), key=lambda a: (a.uses, a.born))
            del self.anchors[(least.slot, least.content)]
            held -= least.nbytes
            self.evicted += 1

    def forget(self, source: str) -> None:
        with self.lock:
            for key in [k for k, a in self.anchors.items() if a.content == source]:
                del self.anchors[key]

    def stats(self) -> dict[str, int]:
        with self.lock:
            count = len(self.anchors)
        return {
            "anchors": count,
            "bytes": self.nbytes,
            "estimates": self.estimates,
            "gated": self.gated,
            "added": self.added,
            "evicted": self.evicted,
        }
