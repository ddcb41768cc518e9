"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the right status; on
Anthropic's routes (/v1/messages) in its shape: {"type": "error", "error": {"type", "message"}}."""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import Scope

from kvgate.runtime.errors import ServerError

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


# An OpenAI error type's status, for an error that arrives as a body (mid-stream) without one.
STATUS_OF = {kind: status for status, kind in reversed(TYPES.items())}
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
ANTHROPIC_ROUTES = "/v1/messages"
# Refusals counted by reason (kvgate_refused_total), by the code of the error each is answered with; a 429 or
# 503 of another code (an upstream's, passed on) is "other".
REFUSALS = {
    "rate_limit_exceeded": "rate_limit",  # a key's (or address's) rpm or tpm
    "tenant_queue_full": "tenant_queue_full",
    "server_queue_full": "server_queue_full",
    "too_many_sequences": "too_many_sequences",
    "overloaded": "overloaded",  # the embedder's requests in flight
    "redis_unavailable": "redis_down",
    "request_too_large": "request_too_large",
    "engine_down": "engine_down",
    "upstreams_down": "upstreams_down",
}
REASONS = (*dict.fromkeys(REFUSALS.values()), "other")


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def speaks_anthropic(path: str) -> bool:
    return path == ANTHROPIC_ROUTES or path.startswith(ANTHROPIC_ROUTES + "/")


class AsciiJSON(JSONResponse):
    """JSON with non-ASCII escaped: an error may quote the client's input, which JSON lets hold lone
    surrogates that UTF-8 cannot encode (found by fuzzing: a 500)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


class APIError(ServerError):
    """A server error the gateway raises itself, with any status and the headers its answer carries."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message, param, code)
        self.status = status
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def body_for(self, path: str) -> dict[str, Any]:
        """The body in the shape of the API `path` belongs to; Anthropic's has no param: its message names it."""
        return anthropic_error(self.status, self.message) if speaks_anthropic(path) else self.body()

    def response(self, path: str = "") -> JSONResponse:
        return AsciiJSON(self.body_for(path), status_code=self.status, headers=self.headers)


def refusal(error: APIError) -> str | None:
    """The reason a refusal is counted under; None for an error that refuses nothing (a 400, 404, 500)."""
    if error.code in REFUSALS:
        return REFUSALS[error.code]
    return "other" if error.status in (429, 503) else None


def note(scope: Scope, error: APIError) -> None:
    """The refusal an error answers, on the request's state (Starlette's `request.state`), where the metrics'
    middleware (gateway/metrics.py `Observe`) counts it once the answer has gone out."""
    scope.setdefault("state", {})["refused"] = refusal(error)


def answer(request: Request, error: APIError) -> JSONResponse:
    """An error's response, its refusal noted: every error the app answers is rendered here (or, from a
    middleware, in gateway/app.py `send_json`)."""
    note(request.scope, error)
    return error.response(request.url.path)


def internal(exc: Exception) -> APIError:
    """The error a client sees for an exception: a ServerError (any layer says what failed by raising
    one) as it says, anything else a 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ServerError):  # raised below the gateway: it says how a client sees it
        return APIError(exc.status, exc.message, exc.param, exc.code)
    return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


# The segments pydantic adds to an error's location for union members and validators: type tags
# (str, list[int], union[...]), validator tags (function-after[...]) and model class names.
_UNION_TAG = re.compile(r"^(str|int|float|bool|bytes|none|[a-z-]+\[.*\]|[A-Z]\w*)$")


def from_validation(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return bad_request(
            f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "),
            code="invalid_json",
        )
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Union tags in the location say nothing to a client; keep field names, keys and indices.
    loc = [p for p in loc if p and not _UNION_TAG.match(p)]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if first.get("type") == "missing":
        message = f"missing required field '{param}'" if param else "the request body is missing; send a JSON object"
    elif param:
        message = f"invalid value for '{param}': {message}"
    if first.get("type") == "model_attributes_type" and not loc:
        message = "the request body must be a JSON object"
    return bad_request(message, param, code="invalid_value" if first.get("type") != "missing" else "missing_field")


def install(app: FastAPI) -> None:
    @app.exception_handler(ServerError)
    async def _server(request: Request, exc: ServerError) -> JSONResponse:
        return answer(request, internal(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(request, from_validation(exc))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = "not found: no such route"
        return answer(request, APIError(exc.status_code, message))
