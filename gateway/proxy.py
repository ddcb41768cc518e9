"""Proxy mode: the OpenAI routes forwarded to upstreams, with the gateway's own parts in front (keys,
limits, the semantic cache, program FCFS, cache-affinity routing over runtime workers). Bodies are
forwarded as they came unless a field must change; SSE events are passed on as each one arrives."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Coroutine
from typing import Any
from urllib.parse import quote

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from kvgate.gateway import semantic
from kvgate.gateway.admission import ProgramClock
from kvgate.gateway.errors import APIError, bad_request
from kvgate.gateway.keys import allow_model
from kvgate.gateway.programs import HEADER, program_of
from kvgate.gateway.protocol import ChatCompletionRequest, CompletionRequest, DocumentRequest
from kvgate.gateway.serving import SSE_HEADERS, account, hang_up, sse
from kvgate.gateway.settings import Settings
from kvgate.gateway.upstreams import Opened, Pool, ProxyConfig, Upstream
from kvgate.semantic_cache import SemanticCache
from pydantic import ValidationError
from pydantic.json_schema import models_json_schema
from starlette.types import Receive, Scope, Send

router = APIRouter()
EVENT_END = re.compile(rb"\r?\n\r?\n")
PASSED_ON = ("content-type", "retry-after")  # and every x-kvgate-* header
DOCUMENT_OWNERS = 65536  # document ids remembered with the worker that stored them


class Front:
    """The gateway over upstreams: what `Served` is over the in-process runtime."""

    def __init__(self, settings: Settings, config: ProxyConfig) -> None:
        self.pool = Pool(config)
        self.semantic = SemanticCache(settings.semantic_cache_config()) if settings.semantic_cache else None
        self.clock = ProgramClock(settings.agent_config().idle_s)
        self.owners: OrderedDict[str, str] = OrderedDict()  # document id -> the affinity key of its text
        self.created = int(time.time())

    def identity(self, model: str) -> dict[str, str]:
        serving = sorted(u.name for u in self.pool.config.upstreams if u.serves(model))  # not by load: stable
        return {"model": model, "upstreams": ",".join(serving)}

    def queued(self) -> int:
        return sum(g.load for g in self.pool.gates.values())

    def remember(self, document_id: str, key: str) -> None:
        self.owners[document_id] = key
        self.owners.move_to_end(document_id)
        if len(self.owners) > DOCUMENT_OWNERS:
            self.owners.popitem(last=False)

    async def close(self) -> None:
        await self.pool.close()


def parse(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("missing required field 'model'", "model", "missing_field")
    return body


def affinity(front: Front, body: dict[str, Any], program: str | None) -> list[str]:
    """What a worker may hold for this request: its program's context, else its documents."""
    if program is not None:
        return ["program:" + program]
    keys = []
    documents = body.get("documents")
    for doc in documents if isinstance(documents, list) else ():  # a malformed one is the upstream's to refuse
        if isinstance(doc, dict) and isinstance(doc.get("id"), str):  # where the text it was stored from went
            keys.append(front.owners.get(doc["id"], doc["id"]))
        elif isinstance(doc, dict) and isinstance(doc.get("text"), str):
            keys.append("text:" + hashlib.sha256(doc["text"].encode()).hexdigest())
    return keys


def headers_for(request: Request, upstream_is_worker: bool, program: str | None) -> dict[str, str]:
    sent = {"x-request-id": request.state.request_id}
    if program is not None:
        sent[HEADER] = program
    if upstream_is_worker:  # a worker scopes its caches by the bearer token: one per tenant
        sent["authorization"] = "Bearer tenant-" + hashlib.sha256(request.state.tenant.encode()).hexdigest()
    return sent


def passed_on(opened: Opened) -> dict[str, str]:
    found = {k: v for k, v in opened.response.headers.items() if k in PASSED_ON or k.startswith("x-kvgate-")}
    return {**found, "x-kvgate-upstream": opened.upstream.name}


