"""POST /v1/chat/completions"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from kvgate.gateway import documents, programs, semantic
from kvgate.gateway.errors import bad_request
from kvgate.gateway.keys import allow_model
from kvgate.gateway.protocol import ChatCompletionRequest
from kvgate.gateway.serving import (
    Served,
    account,
    chat_logprobs,
    collect,
    response_head,
    reuse_headers,
    streamed,
    usage,
)
from kvgate.runtime.engine import Result
from kvgate.runtime.sequence import Output
from kvgate.runtime.tokens import TemplateError, chat_prompt

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    served: Served = request.app.state.served
    allow_model(request, body.model)
    served.check_model(body.model)
    messages = [m.for_template(i) for i, m in enumerate(body.messages)]
    queued = served.engine.load_stats["waiting"]
    cached = await semantic.consult(request, served.semantic, served.identity, queued, body, messages)
    if cached.status == "hit":
        return semantic.replay(cached, body, response_head("chatcmpl", request, served))
    program = programs.of(request, body)
    scope = documents.scope_of(request)
    plan = None
    # Off the event loop: rendering and tokenizing a long prompt takes seconds.
    if body.documents:
        plan = await asyncio.to_thread(documents.plan, served, body, messages, scope)
    elif program is not None:
        # Spans are computed in their first reader's context: shared within a tenant only, always.
        plan = await asyncio.to_thread(programs.plan, served, body, messages, program, request.state.tenant)
    if plan is not None:
        prompt = [t for piece in plan.pieces for t in piece]
    else:
        try:
            prompt = await asyncio.to_thread(
                chat_prompt, served.tokenizer, messages, body.add_generation_prompt, body.tools
            )
        except TemplateError as exc:
            raise bad_request(str(exc), "messages", "invalid_messages") from exc
    turn = programs.begin(request, served, program, messages, len(prompt))
    choices = served.choices([prompt], body, body.max_new_tokens, body.logprobs_k, "messages", plan, turn)
    head = response_head("chatcmpl", request, served)
    sent = cached.headers | programs.headers(turn)
    if body.stream:
        opening = [
            {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for c in choices
        ]
        chunk_head = {**head, "object": "chat.completion.chunk"}

        async def keep(whole: Result, counted: dict[str, Any]) -> None:
            await programs.end(request, served, turn)
            await account(request, served.name, counted, whole)
            await semantic.keep(served.semantic, cached, whole.text, whole.finish_reason, counted)

        chunks = render(served, body.logprobs)
        return await streamed(served, body, choices, chunk_head, len(prompt), opening, chunks, sent, keep)

    try:
        done = await collect(request, served.engine, choices)
    finally:
        await programs.end(request, served, turn)
    counted = usage(len(prompt), sum(f.completion_tokens for f in done.values()), done[0].cached_tokens)
    await account(request, served.name, counted, done[0])
    await semantic.keep(served.semantic, cached, done[0].text, done[0].finish_reason, counted)
    return JSONResponse(
        {
            **head,
            "object": "chat.completion",
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": f.text},
                    "logprobs": chat_logprobs(served.token_bytes, f.logprobs) if body.logprobs else None,
                    "finish_reason": f.finish_reason,
                }
                for i, f in sorted(done.items())
            ],
            "usage": counted,
        },
        headers=reuse_headers(done[0]) | sent,
    )


def render(served: Served, logprobs: bool) -> Callable[[int, Output], list[dict[str, Any]]]:
    """A content chunk for new text, then a chunk with an empty delta carrying finish_reason."""

    def chunks(index: int, out: Output) -> list[dict[str, Any]]:
        found = []
        if out.text or out.logprobs:
            lps = chat_logprobs(served.token_bytes, out.logprobs) if logprobs else None
            found.append({"index": index, "delta": {"content": out.text}, "logprobs": lps, "finish_reason": None})
        if out.finish_reason is not None:
            found.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": out.finish_reason})
        return found

    return chunks
