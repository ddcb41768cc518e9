"""Documents: `/v1/documents` (store a document's KV ahead of time), and the `documents` field of
chat completions turned into a prompt plan for the engine."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from kvgate.gateway.errors import APIError, bad_request
from kvgate.gateway.protocol import ChatCompletionRequest, DocumentRequest
from kvgate.gateway.serving import Served
from kvgate.runtime.documents import chat_pieces, document_ids
from kvgate.runtime.reuse import Reuse
from kvgate.runtime.sequence import Plan
from kvgate.runtime.tokens import TemplateError

router = APIRouter()
PREFIX = "doc-"


def card(key: str, tokens: int, served: Served) -> dict[str, Any]:
    return {"id": PREFIX + key, "object": "document", "tokens": tokens, "cached": key in served.engine.reuser.store}


def scope_of(request: Request) -> str:
    """Whose documents: the tenant's own (tenant_scoped_kv), else everyone's."""
    served: Served = request.app.state.served
    return request.state.tenant if served.tenant_kv else ""


def tokens_of(served: Served, document_id: str, scope: str, param: str = "id") -> tuple[str, tuple[int, ...]]:
    """A stored document's key and tokens; 404 for an unknown id or another tenant's document."""
    key = document_id.removeprefix(PREFIX)
    reuser = served.engine.reuser
    tokens = reuser.tokens_of(key) if document_id.startswith(PREFIX) and len(key) == 64 else None
    if tokens is None or reuser.key(list(tokens), scope) != key:
        raise APIError(404, f"no document with id {document_id!r}", param, "document_not_found")
    return key, tokens


@router.post("/v1/documents")
async def store(body: DocumentRequest, request: Request) -> dict[str, Any]:
    served: Served = request.app.state.served
    ids = await asyncio.to_thread(document_ids, served.tokenizer, body.text)
    if len(ids) >= served.engine.max_model_len:
        raise bad_request(
            f"the document has {len(ids)} tokens; the context window is {served.engine.max_model_len}",
            "text",
            "context_length_exceeded",
        )
    scope = scope_of(request)
    entry, _ = await asyncio.wrap_future(
        served.engine.call(lambda: served.engine.reuser.document(ids, scope, remember=True))
    )
    return card(entry.key, entry.tokens, served)


@router.get("/v1/documents/{document_id}")
async def show(document_id: str, request: Request) -> dict[str, Any]:
    served: Served = request.app.state.served
    key, tokens = tokens_of(served, document_id, scope_of(request))
    return card(key, len(tokens), served)


@router.delete("/v1/documents/{document_id}")
async def delete(document_id: str, request: Request) -> dict[str, Any]:
    served: Served = request.app.state.served
    key, _ = tokens_of(served, document_id, scope_of(request))
    if not served.engine.reuser.forget(key):
        raise APIError(404, f"no document with id {document_id!r}", "id", "document_not_found")
    return {"id": document_id, "object": "document", "deleted": True}


def plan(served: Served, body: ChatCompletionRequest, messages: list[dict[str, Any]], scope: str) -> Plan:
    """The chat prompt in pieces, [head][documents...][tail] (runs in a worker thread)."""
    assert body.documents is not None
    docs = []
    for i, ref in enumerate(body.documents):
        if ref.text is not None:
            docs.append(document_ids(served.tokenizer, ref.text))
        else:
            docs.append(list(tokens_of(served, ref.id or "", scope, f"documents.{i}.id")[1]))
    try:
        head, tail = chat_pieces(served.tokenizer, messages, body.add_generation_prompt, body.tools)
    except TemplateError as exc:
        raise bad_request(str(exc), "messages", "invalid_messages") from exc
    options = body.kvgate
    reuse = Reuse()
    if options is not None:  # documents have no anchors: kvcomm is blend for them
        reuse = Reuse("blend" if options.reuse == "kvcomm" else options.reuse, options.recompute_ratio)
    return Plan([head, *docs, tail], [False, *[True] * len(docs), False], reuse, scope)
