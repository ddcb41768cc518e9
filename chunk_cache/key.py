"""Content addresses of chunk KV: the same tokens under the same model and scope, the same key."""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import torch

_DOMAIN = b"kvgate.chunk.v1"


def feed(h: Any, parts: Iterable[Any]) -> None:
    """Hash each part (bytes-like) behind its 8-byte length, so parts cannot run into each other."""
    for part in parts:
        view = memoryview(part)
        h.update(view.nbytes.to_bytes(8, "little"))
        h.update(view)


def token_bytes(token_ids: Sequence[int] | torch.Tensor) -> bytes:
    """Token ids as little-endian int64, whatever the machine."""
    ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids
    packed = array("q", ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def chunk_key(model_fp: str, tokenizer_fp: str, token_ids: Sequence[int] | torch.Tensor, scope: str = "") -> str:
    """sha256 hex of (model, tokenizer, token ids, scope); scope is the tenant, "" when shared."""
    h = hashlib.sha256()
    feed(h, (_DOMAIN, model_fp.encode(), tokenizer_fp.encode(), token_bytes(token_ids), scope.encode()))
    return h.hexdigest()


def fingerprint(*parts: bytes | str) -> str:
    """sha256 hex of some identifying bytes (a model file's hash, a tokenizer's JSON), length-prefixed."""
    h = hashlib.sha256()
    feed(h, (p.encode() if isinstance(p, str) else p for p in parts))
    return h.hexdigest()
