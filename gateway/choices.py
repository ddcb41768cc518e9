"""The engine's work for one request, its n choices run concurrently, and the OpenAI answers and
chunks their outputs make."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvgate.gateway.admission import Admission
from kvgate.gateway.backend import Outcome
from kvgate.gateway.errors import bad_request
from kvgate.gateway.protocol import SEED_BOUND, CompletionRequest, Sampling
from kvgate.gateway.render import chat_logprobs, completion_logprobs
from kvgate.gateway.toolcalls import CallStream, message
from kvgate.runtime.engine import Engine, Result
from kvgate.runtime.request import Output, Request
from kvgate.runtime.reuse_report import ReuseReport
from kvgate.runtime.sampling import SamplingParams
from kvgate.runtime.tokens import TokenBytes, text_prompt

NONE = {"logprobs": None, "finish_reason": None}
CHAT_CHUNK = {"object": "chat.completion.chunk"}
COMPLETION_CHUNK = {"object": "text_completion"}


@dataclass
class Choice:
    index: int
    request: Request


def sampling_params(
    body: Sampling,
    max_tokens: int,
    logprobs: int | None,
    vocab_size: int,
    choice: int,
    grammar: str | None = None,
    calls: tuple[str, str] | None = None,
) -> SamplingParams:
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias key {key!r} is not a token id of this model", "logit_bias")
        bias[token] = value
    for token in body.stop_token_ids or ():
        if not 0 <= token < vocab_size:
            raise bad_request(f"stop_token_ids holds {token}, not a token id of this model", "stop_token_ids")
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    seed = body.seed
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        # n choices with one seed must still differ, and stay reproducible (and within int64).
        seed=None if seed is None else (seed + choice + SEED_BOUND) % (2 * SEED_BOUND) - SEED_BOUND,
        stop=tuple(stop),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=bias,
        logprobs=logprobs,
        grammar=grammar,
        calls=calls,
    )


def token_ids(tokenizer: Any, body: CompletionRequest) -> list[list[int]]:
    prompts = []
    for i, p in enumerate(body.prompts):
        if isinstance(p, str):
            prompts.append(text_prompt(tokenizer, p))
        elif any(not 0 <= t < len(tokenizer) for t in p):
            raise bad_request(f"prompt {i} holds token ids outside this model's vocabulary", "prompt")
        else:
            prompts.append(list(p))
    return prompts


async def run(
    engine: Engine, choices: list[Choice], admission: Admission | None = None
) -> AsyncIterator[tuple[int, Output]]:
    """Every choice's outputs, interleaved as they come; leaving early aborts the rest. With
    `admission`, the choices are admitted together before any reaches the engine (or the request is
    refused: APIError), and each counts until it ends: finished, failed, or aborted."""
    tenant = choices[0].request.tenant if choices else ""
    held = admission.admit(tenant, len(choices)) if admission is not None else None
    merged: asyncio.Queue[tuple[int, Output | Exception]] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            outputs = engine.generate(choice.request)
            async for out in outputs:
                await merged.put((choice.index, out))
        except Exception as exc:
            await merged.put((choice.index, exc))

    tasks = []
    try:
        tasks = [asyncio.create_task(pump(c)) for c in choices]
        remaining = len(choices)
        while remaining:
            index, out = await merged.get()
            if isinstance(out, Exception):
                raise out
            if out.finish_reason is not None:
                remaining -= 1
                if held is not None:
                    held.end()
            yield index, out
    finally:
        for task in tasks:
            task.cancel()
        if held is not None:
            held.close()


async def collect(engine: Engine, choices: list[Choice], admission: Admission | None = None) -> dict[int, Result]:
    """Run the choices to the end (cancelled, they free the engine: see `run`)."""
    done = {c.index: Result() for c in choices}
    async for index, out in run(engine, choices, admission):
        done[index].add(out)
    return done


def reuse_headers(report: ReuseReport) -> dict[str, str]:
    """What reuse did for the prompt (the same for every choice of a request)."""
    headers = {"x-kvgate-reused-tokens": str(report.reused), "x-kvgate-recomputed-tokens": str(report.recomputed)}
    if said := str(report):
        headers["x-kvgate-reuse"] = said
    if report.fidelity is not None:
        headers["x-kvgate-fidelity"] = str(report.fidelity)
    return headers


def outcome(first: Result, counted: dict[str, Any]) -> Outcome:
    return Outcome(first.text, first.finish_reason, counted, first.report, True, first.stages)


def chat_answer(
    head: dict[str, Any],
    done: dict[int, Result],
    counted: dict[str, Any],
    tb: TokenBytes | None,
    calls: Callable[[], CallStream] | None = None,
) -> dict[str, Any]:
    """A whole chat completion; `tb` when logprobs were asked for, `calls` when the answers may
    hold tool calls."""
    choices = []
    for i, f in sorted(done.items()):
        said = {"role": "assistant", "content": f.text} if calls is None else message(calls(), f.text)
        finish = "tool_calls" if "tool_calls" in said and f.finish_reason == "stop" else f.finish_reason
        lps = chat_logprobs(tb, f.logprobs) if tb is not None else None
        choices.append(
            {"index": i, "message": said, "logprobs": lps, "finish_reason": finish, "stop_reason": f.stop_reason}
        )
    return {**head, "object": "chat.completion", "choices": choices, "usage": counted}


def completion_answer(
    head: dict[str, Any], done: dict[int, Result], counted: dict[str, Any], echo: dict[int, str], tb: TokenBytes | None
) -> dict[str, Any]:
    choices = [
        {
            "index": i,
            "text": echo[i] + f.text,
            "logprobs": completion_logprobs(tb, f.logprobs, 0) if tb is not None else None,
            "finish_reason": f.finish_reason,
            "stop_reason": f.stop_reason,
        }
        for i, f in sorted(done.items())
    ]
    return {**head, "object": "text_completion", "choices": choices, "usage": counted}


def chat_chunks(
    tb: TokenBytes, logprobs: bool, calls: Callable[[], CallStream] | None = None
) -> Callable[[int, Output], list[dict[str, Any]]]:
    """A chunk per delta of new text (content, or tool calls when `calls` parses them), then one
    with an empty delta carrying finish_reason. Logprobs ride on the first chunk of their text."""
    streams: dict[int, CallStream] = {}

    def chunks(index: int, out: Output) -> list[dict[str, Any]]:
        if calls is None:
            deltas = [{"content": out.text}] if out.text or out.logprobs else []
        else:
            stream = streams.setdefault(index, calls())
            deltas = stream.feed(out.text) + (stream.end() if out.finish_reason is not None else [])
        lps = chat_logprobs(tb, out.logprobs) if logprobs and out.logprobs else None
        if lps is not None and not deltas:
            deltas = [{"content": ""}]
        found = [
            {"index": index, "delta": d, "logprobs": lps if j == 0 else None, "finish_reason": None}
            for j, d in enumerate(deltas)
        ]
        if out.finish_reason is not None:
            called = index in streams and streams[index].calls and out.finish_reason == "stop"
            finish = "tool_calls" if called else out.finish_reason
            ended = {"finish_reason": finish, "stop_reason": out.stop_reason}
            found.append({"index": index, "delta": {}, "logprobs": None} | ended)
        return found

    return chunks


def completion_chunks(tb: TokenBytes, logprobs: int | None) -> Callable[[int, Output], list[dict[str, Any]]]:
    """One chunk per output; the last carries finish_reason. Logprob offsets run on across chunks,
    by the tokens' own text (the chunks' text lags behind it while a stop string may be starting)."""
    offsets: dict[int, int] = {}

    def chunks(index: int, out: Output) -> list[dict[str, Any]]:
        if not (out.text or out.logprobs or out.finish_reason):
            return []
        lps = None
        if logprobs is not None:
            lps = completion_logprobs(tb, out.logprobs, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + sum(map(len, lps["tokens"]))
        chunk = {"index": index, "text": out.text, "logprobs": lps, "finish_reason": out.finish_reason}
        return [chunk | ({"stop_reason": out.stop_reason} if out.finish_reason is not None else {})]

    return chunks
