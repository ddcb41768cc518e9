"""One document's KV, and its self-checking byte form for tiers that leave process memory."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
from safetensors.torch import load, save

from chunk_cache.key import feed, token_bytes

FORMAT = "kvgate.chunk-entry.v1"
_TENSORS = {"keys", "values", "token_ids"}


class CorruptEntry(ValueError):
    """Stored bytes that are not a sound entry (or not the one asked for): treat as a miss."""


@dataclass(frozen=True, eq=False)
class ChunkKV:
    key: str
    token_ids: tuple[int, ...]
    # [layers, kv_heads, T, head_dim]; keys post-RoPE at chunk-local positions 0..T-1.
    keys: torch.Tensor
    values: torch.Tensor
    # What recomputing this chunk would take (seconds, or anything proportional to FLOPs);
    # eviction keeps entries that save the most per byte.
    cost: float = 0.0

    def __post_init__(self) -> None:
        ids = self.token_ids.tolist() if isinstance(self.token_ids, torch.Tensor) else self.token_ids
        object.__setattr__(self, "token_ids", tuple(int(t) for t in ids))
        object.__setattr__(self, "cost", float(self.cost))
        if self.keys.dim() != 4:
            raise ValueError(f"keys must be [layers, kv_heads, T, head_dim], got shape {tuple(self.keys.shape)}")
        if self.keys.shape != self.values.shape or self.keys.dtype != self.values.dtype:
            raise ValueError(
                f"keys {tuple(self.keys.shape)} {self.keys.dtype} and values "
                f"{tuple(self.values.shape)} {self.values.dtype} differ"
            )
        if self.keys.shape[2] != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} token ids for {self.keys.shape[2]} cached tokens")

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def to(self, device: str | torch.device) -> ChunkKV:
        if self.keys.device == torch.device(device):
            return self
        return ChunkKV(self.key, self.token_ids, self.keys.to(device), self.values.to(device), self.cost)

    def to_bytes(self) -> bytes:
        """A safetensors file: keys, values, token_ids, and a checksum over all of them in its metadata."""
        keys, values = _cpu(self.keys), _cpu(self.values)
        ids = torch.tensor(self.token_ids, dtype=torch.int64)
        metadata = {
            "format": FORMAT,
            "key": self.key,
            "dtype": _dtype_name(keys.dtype),
            "shape": json.dumps(list(keys.shape)),
            "cost": repr(self.cost),
        }
        metadata["checksum"] = _checksum(metadata, self.token_ids, keys, values)
        return save({"keys": keys, "values": values, "token_ids": ids}, metadata=metadata)

    @classmethod
    def from_bytes(cls, data: bytes, key: str | None = None, device: str | torch.device = "cpu") -> ChunkKV:
        """Raises CorruptEntry for anything but an intact entry (under `key`, when given)."""
        metadata = _metadata(data)
        try:
            tensors = load(data)
        except Exception as e:
            raise CorruptEntry(f"unreadable safetensors: {e}") from None
        if set(tensors) != _TENSORS:
            raise CorruptEntry(f"tensors {sorted(tensors)}, expected {sorted(_TENSORS)}")
        keys, values, ids = tensors["keys"], tensors["values"], tensors["token_ids"]
        if metadata.get("format") != FORMAT:
            raise CorruptEntry(f"format {metadata.get('format')!r}, expected {FORMAT!r}")
        if key is not None and metadata.get("key") != key:
            raise CorruptEntry(f"entry holds key {metadata.get('key')!r}, expected {key!r}")
        for t in (keys, values):
            if _dtype_name(t.dtype) != metadata.get("dtype") or json.dumps(list(t.shape)) != metadata.get("shape"):
                raise CorruptEntry(f"tensor {_dtype_name(t.dtype)} {list(t.shape)} does not match its metadata")
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise CorruptEntry("token_ids must be a 1-D int64 tensor")
        token_ids = tuple(ids.tolist())
        if _checksum(metadata, token_ids, keys, values) != metadata.get("checksum"):
            raise CorruptEntry("checksum mismatch")
        try:
            entry = cls(metadata["key"], token_ids, keys, values, float(metadata["cost"]))
        except (KeyError, ValueError) as e:
            raise CorruptEntry(str(e)) from None
        return entry.to(device)


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _raw(t: torch.Tensor):
    return t.reshape(-1).view(torch.uint8).numpy()


def _checksum(metadata: dict[str, str], token_ids: tuple[int, ...], keys: torch.Tensor, values: torch.Tensor) -> str:
    h = hashlib.sha256()
    fields = (metadata.get(f, "") for f in ("format", "key", "dtype", "shape", "cost"))
    feed(h, (*(f.encode() for f in fields), token_bytes(token_ids), _raw(keys), _raw(values)))
    return h.hexdigest()


def _metadata(data: bytes) -> dict[str, str]:
    # safetensors' own loader does not hand back the metadata, so read the header directly:
    # 8-byte little-endian length, then that many bytes of JSON.
    if len(data) < 8:
        raise CorruptEntry(f"{len(data)} bytes is shorter than a header")
    n = int.from_bytes(data[:8], "little")
    if 8 + n > len(data):
        raise CorruptEntry(f"header of {n} bytes in {len(data)} bytes")
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptEntry(f"unreadable header: {e}") from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptEntry("header has no metadata")
    return metadata
