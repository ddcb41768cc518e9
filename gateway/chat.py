"""POST /v1/chat/completions"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.errors import bad_request
from gateway.protocol import ChatCompletionRequest
from gateway.serving import FINGERPRINT, SSE_HEADERS, Choice, Served, chat_logprobs, collect, run, sse, sse_error, usage
from runtime.tokens import TemplateError, chat_prompt

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    served: Served = request.app.state.served
    served.check_model(body.model)
    messages = [m.for_template(i) for i, m in enumerate(body.messages)]
    try:
        prompt = chat_prompt(served.tokenizer, messages, body.add_generation_prompt, body.tools)
    except TemplateError as exc:
        raise bad_request(str(exc), "messages", "invalid_messages") from exc
    choices = served.choices([prompt], body, body.max_new_tokens, body.logprobs_k, "messages")
    head = {
        "id": f"chatcmpl-{request.state.request_id}",
        "created": int(time.time()),
        "model": served.name,
        "system_fingerprint": FINGERPRINT,
    }
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            stream(served, choices, head, include_usage, body.logprobs),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )

    done = await collect(request, served.engine, choices)
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
            "usage": usage(len(prompt), sum(f.completion_tokens for f in done.values())),
        }
    )


async def stream(
    served: Served, choices: list[Choice], head: dict[str, Any], include_usage: bool, logprobs: bool
) -> AsyncIterator[str]:
    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, lps: Any = None) -> str:
        body = {
            **head,
            "object": "chat.completion.chunk",
            "choices": [{"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}],
        }
        if include_usage:
            body["usage"] = None
        return sse(body)

    completion_tokens = 0
    try:
        for c in choices:
            yield chunk(c.index, {"role": "assistant", "content": ""})
        async for index, out in run(served.engine, choices):
            if out.text or out.logprobs:
                lps = chat_logprobs(served.token_bytes, out.logprobs) if logprobs else None
                yield chunk(index, {"content": out.text}, lps=lps)
            if out.finish_reason is not None:
                completion_tokens += out.completion_tokens
                yield chunk(index, {}, out.finish_reason)
        if include_usage:
            yield sse(
                {
                    **head,
                    "object": "chat.completion.chunk",
                    "choices": [],
                    "usage": usage(len(choices[0].prompt_ids), completion_tokens),
                }
            )
    except Exception as exc:
        yield sse_error(exc)
    yield sse("[DONE]")
