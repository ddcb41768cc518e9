"""The proxy backends: upstream OpenAI-compatible servers, and kvgate's own runtime workers routed by
cache affinity. Bodies are forwarded as they came unless a field must change; SSE events are passed
on as each one arrives. No torch here: a proxy front is a light process."""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from functools import partial
from typing import Any
from urllib.parse import quote

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvgate.gateway import tracing
from kvgate.gateway.admission import Admission, ProgramClock, fan_out
from kvgate.gateway.backend import Backend, Call, Reply
from kvgate.gateway.errors import APIError
from kvgate.gateway.outgoing import headers_for, pasted_documents
from kvgate.gateway.placement import placements
from kvgate.gateway.relay import Relay, whole
from kvgate.gateway.replica_load import ReplicaLoads
from kvgate.gateway.routing import Router, conversation_key
from kvgate.gateway.settings import Settings
from kvgate.gateway.upstreams import OpenedStream, Upstream, UpstreamPool

PASSED_ON = ("content-type", "retry-after")  # and every x-kvgate-* header
DOCUMENT_OWNERS = 65536  # document ids remembered with the worker that stored them


class Upstreams(Backend):
    """The gateway over upstream servers (and runtime workers, when it fronts some)."""

    validates = False  # a body kvgate cannot read is forwarded: the upstream judges it

    def __init__(self, settings: Settings, workers: tuple[Upstream, ...] = ()) -> None:
        self.pool = UpstreamPool(settings.proxy_config(workers))
        names = [u.name for u in self.pool.config.upstreams if not u.fallback]
        kept = placements(settings.redis_url, settings.proxy.route_conversations, settings.proxy.route_ttl_s)
        self.router = Router(names, kept, settings.proxy.spill_at, settings.proxy.routing)
        self.loads = ReplicaLoads(
            names, self.pool.scrape_named, self.pool.load, settings.proxy.replica_load_poll_s, settings.proxy.spill_at
        )
        self.clock = ProgramClock(settings.agent_config().idle_s)
        self.owners: OrderedDict[str, str] = OrderedDict()  # document id -> the affinity key of its text
        self.created = int(time.time())
        self.admission = Admission(
            settings.security.max_request_seqs,
            settings.security.max_waiting_seqs,
            settings.security.max_waiting_seqs_per_tenant,
        )
        self.limit = settings.proxy.max_response_bytes  # a whole answer, or one SSE event, held here

    def models(self) -> list[dict[str, Any]]:
        return [
            {"id": m, "object": "model", "created": self.created, "owned_by": "kvgate-proxy"}
            for m in self.pool.models()
        ]

    def serves(self, model: str) -> bool:
        return any(u.serves(model) for u in self.pool.config.upstreams)

    def document_models(self) -> list[str]:
        return sorted({m for u in self.pool.config.upstreams if u.worker for m in u.models})

    def identity(self, model: str) -> dict[str, str]:
        serving = sorted(u.name for u in self.pool.config.upstreams if u.serves(model))  # not by load: stable
        return {"model": model, "upstreams": ",".join(serving)}

    def queued(self) -> int:
        return sum(g.load for g in self.pool.gates.values())

    def remember(self, document_id: str, key: str) -> None:
        self.owners[document_id] = key
        self.owners.move_to_end(document_id)
        if len(self.owners) > DOCUMENT_OWNERS:
            self.owners.popitem(last=False)

    def affinity(self, body: dict[str, Any]) -> list[str]:
        """The documents a replica may hold the KV of for this request."""
        keys = []
        documents = body.get("documents")
        for doc in documents if isinstance(documents, list) else ():  # a malformed one is the upstream's to refuse
            if isinstance(doc, dict) and isinstance(doc.get("id"), str):  # where the text it was stored from went
                keys.append(self.owners.get(doc["id"], doc["id"]))
            elif isinstance(doc, dict) and isinstance(doc.get("text"), str):
                keys.append(text_key(doc["text"]))
        return keys

    async def generate(self, call: Call) -> Reply:
        """Forwarded once admitted: the local engine's bounds, on sequences (prompts x n) waiting at the
        gates or in flight upstream, held until the answer has been read or its stream closed."""
        await self.admission.screen(call.tenant, *fan_out(call.body))  # a 429 held back a second
        held = self.admission.admit(call.tenant, *fan_out(call.body))  # nothing awaited since: it fits
        try:
            reply = await self.forward(call)
        except BaseException:
            held.close()
            raise
        if not reply.streamed:
            held.close()
            return reply
        return replace(reply, close=releasing(reply.close, held.close))

    async def forward(self, call: Call) -> Reply:
        body, model = call.body, call.model
        stream_options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
        asked_usage = stream_options.get("include_usage") is True
        # The tokens of a stream are counted from its usage chunk: asked for here if the client did not.
        changed = call.stream and not asked_usage
        sent_body = {**body, "stream_options": {**stream_options, "include_usage": True}} if changed else body

        def payload(upstream: Upstream) -> bytes:
            """The body for one upstream: renamed model; kvgate's own options and documents for kvgate's workers,
            an other engine reads the documents pasted in the prompt."""
            named = upstream.model_name(model)
            ours = ("kvgate" in body or "documents" in body) and not upstream.worker
            if named == model and not changed and not ours:
                return call.raw
            return json.dumps({**shown_to(upstream, sent_body), "model": named}).encode()

        tenant_program = None if call.program is None else f"{call.tenant}/{call.program}"
        affinity = self.affinity(body)
        key = conversation_key(call.tenant, body, call.program, affinity)
        serving = self.pool.serving(model)
        self.loads.start()  # reading each replica's own load, from the first request on (a running loop)
        routed = await self.router.order([u.name for u in serving if not u.fallback], key, affinity, self.loads.load)
        started = time.monotonic()
        opened = await self.pool.open(
            [self.pool.upstreams[name] for name in routed] + [u for u in serving if u.fallback],
            call.path,
            payload,
            lambda u: headers_for(call.request_id, call.tenant, u.worker, call.program),
            rank=self.clock.rank(tenant_program),
            stream=call.stream,
        )
        # to the upstream's first bytes (its whole answer unless streamed): its gate's queue, retries, its prefill
        tracing.stage(
            "kvgate.upstream",
            started,
            {"kvgate.upstream": opened.upstream.name, "http.response.status_code": opened.status},
        )
        await self.router.served(key, opened.upstream.name)  # the next turn goes where this one's KV is
        relay = Relay(opened, keep_usage=asked_usage, keep_text=call.keep, limit=self.limit)
        if not call.stream or opened.status != 200:
            content = await whole(opened, self.limit)
            return Reply(
                opened.status, passed_on(opened), content, settled=relay.read_whole(content), close=opened.close
            )
        return Reply(opened.status, passed_on(opened), events=relay.events(), settled=relay.settled, close=opened.close)

    async def count_tokens(self, call: Call) -> int:
        """Counted where the model is, by the upstream's /tokenize (vLLM's, SGLang's and kvgate's): the chat
        body as generate sends it (documents pasted into the prompt for an engine that is not kvgate's)."""

        def payload(upstream: Upstream) -> bytes:
            return json.dumps({**shown_to(upstream, call.body), "model": upstream.model_name(call.model)}).encode()

        sent = partial(headers_for, call.request_id, call.tenant)
        opened = await self.pool.open(self.pool.serving(call.model), "/tokenize", payload, lambda u: sent(u.worker))
        status, content = opened.status, await whole(opened, self.limit)
        try:
            answer = json.loads(content)
        except ValueError:
            answer = None
        if status == 200 and isinstance(answer, dict) and isinstance(answer.get("count"), int):
            return answer["count"]
        said = f"upstream {opened.upstream.name} did not count the tokens (status {status} on /tokenize)"
        raise APIError(502 if status == 200 else status, said, code="upstream_error")

    # ---- documents: only kvgate's own workers keep them; a document's text never goes elsewhere ----

    async def add_document(self, text: str, raw: bytes, tenant: str, request_id: str) -> Reply:
        key = text_key(text)
        reply = await self.send_document("POST", "/v1/documents", raw, [key], tenant, request_id)
        if reply.status == 200:
            self.remember(reply.json()["id"], key)
        return reply

    async def document(self, method: str, document_id: str, tenant: str, request_id: str) -> Reply:
        path = "/v1/documents/" + quote(document_id, safe="")  # as it came: never a path of another route
        keys = [self.owners.get(document_id, document_id)]
        return await self.send_document(method, path, b"", keys, tenant, request_id)

    async def send_document(
        self, method: str, path: str, raw: bytes, keys: list[str], tenant: str, request_id: str
    ) -> Reply:
        """A document request, sent where its KV lives (or will): the worker its text hashes to."""
        order = self.pool.workers(keys)
        if not order:
            raise APIError(
                404, "documents are kept by kvgate's runtime workers; this gateway has none", code="no_workers"
            )
        opened = await self.pool.open(
            order, path, lambda _: raw, lambda u: headers_for(request_id, tenant, u.worker), method
        )
        return Reply(opened.status, passed_on(opened), await whole(opened, self.limit))

    # ---- the process -----------------------------------------------------------------------

    async def ready(self) -> dict[str, Any]:
        found = await self.pool.reachable()
        if not any(found.values()):
            raise APIError(503, f"no upstream is reachable: {sorted(found)}", code="upstreams_down")
        return {"status": "ready", "upstreams": found}

    def metrics(self) -> Iterator[Metric]:
        busy = GaugeMetricFamily("kvgate_upstream_in_flight", "requests sent to an upstream", labels=["upstream"])
        waiting = GaugeMetricFamily("kvgate_upstream_waiting", "requests waiting for an upstream", labels=["upstream"])
        for name, gate in self.pool.gates.items():
            busy.add_metric([name], gate.busy)
            waiting.add_metric([name], len(gate.waiting))
        yield busy
        yield waiting
        answered = CounterMetricFamily(
            "kvgate_upstream_responses", "answers an upstream gave that were passed on", labels=["upstream", "status"]
        )
        for (name, status), count in sorted(self.pool.answered.items()):
            answered.add_metric([name, status], count)
        failed = CounterMetricFamily(
            "kvgate_upstream_errors", "tries an upstream failed (retried, or passed over)", labels=["upstream", "error"]
        )
        for (name, error), count in self.pool.errors.items():
            failed.add_metric([name, error], count)
        routed = CounterMetricFamily("kvgate_routing_decisions", "requests routed, by why", labels=["reason"])
        for reason, count in self.router.decisions.items():
            routed.add_metric([reason], count)
        yield from (answered, failed, routed)

    async def close(self) -> None:
        await self.loads.close()
        await self.pool.close()
        await self.router.placements.close()


