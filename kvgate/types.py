"""What the SDK returns: plain frozen dataclasses over kvgate's JSON and headers (no HTTP library in
here, so the in-process runtime can build the same objects)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ChatCompletion", "Document", "Reuse"]


@dataclass(frozen=True)
class Reuse:
    """What kvgate did for a response, from its `x-kvgate-*` headers.

    `mode` is the reuse that ran (blend, naive, prefix, full, program, kvcomm; "" when none was
    reported) and `note` why it is not the one asked for. `reused_tokens` are cached tokens kept
    as they were, `recomputed_tokens` cached tokens computed again. `cache` is the semantic cache's
    verdict (hit, miss, bypass), `program` the agent program and `pin_ttl_s` how long its KV stays
    pinned, `upstream` the upstream that answered in proxy mode.
    """

    mode: str = ""
    note: str = ""
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    cache: str | None = None
    cache_category: str | None = None
    cache_entry: str | None = None
    similarity: float | None = None
    cache_refused: str | None = None
    pin_ttl_s: float | None = None
    program: str | None = None
    upstream: str | None = None
    request_id: str | None = None
    fidelity: str | None = None  # how far the reuse moves the first token: "exact", or kl/top1 and their source

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> Reuse:
        """Read from response headers, whatever the case of their names."""
        h = {k.lower(): v for k, v in headers.items()}
        mode, _, note = h.get("x-kvgate-reuse", "").partition(";")
        return cls(
            mode=mode.strip(),
            note=note.strip(),
            reused_tokens=_int(h.get("x-kvgate-reused-tokens")),
            recomputed_tokens=_int(h.get("x-kvgate-recomputed-tokens")),
            cache=h.get("x-kvgate-cache"),
            cache_category=h.get("x-kvgate-cache-category"),
            cache_entry=h.get("x-kvgate-cache-entry"),
            similarity=_float(h.get("x-kvgate-similarity")),
            cache_refused=h.get("x-kvgate-cache-refused"),
            pin_ttl_s=_float(h.get("x-kvgate-pin-ttl")),
            program=h.get("x-kvgate-program-id"),
            upstream=h.get("x-kvgate-upstream"),
            request_id=h.get("x-request-id"),
            fidelity=h.get("x-kvgate-fidelity"),
        )


@dataclass(frozen=True)
class Document:
    """A document whose KV kvgate keeps: cite it in a chat by `id`; `tokens` is its length and
    `cached` whether its KV is held now (else it is computed again when cited)."""

    id: str
    tokens: int
    cached: bool

    @classmethod
    def from_json(cls, card: Mapping[str, Any]) -> Document:
        """From the card `/v1/documents` answers with."""
        return cls(id=str(card["id"]), tokens=int(card.get("tokens", 0)), cached=bool(card.get("cached", False)))


@dataclass(frozen=True)
class ChatCompletion:
    """A chat completion: the OpenAI body as returned (`raw`) and what reuse did (`reuse`)."""

    raw: dict[str, Any]
    reuse: Reuse

    @property
    def id(self) -> str:
        return str(self.raw.get("id", ""))

    @property
    def model(self) -> str:
        return str(self.raw.get("model", ""))

    @property
    def choices(self) -> list[dict[str, Any]]:
        return list(self.raw.get("choices") or [])

    @property
    def text(self) -> str:
        """The first choice's message content ("" when it has none)."""
        choices = self.choices
        if not choices:
            return ""
        return (choices[0].get("message") or {}).get("content") or ""

    @property
    def finish_reason(self) -> str | None:
        choices = self.choices
        return choices[0].get("finish_reason") if choices else None

    @property
    def usage(self) -> dict[str, Any]:
        return dict(self.raw.get("usage") or {})


def _int(value: str | None) -> int:
    try:
        return int(value) if value else 0
    except ValueError:
        return 0


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value else None
    except ValueError:
        return None
