"""The OpenAI routes, one set for every backend: read and check the request, the semantic cache in
front, the backend's answer passed on (whole or as SSE), then tokens counted and the answer kept."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.background import BackgroundTask
from starlette.types import Receive, Scope, Send

from kvgate.gateway import semantic, tracing
from kvgate.gateway.backend import Backend, Call, Reply
from kvgate.gateway.errors import APIError, bad_request, from_validation
from kvgate.gateway.keys import allow_model, spend
from kvgate.gateway.messages_output import anthropic_client, model_info, model_page
from kvgate.gateway.programs import HEADER, program_of
from kvgate.gateway.protocol import ChatCompletionRequest, CompletionRequest, DocumentRequest, FeedbackRequest
from kvgate.gateway.render import SSE_HEADERS
from kvgate.gateway.responses_protocol import ResponsesRequest
from kvgate.runtime.errors import ServerError

router = APIRouter()
log = logging.getLogger("kvgate")
T = TypeVar("T")


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await answer(request, "/v1/chat/completions", ChatCompletionRequest)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await answer(request, "/v1/completions", CompletionRequest)


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    return await answer(request, "/v1/embeddings", None)


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    """vLLM's /tokenize, for a chat (its messages, tools and documents): the count of the prompt's tokens as
    the model reads it, nothing generated (the token ids themselves are not given)."""
    raw = await request.body()
    body = read(raw, model=True)
    parsed = validated(ChatCompletionRequest, body, strict=True)
    check_model(request, body["model"])
    backend: Backend = request.app.state.backend
    call = Call.of("/tokenize", body, parsed, tenant=request.state.tenant, request_id=request.state.request_id, raw=raw)
    return {"count": await backend.count_tokens(call)}


@router.post("/v1/cache/feedback")
async def cache_feedback(request: Request) -> dict[str, Any]:
    """The caller says a semantic-cache hit was wrong, by the completion's id: the error bound learns
    it and the entry is deleted. Only the tenant that was served the hit may report it."""
    body = validated(FeedbackRequest, read(await request.body()), strict=True)
    assert isinstance(body, FeedbackRequest)
    cache = request.app.state.semantic
    if cache is None:
        raise APIError(404, "the semantic cache is off (semantic_cache.enabled: false)", code="semantic_cache_off")
    entry = await asyncio.to_thread(cache.report, body.id, request.state.tenant)
    if entry is None:
        raise APIError(404, f"no recent semantic-cache hit with id {body.id!r} for this key", "id", "hit_not_found")
    return {"object": "cache.feedback", "id": body.id, "entry": entry, "deleted": True}


@router.post("/v1/documents")
async def add_document(request: Request) -> Response:
    raw = await request.body()
    document = validated(DocumentRequest, read(raw), strict=True)
    assert isinstance(document, DocumentRequest)
    backend: Backend = request.app.state.backend
    allow_model(request, *backend.document_models())  # computing a document's KV runs the model
    reply = await backend.add_document(document.text, raw, request.state.tenant, request.state.request_id)
    if reply.status == 200:
        await spend(request, tokens_of(reply))
    return Response(reply.body(), reply.status, headers=reply.headers)


def tokens_of(card: Reply) -> int:
    """The tokens of a stored document, from its card (what its KV cost, as a prompt's tokens do)."""
    try:
        tokens = card.json().get("tokens")
    except APIError:
        return 0
    return tokens if isinstance(tokens, int) else 0


@router.get("/v1/documents/{document_id}")
async def show_document(document_id: str, request: Request) -> Response:
    return await by_id(request, document_id)


@router.delete("/v1/documents/{document_id}")
async def delete_document(document_id: str, request: Request) -> Response:
    return await by_id(request, document_id)


async def by_id(request: Request, document_id: str) -> Response:
    backend: Backend = request.app.state.backend
    reply = await backend.document(request.method, document_id, request.state.tenant, request.state.request_id)
    return Response(reply.body(), reply.status, headers=reply.headers)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    """OpenAI's list, or Anthropic's for its clients (both SDKs call this path)."""
    cards, anthropic = request.app.state.backend.models(), anthropic_client(request.headers)
    return model_page(cards, request.query_params) if anthropic else {"object": "list", "data": cards}


@router.get("/v1/models/{model:path}")
async def model(model: str, request: Request) -> JSONResponse:
    backend: Backend = request.app.state.backend
    card = backend.card(model)
    if card is None:
        raise not_served(backend, model)
    return JSONResponse(model_info(card) if anthropic_client(request.headers) else card)


def not_served(backend: Backend, model: str) -> APIError:
    names = [c["id"] for c in backend.models()]
    serving = f"; this server serves `{names[0]}`" if len(names) == 1 else ""
    return APIError(404, f"The model `{model}` does not exist{serving}.", "model", "model_not_found")


BODIES = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/documents": DocumentRequest,
    "/v1/responses": ResponsesRequest,
}


