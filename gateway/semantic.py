"""The semantic cache in front of chat completions: who the caller is, what scope a request's answer
belongs to, the lookup, the replay of a hit (JSON or SSE), and keeping a new answer."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvgate.gateway import tracing
from kvgate.gateway.errors import APIError
from kvgate.gateway.protocol import ChatCompletionRequest
from kvgate.gateway.render import SSE_HEADERS, response_head, sse, usage

if TYPE_CHECKING:
    from kvgate.gateway.backend import Backend, Call, Outcome
    from kvgate.semantic_cache import Lookup, SemanticCache

log = logging.getLogger("kvgate.semantic")

# Body fields that do not change the answer, left out of the scope. kvgate.cache is taken out below.
UNSCOPED = {"messages", "stream", "stream_options", "user"}
PIECE = re.compile(r"\s*\S+\s*|\s+")  # how a cached answer is cut into streamed chunks
# The embedder reads ~256 tokens: of a longer user turn (a pasted document, then a question) only the
# end is compared by meaning; everything before it must match exactly, as part of the scope.
QUERY_CHARS = 800


@dataclass(frozen=True)
class Consult:
    """The semantic cache's part in one request."""

    status: str = "bypass"  # hit | miss | verify (a would-be hit the model answers, to check it) | bypass
    store: bool = False  # keep the answer afterwards
    tenant: str = ""
    scope: str = ""
    query: str = ""
    found: Lookup | None = None
    headers: dict[str, str] = field(default_factory=dict)


def directives(request: Request) -> set[str]:
    return {d.strip().lower() for d in request.headers.get("cache-control", "").split(",")}


def scope_of(
    identity: dict[str, str], body: ChatCompletionRequest, messages: list[dict[str, Any]], tenant: str
) -> tuple[str, str] | None:
    """(scope, query): the query is the last user turn's text; the scope everything else the answer
    depends on (tenant, the model's identity, every other message, documents, tools, sampling).
    None without a user turn."""
    messages = list(messages)
    last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last is None:
        return None
    text = messages[last]["content"]
    query = text[-QUERY_CHARS:]
    messages[last] = {**messages[last], "content": text[: len(text) - len(query)]}
    fields = body.model_dump(exclude=UNSCOPED, exclude_none=True)
    fields.get("kvgate", {}).pop("cache", None)
    key = {"tenant": tenant, **identity, "messages": messages, **fields}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest(), query


def plan(
    request: Request, cache: SemanticCache | None, identity: dict[str, str], body: ChatCompletionRequest
) -> Consult:
    """Whether this request may be answered from the cache (status "look": `look` says) or stored in
    it, and under what scope. `identity` names what answers (model and weights, or upstreams)."""
    opted = body.kvgate.cache if body.kvgate else None
    cacheable = opted is True or (opted is None and body.temperature == 0)
    shaped = body.tools or body.response_format is not None  # a replay holds neither calls nor a grammar
    if cache is None or not cacheable or body.n != 1 or body.logprobs or shaped:
        return Consult(headers={"x-kvgate-cache": "bypass"})
    try:
        messages = [m.for_template(i) for i, m in enumerate(body.messages)]
    except APIError:  # the backend judges what it cannot read
        return Consult(headers={"x-kvgate-cache": "bypass"})
    found = scope_of(identity, body, messages, request.state.tenant)
    if found is None:
        return Consult(headers={"x-kvgate-cache": "bypass"})
    said, (scope, query) = directives(request), found
    status, header = ("bypass", "bypass") if "no-cache" in said else ("look", "miss")
    tenant = request.state.tenant
    headers = {"x-kvgate-cache": header}
    return Consult(status, "no-store" not in said, tenant, scope, query, headers=headers)


async def look(request: Request, cache: SemanticCache, planned: Consult, queued: int) -> Consult:
    """What the lookup of a planned consult (status "look") found: a hit, a miss, or a would-be hit to verify.
    `queued` is the load it is under."""
    started = time.monotonic()
    lookup = await asyncio.to_thread(cache.lookup, planned.scope, planned.query, None, queued)
    status = "hit" if lookup.hit else "verify" if lookup.verify else "miss"
    tracing.stage(
        "kvgate.semantic_lookup", started, {"kvgate.cache": status, "kvgate.cache.category": lookup.category.name}
    )
    request.app.state.metrics.lookups.labels("semantic", status).inc()
    headers = {"x-kvgate-cache": status, "x-kvgate-cache-category": lookup.category.name}
    if lookup.entry is not None:
        headers |= {"x-kvgate-similarity": f"{lookup.similarity:.4f}", "x-kvgate-cache-entry": lookup.entry.id}
        headers["x-kvgate-cache-score"] = f"{lookup.score:.4f}"
        if lookup.verify:  # served, and the model answers it later to check it
            headers["x-kvgate-cache-check"] = "beside"
    elif lookup.refused:
        headers["x-kvgate-cache-refused"] = lookup.refused
    return replace(planned, status=status, found=lookup, headers=headers)


