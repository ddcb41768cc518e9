"""The FastAPI application: routes, the request-id and body-size middlewares, error shapes."""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvgate.gateway import admin, errors, logs, messages, responses, routes, tracing
from kvgate.gateway.backend import Backend
from kvgate.gateway.errors import APIError, internal, note
from kvgate.gateway.keys import Keys, authenticate, redis_down
from kvgate.gateway.limits import limiter as make_limiter
from kvgate.gateway.metrics import CONTENT_TYPE, Metrics, Observe, merged, semantic_metrics
from kvgate.gateway.redis_state import REDIS_DOWN
from kvgate.gateway.responses_store import response_store
from kvgate.gateway.semantic import Checks
from kvgate.gateway.settings import Settings
from kvgate.gateway.workers import front_only

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
            await send_json(send_with_id, internal(exc), scope)


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
            return await self.reject(send, scope)
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.limit:
                return await self.reject(send, scope)
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

    async def reject(self, send: Send, scope: Scope) -> None:
        error = APIError(413, f"the request body is larger than {self.limit} bytes", code="request_too_large")
        await send_json(send, error, scope)


async def send_json(send: Send, error: APIError, scope: Scope) -> None:
    """An error response, sent from a middleware (outside the app's exception handlers), its refusal noted."""
    note(scope, error)
    body = json.dumps(error.body_for(scope["path"])).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def create_app(settings: Settings, backend: Backend) -> FastAPI:
    """The gateway: one set of OpenAI routes over `backend` (the local engine, runtime workers or
    upstream servers), with keys, limits, the semantic cache and metrics in front."""
    logs.install()
    traces = tracing.start(settings)  # None unless operations.tracing
    metrics = Metrics()
    keys = Keys(settings)
    limiter = make_limiter(settings.redis_url)
    kept = response_store(settings.redis_url)  # /v1/responses kept for previous_response_id
    semantic = None
    if settings.semantic_cache.enabled:  # the embedder and the index: torch and hnswlib, only when wanted
        from kvgate.semantic_cache import SemanticCache

        semantic = SemanticCache(settings.semantic_cache_config())
        metrics.watch(partial(semantic_metrics, semantic.bound.stats))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await backend.close()  # its threads (pin expiry) stop, its connections close
        await keys.close()
        await limiter.close()
        await kept.close()
        if semantic is not None:
            semantic.close()
        if traces is not None:
            traces.shutdown()  # its last spans exported

    docs = settings.security.openapi_docs
    app = FastAPI(
        title="kvgate",
        version="0.1.0",
        lifespan=lifespan,
        openapi_url="/openapi.json" if docs else None,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
    )
    app.state.settings, app.state.metrics, app.state.keys, app.state.limiter = settings, metrics, keys, limiter
    app.state.backend, app.state.semantic = backend, semantic
    app.state.checks = Checks()  # would-be hits checked beside the hit (semantic_verify_beside)
    app.state.responses = kept
    errors.install(app)
    for outage in REDIS_DOWN:
        app.add_exception_handler(outage, redis_down)
    app.include_router(routes.router, dependencies=[Depends(authenticate)])
    app.include_router(responses.router, dependencies=[Depends(authenticate)])
    app.include_router(messages.router, dependencies=[Depends(authenticate)])
    app.include_router(admin.router)
    app.include_router(admin.keys_router)
    document_bodies(app)
    metrics.watch(backend.metrics)
    probes(app, settings, backend, metrics)
    app.add_middleware(BodyLimit, limit=settings.security.max_body_bytes)
    front_only(app, settings)  # a runtime worker answers its front only, before reading a body
    app.add_middleware(Observe, metrics=metrics)
    if traces is not None:
        traces.install(app)  # inside RequestId: the request's id is on its span
    app.add_middleware(RequestId)  # outermost: even a 413 carries the id
    return app


def document_bodies(app: FastAPI) -> None:
    """/openapi.json with the request bodies the routes parse themselves (routes.with_bodies)."""
    described = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = routes.with_bodies(described())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def probes(app: FastAPI, settings: Settings, backend: Backend, metrics: Metrics) -> None:
    """/health, /ready and /metrics (the last as `security.metrics_access` says: open, admin only, or absent)."""

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Liveness: the process serves (and its engine thread runs)."""
        if not backend.alive():
            raise APIError(503, "the engine thread has stopped", code="engine_down")
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> dict[str, Any]:
        """Readiness: the model is loaded and serving, or the upstreams answer."""
        return await backend.ready()

    async def prometheus() -> Response:
        """This process's metrics; a front's also carry its workers' (labelled `worker`)."""
        behind = await backend.scrape()
        return Response(merged(metrics.text(), behind) if behind else metrics.text(), media_type=CONTENT_TYPE)

    if settings.security.metrics_access != "off":  # off: no route, a 404
        guard = [Depends(admin.admin_only)] if settings.security.metrics_access == "admin" else []
        app.add_api_route("/metrics", prometheus, methods=["GET"], dependencies=guard)
