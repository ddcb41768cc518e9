"""What answers behind the gateway's routes: the `Backend` interface, the request and the reply as
they cross it, and the registry of backends (the local engine, runtime workers, upstream servers).

The routes (gateway/routes.py) do what every mode shares: keys, limits, the semantic cache,
accounting, a client that hangs up. A backend turns an OpenAI request into an OpenAI answer."""

from __future__ import annotations

import asyncio
import importlib
import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvgate.gateway.errors import APIError
from kvgate.gateway.protocol import ChatCompletionRequest, CompletionRequest
from kvgate.gateway.render import Data, dumps, encoded, sse_data
from kvgate.runtime.reuse_report import NOTHING, ReuseReport
from kvgate.runtime.stages import Stages

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from kvgate.gateway.settings import Settings
    from kvgate.gateway.upstreams import Upstream
    from kvgate.runtime.engine import Engine


@dataclass(frozen=True, kw_only=True)
class Call:
    """One OpenAI request as a backend gets it, made once (what the route learns later is a new one)."""

    path: str  # /v1/chat/completions, /v1/completions, /v1/embeddings
    body: dict[str, Any]  # the JSON object as sent
    raw: bytes  # and its bytes, forwarded as they came where nothing changes
    model: str
    tenant: str
    request_id: str
    program: str | None = None
    # The body read by kvgate's protocol; None where it could not be (an upstream judges it then).
    parsed: ChatCompletionRequest | CompletionRequest | None = None
    keep: bool = False  # the answer's text is wanted (the semantic cache keeps it)

    @classmethod
    def of(
        cls,
        path: str,
        body: dict[str, Any],
        parsed: ChatCompletionRequest | CompletionRequest | None,
        *,
        tenant: str,
        request_id: str,
        program: str | None = None,
        raw: bytes | None = None,
    ) -> Call:
        """A request read and checked: its model the body's, `raw` the bytes it came as (else the body's)."""
        raw = dumps(body) if raw is None else raw
        return cls(
            path=path,
            body=body,
            raw=raw,
            model=body["model"],
            tenant=tenant,
            request_id=request_id,
            program=program,
            parsed=parsed,
        )

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True


@dataclass(frozen=True)
class Outcome:
    """What an answer came to, once it ended: what the gateway counts and keeps."""

    text: str = ""  # the first choice's content
    finish_reason: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    report: ReuseReport = NOTHING  # what reuse made of the prompt's KV, where the runtime is this process's
    done: bool = False  # the answer ended as it should (not an error, not cut short)
    stages: Stages | None = None  # when its first choice passed each of the engine's stages, where it ran here


@dataclass(frozen=True)
class Reply:
    """A backend's answer: whole or an SSE stream, each as the bytes an upstream sent (`content`, `events`:
    passed on as they came) or as the objects this process made (`answer`, `chunks`: DONE last). Each is
    encoded or read once, by whoever needs the other form (`body`, `json`, `sse`, `data`). `settled`: what it
    came to, a whole answer's at once, a stream's a future its events settle as they end. `close` lets go of
    whatever the answer holds (an upstream's connection, the engine's sequences)."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    content: bytes | None = None
    events: AsyncIterator[bytes] | None = None
    settled: Outcome | asyncio.Future[Outcome] = field(default_factory=Outcome)
    close: Callable[[], Awaitable[None]] | None = None
    answer: dict[str, Any] | None = None
    chunks: AsyncIterator[Data] | None = None

    @property
    def outcome(self) -> Outcome:
        """What the answer came to; a stream not ended (or ended by an error) came to nothing done."""
        settled = self.settled
        if isinstance(settled, Outcome):
            return settled
        return settled.result() if settled.done() and not settled.cancelled() else Outcome()

    @property
    def streamed(self) -> bool:
        return self.events is not None or self.chunks is not None

    def body(self) -> bytes:
        """A whole answer's bytes."""
        if self.answer is not None:
            return dumps(self.answer)
        return self.content or b""

    def json(self) -> dict[str, Any]:
        """A whole answer as an object: 502 where what an upstream sent is not a JSON object."""
        if self.answer is not None:
            return self.answer
        try:
            answer = json.loads(self.content or b"")
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise APIError(502, "the answer is not a JSON object", code="upstream_error")
        return answer

    def sse(self) -> AsyncIterator[bytes]:
        """A stream's SSE events as bytes (read once)."""
        if self.events is not None:
            return self.events
        assert self.chunks is not None, "a whole answer has no events"
        return encoded(self.chunks)

    def data(self) -> AsyncIterator[Data]:
        """A stream's events' data as objects, DONE last (read once)."""
        if self.chunks is not None:
            return self.chunks
        assert self.events is not None, "a whole answer has no events"
        return sse_data(self.events)


class Backend(ABC):
    """The OpenAI routes' other side. `validates`: requests must pass kvgate's protocol (the local
    engine); otherwise a body kvgate cannot read is forwarded for the upstream to judge."""

    validates: bool = True

    @abstractmethod
    def models(self) -> list[dict[str, Any]]:
        """The model cards this backend serves."""

    def card(self, model: str) -> dict[str, Any] | None:
        return next((c for c in self.models() if c["id"] == model), None)

    @abstractmethod
    def serves(self, model: str) -> bool: ...

    def document_models(self) -> list[str]:
        """The models whose KV `POST /v1/documents` computes (a key must be allowed one of them)."""
        return [c["id"] for c in self.models()]

    @abstractmethod
    def identity(self, model: str) -> dict[str, str]:
        """What answers for `model` (the semantic cache's entries are scoped by it)."""

    @abstractmethod
    def queued(self) -> int:
        """Requests waiting: the load the semantic cache relaxes its thresholds under."""

    @abstractmethod
    async def generate(self, call: Call) -> Reply: ...

    @abstractmethod
    async def add_document(self, text: str, raw: bytes, tenant: str, request_id: str) -> Reply: ...

    async def count_tokens(self, call: Call) -> int:
        """The tokens of a chat call's prompt as the model reads it (template, tools, documents), nothing generated."""
        raise APIError(404, "this backend does not count tokens", code="unsupported_route")

    @abstractmethod
    async def document(self, method: str, document_id: str, tenant: str, request_id: str) -> Reply:
        """GET (its card) or DELETE (forget it) a stored document."""

    @abstractmethod
    async def ready(self) -> dict[str, Any]:
        """Readiness (APIError 503 when not ready)."""

    def alive(self) -> bool:
        return True

    def metrics(self) -> Iterator[Metric]:
        return iter(())

    async def scrape(self) -> dict[str, str]:
        """Metrics text of the processes behind this one, by name."""
        return {}

    async def close(self) -> None:
        return None


# name -> "module:class"; a backend is imported only when asked for (the local one imports torch).
BACKENDS = {
    "local": "kvgate.gateway.local:Local",
    "workers": "kvgate.gateway.proxy:Workers",
    "upstreams": "kvgate.gateway.proxy:Upstreams",
}


def backend_class(name: str) -> type[Backend]:
    try:
        module, _, attr = BACKENDS[name].partition(":")
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(sorted(BACKENDS))}") from None
    return getattr(importlib.import_module(module), attr)


def make_backend(settings: Settings, engine: Engine | None = None, workers: tuple[Upstream, ...] = ()) -> Backend:
    """The local engine's backend when given one; else runtime workers when given, else upstreams."""
    if engine is not None:
        return backend_class("local")(settings, engine)  # type: ignore[call-arg]
    return backend_class("workers" if workers else "upstreams")(settings, workers)  # type: ignore[call-arg]