def with_bodies(schema: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI schema with the request bodies: the routes read them raw (a proxy forwards them
    as they came), so FastAPI declares none; they are the OpenAI bodies kvgate reads itself."""
    _, defs = models_json_schema(
        [(model, "validation") for model in BODIES.values()], ref_template="#/components/schemas/{model}"
    )
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
    for path, model in BODIES.items():
        content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}
        schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": content}
    return schema


def read(raw: bytes, model: bool = False) -> dict[str, Any]:
    if not raw.strip():
        raise bad_request("the request body is missing; send a JSON object")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if model and not (isinstance(body.get("model"), str) and body["model"]):
        raise bad_request("missing required field 'model'", "model", "missing_field")
    return body


def validated(kind: type[BaseModel] | None, body: dict[str, Any], strict: bool) -> Any:
    """The body read by kvgate's protocol: a clear 400 when `strict`, else None (an upstream judges)."""
    if kind is None:
        return None
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        if not strict:
            return None
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise from_validation(RequestValidationError(errors)) from None


async def answer(request: Request, path: str, kind: type[BaseModel] | None) -> Response:
    backend: Backend = request.app.state.backend
    raw = await request.body()
    body = read(raw, model=True)
    parsed = validated(kind, body, strict=backend.validates)
    model: str = body["model"]
    check_model(request, model)
    program = program_of(request.headers.get(HEADER), body)
    tenant, request_id = request.state.tenant, request.state.request_id
    call = Call.of(path, body, parsed, tenant=tenant, request_id=request_id, program=program, raw=raw)
    return await passed_on(request, await generate(request, call))


def check_model(request: Request, model: str) -> None:
    """The key may use `model` (403) and it is served here (404)."""
    backend: Backend = request.app.state.backend
    allow_model(request, model)
    if not backend.serves(model):
        raise not_served(backend, model)


@dataclass
class Generated:
    """A call's answer: the backend's reply, or the semantic cache's (`hit`: nothing was generated,
    nothing is counted or kept). `looking`: the lookup, when it ran beside the backend and lost."""

    call: Call
    cached: semantic.Consult
    reply: Reply
    hit: bool = False
    looking: asyncio.Task[semantic.Consult] | None = None

    @property
    def headers(self) -> dict[str, str]:
        return self.reply.headers | self.cached.headers


async def generate(request: Request, call: Call) -> Generated:
    """The semantic cache in front of the backend: a hit replayed, else the backend's reply.

    With `semantic_cache.race`, the backend starts at once and the lookup runs beside it: a hit found first
    withdraws the backend's answer; an answer that comes first is served, and the lookup only decides
    what is learnt and kept afterwards. A miss then waits for no embedding."""
    backend: Backend = request.app.state.backend
    cache = request.app.state.semantic
    tracing.note({"gen_ai.request.model": call.model, "kvgate.stream": call.stream})
    cached = semantic.Consult(headers={"x-kvgate-cache": "bypass"})
    if isinstance(call.parsed, ChatCompletionRequest):
        cached = semantic.plan(request, cache, backend.identity(call.model), call.parsed)
    call = replace(call, keep=cached.store)
    if cached.status != "look":
        return Generated(call, cached, await unless_gone(request, backend.generate(call)))
    if not request.app.state.settings.semantic_cache.race:
        cached = await semantic.look(request, cache, cached, backend.queued())
        if cached.status == "hit":
            return served(request, call, cached)
        return Generated(call, cached, await unless_gone(request, backend.generate(call)))
    looking = asyncio.create_task(semantic.look(request, cache, cached, backend.queued()))
    answering = asyncio.create_task(unless_gone(request, backend.generate(call)))
    try:
        await asyncio.wait({looking, answering}, return_when=asyncio.FIRST_COMPLETED)
        if looking.done() and not looking.exception():
            cached = looking.result()
            if cached.status == "hit":
                await withdraw(answering)
                return served(request, call, cached)
        return Generated(call, cached, await answering, looking=looking)
    except BaseException:
        looking.cancel()
        await withdraw(answering)
        raise


def served(request: Request, call: Call, cached: semantic.Consult) -> Generated:
    """A hit, replayed; a would-be hit checked beside it is offered to the background checks."""
    cache = request.app.state.semantic
    replayed = semantic.replay(cache, cached, call.parsed, call.model, call.request_id)
    if cached.found is not None and cached.found.verify:
        request.app.state.checks.offer(request.app.state.backend, cache, call, cached.found)
    return Generated(call, cached, as_reply(replayed), hit=True)


async def withdraw(answering: asyncio.Task[Reply]) -> None:
    """A backend's answer no longer wanted: stopped, or let go if it had begun."""
    answering.cancel()
    try:
        reply = await answering
    except (asyncio.CancelledError, ServerError):
        return
    if reply.close is not None:
        await reply.close()


def as_reply(response: Response) -> Reply:
    """A replayed hit as a backend's reply: its JSON, or its SSE events."""
    if not isinstance(response, StreamingResponse):
        return Reply(response.status_code, {"content-type": "application/json"}, content=bytes(response.body))

    async def events() -> AsyncIterator[bytes]:
        async for event in response.body_iterator:
            yield event if isinstance(event, bytes) else str(event).encode()

    return Reply(events=events())


async def passed_on(request: Request, got: Generated) -> Response:
    """The answer as it came: whole (counted and kept first), or relayed event by event. After a race
    (a lookup still running beside the answer) it is kept once it has gone out."""
    if not got.reply.streamed:
        await settle(request, got)
        after = BackgroundTask(keep, request, got) if got.looking is not None else None
        return Response(got.reply.body(), got.reply.status, headers=got.headers, background=after)
    return Relayed(relay(request, got, got.reply.sse(), ends), got.reply, headers=SSE_HEADERS | got.headers)


def ends(event: bytes) -> bool:
    return event.startswith(b"data: [DONE]")


async def relay(
    request: Request, got: Generated, events: AsyncIterator[T], last: Callable[[T], bool]
) -> AsyncIterator[T]:
    """A stream's events (its SSE bytes, or its data) passed on one by one; counted and kept before the
    `last` goes out (after a race, kept after it)."""
    settled = False
    async for event in events:
        if last(event) and not settled:
            settled = True
            await settle(request, got)
        yield event
    if not settled:
        await settle(request, got)
    if got.looking is not None:
        await keep(request, got)


async def settle(request: Request, got: Generated) -> None:
    """A finished answer in the metrics, its tokens against the key's limit, and kept in the semantic
    cache, unless a lookup still runs beside it (a race: kept after the answer went out)."""
    if got.hit:
        return
    outcome = got.reply.outcome
    metrics = request.app.state.metrics
    metrics.usage(got.call.model, outcome.usage)
    metrics.reuse(outcome.report)
    metrics.stages(request.scope, outcome.stages)
    tracing.settled(outcome.report, outcome.usage, outcome.stages)
    await spend(request, outcome.usage.get("total_tokens") or 0)
    if got.looking is None:
        await keep(request, got)


async def keep(request: Request, got: Generated) -> None:
    """An answer that ended as it should, kept in the semantic cache (after the lookup that ran beside
    it, if any: what it found decides what is learnt)."""
    if got.hit or not got.reply.outcome.done:
        return
    cached = got.cached
    if got.looking is not None:
        try:
            cached = await got.looking
        except Exception:
            log.warning("semantic cache: the lookup beside request %s failed", got.call.request_id, exc_info=True)
            return
    await semantic.keep(request.app.state.semantic, cached, got.reply.outcome)


class Relayed(StreamingResponse):
    """A streamed reply whose backend lets go (an upstream's connection, the engine's sequences) even
    when the client left before the stream started."""

    def __init__(self, events: AsyncIterator[bytes], reply: Reply, headers: dict[str, str]) -> None:
        super().__init__(events, headers=headers, media_type="text/event-stream")
        self.reply = reply

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.reply.close is not None:
                await self.reply.close()


async def unless_gone(request: Request, answering: Coroutine[Any, Any, Reply]) -> Reply:
    """The backend's reply, unless the client hangs up first (while its request waits in a queue or
    its whole answer is generated): then the work is withdrawn, 499. Cancelled, it withdraws it too."""
    task, watching = asyncio.create_task(answering), asyncio.create_task(hang_up(request))
    try:
        await asyncio.wait({task, watching}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await withdraw(task)
        raise
    finally:
        watching.cancel()
    if watching.done() and not watching.cancelled():
        await withdraw(task)
        raise APIError(499, "the client closed the request")
    return task.result()


async def hang_up(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
