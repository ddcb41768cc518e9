"""POST /v1/completions"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from kvgate.gateway.errors import bad_request
from kvgate.gateway.keys import allow_model
from kvgate.gateway.protocol import CompletionRequest
from kvgate.gateway.serving import (
    Served,
    account,
    collect,
    completion_logprobs,
    response_head,
    reuse_headers,
    streamed,
    usage,
)
from kvgate.runtime.engine import Result
from kvgate.runtime.sequence import Output
from kvgate.runtime.tokens import text_prompt

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    served: Served = request.app.state.served
    allow_model(request, body.model)
    served.check_model(body.model)
    # Off the event loop: tokenizing a long prompt takes seconds.
    prompts = await asyncio.to_thread(token_ids, served, body)
    choices = served.choices(prompts, body, body.max_tokens, body.logprobs, "prompt")
    # Echo returns each prompt as text in front of its completion.
    texts = [""] * len(prompts)
    if body.echo:
        texts = await asyncio.to_thread(served.tokenizer.batch_decode, prompts, skip_special_tokens=True)
    echo = {c.index: texts[c.index // body.n] for c in choices}
    head = response_head("cmpl", request, served)
    prompt_tokens = sum(map(len, prompts))
    if body.stream:
        opening = [
            {"index": i, "text": text, "logprobs": None, "finish_reason": None} for i, text in echo.items() if text
        ]
        chunk_head = {**head, "object": "text_completion"}
        chunks = render(served, body.logprobs)

        async def count(whole: Result, counted: dict[str, Any]) -> None:
            await account(request, served.name, counted, whole)

        return await streamed(served, body, choices, chunk_head, prompt_tokens, opening, chunks, on_done=count)

    done = await collect(request, served.engine, choices)
    counted = usage(prompt_tokens, sum(f.completion_tokens for f in done.values()))
    await account(request, served.name, counted, done[0])
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
            "usage": counted,
        },
        headers=reuse_headers(done[0]),
    )


def token_ids(served: Served, body: CompletionRequest) -> list[list[int]]:
    prompts = []
    for i, p in enumerate(body.prompts):
        if isinstance(p, str):
            prompts.append(text_prompt(served.tokenizer, p))
        elif any(not 0 <= t < len(served.tokenizer) for t in p):
            raise bad_request(f"prompt {i} holds token ids outside this model's vocabulary", "prompt")
        else:
            prompts.append(list(p))
    return prompts


def render(served: Served, logprobs: int | None) -> Callable[[int, Output], list[dict[str, Any]]]:
    """One chunk per output; the last carries finish_reason. Logprob offsets run on across chunks,
    by the tokens' own text (the chunks' text lags behind it while a stop string may be starting)."""
    offsets: dict[int, int] = {}

    def chunks(index: int, out: Output) -> list[dict[str, Any]]:
        if not (out.text or out.logprobs or out.finish_reason):
            return []
        lps = None
        if logprobs is not None:
            lps = completion_logprobs(served.token_bytes, out.logprobs, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + sum(map(len, lps["tokens"]))
        return [{"index": index, "text": out.text, "logprobs": lps, "finish_reason": out.finish_reason}]

    return chunks