async def keep(cache: SemanticCache | None, consult: Consult, outcome: Outcome) -> None:
    """A finished answer (not an error, nor one cut short by the client): a verdict on the cached
    question it was near, if any, for the error bound; then kept, unless the caller said no-store."""
    if cache is None or outcome.finish_reason not in ("stop", "length"):
        return
    if consult.found is not None and consult.found.candidate is not None and not consult.found.hit:
        await asyncio.to_thread(cache.learn, consult.found, outcome.text)
    if not consult.store:
        return
    response = {"content": outcome.text, "finish_reason": outcome.finish_reason, "usage": outcome.usage}
    found = consult.found
    vector, category = (found.vector, found.category) if found else (None, None)
    await asyncio.to_thread(cache.put, consult.tenant, consult.scope, consult.query, response, vector, category)


def replay(
    cache: SemanticCache, consult: Consult, body: ChatCompletionRequest, model: str, request_id: str
) -> Response:
    """A hit, answered as the model's answer was: a chat completion, or its SSE stream. Its id is
    remembered, so that the caller may report it wrong (/v1/cache/feedback)."""
    head = response_head("chatcmpl", request_id, model)
    assert consult.found is not None and consult.found.entry is not None
    cache.remember(head["id"], consult.tenant, consult.found)
    stored = consult.found.entry.response
    counted = stored.get("usage", {})
    usage_ = usage(counted.get("prompt_tokens", 0), counted.get("completion_tokens", 0))
    headers = dict(consult.headers)
    if not body.stream:
        message = {"role": "assistant", "content": stored["content"]}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": stored["finish_reason"]}
        payload = {**head, "object": "chat.completion", "choices": [choice], "usage": usage_}
        return JSONResponse(payload, headers=headers)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunk_head = {**head, "object": "chat.completion.chunk"}

    def event(delta: dict[str, Any], finish_reason: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        chunk = {**chunk_head, "choices": [choice]}
        return sse({**chunk, "usage": None} if include_usage else chunk)

    async def events() -> AsyncIterator[str]:
        yield event({"role": "assistant", "content": ""})
        for piece in PIECE.findall(stored["content"]):
            yield event({"content": piece})
        yield event({}, stored["finish_reason"])
        if include_usage:
            yield sse({**chunk_head, "choices": [], "usage": usage_})
        yield sse("[DONE]")

    headers |= SSE_HEADERS
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


class Checks:
    """Would-be hits checked beside the hit they were served as (`semantic_cache.verify_beside`): the model
    answers the same request in the background, one at a time, once nothing waits for the backend,
    and the error bound learns the verdict. At most `limit` wait; more, or one that finds no idle
    moment within `patience_s`, are dropped (counted)."""

    def __init__(self, limit: int = 8, patience_s: float = 60.0) -> None:
        self.limit, self.patience_s = limit, patience_s
        self.waiting: set[asyncio.Task[None]] = set()
        self.one = asyncio.Lock()
        self.counts = {"checked": 0, "dropped": 0}

    def offer(self, backend: Backend, cache: SemanticCache, call: Call, found: Lookup) -> None:
        if len(self.waiting) >= self.limit:
            self.counts["dropped"] += 1
            return
        task = asyncio.create_task(self.check(backend, cache, quiet(call), found))
        self.waiting.add(task)
        task.add_done_callback(self.waiting.discard)

    async def check(self, backend: Backend, cache: SemanticCache, call: Call, found: Lookup) -> None:
        deadline = time.monotonic() + self.patience_s
        async with self.one:
            while backend.queued() > 0:
                if time.monotonic() > deadline:
                    self.counts["dropped"] += 1
                    return
                await asyncio.sleep(0.05)
            try:
                reply = await backend.generate(call)
                try:
                    if reply.streamed:
                        async for _ in reply.data():
                            pass
                finally:
                    if reply.close is not None:
                        await reply.close()
            except Exception:  # an error answer (the tenant's limits, an upstream down): no verdict
                log.info("semantic cache: a check beside a hit failed", exc_info=True)
                self.counts["dropped"] += 1
                return
        if reply.outcome.done:
            await asyncio.to_thread(cache.learn, found, reply.outcome.text)
            self.counts["checked"] += 1

    def stats(self) -> dict[str, int]:
        return {**self.counts, "waiting": len(self.waiting)}


def quiet(call: Call) -> Call:
    """The request again, whole (not streamed), its text wanted."""
    body = {k: v for k, v in call.body.items() if k not in ("stream", "stream_options")}
    parsed = call.parsed.model_copy(update={"stream": False, "stream_options": None}) if call.parsed else None
    raw = json.dumps(body).encode()
    return replace(call, body=body, raw=raw, parsed=parsed, request_id=f"{call.request_id}-check", keep=True)
