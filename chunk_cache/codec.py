"""Compressed KV for the tiers below memory: asymmetric integer quantisation, one layer at a time.

Each layer's keys and values [kv_heads, T, head_dim] are quantised separately, per head, per channel
(head_dim index) and per group of `group` consecutive tokens: a group's channel keeps its min and
step as float32, its values as `bits`-bit integers (4-bit: two per byte). Per channel, because keys
have outlier channels whose range would swamp the others' resolution (KIVI, CacheGen); per group of
tokens, because one chunk-wide range per channel cost 4-bit entries about 5x the first-token KL to
the same blend over raw entries (3 MuSiQue items, 6 documents each). A layer's bytes are its
parameters [2 (keys, values), 2 (min, step), kv_heads, groups, 1, head_dim], then its integers
[2, kv_heads, T, head_dim * bits / 8] (4-bit: channel c in the low nibble, c + head_dim / 2 in the
high one): one byte range per layer, decoded straight into the layer's tensor, so a load still
pipelines layer by layer. A value's error is at most step / 2. A codec's name fixes its bits and
group: another choice needs another name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Quantiser:
    name: str
    bits: int  # 8 or 4
    group: int  # tokens sharing one min and step per channel

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def groups(self, tokens: int) -> int:
        return -(-tokens // self.group)

    def param_bytes(self, kv_heads: int, tokens: int, head_dim: int) -> int:
        return 4 * 2 * 2 * kv_heads * self.groups(tokens) * head_dim

    def layer_bytes(self, kv_heads: int, tokens: int, head_dim: int) -> int:
        """Stored bytes of one layer's keys and values."""
        data = 2 * kv_heads * tokens * head_dim * self.bits // 8
        return self.param_bytes(kv_heads, tokens, head_dim) + data

    def encode(self, layer: torch.Tensor) -> torch.Tensor:
        """Layer [2, kv_heads, T, head_dim] (any float dtype) -> its stored bytes, uint8 [layer_bytes].

        In numpy, as decode is, for the same reason: the tiers' writer thread encodes beside requests."""
        _, kv_heads, tokens, head_dim = layer.shape
        if self.bits == 4 and head_dim % 2:
            raise ValueError(f"4-bit packing needs an even head_dim, got {head_dim}")
        x = layer.detach().to("cpu", torch.float32).numpy()
        groups, pad = self.groups(tokens), self.groups(tokens) * self.group - tokens
        if pad:  # the last group filled with copies of the last token: its range stays its own
            x = np.concatenate([x, np.repeat(x[:, :, -1:], pad, 2)], 2)
        x = x.reshape(2, kv_heads, groups, self.group, head_dim)
        low = x.min(3, keepdims=True)
        step = (x.max(3, keepdims=True) - low) / np.float32(self.levels)
        # A constant channel has step 0: every value is its min, stored as 0.
        q = np.rint((x - low) / np.where(step > 0, step, np.float32(1)))
        q = q.clip(0, self.levels).astype(np.uint8).reshape(2, kv_heads, groups * self.group, head_dim)[:, :, :tokens]
        if self.bits == 4:  # a byte holds channel c (low nibble) and channel c + head_dim / 2
            q = q[..., : head_dim // 2] | (q[..., head_dim // 2 :] << 4)
        params = np.stack([low, step], 1).astype(np.float32)
        return torch.from_numpy(np.concatenate([params.reshape(-1).view(np.uint8), q.reshape(-1)]))

    def decode(self, raw: bytes | memoryview, out: torch.Tensor) -> torch.Tensor:
        """Stored bytes of one layer -> `out` [2, kv_heads, T, head_dim], in out's dtype.

        In numpy: one thread, the GIL released, so a load beside a blend does not contend for torch's
        intra-op threads (on a busy machine torch's threaded casts into fresh pages ran 10x slower)."""
        _, kv_heads, tokens, head_dim = out.shape
        groups, n = self.groups(tokens), self.param_bytes(kv_heads, tokens, head_dim)
        params = np.frombuffer(raw, np.float32, n // 4).reshape(2, 2, kv_heads, groups, 1, head_dim)
        q = np.frombuffer(raw, np.uint8, offset=n).reshape(2, kv_heads, tokens, head_dim * self.bits // 8)
        target = out if out.dtype != torch.bfloat16 else torch.empty(out.shape, dtype=torch.float32)
        o = target.numpy()
        low, step = params[:, 0].astype(o.dtype), params[:, 1].astype(o.dtype)
        whole = tokens // self.group
        # The whole groups as one [2, kv_heads, groups, group, ...] view, then the last, shorter one.
        for g0, g1, t0, t1 in ((0, whole, 0, whole * self.group), (whole, groups, whole * self.group, tokens)):
            if t1 > t0:
                size = (t1 - t0) // (g1 - g0)
                part = (2, kv_heads, g1 - g0, size, -1)
                self._dequantise(
                    q[:, :, t0:t1].reshape(part), step[:, :, g0:g1], low[:, :, g0:g1], o[:, :, t0:t1].reshape(part)
                )
        return out if target is out else out.copy_(target)

    def _dequantise(self, q: np.ndarray, step: np.ndarray, low: np.ndarray, o: np.ndarray) -> None:
        """o = q * step + low, in place; q [..., tokens, head_dim * bits / 8], o [..., tokens, head_dim]."""
        if self.bits == 4:
            half = o.shape[-1] // 2
            np.multiply(q & 0x0F, step[..., :half], out=o[..., :half])
            np.multiply(q >> 4, step[..., half:], out=o[..., half:])
        else:
            np.multiply(q, step, out=o)
        np.add(o, low, out=o)


CODECS = {"int8": Quantiser("int8", 8, 128), "int4": Quantiser("int4", 4, 64)}


def codec_named(name: str | None) -> Quantiser | None:
    """The codec of that name; None (raw entries) for None. ValueError for a name not known here."""
    if name is None:
        return None
    if name not in CODECS:
        raise ValueError(f"unknown KV codec {name!r}; known: {sorted(CODECS)} (or none: raw)")
    return CODECS[name]
