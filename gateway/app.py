"""The FastAPI application: routes, the request-id and body-size middlewares, error shapes."""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import Response
from kvgate.gateway import admin, chat, completions, documents, errors, proxy
from kvgate.gateway.errors import APIError, internal
from kvgate.gateway.keys import Keys, authenticate
from kvgate.gateway.limits import limiter as make_limiter
from kvgate.gateway.metrics import CONTENT_TYPE, Metrics, Observe, counter, gauge, merged, tier_metrics
from kvgate.gateway.proxy import Front
from kvgate.gateway.serving import Served
from kvgate.gateway.settings import Settings
from kvgate.gateway.upstreams import Upstream
from kvgate.runtime.engine import Engine
from prometheus_client.core import GaugeMetricFamily, Metric
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("kvgate")

_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class RequestId:
    """Every response carries x-request-id: the client's own when it sent a sane one, and the headers
    a dependency left in request.state.response_headers (rate limits).

    It is the outermost middleware, so it also turns an unhandled exception into the 500 (Starlette's
    own error middleware sits outside it and would answer without the id)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _CLIENT_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
                given = {name for name, _ in headers}
                for name, value in scope["state"].get("response_headers", {}).items():
                    if name.encode() not in given:
                        headers.append((name.encode(), value.encode()))
                message["headers"] = headers
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            log.exception("request %s failed", request_id)
            if started:  # too late for an error response; the server ends the connection
                raise
            await send_json(send_with_id, internal(exc))


class BodyLimit:
    """413 for a body over the limit, whether it declares its length or streams it in chunks.

    The body is read here (it is JSON the app would buffer anyway) and replayed to the app."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self.reject(send)
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.limit:
                return await self.reject(send)
            if not message.get("more_body", False):
                break
        body = b"".join(parts)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: wait for the client to hang up
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def reject(self, send: Send) -> None:
        error = APIError(413, f"the request body is larger than {self.limit} bytes", code="request_too_large")
        await send_json(send, error)


async def send_json(send: Send, error: APIError) -> None:
    """An error response, sent from a middleware (below the app's exception handlers)."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def create_app(settings: Settings, engine: Engine | None, workers: tuple[Upstream, ...] = ()) -> FastAPI:
    """The gateway over the in-process runtime `engine`, or, without one, over upstreams (proxy mode:
    the configured ones, or `workers`, this front's runtime worker processes)."""
    metrics = Metrics()
    keys = Keys(settings.api_keys, settings.redis_url, settings.keys_required, settings.limits())
    limiter = make_limiter(settings.redis_url)
    front = Front(settings, settings.proxy_config(workers)) if engine is None else None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if front is not None:
            await front.close()
        await keys.close()
        await limiter.close()

    app = FastAPI(title="kvgate", version="0.1.0", lifespan=lifespan)
    app.state.settings, app.state.metrics, app.state.keys, app.state.limiter = settings, metrics, keys, limiter
    errors.install(app)
    authenticated = [Depends(authenticate)]
    if front is not None:
        app.state.front = front
        app.state.semantic = front.semantic
        app.include_router(proxy.router, dependencies=authenticated)
        described = app.openapi

        def openapi() -> dict[str, Any]:
            if app.openapi_schema is None:
                app.openapi_schema = proxy.with_bodies(described())
            return app.openapi_schema

        app.openapi = openapi  # type: ignore[method-assign]
        metrics.watch(lambda: gate_metrics(front))
    else:
        assert engine is not None
        app.state.served = served = Served(settings, engine)
        app.state.semantic = served.semantic
        for router in (chat.router, completions.router, documents.router):
            app.include_router(router, dependencies=authenticated)
        models_routes(app, served)
        metrics.watch(lambda: engine_metrics(served))
    app.include_router(admin.router)
    app.include_router(admin.keys_router)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Liveness: the process serves (and its engine thread runs)."""
        if engine is not None and not engine.thread.is_alive():
            raise APIError(503, "the engine thread has stopped", code="engine_down")
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> dict[str, Any]:
        """Readiness: the model is loaded and serving, or the upstreams answer."""
        if engine is not None:
            if not engine.thread.is_alive():
                raise APIError(503, "the engine thread has stopped", code="engine_down")
            return {"status": "ready", "model": served.name, **engine.load_stats}
        assert front is not None
        found = await front.pool.reachable()
        if not any(found.values()):
            raise APIError(503, f"no upstream is reachable: {sorted(found)}", code="upstreams_down")
        return {"status": "ready", "upstreams": found}

    @app.get("/metrics")
    async def prometheus() -> Response:
        """This process's metrics; a front's also carry its workers' (labelled `worker`)."""
        if front is None or not workers:
            return Response(metrics.text(), media_type=CONTENT_TYPE)
        return Response(merged(metrics.text(), await front.pool.scrape(workers)), media_type=CONTENT_TYPE)

    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(Observe, metrics=metrics)
    app.add_middleware(RequestId)  # outermost: even a 413 carries the id
    return app


def models_routes(app: FastAPI, served: Served) -> None:
    engine = served.engine

    def card() -> dict[str, Any]:
        return {
            "id": served.name,
            "object": "model",
            "created": served.created,
            "owned_by": "kvgate",
            "root": str(engine.loaded.path),
            "max_model_len": engine.max_model_len,
        }

    @app.get("/v1/models", dependencies=[Depends(authenticate)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}", dependencies=[Depends(authenticate)])
    async def model(model: str) -> dict[str, Any]:
        served.check_model(model)
        return card()


def engine_metrics(served: Served) -> Iterator[Metric]:
    engine = served.engine
    yield from tier_metrics(engine.reuser.store.stats()["tiers"])
    load = engine.load_stats
    yield gauge("kvgate_requests_waiting", "sequences waiting for the engine", load["waiting"])
    yield gauge("kvgate_requests_running", "sequences the engine is running", load["running"])
    programs = served.programs.stats()
    yield gauge("kvgate_programs", "agent programs seen recently", programs["programs"])
    yield gauge("kvgate_pinned_programs", "agent programs whose context is pinned", programs["pinned"])
    yield counter("kvgate_program_turns", "agent turns ended", programs["turns_ended"])
    yield counter("kvgate_tool_returns", "agent turns that followed a tool call", programs["tool_returns"])
    if served.anchors is not None:
        anchors = served.anchors.stats()
        yield gauge("kvgate_kvcomm_anchors", "KVCOMM anchors held", anchors["anchors"])
        yield gauge("kvgate_kvcomm_anchor_bytes", "bytes of KVCOMM anchor deviations", anchors["bytes"])
        yield counter("kvgate_kvcomm_estimates", "spans reused with offsets from anchors", anchors["estimates"])
        yield counter("kvgate_kvcomm_gated", "spans no anchor was close to (dense prefill)", anchors["gated"])
        yield counter("kvgate_kvcomm_anchor_evictions", "KVCOMM anchors evicted", anchors["evicted"])


def gate_metrics(front: Front) -> Iterator[Metric]:
    busy = GaugeMetricFamily("kvgate_upstream_in_flight", "requests sent to an upstream", labels=["upstream"])
    waiting = GaugeMetricFamily("kvgate_upstream_waiting", "requests waiting for an upstream", labels=["upstream"])
    for name, gate in front.pool.gates.items():
        busy.add_metric([name], gate.busy)
        waiting.add_metric([name], len(gate.waiting))
    yield busy
    yield waiting
