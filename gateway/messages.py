"""/v1/messages (Anthropic's Messages API, as the anthropic SDK, Claude Code and the frameworks'
Anthropic clients call it), answered through chat completions, so every backend serves it: the
request becomes a chat completion body (gateway/messages_protocol.py), which goes the chat route's
way (keys, the semantic cache, the backend, accounting; programs without markup, documents), and its
answer, whole or streamed, becomes a Message (gateway/messages_output.py). Errors are in Anthropic's
shape (gateway/errors.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvgate.gateway.backend import Backend, Call, Reply
from kvgate.gateway.errors import APIError
from kvgate.gateway.messages_output import MessagesTranslator, message_of, new_id, skeleton
from kvgate.gateway.messages_protocol import CountRequest, MessagesRequest, chat_body, refuse_unsupported
from kvgate.gateway.programs import HEADER, program_of
from kvgate.gateway.protocol import ChatCompletionRequest
from kvgate.gateway.render import SSE_HEADERS, dumps
from kvgate.gateway.responses import data, plain, whole
from kvgate.gateway.routes import Relayed, check_model, generate, read, validated

router = APIRouter()
CHAT = "/v1/chat/completions"  # the route every message is answered through
TOKENIZE = "/tokenize"  # and every count made
JSON = {"content-type": "application/json"}


@router.post("/v1/messages")
async def create(request: Request) -> Response:
    body = read(await request.body(), model=True)
    req: MessagesRequest = validated(MessagesRequest, body, strict=True)
    call = chat_call(request, req, body, CHAT)
    got = await generate(request, replace(call, program=program_of(request.headers.get(HEADER), body)))
    message_id, stops = new_id(), req.stop_sequences or []
    if got.reply.status != 200:  # an upstream's refusal, in Anthropic's shape
        raise refused(got.reply.status, await whole(request, got), plain(got.headers))
    if not got.reply.streamed:
        message = message_of((await whole(request, got)).json(), message_id, req.model, stops)
        return Response(dumps(message), headers=plain(got.headers) | JSON)
    events = MessagesTranslator(skeleton(message_id, req.model), stops).events(data(request, got))
    return Relayed(events, got.reply, headers=SSE_HEADERS | plain(got.headers))


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, Any]:
    """The prompt's tokens as the model reads it (its chat template, tools and documents), nothing generated."""
    body = read(await request.body(), model=True)
    req: CountRequest = validated(CountRequest, body, strict=True)
    backend: Backend = request.app.state.backend
    return {"input_tokens": await backend.count_tokens(chat_call(request, req, body, TOKENIZE))}


def chat_call(request: Request, req: MessagesRequest | CountRequest, body: dict[str, Any], path: str) -> Call:
    """A Messages request (checked: what kvgate does not support, the model) as the chat a backend answers."""
    refuse_unsupported(req)
    check_model(request, req.model)
    chat = chat_body(req, body)
    parsed = validated(ChatCompletionRequest, chat, strict=True)
    tenant, request_id = request.state.tenant, request.state.request_id
    return Call.of(path, chat, parsed, tenant=tenant, request_id=request_id)


def refused(status: int, reply: Reply, headers: dict[str, str]) -> APIError:
    """An upstream's error answer, its message kept."""
    try:
        message = reply.json().get("error", {}).get("message")
    except APIError:
        message = None
    said = message if isinstance(message, str) else f"the upstream answered {status}"
    return APIError(status, said, headers=headers)
