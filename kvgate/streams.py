"""A streamed chat completion, read from kvgate's SSE: `ChatStream` and its async twin."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from kvgate.errors import APIConnectionError, APITimeoutError, KVGateError, error_for
from kvgate.types import Reuse

__all__ = ["AsyncChatStream", "ChatStream"]

# A stream's error event has no status of its own; its OpenAI type says which error it is.
_STATUS_OF_TYPE = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "rate_limit_error": 429,
}


@contextmanager
def _transport() -> Iterator[None]:
    """httpx's transport failures as the SDK's errors."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise APITimeoutError(f"request timed out: {exc!r}") from exc
    except httpx.TransportError as exc:
        raise APIConnectionError(f"connection error: {exc!r}") from exc


class _StreamState:
    """A chat stream's SSE decoding and what it has said so far, for both stream classes."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.reuse = Reuse.from_headers(response.headers)
        self.text = ""
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self._data: list[str] = []
        self._done = self._closed = False

    def _feed(self, line: str) -> dict[str, Any] | None:
        """One line of SSE; the chunk when it ends an event."""
        if line.startswith("data:"):
            self._data.append(line[5:].removeprefix(" "))
        if line or not self._data:
            return None  # comments and other SSE fields carry nothing kvgate sends
        data, self._data = "\n".join(self._data), []
        if data.strip() == "[DONE]":
            self._done = True
            return None
        try:
            chunk = json.loads(data)
        except ValueError:
            chunk = None
        if not isinstance(chunk, dict):
            raise KVGateError(f"the stream sent an event that is not a JSON object: {data[:200]!r}")
        if "error" in chunk:
            error = chunk["error"] if isinstance(chunk["error"], dict) else {}
            raise error_for(_STATUS_OF_TYPE.get(str(error.get("type")), 500), chunk, self.response.headers)
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) == 0:
                self.text += (choice.get("delta") or {}).get("content") or ""
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        return chunk

    def _end(self) -> None:
        if not self._done:  # a proxy or the server gave up mid-answer
            raise APIConnectionError("the stream ended before [DONE]")


class ChatStream(_StreamState):
    """A streamed chat completion: iterate for chunk dicts; `reuse` is known from the start."""

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._done or self._closed:
            return
        try:
            with _transport():
                for line in self.response.iter_lines():
                    if (chunk := self._feed(line)) is not None:
                        yield chunk
                    if self._done:
                        return
            if (chunk := self._feed("")) is not None:  # a last event without its blank line
                yield chunk
            self._end()
        finally:
            self.close()

    def close(self) -> None:
        self._closed = True
        self.response.close()

    def __enter__(self) -> ChatStream:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class AsyncChatStream(_StreamState):
    """`ChatStream`'s async twin: `async for chunk in stream`."""

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        if self._done or self._closed:
            return
        try:
            with _transport():
                async for line in self.response.aiter_lines():
                    if (chunk := self._feed(line)) is not None:
                        yield chunk
                    if self._done:
                        return
            if (chunk := self._feed("")) is not None:  # a last event without its blank line
                yield chunk
            self._end()
        finally:
            await self.close()

    async def close(self) -> None:
        self._closed = True
        await self.response.aclose()

    async def __aenter__(self) -> AsyncChatStream:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()