async def forward(request: Request, path: str, chat: bool = False) -> Response:
    front: Front = request.app.state.front
    raw = await request.body()
    body = parse(raw)
    model: str = body["model"]
    allow_model(request, model)
    options = body.get("kvgate") if isinstance(body.get("kvgate"), dict) else {}
    program = program_of(request, options.get("program_id"))
    order = front.pool.candidates(model, affinity(front, body, program))
    if not order:
        raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
    cached = semantic.Consult(headers={"x-kvgate-cache": "bypass"})
    if chat and front.semantic is not None:
        cached = await consult(request, front, body)
        if cached.status == "hit":
            head = {"id": f"chatcmpl-{request.state.request_id}", "created": int(time.time()), "model": model}
            return semantic.replay(cached, ChatCompletionRequest.model_validate(body), head)
    stream = body.get("stream") is True
    stream_options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
    asked_usage = stream_options.get("include_usage") is True
    # The tokens of a stream are counted from its usage chunk: asked for here if the client did not.
    changed = stream and not asked_usage
    if changed:
        body["stream_options"] = {**stream_options, "include_usage": True}

    def payload(upstream: Upstream) -> bytes:
        """The body for one upstream: renamed model; kvgate's own options only for kvgate's workers."""
        named = upstream.model_name(model)
        ours = "kvgate" in body and not upstream.worker
        if named == model and not changed and not ours:
            return raw
        sent = {k: v for k, v in body.items() if k != "kvgate" or upstream.worker}
        return json.dumps({**sent, "model": named}).encode()

    tenant_program = None if program is None else f"{request.state.tenant}/{program}"
    opening = front.pool.open(
        order,
        path,
        payload,
        lambda u: headers_for(request, u.worker, program),
        rank=front.clock.rank(tenant_program),
        stream=stream,
    )
    opened = await unless_gone(request, opening)
    relay = Relay(request, front, opened, model, cached, keep_usage=asked_usage)
    sent = passed_on(opened) | cached.headers
    if not stream or opened.response.status_code != 200:
        content = await whole(request, opened)
        await relay.settle_whole(content)
        return Response(content, opened.response.status_code, headers=sent)
    return Streamed(relay, headers=SSE_HEADERS | sent)


