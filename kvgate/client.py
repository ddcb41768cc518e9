"""`Client` and `AsyncClient`: kvgate's REST API over httpx, with documents and reuse reports.

with kvgate.Client("http://127.0.0.1:8000") as client:
    doc = client.documents.add("Thomas Nabbes was an English dramatist...")
    reply = client.chat("Where was Nabbes educated?", documents=[doc], max_tokens=32)
    print(reply.text, reply.reuse.reused_tokens)
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, Generic, Literal, TypeVar, cast, overload
from urllib.parse import quote

import httpx

from kvgate.errors import KVGateError, error_for
from kvgate.streams import AsyncChatStream, ChatStream, _transport
from kvgate.types import ChatCompletion, Document, Reuse

__all__ = ["AsyncChatStream", "AsyncClient", "ChatStream", "Client"]

Messages = str | Sequence[Mapping[str, Any]]
DocumentLike = str | Document | Mapping[str, Any]


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError as exc:
        raise KVGateError(f"expected JSON from {response.request.url}, got {response.text[:200]!r}") from exc


def _document_ref(doc: DocumentLike) -> dict[str, Any]:
    if isinstance(doc, str):
        return {"text": doc}
    if isinstance(doc, Document):
        return {"id": doc.id}
    if isinstance(doc, Mapping):
        return dict(doc)  # {"text"} or {"id"}; the server says which field is wrong
    raise TypeError(f"a document is a str, a Document or a dict with 'text' or 'id', not {type(doc).__name__}")


C = TypeVar("C")  # what chat returns: ChatCompletion, or an awaitable of it
S = TypeVar("S")  # what chat(stream=True) returns: ChatStream, or an awaitable AsyncChatStream


class _Base(Generic[C, S]):
    """What the sync and async clients share: configuration, chat's signature and its body."""

    def __init__(
        self, base_url: str, api_key: str | None, headers: Mapping[str, str] | None, model: str | None
    ) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.api_key = api_key
        self.model = model  # None until the first request looks it up
        self._headers = {"accept": "application/json", **(headers or {})}
        if api_key is not None:
            self._headers["authorization"] = f"Bearer {api_key}"

    def _url(self, path: str) -> str:
        return f"{self.base_url}/v1{path}"

    @staticmethod
    def _first_model(response: httpx.Response) -> str:
        listing = _json(response)
        data = listing.get("data") if isinstance(listing, dict) else None
        if not data:
            raise KVGateError("GET /v1/models listed no model; pass model= to the client")
        return str(data[0]["id"])

    @overload
    def chat(
        self,
        messages: Messages,
        *,
        model: str | None = None,
        documents: Sequence[DocumentLike] | None = None,
        program: str | None = None,
        reuse: str | None = None,
        recompute_ratio: float | None = None,
        cache: bool | None = None,
        stream: Literal[False] = False,
        **openai_fields: Any,
    ) -> C: ...
    @overload
    def chat(
        self,
        messages: Messages,
        *,
        model: str | None = None,
        documents: Sequence[DocumentLike] | None = None,
        program: str | None = None,
        reuse: str | None = None,
        recompute_ratio: float | None = None,
        cache: bool | None = None,
        stream: Literal[True],
        **openai_fields: Any,
    ) -> S: ...
    def chat(
        self,
        messages: Messages,
        *,
        model: str | None = None,
        documents: Sequence[DocumentLike] | None = None,
        program: str | None = None,
        reuse: str | None = None,
        recompute_ratio: float | None = None,
        cache: bool | None = None,
        stream: bool = False,
        **openai_fields: Any,
    ) -> C | S:
        """POST /v1/chat/completions. `messages`: a str (one user turn) or OpenAI message dicts;
        `documents`: texts, `Document`s or {"text"}/{"id"} dicts; `program`, `reuse`,
        `recompute_ratio`, `cache`: kvgate's options; any other OpenAI field goes in the body as given.
        Streamed: the response is opened now, so an error status raises here."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        body: dict[str, Any] = {"messages": [dict(m) for m in messages], **openai_fields}
        if documents is not None:
            body["documents"] = [_document_ref(d) for d in documents]
        options = {"program_id": program, "reuse": reuse, "recompute_ratio": recompute_ratio, "cache": cache}
        # Only the options given: kvgate tells an unset reuse mode from an explicit one.
        kvgate = {**(openai_fields.get("kvgate") or {}), **{k: v for k, v in options.items() if v is not None}}
        if kvgate:
            body["kvgate"] = kvgate
        if stream:
            body["stream"] = True
        return cast("C | S", self._chat(model, body))

    def _chat(self, model: str | None, body: dict[str, Any]) -> Any:
        """Send `body` with its model; the completion, or the stream when body["stream"]."""
        raise NotImplementedError


class Client(_Base[ChatCompletion, ChatStream]):
    """kvgate over HTTP. `base_url` may end in /v1 or not; `model=None` uses the server's first model.
    `timeout` (seconds) is the httpx client's; an `http_client` given keeps its own and stays open."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        *,
        timeout: float = 600.0,
        headers: Mapping[str, str] | None = None,
        model: str | None = None,
        http_client: httpx.Client | None = None,
    ) -> None:
        super().__init__(base_url, api_key, headers, model)
        self._owned = http_client is None
        self._http = http_client or httpx.Client(timeout=timeout)
        self.documents = Documents(self)

    def _send(self, method: str, path: str, body: Any = None, *, stream: bool = False) -> httpx.Response:
        with _transport():
            request = self._http.build_request(method, self._url(path), json=body, headers=self._headers)
            response = self._http.send(request, stream=stream)
            if response.is_success:
                return response
            try:
                response.read()
            finally:
                response.close()
        raise error_for(response.status_code, response.content, response.headers)

    def _chat(self, model: str | None, body: dict[str, Any]) -> ChatCompletion | ChatStream:
        if model is None and self.model is None:
            self.model = self._first_model(self._send("GET", "/models"))
        body = {"model": model or self.model, **body}
        response = self._send("POST", "/chat/completions", body, stream=bool(body.get("stream")))
        if body.get("stream"):
            return ChatStream(response)
        return ChatCompletion(_json(response), Reuse.from_headers(response.headers))

    def report_wrong_hit(self, completion_id: str) -> str:
        """POST /v1/cache/feedback: the semantic cache served a wrong answer as `completion_id`; the
        entry is deleted and the cache's error bound learns it. Returns the deleted entry's id."""
        return str(_json(self._send("POST", "/cache/feedback", {"id": completion_id}))["entry"])

    def close(self) -> None:
        if self._owned:
            self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class AsyncClient(_Base[Awaitable[ChatCompletion], Awaitable[AsyncChatStream]]):
    """`Client`'s async twin: `await client.chat(...)`, `await client.documents.add(...)`."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        *,
        timeout: float = 600.0,
        headers: Mapping[str, str] | None = None,
        model: str | None = None,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(base_url, api_key, headers, model)
        self._owned = http_client is None
        self._http = http_client or httpx.AsyncClient(timeout=timeout)
        self.documents = AsyncDocuments(self)

    async def _send(self, method: str, path: str, body: Any = None, *, stream: bool = False) -> httpx.Response:
        with _transport():
            request = self._http.build_request(method, self._url(path), json=body, headers=self._headers)
            response = await self._http.send(request, stream=stream)
            if response.is_success:
                return response
            try:
                await response.aread()
            finally:
                await response.aclose()
        raise error_for(response.status_code, response.content, response.headers)

    async def _chat(self, model: str | None, body: dict[str, Any]) -> ChatCompletion | AsyncChatStream:
        if model is None and self.model is None:
            self.model = self._first_model(await self._send("GET", "/models"))
        body = {"model": model or self.model, **body}
        response = await self._send("POST", "/chat/completions", body, stream=bool(body.get("stream")))
        if body.get("stream"):
            return AsyncChatStream(response)
        return ChatCompletion(_json(response), Reuse.from_headers(response.headers))

    async def report_wrong_hit(self, completion_id: str) -> str:
        """`Client.report_wrong_hit`'s async twin."""
        return str(_json(await self._send("POST", "/cache/feedback", {"id": completion_id}))["entry"])

    async def close(self) -> None:
        if self._owned:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()


