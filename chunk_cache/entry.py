"""One document's KV, and its self-checking byte form for tiers that leave process memory.

The byte form is a safetensors file with two tensors, `kv` [layers, 2, kv_heads, T, head_dim]
(each layer's keys then values, contiguous, so one layer is one byte range) and `token_ids`,
and metadata: key, model fingerprint, dtype, shape, cost, an xxh3 checksum per layer, and a
checksum of the header itself. A reader can check the header alone, then each layer as it
arrives, and use layer i before layer i+1 has been read (`Header`, `Header.layer`).

A compressed entry (`to_bytes(codec)`, codec.py) names its codec in the metadata (covered by the
header checksum) and stores `kv` as uint8 [layers, stored bytes per layer]: the checksums cover
the stored bytes, and each layer is decoded into its tensor once checked. Raw entries carry no
codec and are unchanged; a codec this reader does not know makes the entry damaged (a miss).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch
import xxhash
from safetensors.torch import save

from kvgate.chunk_cache.codec import Quantiser, codec_named
from kvgate.chunk_cache.key import token_bytes

FORMAT = "kvgate.chunk-entry.v2"
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}
_NAMES = {v: k for k, v in _DTYPES.items()}
_FIELDS = ("format", "key", "model", "dtype", "shape", "cost", "layers")


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
    model: str = ""  # fingerprint of the model that computed it
    # Rows 0..exact-1 are, bit for bit, what a full prefill of the same tokens computes; the rest came otherwise
    # (decode steps, or a lossy codec's read-back: 0). None: every row.
    exact: int | None = None

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
        if self.exact is not None and not 0 <= self.exact <= len(self.token_ids):
            raise ValueError(f"exact={self.exact} rows of {len(self.token_ids)}")

    @property
    def exact_rows(self) -> int:
        """How many leading rows are full prefill's own."""
        return self.tokens if self.exact is None else min(self.exact, self.tokens)

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values, [kv_heads, T, head_dim] each (the same call a `Loading` answers)."""
        return self.keys[i], self.values[i]

    def to(self, device: str | torch.device) -> ChunkKV:
        if self.keys.device == torch.device(device):
            return self
        keys, values = self.keys.to(device), self.values.to(device)
        return ChunkKV(self.key, self.token_ids, keys, values, self.cost, self.model, self.exact)

    def to_bytes(self, codec: str | None = None) -> bytes:
        """The byte form; `codec` (codec.py's names; None: raw) compresses each layer."""
        kv = torch.stack([self.keys, self.values], 1).detach().to("cpu").contiguous()
        coder = codec_named(codec)
        stored = kv if coder is None else torch.stack([coder.encode(layer) for layer in kv])
        digests = tuple(_digest(_raw(layer)) for layer in stored)
        shape = tuple(self.keys.shape)
        metadata = _described(self.key, self.model, kv.dtype, shape, self.cost, digests, codec, self.exact)
        metadata["checksum"] = _header_checksum(metadata, self.token_ids)
        ids = torch.tensor(self.token_ids, dtype=torch.int64)
        return save({"kv": stored, "token_ids": ids}, metadata=metadata)

    @classmethod
    def from_bytes(
        cls, data: bytes, key: str | None = None, model: str | None = None, device: str | torch.device = "cpu"
    ) -> ChunkKV:
        """Raises CorruptEntry for anything but an intact entry (under `key` and `model`, when given)."""
        view = memoryview(data)
        header = Header.parse(view[: Header.size_of(view)], key, model)
        header.check_tokens(view[header.ids_start : header.ids_stop])
        if len(view) != header.total:
            raise CorruptEntry(f"{len(view)} bytes, expected {header.total}")
        kv = torch.empty(header.kv_shape, dtype=header.dtype)
        for i in range(header.layers):
            start, stop = header.layer_range(i)
            header.layer(i, view[start:stop], out=kv[i])
        return header.entry(kv).to(device)


@dataclass(frozen=True)
class Header:
    """An entry's header, checked: where each part lies, and what each layer must hash to."""

    key: str
    model: str
    dtype: torch.dtype
    shape: tuple[int, int, int, int]  # [layers, kv_heads, T, head_dim]
    cost: float
    digests: tuple[str, ...]
    checksum: str
    kv_start: int  # absolute byte offsets
    ids_start: int
    ids_stop: int
    total: int
    token_ids: tuple[int, ...] = ()  # filled by check_tokens
    codec: Quantiser | None = None  # None: raw layers
    exact: int | None = None  # ChunkKV.exact as stored

    @staticmethod
    def size_of(prefix: bytes | memoryview) -> int:
        """The header's length in bytes, from the entry's first 8."""
        if len(prefix) < 8:
            raise CorruptEntry(f"{len(prefix)} bytes is shorter than a header")
        n = int.from_bytes(prefix[:8], "little")
        if n > 1 << 24:
            raise CorruptEntry(f"a header of {n} bytes")
        return 8 + n

    @classmethod
    def parse(cls, head: bytes | memoryview, key: str | None = None, model: str | None = None) -> Header:
        size = cls.size_of(head)
        if len(head) < size:
            raise CorruptEntry(f"header of {size} bytes in {len(head)} bytes")
        try:
            header = json.loads(bytes(head[8:size]))
            meta = header["__metadata__"]
            kv, ids = header["kv"], header["token_ids"]
            if meta.get("format") != FORMAT:
                raise CorruptEntry(f"format {meta.get('format')!r}, expected {FORMAT!r}")
            if key is not None and meta.get("key") != key:
                raise CorruptEntry(f"entry holds key {meta.get('key')!r}, expected {key!r}")
            if model is not None and meta.get("model") != model:
                raise CorruptEntry(f"entry computed by model {meta.get('model')!r:.20}, not {model!r:.20}")
            shape = tuple(json.loads(meta["shape"]))
            dtype = _DTYPES[meta["dtype"]]
            digests = tuple(json.loads(meta["layers"]))
            codec = codec_named(meta.get("codec"))  # ValueError (damage) for a codec not known here
            exact = int(meta["exact"]) if "exact" in meta else None
            if len(shape) != 4 or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise CorruptEntry(f"shape {shape}")
            if [kv["dtype"], kv["shape"]] != _stored(codec, meta["dtype"], shape) or ids["dtype"] != "I64":
                raise CorruptEntry("tensors do not match the metadata")
            if ids["shape"] != [shape[2]] or len(digests) != shape[0]:
                raise CorruptEntry("token ids or layer checksums do not match the shape")
            (k0, k1), (i0, i1) = kv["data_offsets"], ids["data_offsets"]
            parsed = cls(
                str(meta["key"]), str(meta["model"]), dtype, shape, float(meta["cost"]), digests,
                str(meta["checksum"]), size + k0, size + i0, size + i1, size + max(k1, i1), codec=codec, exact=exact,
            )  # fmt: skip
            if k1 - k0 != shape[0] * parsed.layer_bytes or i1 - i0 != 8 * shape[2]:
                raise CorruptEntry("tensor byte ranges do not match their shapes")
        except CorruptEntry:
            raise
        except (KeyError, TypeError, ValueError, UnicodeDecodeError) as e:
            raise CorruptEntry(f"unreadable header: {e!r}") from None
        return parsed

    @property
    def layers(self) -> int:
        return self.shape[0]

    @property
    def kv_shape(self) -> tuple[int, ...]:
        return (self.shape[0], 2, *self.shape[1:])

    @property
    def layer_bytes(self) -> int:
        """Stored bytes of one layer (compressed ones, under a codec)."""
        _, kv_heads, tokens, head_dim = self.shape
        if self.codec is not None:
            return self.codec.layer_bytes(kv_heads, tokens, head_dim)
        return 2 * kv_heads * tokens * head_dim * torch.empty(0, dtype=self.dtype).element_size()

    def layer_range(self, i: int) -> tuple[int, int]:
        start = self.kv_start + i * self.layer_bytes
        return start, start + self.layer_bytes

    def check_tokens(self, raw: bytes | memoryview) -> Header:
        """Verify the header checksum, which covers the token ids; remember them."""
        if len(raw) != self.ids_stop - self.ids_start:
            raise CorruptEntry("token ids truncated")
        ids = tuple(np.frombuffer(raw, dtype="<i8").tolist())
        codec = None if self.codec is None else self.codec.name
        meta = _described(self.key, self.model, self.dtype, self.shape, self.cost, self.digests, codec, self.exact)
        if _header_checksum(meta, ids) != self.checksum:
            raise CorruptEntry("header checksum mismatch")
        object.__setattr__(self, "token_ids", ids)
        return self

    def layer(self, i: int, raw: bytes | memoryview, out: torch.Tensor) -> torch.Tensor:
        """Check layer i's bytes and copy (or decode) them into `out` [2, kv_heads, T, head_dim]."""
        self.check(i, raw)
        if self.codec is not None:
            return self.codec.decode(raw, out)
        out.view(torch.uint8).reshape(-1).numpy()[:] = np.frombuffer(raw, dtype=np.uint8)
        return out

    def check(self, i: int, raw: bytes | memoryview) -> None:
        """Layer i's bytes, read in place: the right length and checksum, else CorruptEntry."""
        if len(raw) != self.layer_bytes:
            raise CorruptEntry(f"layer {i}: {len(raw)} bytes, expected {self.layer_bytes}")
        if _digest(raw) != self.digests[i]:
            raise CorruptEntry(f"layer {i}: checksum mismatch")

    def entry(self, kv: torch.Tensor) -> ChunkKV:
        """The entry whose layers have all been read into `kv` [layers, 2, kv_heads, T, head_dim]. A lossy
        codec's rows are nobody's prefill: none is exact."""
        exact = 0 if self.codec is not None else self.exact
        return ChunkKV(self.key, self.token_ids, kv[:, 0], kv[:, 1], self.cost, self.model, exact)


def _described(
    key: str,
    model: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    cost: float,
    digests: tuple[str, ...],
    codec: str | None = None,
    exact: int | None = None,
) -> dict[str, str]:
    """An entry's metadata, as stored and as the header checksum covers it (a raw entry: no codec; every row
    exact: no `exact`)."""
    described = {
        "format": FORMAT,
        "key": key,
        "model": model,
        "dtype": _NAMES[dtype],
        "shape": json.dumps(list(shape)),
        "cost": repr(cost),
        "layers": json.dumps(list(digests)),
    }
    if exact is not None:
        described["exact"] = str(exact)
    return described if codec is None else {**described, "codec": codec}


def _stored(codec: Quantiser | None, dtype: str, shape: tuple[int, ...]) -> list[object]:
    """The `kv` tensor's safetensors dtype and shape in an entry of that codec, dtype and shape."""
    layers, kv_heads, tokens, head_dim = shape
    if codec is None:
        return [dtype, [layers, 2, kv_heads, tokens, head_dim]]
    return ["U8", [layers, codec.layer_bytes(kv_heads, tokens, head_dim)]]


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _digest(raw: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(raw)


def _header_checksum(metadata: dict[str, str], token_ids: tuple[int, ...]) -> str:
    h = xxhash.xxh3_128()
    # A raw entry's checksum is what it was before codecs existed: "codec" only counts when present.
    for field in _FIELDS + (("codec",) if "codec" in metadata else ()):
        part = metadata.get(field, "").encode()
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    h.update(token_bytes(token_ids))
    return h.hexdigest()
