"""kvgate: an OpenAI-compatible gateway that reuses the KV of documents and agent turns, so the first
token comes fast without changing the answer.

    import kvgate

    client = kvgate.Client("http://127.0.0.1:8000")     # a kvgate server
    llm = kvgate.LLM()                                  # or the same calls in-process

The public surface is what `__all__` names; everything else is kvgate's own."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvgate.client import AsyncChatStream, AsyncClient, ChatStream, Client
from kvgate.errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InternalServerError,
    KVGateError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RequestTooLargeError,
    UnprocessableEntityError,
)
from kvgate.types import ChatCompletion, Document, Reuse

if TYPE_CHECKING:
    from kvgate.gateway.settings import Settings
    from kvgate.llm import LLM, LLMStream

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncChatStream",
    "AsyncClient",
    "AuthenticationError",
    "BadRequestError",
    "ChatCompletion",
    "ChatStream",
    "Client",
    "ConflictError",
    "Document",
    "InternalServerError",
    "KVGateError",
    "LLMStream",
    "NotFoundError",
    "PermissionDeniedError",
    "RateLimitError",
    "RequestTooLargeError",
    "Reuse",
    "Settings",
    "UnprocessableEntityError",
    "__version__",
]


def __getattr__(name: str) -> object:
    """`LLM` loads the runtime (torch) on first use, `Settings` the gateway's settings: a client
    that needs neither imports httpx and kvgate's own few modules only."""
    if name in ("LLM", "LLMStream"):
        from kvgate import llm

        return getattr(llm, name)
    if name == "Settings":
        from kvgate.gateway.settings import Settings

        return Settings
    raise AttributeError(f"module 'kvgate' has no attribute {name!r}")
