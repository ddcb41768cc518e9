"""What chat and text completions share: the model behind the gateway, choices run on the
engine concurrently, usage, logprobs and SSE framing."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from kvgate.agents import AnchorPool, EngineCosts, Expirer, Programs
from kvgate.gateway.errors import APIError, bad_request, internal
from kvgate.gateway.keys import spend
from kvgate.gateway.protocol import Sampling
from kvgate.gateway.settings import Settings
from kvgate.runtime.engine import Engine, PromptTooLong, Result
from kvgate.runtime.sampling import SamplingParams, TokenLogprob
from kvgate.runtime.sequence import Output, Plan, Turn
from kvgate.runtime.tokens import TokenBytes
from kvgate.semantic_cache import SemanticCache
from starlette.requests import Request
from starlette.responses import StreamingResponse

FINGERPRINT = "kvgate-0.1"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}  # no proxy may buffer or keep a stream


@dataclass
class Choice:
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    plan: Plan | None = None
    turn: Turn | None = None


class Served:
    """The model as the gateway sees it: its name, its engine and tokenizer."""

    def __init__(self, settings: Settings, engine: Engine) -> None:
        self.settings, self.engine = settings, engine
        self.tokenizer = engine.tokenizer
        self.name = settings.served_model_name or engine.loaded.name
        self.token_bytes = TokenBytes(self.tokenizer)
        self.created = int(time.time())
        self.semantic = SemanticCache(settings.semantic_cache_config()) if settings.semantic_cache else None
        config = settings.agent_config()
        self.programs = Programs(config, engine.reuser.store, EngineCosts(engine, config.reload_bytes_per_s))
        self.expirer = Expirer(self.programs)
        self.anchors = AnchorPool(config.anchors) if config.kvcomm else None
        engine.spans.offsets = self.anchors
        self.identity = {"model": self.name, "weights": engine.model_fp}  # what answers, for the semantic cache
        self.tenant_kv = settings.tenant_scoped_kv

    def check_model(self, model: str) -> None:
        if model != self.name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.name}`.",
                "model",
                "model_not_found",
            )

    def choices(
        self,
        prompts: list[list[int]],
        body: Sampling,
        max_tokens: int | None,
        logprobs: int | None,
        param: str,
        plan: Plan | None = None,
        turn: Turn | None = None,
    ) -> list[Choice]:
        """The engine's work for a request: n choices per prompt. Only the first choice of a
        program's turn keeps its context for the next turn."""
        choices = []
        for p, ids in enumerate(prompts):
            try:
                self.engine.check(len(ids), max_tokens)
            except ValueError as exc:
                code = "context_length_exceeded" if isinstance(exc, PromptTooLong) else "invalid_value"
                raise bad_request(str(exc), param, code) from exc
            limit = max_tokens or self.engine.max_model_len - len(ids)
            for i in range(body.n):
                index = p * body.n + i
                params = body.sampling_params(limit, logprobs, len(self.tokenizer), index)
                keep = turn if index == 0 or turn is None else replace(turn, keep="", pin_s=0.0)
                choices.append(Choice(index, ids, params, plan, keep))
        return choices


async def run(engine: Engine, choices: list[Choice]) -> AsyncIterator[tuple[int, Output]]:
    """Every choice's outputs, interleaved as they come; leaving early aborts the rest."""
    merged: asyncio.Queue[tuple[int, Output | Exception]] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for out in engine.generate(choice.prompt_ids, choice.params, choice.plan, choice.turn):
                await merged.put((choice.index, out))
        except Exception as exc:
            await merged.put((choice.index, exc))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        remaining = len(choices)
        while remaining:
            index, out = await merged.get()
            if isinstance(out, Exception):
                raise out
            remaining -= out.finish_reason is not None
            yield index, out
    finally:
        for task in tasks:
            task.cancel()


