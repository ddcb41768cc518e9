"""A cached response and its self-check: every field that decides an answer is under one checksum,
so a damaged entry is a miss, never an answer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

# Written with every entry; last_used and hits change on reads and are not checked.
CHECKED = ("id", "tenant", "scope", "category", "query", "response", "vector", "created", "expires")


@dataclass
class Entry:
    id: str
    tenant: str
    scope: str  # everything the answer depends on besides the question (see gateway/semantic.py)
    category: str
    query: str
    response: dict[str, Any]  # what a hit replays: content, finish_reason, usage
    vector: np.ndarray  # the query's embedding, float32, L2-normalised
    created: float
    expires: float
    last_used: float = 0.0
    hits: int = 0

    def expired(self, now: float) -> bool:
        return now >= self.expires


def pack(entry: Entry) -> dict[str, bytes]:
    fields = {
        "id": entry.id.encode(),
        "tenant": entry.tenant.encode(),
        "scope": entry.scope.encode(),
        "category": entry.category.encode(),
        "query": entry.query.encode(),
        "response": json.dumps(entry.response, sort_keys=True, separators=(",", ":")).encode(),
        "vector": np.ascontiguousarray(entry.vector, dtype=np.float32).tobytes(),
        "created": repr(entry.created).encode(),
        "expires": repr(entry.expires).encode(),
    }
    fields["sum"] = _checksum(fields).encode()
    fields["last_used"] = repr(entry.last_used or entry.created).encode()
    fields["hits"] = str(entry.hits).encode()
    return fields


def unpack(fields: dict[bytes | str, Any], dim: int) -> Entry | None:
    """The entry, or None when anything is missing, malformed or fails its checksum."""
    raw = {_text(k): (v.encode() if isinstance(v, str) else v) for k, v in fields.items()}
    # A store may hand back the unchecked numbers as numbers (SQLite columns).
    try:
        if raw["sum"].decode() != _checksum({k: raw[k] for k in CHECKED}):
            return None
        vector = np.frombuffer(raw["vector"], dtype=np.float32)
        if vector.shape != (dim,):
            return None
        response = json.loads(raw["response"])
        if not isinstance(response, dict):
            return None
        return Entry(
            id=raw["id"].decode(),
            tenant=raw["tenant"].decode(),
            scope=raw["scope"].decode(),
            category=raw["category"].decode(),
            query=raw["query"].decode(),
            response=response,
            vector=vector,
            created=float(raw["created"]),
            expires=float(raw["expires"]),
            last_used=float(raw.get("last_used", raw["created"])),
            hits=int(raw.get("hits", 0)),
        )
    except (KeyError, ValueError, UnicodeDecodeError, TypeError):
        return None


def _checksum(fields: dict[str, bytes]) -> str:
    h = xxhash.xxh3_128()
    for name in CHECKED:
        value = fields[name]
        h.update(len(value).to_bytes(8, "little"))
        h.update(value)
    return h.hexdigest()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
