"""Documents: `/v1/documents` (store a document's KV ahead of time), and the `documents` field of
chat completions turned into a prompt plan for the engine."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from gateway.errors import APIError, bad_request
from gateway.protocol import ChatCompletionRequest, DocumentRequest
from gateway.serving import Served
from runtime.documents import chat_pieces, document_ids
from runtime.reuse import Reuse
from runtime.sequence import Plan
from runtime.tokens import TemplateError

router = APIRouter()
PREFIX = "doc-"


def card(key: str, tokens: int, served: Served) -> dict[str, Any]:
    return {"id": PREFIX + key, "object": "document", "tokens": tokens, "cached": key in served.engine.reuser.store}


def key_of(document_id: str, param: str = "id") -> str:
    key = document_id.removeprefix(PREFIX)
    if not document_id.startswith(PREFIX) or len(key) != 64:
        raise APIError(404, f"no document with id {document_id!r}", param, "document_not_found")
    return key


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
    entry, _ = await asyncio.wrap_future(served.engine.call(lambda: served.engine.reuser.document(ids, remember=True)))
    return card(entry.key, entry.tokens, served)


@router.get("/v1/documents/{document_id}")
async def show(document_id: str, request: Request) -> dict[str, Any]:
    served: Served = request.app.state.served
    key = key_of(document_id)
    tokens = served.engine.reuser.tokens_of(key)
    if tokens is None:
        raise APIError(404, f"no document with id {document_id!r}", "id", "document_not_found")
    return card(key, len(tokens), served)


@router.delete("/v1/documents/{document_id}")
async def delete(document_id: str, request: Request) -> dict[str, Any]:
    served: Served = request.app.state.served
    if not served.engine.reuser.forget(key_of(document_id)):
        raise APIError(404, f"no document with id {document_id!r}", "id", "document_not_found")
    return {"id": document_id, "object": "document", "deleted": True}


def plan(served: Served, body: ChatCompletionRequest, messages: list[dict[str, Any]]) -> Plan:
    """The chat prompt in pieces, [head][documents...][tail] (runs in a worker thread)."""
    assert body.documents is not None
    reuser = served.engine.reuser
    docs = []
    for i, ref in enumerate(body.documents):
        if ref.text is not None:
            docs.append(document_ids(served.tokenizer, ref.text))
            continue
        tokens = reuser.tokens_of(key_of(ref.id, f"documents.{i}.id"))
        if tokens is None:
            raise APIError(404, f"no document with id {ref.id!r}", f"documents.{i}.id", "document_not_found")
        docs.append(list(tokens))
    try:
        head, tail = chat_pieces(served.tokenizer, messages, body.add_generation_prompt, body.tools)
    except TemplateError as exc:
        raise bad_request(str(exc), "messages", "invalid_messages") from exc
    options = body.kvgate
    reuse = Reuse(options.reuse, options.recompute_ratio) if options else Reuse()
    return Plan([head, *docs, tail], [False, *[True] * len(docs), False], reuse)