async def unless_gone(request: Request, opening: Coroutine[Any, Any, Opened]) -> Opened:
    """The upstream's answer, unless the client hangs up first (while it waits at a full gate, say):
    then the request is withdrawn, never sent."""
    task, watching = asyncio.create_task(opening), asyncio.create_task(hang_up(request))
    try:
        await asyncio.wait({task, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
    if watching.done() and not watching.cancelled():
        task.cancel()
        try:
            opened = await task
        except (asyncio.CancelledError, APIError):
            pass
        else:
            await opened.close()
        raise APIError(499, "the client closed the request")
    return task.result()


async def whole(request: Request, opened: Opened) -> bytes:
    """The rest of an answer that is not streamed; the upstream is let go if the client hangs up."""

    async def read() -> bytes:
        return opened.first + b"".join([c async for c in opened.chunks])

    reading, watching = asyncio.create_task(read()), asyncio.create_task(hang_up(request))
    try:
        await asyncio.wait({reading, watching}, return_when=asyncio.FIRST_COMPLETED)
        if not reading.done():
            reading.cancel()
            raise APIError(499, "the client closed the request")
        return reading.result()
    except httpx.HTTPError as exc:
        raise failed(opened, exc, "mid-answer") from exc
    finally:
        watching.cancel()
        await opened.close()


def failed(opened: Opened, exc: httpx.HTTPError, where: str) -> APIError:
    """An upstream that failed after its first bytes (`where`: mid-answer, mid-stream): nothing is
    retried, the client is told."""
    status = 504 if isinstance(exc, httpx.TimeoutException) else 502
    said = f"upstream {opened.upstream.name} failed {where}: {type(exc).__name__}"
    return APIError(status, said, code="upstream_error")


async def consult(request: Request, front: Front, body: dict[str, Any]) -> semantic.Consult:
    """The semantic cache for a chat request it may answer; a body it cannot read is the upstream's to judge."""
    options = body.get("kvgate") if isinstance(body.get("kvgate"), dict) else {}
    if not (options.get("cache") is True or (options.get("cache") is None and body.get("temperature") == 0)):
        return semantic.Consult(headers={"x-kvgate-cache": "bypass"})
    try:
        parsed = ChatCompletionRequest.model_validate(body)
        messages = [m.for_template(i) for i, m in enumerate(parsed.messages)]
    except (ValidationError, APIError):
        return semantic.Consult(headers={"x-kvgate-cache": "bypass"})
    identity = front.identity(parsed.model)
    return await semantic.consult(request, front.semantic, identity, front.queued(), parsed, messages)


class Relay:
    """An upstream's answer on its way to the client: a whole one read at once; a stream passed on
    event by event, its usage chunk read (and dropped if the client did not ask for it), an upstream
    failing mid-stream ending it with an error event. Then tokens are counted and the answer kept."""

    def __init__(
        self,
        request: Request,
        front: Front,
        opened: Opened,
        model: str,
        cached: semantic.Consult,
        keep_usage: bool,
    ) -> None:
        self.request, self.front, self.opened = request, front, opened
        self.model, self.cached, self.keep_usage = model, cached, keep_usage
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] = {}
        self.done = False

    async def events(self) -> AsyncIterator[bytes]:
        buffer = self.opened.first
        try:
            async for chunk in self.opened.chunks:
                buffer += chunk
                *whole, buffer = EVENT_END.split(buffer)
                for event in whole:
                    if self.read(event):
                        yield event + b"\n\n"
            for event in EVENT_END.split(buffer):
                if event.strip() and self.read(event):
                    yield event + b"\n\n"
        except httpx.HTTPError as exc:
            yield sse(failed(self.opened, exc, "mid-stream").body()).encode()
            yield sse("[DONE]").encode()
            return
        finally:
            await self.opened.close()
        await self.settle()

    def read(self, event: bytes) -> bool:
        """Note what an event says; whether to pass it on."""
        if not event.startswith(b"data:") or event.endswith(b"[DONE]"):
            self.done = self.done or event.endswith(b"[DONE]")
            return bool(event.strip())
        if not self.cached.store and b'"usage"' not in event:
            return True
        try:
            chunk = json.loads(event[5:])
        except ValueError:
            return True
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
            if not chunk.get("choices"):
                return self.keep_usage
        for choice in chunk.get("choices") or ():
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                self.text.append((choice.get("delta") or {}).get("content") or "")
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return True

    async def settle_whole(self, content: bytes) -> None:
        if self.opened.response.status_code != 200:
            return
        try:
            answer = json.loads(content)
        except ValueError:
            return
        if not isinstance(answer, dict):
            return
        self.usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
        choice = (answer.get("choices") or [{}])[0]
        if isinstance(choice, dict):
            self.text = [(choice.get("message") or {}).get("content") or ""]
            self.finish_reason, self.done = choice.get("finish_reason"), True
        await self.settle()

    async def settle(self) -> None:
        await account(self.request, self.model, self.usage)
        if self.done:
            await semantic.keep(self.front.semantic, self.cached, "".join(self.text), self.finish_reason, self.usage)


class Streamed(StreamingResponse):
    """A relayed stream whose upstream is closed even when the client left before it started."""

    def __init__(self, relay: Relay, headers: dict[str, str]) -> None:
        super().__init__(relay.events(), headers=headers, media_type="text/event-stream")
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.opened.close()


async def send_document(request: Request, method: str, path: str, keys: list[str]) -> Response:
    """A document request, sent where its KV lives (or will): the worker its text hashes to. Only
    kvgate's own workers keep documents; a document's text never goes to another upstream."""
    front: Front = request.app.state.front
    order = [u for u in front.pool.candidates(None, keys) if u.worker]
    if not order:
        raise APIError(404, "documents are kept by kvgate's runtime workers; this gateway has none", code="no_workers")
    raw = await request.body() if method == "POST" else b""
    opened = await front.pool.open(order, path, lambda _: raw, lambda u: headers_for(request, u.worker, None), method)
    return Response(await whole(request, opened), opened.response.status_code, headers=passed_on(opened))


@router.post("/v1/documents")
async def store_document(request: Request) -> Response:
    try:
        text = json.loads(await request.body()).get("text")
    except (ValueError, AttributeError):
        text = None
    if not isinstance(text, str) or not text:
        raise bad_request("the body must be a JSON object with a non-empty 'text'", "text")
    key = "text:" + hashlib.sha256(text.encode()).hexdigest()
    response = await send_document(request, "POST", "/v1/documents", [key])
    if response.status_code == 200:
        request.app.state.front.remember(json.loads(response.body)["id"], key)
    return response


async def by_id(request: Request, document_id: str) -> Response:
    front: Front = request.app.state.front
    path = "/v1/documents/" + quote(document_id, safe="")  # as it came: never a path of another route
    return await send_document(request, request.method, path, [front.owners.get(document_id, document_id)])


@router.get("/v1/documents/{document_id}")
async def show_document(document_id: str, request: Request) -> Response:
    return await by_id(request, document_id)


@router.delete("/v1/documents/{document_id}")
async def delete_document(document_id: str, request: Request) -> Response:
    return await by_id(request, document_id)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await forward(request, "/v1/chat/completions", chat=True)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await forward(request, "/v1/completions")


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    return await forward(request, "/v1/embeddings")


BODIES = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/documents": DocumentRequest,
}


def with_bodies(schema: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI schema of proxy mode with its request bodies: the routes read them raw (they are
    forwarded as they came), so FastAPI declares none; they are the OpenAI bodies kvgate reads itself."""
    _, defs = models_json_schema(
        [(model, "validation") for model in BODIES.values()], ref_template="#/components/schemas/{model}"
    )
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
    for path, model in BODIES.items():
        content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}
        schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": content}
    return schema


def card(model: str, front: Front) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": front.created, "owned_by": "kvgate-proxy"}


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    front: Front = request.app.state.front
    return {"object": "list", "data": [card(m, front) for m in front.pool.models()]}


@router.get("/v1/models/{model:path}")
async def model(model: str, request: Request) -> JSONResponse:
    front: Front = request.app.state.front
    if model not in front.pool.models():
        raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
    return JSONResponse(card(model, front))