async def collect(request: Request, engine: Engine, choices: list[Choice]) -> dict[int, Result]:
    """Run choices to the end; stop (and free the engine) if the client hangs up first."""
    done = {c.index: Result() for c in choices}

    async def gather() -> None:
        async for index, out in run(engine, choices):
            done[index].add(out)

    work = asyncio.create_task(gather())
    watcher = asyncio.create_task(hang_up(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            raise APIError(499, "the client closed the request")
        work.result()
        return done
    finally:
        watcher.cancel()


async def hang_up(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def reuse_headers(done: Output | Result) -> dict[str, str]:
    """What reuse did for the prompt (the same for every choice of a request)."""
    headers = {
        "x-kvgate-reused-tokens": str(done.cached_tokens),
        "x-kvgate-recomputed-tokens": str(done.recomputed_tokens),
    }
    if done.reuse:
        headers["x-kvgate-reuse"] = done.reuse
    return headers


async def account(request: Request, model: str, counted: dict[str, Any], done: Output | Result | None = None) -> None:
    """A finished request in the metrics (with what reuse did, when the runtime is ours), and its
    tokens against the key's limit."""
    metrics = request.app.state.metrics
    metrics.usage(model, counted)
    if done is not None:
        metrics.reuse(done.reuse, done.cached_tokens, done.recomputed_tokens)
    await spend(request, counted.get("total_tokens") or 0)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def finite(logprob: float) -> float:
    return max(logprob, -9999.0)  # JSON has no -inf


def chat_logprobs(tb: TokenBytes, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": tb.text(token_id), "logprob": finite(logprob), "bytes": list(tb(token_id))}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top]} for lp in logprobs
        ]
    }


def completion_logprobs(tb: TokenBytes, logprobs: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """Logprobs of text completions; text_offset counts on from `offset`, each token's own text."""
    tokens, offsets, tops = [], [], []
    for lp in logprobs:
        tokens.append(tb.text(lp.token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
        # As vLLM: the sampled token is among its top logprobs even when it is not in the top k.
        tops.append({**{tb.text(t): finite(p) for t, p in lp.top}, tokens[-1]: finite(lp.logprob)})
    return {
        "tokens": tokens,
        "token_logprobs": [finite(lp.logprob) for lp in logprobs],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def response_head(kind: str, request: Request, served: Served) -> dict[str, Any]:
    """The fields every response and chunk of one request share; kind is chatcmpl or cmpl."""
    return {
        "id": f"{kind}-{request.state.request_id}",
        "created": int(time.time()),
        "model": served.name,
        "system_fingerprint": FINGERPRINT,
    }


async def streamed(
    served: Served,
    body: Sampling,
    choices: list[Choice],
    head: dict[str, Any],
    prompt_tokens: int,
    opening: list[dict[str, Any]],
    render: Callable[[int, Output], list[dict[str, Any]]],
    headers: dict[str, str] | None = None,
    on_done: Callable[[Result, dict[str, Any]], Awaitable[None]] | None = None,
) -> StreamingResponse:
    """A streamed completion as SSE: the opening choice chunks, then each output as `render`
    turns it into choice chunks, the usage chunk if asked for, and always [DONE].
    `on_done` gets the first choice, whole, and the usage once the last output is sent."""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def event(choice: dict[str, Any]) -> str:
        chunk = {**head, "choices": [choice]}
        if include_usage:
            chunk["usage"] = None
        return sse(chunk)

    # The headers say what reuse did, so the response starts once the prompt is prefilled
    # (an error before then is an ordinary error response).
    outputs = run(served.engine, choices)
    first = await anext(outputs)

    async def events() -> AsyncIterator[str]:
        completion_tokens = 0
        whole = Result()
        try:
            for choice in opening:
                yield event(choice)
            for index, out in [first]:
                completion_tokens += out.completion_tokens if out.finish_reason is not None else 0
                if index == 0:
                    whole.add(out)
                for choice in render(index, out):
                    yield event(choice)
            async for index, out in outputs:
                if out.finish_reason is not None:
                    completion_tokens += out.completion_tokens
                if index == 0:
                    whole.add(out)
                for choice in render(index, out):
                    yield event(choice)
            counted = usage(prompt_tokens, completion_tokens, first[1].cached_tokens)
            if include_usage:
                yield sse({**head, "choices": [], "usage": counted})
            if on_done is not None:
                await on_done(whole, counted)
        except Exception as exc:
            yield sse_error(exc)
        yield sse("[DONE]")

    sent = {**SSE_HEADERS, **reuse_headers(first[1]), **(headers or {})}
    return StreamingResponse(events(), media_type="text/event-stream", headers=sent)


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def sse_error(exc: Exception) -> str:
    return sse(internal(exc).body())
