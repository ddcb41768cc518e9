"""/v1/responses (OpenAI's Responses API, as the openai SDK and the OpenAI Agents SDK call it), answered
through chat completions, so every backend serves it: the request becomes a chat completion body
(gateway/responses_protocol.py), which goes the chat route's way (semantic cache, backend, accounting),
and its answer, whole or streamed, becomes a Response (gateway/responses_output.py) or the Responses
stream (gateway/responses_stream.py).

Responses are kept (unless `store` is false) for `previous_response_id` and GET/DELETE, per tenant, in
Redis when `redis_url` is set (a turn may continue through any front); their input and output items too,
for `item_reference`s in the input and GET /v1/responses/{id}/input_items (gateway/responses_items.py).
A chain of responses is one agent program, so its KV stays pinned between turns: the program of the
response it continues, whether named by `previous_response_id` or by items of it in the input, sent
back whole (the Agents SDK sends the whole conversation each turn) or referred to by id (the AI SDK)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvgate.gateway.backend import Call, Reply
from kvgate.gateway.errors import APIError, bad_request
from kvgate.gateway.programs import HEADER, program_of
from kvgate.gateway.protocol import ChatCompletionRequest
from kvgate.gateway.render import DONE, SSE_HEADERS, Data, dumps
from kvgate.gateway.responses_items import Input, kept, listing, page, resolved
from kvgate.gateway.responses_output import answered, new_id, skeleton
from kvgate.gateway.responses_protocol import ResponsesRequest, chat_body, messages_of, refuse_unsupported
from kvgate.gateway.responses_store import ResponseStore, Stored
from kvgate.gateway.responses_stream import ResponsesTranslator
from kvgate.gateway.routes import Generated, Relayed, check_model, generate, read, relay, settle, validated

router = APIRouter()
CHAT = "/v1/chat/completions"  # the route every response is answered through
JSON = {"content-type": "application/json"}
# Chat fields as the Responses request names them (the name, and what chat nests that Responses does
# not), in errors the chat body's validation finds. The messages are the stored conversation and the
# input together: an index would not be the input's, so they are "input" alone.
RENAMED = {
    "max_tokens": ("max_output_tokens", ""),
    "response_format": ("text.format", "json_schema."),
    "tools": ("tools", "function."),
}


@dataclass
class ResponseTurn:
    """One response in the making: the conversation it answers and the agent program it runs in."""

    id: str
    req: ResponsesRequest
    tenant: str
    messages: list[dict[str, Any]]  # chat messages: the conversation before it, then its input
    inputs: list[dict[str, Any]]  # its input items, each with its id
    program: str | None
    store: ResponseStore

    async def keep(self, done: dict[str, Any]) -> None:
        """The finished response kept for the next turn (unless `store` is false)."""
        if self.req.store:
            output = messages_of(done["output"], "output")
            await self.store.put(self.tenant, Stored(done, self.messages + output, self.program, self.inputs))


@router.post("/v1/responses")
async def create(request: Request) -> Response:
    body = read(await request.body(), model=True)
    req: ResponsesRequest = validated(ResponsesRequest, body, strict=True)
    refuse_unsupported(req)
    check_model(request, req.model)
    turn = await begin(request, req, body)
    chat = chat_body(req, body, turn.messages)
    parsed = chat_request(chat)
    call = Call.of(CHAT, chat, parsed, tenant=turn.tenant, request_id=request.state.request_id, program=turn.program)
    got = await generate(request, call)
    response = skeleton(req, turn.id, req.model)
    if got.reply.status != 200:  # an upstream's refusal, passed on as it came
        return Response((await whole(request, got)).body(), got.reply.status, headers=got.headers)
    if not got.reply.streamed:
        done = answered(response, (await whole(request, got)).json())
        await turn.keep(done)
        return Response(dumps(done), headers=plain(got.headers) | JSON)
    events = ResponsesTranslator(response, turn.keep).events(data(request, got))
    return Relayed(events, got.reply, headers=SSE_HEADERS | plain(got.headers))


@router.get("/v1/responses/{response_id}")
async def show(response_id: str, request: Request) -> Response:
    stored = await request.app.state.responses.get(request.state.tenant, response_id)
    if stored is None:
        raise not_found(response_id)
    return Response(dumps(stored.response), headers=JSON)


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(response_id: str, request: Request) -> Response:
    query = request.query_params
    asked = listing(query, query.getlist("include") + query.getlist("include[]"))
    stored = await request.app.state.responses.get(request.state.tenant, response_id)
    if stored is None:
        raise not_found(response_id)
    return Response(dumps(page(stored.inputs, asked)), headers=JSON)


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, request: Request) -> Response:
    if not await request.app.state.responses.delete(request.state.tenant, response_id):
        raise not_found(response_id)
    return Response(dumps({"id": response_id, "object": "response", "deleted": True}), headers=JSON)


async def begin(request: Request, req: ResponsesRequest, body: dict[str, Any]) -> ResponseTurn:
    """The turn a request asks for: the conversation so far and its input, in the program the client
    names, else that of the chain it continues; a new conversation (kept) starts a chain of its own;
    a history from elsewhere gets none here (the local backend finds a conversation by its messages)."""
    store: ResponseStore = request.app.state.responses
    tenant, response_id = request.state.tenant, new_id("resp")
    given = await resolved(store, tenant, req.input)
    before, program = await history(store, tenant, req, given)
    messages = before + messages_of(given.items)
    if not messages:
        raise bad_request("input must not be empty (without a previous_response_id)", "input", "invalid_value")
    program = program_of(request.headers.get(HEADER), body) or program
    if program is None and req.store and not has_history(messages):
        program = chain(response_id)
    return ResponseTurn(response_id, req, tenant, messages, kept(given.items), program, store)


async def history(
    store: ResponseStore, tenant: str, req: ResponsesRequest, given: Input
) -> tuple[list[dict[str, Any]], str | None]:
    """The conversation before this request's input, and the program of its chain: those of
    `previous_response_id` (404 when unknown); else the input holds the conversation, and the chain
    is that of the latest kept item in it, if any."""
    if req.previous_response_id is None:
        return [], given.program
    before = await store.get(tenant, req.previous_response_id)
    if before is None:
        said = f"Previous response with id '{req.previous_response_id}' not found."
        raise APIError(404, said, "previous_response_id", "previous_response_not_found")
    return before.messages, before.program


def has_history(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] in ("assistant", "tool") for m in messages)


def chain(response_id: str) -> str:
    """The program id of a chain that starts with this response."""
    return "responses:" + response_id.removeprefix("resp_")


def chat_request(chat: dict[str, Any]) -> ChatCompletionRequest:
    """The chat body read as the chat route reads it; its errors name the Responses fields."""
    try:
        return validated(ChatCompletionRequest, chat, strict=True)
    except APIError as exc:
        said, (head, _, rest) = exc.param or "", (exc.param or "").partition(".")
        if head == "messages":
            raise exc.named("input", exc.message) from exc
        if head in RENAMED:
            name, nested = RENAMED[head]
            param = ".".join(p for p in (name, rest.replace(nested, "", 1) if nested else rest) if p)
            raise exc.named(param, exc.message.replace(f"'{said}'", f"'{param}'")) from exc
        raise


async def whole(request: Request, got: Generated) -> Reply:
    """A whole answer, counted and kept first as the chat route does."""
    await settle(request, got)
    return got.reply


def data(request: Request, got: Generated) -> AsyncIterator[Data]:
    """A stream's data, counted and kept before its DONE as the chat route does."""
    return relay(request, got, got.reply.data(), lambda d: d == DONE)


def plain(headers: dict[str, str]) -> dict[str, str]:
    """The chat reply's headers but those of its body (whose type and length are the response's)."""
    return {k: v for k, v in headers.items() if k.lower() not in ("content-type", "content-length")}


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", code="response_not_found")
