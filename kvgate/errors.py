"""Errors of the kvgate SDK, named as the openai SDK names them.

An error response's body is OpenAI's, `{"error": {"message", "type", "param", "code"}}`;
`error_for` turns a status and a body into the matching `APIStatusError`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from email.utils import parsedate_to_datetime
from typing import Any

__all__ = [
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "InternalServerError",
    "KVGateError",
    "NotFoundError",
    "PermissionDeniedError",
    "RateLimitError",
    "RequestTooLargeError",
    "UnprocessableEntityError",
    "error_for",
]


class KVGateError(Exception):
    """Base of every error the SDK raises."""


class APIConnectionError(KVGateError):
    """The request did not get an answer: the server could not be reached or the connection broke."""

    def __init__(self, message: str = "connection error") -> None:
        super().__init__(message)
        self.message = message


class APITimeoutError(APIConnectionError):
    """The request timed out."""

    def __init__(self, message: str = "request timed out") -> None:
        super().__init__(message)


class APIStatusError(KVGateError):
    """The server answered with an error status; its OpenAI error body, read into fields."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        body: object = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(f"{status_code}: {message}")
        self.status_code, self.message = status_code, message
        self.type, self.param, self.code = type, param, code
        self.body = body
        self.headers: dict[str, str] = {k.lower(): v for k, v in (headers or {}).items()}

    @property
    def request_id(self) -> str | None:
        return self.headers.get("x-request-id")


class BadRequestError(APIStatusError):
    """400: a malformed or invalid request."""


class AuthenticationError(APIStatusError):
    """401: a missing or wrong API key."""


class PermissionDeniedError(APIStatusError):
    """403: the key may not do this (a model it may not use, an admin route)."""


class NotFoundError(APIStatusError):
    """404: an unknown model, document or route."""


class ConflictError(APIStatusError):
    """409."""


class RequestTooLargeError(APIStatusError):
    """413: a body over the server's `max_body_bytes`."""


class UnprocessableEntityError(APIStatusError):
    """422."""


class RateLimitError(APIStatusError):
    """429: over a rate limit; `retry_after` is the seconds the server asked to wait, if it said."""

    @property
    def retry_after(self) -> float | None:
        return _retry_after(self.headers.get("retry-after"))


class InternalServerError(APIStatusError):
    """5xx."""


_CLASSES: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    413: RequestTooLargeError,
    422: UnprocessableEntityError,
    429: RateLimitError,
}


def error_for(status: int, body: object, headers: Mapping[str, str] | None = None) -> APIStatusError:
    """The error for a response: `body` is its JSON (or its bytes or text, when it was not JSON)."""
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            pass
    fields: dict[str, Any] = {}
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        fields = dict(body["error"])
    message = fields.get("message")
    if not isinstance(message, str) or not message:
        message = _text_of(body) or f"HTTP {status}"
    cls = _CLASSES.get(status) or (InternalServerError if status >= 500 else APIStatusError)
    return cls(
        message,
        status_code=status,
        type=_str_or_none(fields.get("type")),
        param=_str_or_none(fields.get("param")),
        code=_str_or_none(fields.get("code")),
        body=body,
        headers=headers,
    )


def _text_of(body: object) -> str:
    if body is None:
        return ""
    if isinstance(body, str):
        return body.strip()
    return json.dumps(body, default=str)


def _str_or_none(value: object) -> str | None:
    return None if value is None else str(value)


def _retry_after(value: str | None) -> float | None:
    """Retry-After: seconds, or an HTTP date."""
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        return max(parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
    except (TypeError, ValueError):
        return None
