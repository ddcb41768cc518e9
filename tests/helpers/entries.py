"""Small random chunk entries for the tier tests, and exact comparison of two of them."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import torch

from kvgate.chunk_cache import ChunkKV, Header


def chunk(
    key: str = "doc", tokens: int = 4, layers: int = 4, model: str = "model-a", dtype: torch.dtype = torch.float32
) -> ChunkKV:
    """A random entry: [layers, 2 kv heads, tokens, head_dim 8] keys and values, cost 1.5."""
    shape = (layers, 2, tokens, 8)
    ids = [random.randrange(50_000) for _ in range(tokens)]
    return ChunkKV(key, ids, torch.randn(shape).to(dtype), torch.randn(shape).to(dtype), 1.5, model)


def same(got: ChunkKV | None, entry: ChunkKV) -> bool:
    """Equal in every field and every bit."""
    return (
        got is not None
        and (got.key, got.token_ids, got.cost, got.model) == (entry.key, entry.token_ids, entry.cost, entry.model)
        and torch.equal(got.keys, entry.keys)
        and torch.equal(got.values, entry.values)
    )


def priced(
    key: str = "doc", tokens: int = 4, cost: float = 1.0, dtype: torch.dtype = torch.float32, model: str = ""
) -> ChunkKV:
    """A small random entry: 2 layers, 2 kv heads, head_dim 8 (1 KiB of float32 KV at 4 tokens)."""
    shape = (2, 2, tokens, 8)
    ids = [random.randrange(50_000) for _ in range(tokens)]
    return ChunkKV(key, ids, torch.randn(shape).to(dtype), torch.randn(shape).to(dtype), cost, model)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def reheadered(data: bytes, edit: Callable[[dict[str, Any]], None], body: bytes | None = None) -> bytes:
    """An entry's bytes with its safetensors header (the parsed JSON) changed by `edit`, followed by
    `body` (None: the entry's own tensor bytes); its checksums are left as they were."""
    size = Header.size_of(data)
    header = json.loads(data[8:size])
    edit(header)
    head = json.dumps(header).encode()
    return len(head).to_bytes(8, "little") + head + (data[size:] if body is None else body)


def rewritten(data: bytes, **metadata: str) -> bytes:
    """An entry's bytes with these metadata fields replaced."""
    return reheadered(data, lambda header: header["__metadata__"].update(metadata))
