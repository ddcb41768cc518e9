"""`LLM`: kvgate's calls in-process, against a runtime of its own: no server, no HTTP.

    llm = kvgate.LLM()                                   # the default model, settings as `kvgate serve` reads them
    doc = llm.documents.add("Thomas Nabbes was an English dramatist...")
    reply = llm.chat("Where was Nabbes educated?", documents=[doc], max_tokens=32)
    print(reply.text, reply.reuse.reused_tokens)

The same calls and answers as `Client`: requests go through the gateway's local backend (the same
planning, reuse and OpenAI shapes as the server's), on an event loop of the LLM's own. Keys, limits
and the semantic cache are the gateway's, in front of the routes: they are not here."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar, overload

from kvgate.client import _Base
from kvgate.errors import error_for
from kvgate.gateway.backend import Call, Reply
from kvgate.gateway.errors import APIError, internal
from kvgate.gateway.local import Local
from kvgate.gateway.programs import program_of
from kvgate.gateway.protocol import ChatCompletionRequest
from kvgate.gateway.render import DONE, Data
from kvgate.gateway.routes import validated
from kvgate.gateway.settings import Settings
from kvgate.runtime.engine import Engine
from kvgate.runtime.errors import ServerError
from kvgate.types import ChatCompletion, Document, Reuse

T = TypeVar("T")


class LLM(_Base[ChatCompletion, "LLMStream"]):
    """A model and its KV caches in this process. `settings`: a `kvgate.Settings` (default: defaults,
    the KVGATE_CONFIG file and KVGATE_* environment, as `kvgate serve`, then `overrides`).
    `tenant` scopes its documents and programs, as an API key's tenant does on a server."""

    def __init__(self, settings: Settings | None = None, *, tenant: str = "local", **overrides: Any) -> None:
        self.settings = settings if settings is not None else Settings.load(**overrides)
        self.tenant = tenant
        self.engine = Engine(self.settings.engine_config())
        self.backend = Local(self.settings, self.engine)
        super().__init__("in-process", None, None, self.backend.name)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvgate-llm", daemon=True)
        self._thread.start()
        self.documents = LLMDocuments(self)

    def _run(self, work: Coroutine[Any, Any, T]) -> T:
        """Run on the LLM's event loop; the gateway's errors become the SDK's."""
        try:
            return asyncio.run_coroutine_threadsafe(work, self._loop).result()
        except ServerError as exc:
            error = internal(exc)
            raise error_for(error.status, error.body(), error.headers) from None

    def _chat(self, model: str | None, body: dict[str, Any]) -> ChatCompletion | LLMStream:
        body = {**body, "model": model or self.model}
        try:
            parsed = validated(ChatCompletionRequest, body, strict=True)
        except APIError as exc:
            raise error_for(exc.status, exc.body()) from None
        if not self.backend.serves(body["model"]):
            raise error_for(404, {"error": {"message": f"this LLM runs `{self.model}`", "param": "model"}})
        try:
            program = program_of(None, body)
        except APIError as exc:
            raise error_for(exc.status, exc.body()) from None
        call = Call.of(
            "/v1/chat/completions", body, parsed, tenant=self.tenant, request_id=uuid.uuid4().hex, program=program
        )
        reply = self._run(self.backend.generate(call))
        if not reply.streamed:
            return ChatCompletion(reply.json(), Reuse.from_headers(reply.headers))
        return LLMStream(self, reply)

    def close(self) -> None:
        """Stop the engine (writes still queued for lower tiers land first) and the event loop."""
        self._run(self.backend.close())
        self.engine.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class LLMDocuments:
    """`llm.documents`: as a `Client`'s, the tenant's documents kept by this LLM's own engine."""

    def __init__(self, llm: LLM) -> None:
        self._llm = llm

    @overload
    def add(self, text: str) -> Document: ...
    @overload
    def add(self, text: list[str]) -> list[Document]: ...
    def add(self, text: str | list[str]) -> Document | list[Document]:
        if isinstance(text, list):
            return [self.add(t) for t in text]
        if not isinstance(text, str) or not text:
            raise error_for(400, {"error": {"message": "a document needs a non-empty text", "param": "text"}})
        return Document.from_json(self._llm._run(self._llm.backend.keep_document(text, self._llm.tenant)))

    def get(self, id: str) -> Document:
        return Document.from_json(self._llm._run(self._llm.backend.find_document(id, self._llm.tenant)))

    def delete(self, id: str) -> None:
        self._llm._run(self._llm.backend.forget_document(id, self._llm.tenant))


class LLMStream:
    """A streamed chat completion from an `LLM`: chunk dicts as the server's SSE carries them, with
    `reuse` known at once (the prompt is prefilled before the stream starts), `text`, `finish_reason`
    and `usage` as they arrive."""

    def __init__(self, llm: LLM, reply: Reply) -> None:
        self._llm, self._reply, self._chunks = llm, reply, reply.data()
        self.reuse = Reuse.from_headers(reply.headers)
        self.text = ""
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self._closed = False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        try:
            while (chunk := self._llm._run(_next(self._chunks))) is not None:
                if chunk == DONE:
                    return
                assert isinstance(chunk, dict)
                if "error" in chunk:
                    raise error_for(500, chunk)
                for choice in chunk.get("choices") or ():
                    if choice.get("index", 0) == 0:
                        self.text += (choice.get("delta") or {}).get("content") or ""
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
                self.usage = chunk.get("usage") or self.usage
                yield chunk
        finally:
            self.close()

    def close(self) -> None:
        """Let go of the engine's sequences (a stream left early stops generating)."""
        if not self._closed:
            self._closed = True
            self._llm._run(self._chunks.aclose())  # type: ignore[attr-defined]
            if self._reply.close is not None:
                self._llm._run(self._reply.close())

    def __enter__(self) -> LLMStream:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


async def _next(chunks: AsyncIterator[Data]) -> Data | None:
    return await anext(chunks, None)
