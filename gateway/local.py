"""The local backend: the engine in this process. A request becomes a plan (runtime/planner.py),
n choices run on the engine concurrently, and their outputs become OpenAI's answer or its stream."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, replace
from functools import partial
from typing import Any

from prometheus_client.core import Metric

from kvgate.agents import Turn
from kvgate.gateway import tracing
from kvgate.gateway.admission import Admission
from kvgate.gateway.agent_turns import AgentTurns, Ended
from kvgate.gateway.backend import Backend, Call, Outcome, Reply
from kvgate.gateway.choices import (
    CHAT_CHUNK,
    COMPLETION_CHUNK,
    NONE,
    Choice,
    chat_answer,
    chat_chunks,
    collect,
    completion_answer,
    completion_chunks,
    outcome,
    reuse_headers,
    run,
    sampling_params,
    token_ids,
)
from kvgate.gateway.embeddings import Embeddings
from kvgate.gateway.errors import APIError, bad_request, internal
from kvgate.gateway.metrics import calibration_metrics, counter, fidelity_metrics, gauge, tier_metrics
from kvgate.gateway.programs import HEADER
from kvgate.gateway.protocol import ChatCompletionRequest, CompletionRequest, Sampling
from kvgate.gateway.render import DONE, Data, response_head, usage
from kvgate.gateway.settings import Settings
from kvgate.gateway.toolcalls import CallStream, constraint, repeat_guard
from kvgate.runtime.engine import Engine, Result
from kvgate.runtime.errors import GrammarError, InvalidPrompt
from kvgate.runtime.planner import Chat
from kvgate.runtime.quality import STATES
from kvgate.runtime.request import Output, Plan, Request
from kvgate.runtime.tokens import TokenBytes
from kvgate.runtime.tools import detect, prepare

log = logging.getLogger("kvgate.gateway")
JSON = {"content-type": "application/json"}
Render = Callable[[int, Output], list[dict[str, Any]]]
Dicts = list[dict[str, Any]]


class Local(Backend):
    """The model as the gateway sees it: its name, engine, planner, and agent programs."""

    def __init__(self, settings: Settings, engine: Engine) -> None:
        self.settings, self.engine = settings, engine
        self.tokenizer = engine.tokenizer
        self.name = settings.engine.served_model_name or engine.name
        self.token_bytes = TokenBytes(self.tokenizer)
        self.tool_format = detect(self.tokenizer)
        self.created = int(time.time())
        self.agents = AgentTurns(settings, engine)
        self.planner = engine.planner()
        self.embeddings = Embeddings(settings)  # /v1/embeddings: the semantic cache's embedding model
        self.admission = Admission(
            settings.security.max_request_seqs,
            settings.security.max_waiting_seqs,
            settings.security.max_waiting_seqs_per_tenant,
        )
        standing = engine.standing()
        if not standing.calibrated:  # said once at start-up; /ready, /metrics and x-kvgate-reuse say it on
            log.warning("%s in %s has no calibration table: %s", self.name, engine.dtype, standing.note)

    # ---- what is served ----------------------------------------------------------------

    def models(self) -> list[dict[str, Any]]:
        card = {"id": self.name, "object": "model", "created": self.created, "owned_by": "kvgate"}
        # root: the served name, as vLLM has it (the weights' path is no caller's business)
        llm = {**card, "root": self.name, "max_model_len": self.engine.max_model_len}
        return [llm, *self.embeddings.cards(self.created)]

    def document_models(self) -> list[str]:
        return [self.name]

    def serves(self, model: str) -> bool:
        return model == self.name or self.embeddings.serves(model)

    def identity(self, model: str) -> dict[str, str]:
        self.generates(model)  # the embedding model has no chat answer, cached or not
        return {"model": self.name, "weights": self.engine.model_fp}

    def generates(self, model: str) -> None:
        """400 unless `model` is the one that generates (not the embedding model beside it)."""
        if model != self.name:
            raise APIError(400, f"`{model}` is an embedding model; use /v1/embeddings", "model", "invalid_model")

    def queued(self) -> int:
        return self.engine.load_stats["waiting"]

    def scope(self, tenant: str) -> str:
        """Whose documents: the tenant's own (caches.tenant_scoped), else everyone's."""
        return tenant if self.settings.caches.tenant_scoped else ""

    # ---- completions ---------------------------------------------------------------------

    async def generate(self, call: Call) -> Reply:
        if call.path != "/v1/embeddings":
            self.generates(call.model)
        if isinstance(call.parsed, ChatCompletionRequest):
            return await self.chat(call, call.parsed)
        if isinstance(call.parsed, CompletionRequest):
            return await self.complete(call, call.parsed)
        if call.path == "/v1/embeddings":
            return await self.embeddings.answer(call)
        raise APIError(404, f"{call.path} is not served by this model's runtime", code="unsupported_route")

    async def chat(self, call: Call, body: ChatCompletionRequest) -> Reply:
        await self.admission.screen(call.tenant, 1, body.n)  # 400, 429 or 503 before any work (run admits)
        lark, incremental = constraint(body, self.tool_format)
        try:  # off the event loop: rendering and tokenizing a long prompt takes seconds
            grammar = await asyncio.to_thread(self.engine.compile, lark) if lark is not None else None
        except GrammarError as exc:
            param = "tools" if body.calls_tools else "response_format"
            raise bad_request(f"the schema cannot be used for constrained decoding: {exc}", param) from exc
        started = time.monotonic()
        messages, given, prompt, plan = await self.prompt(call, body)
        tracing.stage("kvgate.prompt", started, {"gen_ai.usage.input_tokens": len(prompt)})  # rendered, tokenized
        turn = await self.agents.begin(call.program, call.tenant, given, messages, len(prompt))
        choices = self.choices([prompt], body, body.max_new_tokens, body.logprobs_k, plan, turn, grammar, call.tenant)
        names = frozenset(t.function.name for t in body.tools or ())
        calls = partial(CallStream, self.tool_format, names, incremental) if body.calls_tools else None
        head = response_head("chatcmpl", call.request_id, self.name)
        headers = {} if turn is None else {HEADER: turn.program, "x-kvgate-pin-ttl": f"{turn.pin_s:.3f}"}
        ended = self.agents.ender(call.tenant, turn, given, messages, calls)
        if body.stream:
            opening = [{"index": c.index, "delta": {"role": "assistant", "content": ""}, **NONE} for c in choices]
            chunks = chat_chunks(self.token_bytes, body.logprobs, calls)
            return await self.streamed(body, choices, head | CHAT_CHUNK, len(prompt), opening, chunks, headers, ended)
        try:
            done = await collect(self.engine, choices, self.admission)
        except BaseException:
            await ended(None)
            raise
        await ended(done[0].text)
        counted = usage(len(prompt), sum(f.completion_tokens for f in done.values()), done[0].report.reused)
        payload = chat_answer(head, done, counted, self.token_bytes if body.logprobs else None, calls)
        return Reply(
            headers=JSON | reuse_headers(done[0].report) | headers, answer=payload, settled=outcome(done[0], counted)
        )

    async def complete(self, call: Call, body: CompletionRequest) -> Reply:
        await self.admission.screen(call.tenant, len(body.prompts), body.n)  # before tokenizing (run admits)
        prompts = await asyncio.to_thread(token_ids, self.tokenizer, body)  # tokenizing may take seconds
        choices = self.choices(prompts, body, body.max_tokens, body.logprobs, tenant=call.tenant)
        texts = [""] * len(prompts)  # echo: each prompt as text in front of its completion
        if body.echo:
            texts = await asyncio.to_thread(self.tokenizer.batch_decode, prompts, skip_special_tokens=True)
        echo = {c.index: texts[c.index // body.n] for c in choices}
        head = response_head("cmpl", call.request_id, self.name)
        prompt_tokens = sum(map(len, prompts))
        if body.stream:
            opening = [
                {"index": i, "text": text, "logprobs": None, "finish_reason": None} for i, text in echo.items() if text
            ]
            chunks = completion_chunks(self.token_bytes, body.logprobs)
            return await self.streamed(body, choices, head | COMPLETION_CHUNK, prompt_tokens, opening, chunks)
        done = await collect(self.engine, choices, self.admission)
        counted = usage(prompt_tokens, sum(f.completion_tokens for f in done.values()))
        payload = completion_answer(head, done, counted, echo, self.token_bytes if body.logprobs is not None else None)
        return Reply(headers=JSON | reuse_headers(done[0].report), answer=payload, settled=outcome(done[0], counted))

    def choices(
        self,
        prompts: list[list[int]],
        body: Sampling,
        max_tokens: int | None,
        logprobs: int | None,
        plan: Plan | None = None,
        turn: Turn | None = None,
        grammar: str | None = None,
        tenant: str = "",
    ) -> list[Choice]:
        """The engine's work for a request: n choices per prompt, the tenant's. Only the first choice of a
        program's turn keeps its context for the next one. `run` admits them (or none) before any runs."""
        param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        calls = repeat_guard(body, self.tool_format) if self.settings.engine.repeated_tool_calls == "end" else None
        choices = []
        for p, ids in enumerate(prompts):
            try:
                self.engine.check(len(ids), max_tokens)
            except InvalidPrompt as exc:
                raise exc.at(param) from exc
            limit = max_tokens or self.engine.max_model_len - len(ids)
            for i in range(body.n):
                index = p * body.n + i
                params = sampling_params(body, limit, logprobs, len(self.tokenizer), index, grammar, calls)
                keep = turn if index == 0 or turn is None else replace(turn, keep="", pin_s=0.0)
                choices.append(Choice(index, Request(ids, params, plan, keep, tenant)))
        return choices

    async def prompt(self, call: Call, body: ChatCompletionRequest) -> tuple[Dicts, Dicts | None, list[int], Plan]:
        """The messages and tools as the template reads them, the prompt's tokens and their plan."""
        messages = [m.for_template(i) for i, m in enumerate(body.messages)]
        given = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        shown, tools = prepare(self.tool_format, messages, given)
        options = body.kvgate  # its reuse unset: the request's kind decides (blend for documents, kvcomm for spans)
        chat = Chat(
            shown,
            tools=tools,
            add_generation_prompt=body.add_generation_prompt,
            documents=[d.model_dump(exclude_none=True) for d in body.documents] if body.documents else None,
            mode=options.reuse if options is not None and "reuse" in options.model_fields_set else None,
            ratio=options.recompute_ratio if options is not None else None,
            program=call.program,
            scope=self.scope(call.tenant),
            tenant=call.tenant,
        )
        prompt, plan = await asyncio.to_thread(self.planner.chat, chat)
        return messages, given, prompt, plan

    async def count_tokens(self, call: Call) -> int:
        assert isinstance(call.parsed, ChatCompletionRequest)
        self.generates(call.model)
        return len((await self.prompt(call, call.parsed))[2])

    async def streamed(
        self,
        body: Sampling,
        choices: list[Choice],
        head: dict[str, Any],
        prompt_tokens: int,
        opening: list[dict[str, Any]],
        render: Render,
        headers: dict[str, str] | None = None,
        ended: Ended | None = None,
    ) -> Reply:
        """SSE: the opening choice chunks, each output as `render` makes it into choice chunks, the
        usage chunk if asked for, and always [DONE]. The reply is made once the prompt is prefilled:
        its headers say what reuse did (an error before then is an ordinary error response)."""
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        outputs = run(self.engine, choices, self.admission)
        first = await anext(outputs)
        settled: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()

        def event(choice: dict[str, Any]) -> dict[str, Any]:
            chunk = {**head, "choices": [choice]}
            return chunk | {"usage": None} if include_usage else chunk

        async def rest() -> AsyncIterator[tuple[int, Output]]:
            yield first
            async for item in outputs:
                yield item

        async def events() -> AsyncIterator[Data]:
            completion_tokens, whole = 0, Result()
            try:
                for choice in opening:
                    yield event(choice)
                async for index, out in rest():
                    completion_tokens += out.completion_tokens if out.finish_reason is not None else 0
                    if index == 0:
                        whole.add(out)
                    for choice in render(index, out):
                        yield event(choice)
                counted = usage(prompt_tokens, completion_tokens, first[1].report.reused)
                if include_usage:
                    yield {**head, "choices": [], "usage": counted}
                if ended is not None:
                    await ended(whole.text)
                settled.set_result(outcome(whole, counted))
            except Exception as exc:
                yield internal(exc).body()
            yield DONE

        headers = reuse_headers(first[1].report) | (headers or {})
        return Reply(headers=headers, chunks=events(), settled=settled, close=outputs.aclose)

    # ---- documents -----------------------------------------------------------------------

    async def add_document(self, text: str, raw: bytes, tenant: str, request_id: str) -> Reply:
        return Reply(headers=JSON, answer=await self.keep_document(text, tenant))

    async def document(self, method: str, document_id: str, tenant: str, request_id: str) -> Reply:
        if method == "DELETE":
            return Reply(headers=JSON, answer=await self.forget_document(document_id, tenant))
        return Reply(headers=JSON, answer=await self.find_document(document_id, tenant))

    async def keep_document(self, text: str, tenant: str) -> dict[str, Any]:
        """The tenant's document: its KV computed and kept; its card."""
        ids = await asyncio.to_thread(self.planner.tokens, text)
        limit = self.engine.max_model_len
        if len(ids) >= limit:
            said = f"the document has {len(ids)} tokens; the context window is {limit}"
            raise bad_request(said, "text", "context_length_exceeded")
        scope = self.scope(tenant)
        await self.engine.ingest(ids, scope, tenant)
        # Answered once durable where it can be: its writes to lower tiers land first (bounded wait).
        return await asyncio.to_thread(self.document_card, self.planner.document_id(ids, scope), len(ids), True)

    async def find_document(self, document_id: str, tenant: str) -> dict[str, Any]:
        """A tenant's document's card (NotFound: no such document of theirs)."""
        _, tokens = self.planner.find(document_id, self.scope(tenant))
        return self.document_card(document_id, len(tokens))

    async def forget_document(self, document_id: str, tenant: str) -> dict[str, Any]:
        self.planner.forget(document_id, self.scope(tenant))
        return {"id": document_id, "object": "document", "deleted": True}

    def document_card(self, document_id: str, tokens: int, settle: bool = False) -> dict[str, Any]:
        """`tier`: where its KV is; `durable`: that tier outlives this process (disk, Redis). `settle`
        (blocking: call it off the event loop) waits first until its KV's writes have landed."""
        tier = self.planner.cached(document_id.removeprefix("doc-"), settle)
        where = {"cached": tier is not None, "tier": tier and tier.name, "durable": bool(tier and tier.durable)}
        return {"id": document_id, "object": "document", "tokens": tokens, **where}

    # ---- the process -----------------------------------------------------------------------

    async def ready(self) -> dict[str, Any]:
        if not self.alive():
            raise APIError(503, "the engine thread has stopped", code="engine_down")
        return {"status": "ready", "model": self.name, **self.engine.load_stats, "calibration": self.calibration()}

    def calibration(self) -> dict[str, Any]:
        """Where blends' recompute ratio comes from (runtime/caching.py `standing`): `calibrated` false while
        the server calibrates online (it serves full prefill where it would blend), or cannot."""
        standing = self.engine.standing()
        return {"calibrated": standing.calibrated, **asdict(standing)}

    def alive(self) -> bool:
        return self.engine.alive()

    def metrics(self) -> Iterator[Metric]:
        engine = self.engine
        yield from tier_metrics(engine.store.stats()["tiers"])
        load = engine.load_stats
        yield gauge("kvgate_requests_waiting", "sequences waiting for the engine", load["waiting"])
        yield gauge("kvgate_requests_running", "sequences the engine is running", load["running"])
        yield from fidelity_metrics(self.name, *engine.checks())
        standing = engine.standing()
        yield from calibration_metrics(self.name, standing.state, STATES, standing.checks)
        yield from self.agents.metrics()
        if (anchors := engine.anchor_stats()) is not None:
            yield gauge("kvgate_kvcomm_anchors", "KVCOMM anchors held", anchors["anchors"])
            yield gauge("kvgate_kvcomm_anchor_bytes", "bytes of KVCOMM anchor deviations", anchors["bytes"])
            yield counter("kvgate_kvcomm_estimates", "spans reused with offsets from anchors", anchors["estimates"])
            yield counter("kvgate_kvcomm_gated", "spans no anchor was close to (dense prefill)", anchors["gated"])
            yield counter("kvgate_kvcomm_anchor_evictions", "KVCOMM anchors evicted", anchors["evicted"])

    async def close(self) -> None:
        await self.agents.close()
