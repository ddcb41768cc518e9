"""The FastAPI application: routes, the request-id and body-size middlewares, error shapes."""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any

from fastapi import Depends, FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import admin, chat, completions, documents, errors
from gateway.errors import APIError, internal
from gateway.semantic import authenticate
from gateway.serving import Served
from gateway.settings import Settings
from runtime.engine import Engine

log = logging.getLogger("kvgate")

_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class RequestId:
    """Every response carries x-request-id: the client's own when it sent a sane one.

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
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
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
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def create_app(settings: Settings, engine: Engine) -> FastAPI:
    app = FastAPI(title="kvgate", version="0.1.0")
    app.state.settings = settings
    app.state.served = served = Served(settings, engine)
    errors.install(app)
    for router in (chat.router, completions.router, documents.router):
        app.include_router(router, dependencies=[Depends(authenticate)])
    app.include_router(admin.router)

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

    @app.get("/health")
    async def health() -> dict[str, Any]:
        if not engine.thread.is_alive():
            raise APIError(503, "the engine thread has stopped", code="engine_down")
        return {"status": "ok", "model": served.name, **engine.load_stats}

    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(RequestId)  # outermost: even a 413 carries the id
    return app