class Workers(Upstreams):
    """The gateway over kvgate's own runtime workers (gateway/workers.py starts them): routed by
    cache affinity, trusted with documents and kvgate's options; their metrics are this front's too."""

    def __init__(self, settings: Settings, workers: tuple[Upstream, ...] = ()) -> None:
        super().__init__(settings, workers)
        self.workers = workers

    async def scrape(self) -> dict[str, str]:
        return await self.pool.scrape(self.workers)


def releasing(
    close: Callable[[], Awaitable[None]] | None, release: Callable[[], None]
) -> Callable[[], Awaitable[None]]:
    """`close`, then `release` (whatever `close` did)."""

    async def closing() -> None:
        try:
            if close is not None:
                await close()
        finally:
            release()

    return closing


def shown_to(upstream: Upstream, body: dict[str, Any]) -> dict[str, Any]:
    """The body as an upstream reads it: as sent for kvgate's workers; another engine gets the documents
    pasted into the prompt and not kvgate's options."""
    return body if upstream.worker else pasted_documents({k: v for k, v in body.items() if k != "kvgate"})


def text_key(text: str) -> str:
    return "text:" + hashlib.sha256(text.encode()).hexdigest()


def passed_on(opened: OpenedStream) -> dict[str, str]:
    found = {k: v for k, v in opened.headers.items() if k in PASSED_ON or k.startswith("x-kvgate-")}
    return {**found, "x-kvgate-upstream": opened.upstream.name}
