"""`kvgate bench grammar`: constrained decoding as served. Forced tool calls and json_schema answers
over varied schemas, sampled at temperature 1, each checked with jsonschema; and what the grammar
costs a decode step at batch 16 (masks filled in parallel, applied, tokens consumed), measured
inside the engine against the step it belongs to, in the same run."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import jsonschema

from kvgate.gateway.backend import Call
from kvgate.gateway.local import Local
from kvgate.gateway.protocol import ChatCompletionRequest
from kvgate.gateway.settings import Settings
from kvgate.runtime.engine import Engine
from kvgate.runtime.progress import progress
from kvgate.runtime.report import pct, table, write_section

WORDS = ["city", "count", "title", "tags", "price", "active", "when", "owner", "level", "notes", "kind", "score"]


def chat_call(model: str, parsed: Any) -> Call:
    """A chat completion as the gateway hands one to a backend: `parsed` its validated request."""
    return Call.of("/v1/chat/completions", {"model": model}, parsed, tenant="bench", request_id=uuid.uuid4().hex)


def field(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "enum", "integer", "number", "boolean", "array", "pattern", "anyof"]
    if depth < 2:
        kinds.append("object")
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.choice([8, 16, 32])}
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(["red", "green", "blue", "amber", "grey"], 3)}
    if kind == "integer":
        return {"type": "integer", "minimum": 0, "maximum": rng.choice([9, 100, 5000])}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": {"type": "integer"}, "maxItems": 3}
    if kind == "pattern":
        return {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}
    if kind == "anyof":
        return {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]}
    return schema(rng, depth + 1)


def schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    names = rng.sample(WORDS, rng.randint(1, 4))
    required = [n for n in names if rng.random() < 0.7]
    return {
        "type": "object",
        "properties": {n: field(rng, depth) for n in names},
        "required": required,
        "additionalProperties": False,
    }


def request(
    i: int, rng: random.Random, model: str, mode: str, max_tokens: int
) -> tuple[ChatCompletionRequest, dict[str, Any]]:
    shape = schema(rng)
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": f"Task {i}: fill in the {mode} for a made-up record."}],
        "temperature": 1.0,
        "seed": i,
        "max_tokens": max_tokens,
    }
    if mode == "call":
        tool = {"type": "function", "function": {"name": f"record_{i % 7}", "parameters": shape}}
        named = {"type": "function", "function": {"name": tool["function"]["name"]}}
        body |= {"tools": [tool], "tool_choice": named if i % 2 else "required", "parallel_tool_calls": False}
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "record", "schema": shape}}
    return ChatCompletionRequest.model_validate(body), shape


def judge(answer: dict[str, Any], shape: dict[str, Any], mode: str) -> str:
    choice = answer["choices"][0]
    if choice["finish_reason"] == "length":
        return "cut"
    message = choice["message"]
    if mode == "call":
        if not message.get("tool_calls"):
            return "no call"
        text = message["tool_calls"][0]["function"]["arguments"]
    else:
        text = message["content"]
    try:
        jsonschema.validate(json.loads(text), shape)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return "invalid"
    return "valid"


async def forced(local: Local, total: int, batch: int, mode: str, seed: int, max_tokens: int) -> Counter[str]:
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    for start in progress(range(0, total, batch), f"{mode} batches of {batch}"):
        work = [request(i, rng, local.name, mode, max_tokens) for i in range(start, min(start + batch, total))]

        async def one(body: ChatCompletionRequest, shape: dict[str, Any]) -> str:
            call = chat_call(local.name, body)
            reply = await local.generate(call)
            return judge(reply.json(), shape, mode)

        outcomes.update(await asyncio.gather(*(one(b, s) for b, s in work)))
    return outcomes


async def step_cost(local: Local, batch: int, tokens: int, constrained: bool) -> tuple[float, float, int]:
    """Mean seconds per decode step, and of it the grammar's, for `batch` sequences decoding together."""
    engine = local.engine
    body: dict[str, Any] = {"model": local.name, "temperature": 1.0, "max_tokens": tokens, "ignore_eos": True}
    if constrained:  # a long free string keeps the grammar working on every token
        notes = {"type": "object", "properties": {"notes": {"type": "string"}}, "required": ["notes"]}
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "n", "schema": notes}}
    bodies = [
        ChatCompletionRequest.model_validate(
            body | {"seed": i, "messages": [{"role": "user", "content": f"Note {i}."}]}
        )
        for i in range(batch)
    ]
    steps, spent, start = engine.steps, engine.grammars.spent_s, time.perf_counter()
    calls = [chat_call(local.name, b) for b in bodies]
    await asyncio.gather(*(local.generate(c) for c in calls))
    n = engine.steps - steps
    return (time.perf_counter() - start) / n, (engine.grammars.spent_s - spent) / n, n


def bench_grammar(
    settings: Settings, total: int, batch: int, tokens: int, max_tokens: int, output: Path, command: str
) -> str:
    engine = Engine(settings.engine_config())
    local = Local(settings, engine)
    try:
        calls = asyncio.run(forced(local, total, batch, "call", 1, max_tokens))
        answers = asyncio.run(forced(local, total, batch, "json_schema", 2, max_tokens))
        plain, _, plain_steps = asyncio.run(step_cost(local, batch, tokens, constrained=False))
        held, grammar, held_steps = asyncio.run(step_cost(local, batch, tokens, constrained=True))
    finally:
        asyncio.run(local.close())
        engine.shutdown()
    kinds = ["valid", "invalid", "cut", "no call"]
    rows = [
        [what, str(sum(c.values()))] + [str(c[k]) for k in kinds]
        for what, c in (("forced tool calls", calls), ("response_format json_schema", answers))
    ]
    body = "\n\n".join(
        [
            "Varied schemas (nested objects, enums, bounds, patterns, anyOf, arrays), temperature 1, "
            f"max_tokens {max_tokens}; answers checked with jsonschema. "
            "`cut`: stopped by max_tokens before the JSON closed.",
            table(["what", "requests", *kinds], rows),
            f"Decode steps at batch {batch}, {tokens} tokens each (ignore_eos), same run: "
            f"unconstrained {1000 * plain:.1f} ms/step ({plain_steps} steps); with a json_schema grammar "
            f"{1000 * held:.1f} ms/step ({held_steps} steps), of which the grammar (masks filled in parallel, "
            f"tokens consumed) {1000 * grammar:.2f} ms = **{pct(grammar / max(held - grammar, 1e-9))}% of the step**.",
        ]
    )
    write_section(output, "grammar", "Constrained decoding (llguidance)", command, body)
    return body
