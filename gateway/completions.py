"""POST /v1/completions"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.errors import bad_request
from gateway.protocol import CompletionRequest
from gateway.serving import (
    FINGERPRINT,
    SSE_HEADERS,
    Choice,
    Served,
    collect,
    completion_logprobs,
    run,
    sse,
    sse_error,
    usage,
)
from runtime.tokens import text_prompt

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    served: Served = request.app.state.served
    served.check_model(body.model)
    prompts: list[list[int]] = []
    for i, p in enumerate(body.prompts):
        if isinstance(p, str):
            prompts.append(text_prompt(served.tokenizer, p))
        elif any(not 0 <= t < len(served.tokenizer) for t in p):
            raise bad_request(f"prompt {i} holds token ids outside this model's vocabulary", "prompt")
        else:
            prompts.append(list(p))
    choices = served.choices(prompts, body, body.max_tokens, body.logprobs, "prompt")
    # Echo returns each prompt as text in front of its completion.
    echo = {
        c.index: served.tokenizer.decode(c.prompt_ids, skip_special_tokens=True) if body.echo else "" for c in choices
    }
    head = {
        "id": f"cmpl-{request.state.request_id}",
        "created": int(time.time()),
        "model": served.name,
        "system_fingerprint": FINGERPRINT,
    }
    prompt_tokens = sum(map(len, prompts))
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            stream(served, choices, head, echo, prompt_tokens, include_usage, body.logprobs),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )

    done = await collect(request, served.engine, choices)
    return JSONResponse(
        {
            **head,
            "object": "text_completion",
            "choices": [
                {
                    "index": i,
                    "text": echo[i] + f.text,
                    "logprobs": completion_logprobs(served.token_bytes, f.logprobs, 0)
                    if body.logprobs is not None
                    else None,
                    "finish_reason": f.finish_reason,
                }
                for i, f in sorted(done.items())
            ],
            "usage": usage(prompt_tokens, sum(f.completion_tokens for f in done.values())),
        }
    )


async def stream(
    served: Served,
    choices: list[Choice],
    head: dict[str, Any],
    echo: dict[int, str],
    prompt_tokens: int,
    include_usage: bool,
    logprobs: int | None,
) -> AsyncIterator[str]:
    def chunk(index: int, text: str, finish: str | None, lps: Any) -> str:
        body = {
            **head,
            "object": "text_completion",
            "choices": [{"index": index, "text": text, "logprobs": lps, "finish_reason": finish}],
        }
        if include_usage:
            body["usage"] = None
        return sse(body)

    offsets = {c.index: 0 for c in choices}
    completion_tokens = 0
    try:
        for index, text in echo.items():
            if text:
                yield chunk(index, text, None, None)
        async for index, out in run(served.engine, choices):
            lps = None
            if logprobs is not None:
                lps = completion_logprobs(served.token_bytes, out.logprobs, offsets[index])
            offsets[index] += len(out.text)
            if out.finish_reason is not None:
                completion_tokens += out.completion_tokens
            if out.text or out.logprobs or out.finish_reason:
                yield chunk(index, out.text, out.finish_reason, lps)
        if include_usage:
            yield sse(
                {**head, "object": "text_completion", "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
            )
    except Exception as exc:
        yield sse_error(exc)
    yield sse("[DONE]")