class Documents:
    """`client.documents`: documents whose KV kvgate computes now and keeps, to cite by id."""

    def __init__(self, client: Client) -> None:
        self._client = client

    @overload
    def add(self, text: str) -> Document: ...
    @overload
    def add(self, text: list[str]) -> list[Document]: ...
    def add(self, text: str | list[str]) -> Document | list[Document]:
        """POST /v1/documents, once per text."""
        if isinstance(text, str):
            return Document.from_json(_json(self._client._send("POST", "/documents", {"text": text})))
        return [self.add(t) for t in text]

    def get(self, id: str) -> Document:
        return Document.from_json(_json(self._client._send("GET", f"/documents/{quote(id, safe='')}")))

    def delete(self, id: str) -> None:
        self._client._send("DELETE", f"/documents/{quote(id, safe='')}")


class AsyncDocuments:
    """`Documents`' async twin."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    @overload
    async def add(self, text: str) -> Document: ...
    @overload
    async def add(self, text: list[str]) -> list[Document]: ...
    async def add(self, text: str | list[str]) -> Document | list[Document]:
        if isinstance(text, str):
            return Document.from_json(_json(await self._client._send("POST", "/documents", {"text": text})))
        return [await self.add(t) for t in text]

    async def get(self, id: str) -> Document:
        return Document.from_json(_json(await self._client._send("GET", f"/documents/{quote(id, safe='')}")))

    async def delete(self, id: str) -> None:
        await self._client._send("DELETE", f"/documents/{quote(id, safe='')}")
