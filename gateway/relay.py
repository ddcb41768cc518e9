"""An upstream's answer passed on to the client: a whole one read within a size limit; a stream cut into
its SSE events as they arrive, each passed on at once, its usage and text noted."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

from kvgate.gateway.backend import Outcome
from kvgate.gateway.errors import APIError
from kvgate.gateway.render import sse
from kvgate.gateway.upstreams import OpenedStream, UpstreamFailed, UpstreamTimeout

# A line ends with CRLF, LF or CR (SSE allows each); an empty line ends the event. A CR ends a line by
# itself only once the next byte is known not to be an LF: a CRLF split between two reads is one line end.
LINE_END = rb"(?:\r\n|\r(?=[^\n])|\n)"
EVENT_END = re.compile(LINE_END + LINE_END)


async def whole(opened: OpenedStream, limit: int) -> bytes:
    """The rest of an answer that is not streamed (the route lets the upstream go if the client leaves):
    more than `limit` bytes is a 502, and nothing more is read."""
    try:
        declared = opened.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large(opened, limit, "one answer")
        parts, size = [opened.first], len(opened.first)
        while size <= limit and (chunk := await anext(opened.chunks, None)) is not None:
            parts.append(chunk)
            size += len(chunk)
        if size > limit:
            raise too_large(opened, limit, "one answer")
        return b"".join(parts)
    except UpstreamFailed as exc:
        raise failed(opened, exc, "mid-answer") from exc
    finally:
        await opened.close()


def too_large(opened: OpenedStream, limit: int, what: str) -> APIError:
    said = f"upstream {opened.upstream.name} sent more than {limit} bytes in {what} (proxy_max_response_bytes)"
    return APIError(502, said, code="upstream_response_too_large")


def failed(opened: OpenedStream, exc: UpstreamFailed, where: str) -> APIError:
    """An upstream that failed after its first bytes (`where`: mid-answer, mid-stream): nothing is
    retried, the client is told."""
    status = 504 if isinstance(exc, UpstreamTimeout) else 502
    said = f"upstream {opened.upstream.name} failed {where}: {exc}"
    return APIError(status, said, code="upstream_error")


class Events:
    """SSE events cut out of a stream's bytes as they arrive. One event may hold at most `limit` bytes:
    more raises OverflowError. Each byte is searched once (a stream sent in small pieces is not
    searched again from its start each time)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buffer = bytearray()  # the event not yet ended
        self.searched = 0  # bytes of it without an event's end

    def feed(self, chunk: bytes) -> list[bytes]:
        self.buffer += chunk
        found, start = [], 0
        # An event's end and the byte after a CR it ends with are 4 bytes at most (\r\n\r\n, or \r\n\r and
        # one not an LF): an end waiting on the new bytes begins at most 3 bytes before them.
        while (end := EVENT_END.search(self.buffer, max(start, self.searched - 3))) is not None:
            found.append(bytes(self.buffer[start : end.start()]))
            start = end.end()
        del self.buffer[:start]
        self.searched = len(self.buffer)
        if len(self.buffer) > self.limit or any(len(event) > self.limit for event in found):
            raise OverflowError(f"an SSE event over {self.limit} bytes")
        return found

    def rest(self) -> list[bytes]:
        """What the stream ended with after its last event's end, less its line ends (a CR last, waiting to
        see whether an LF followed, ended the event: nothing follows)."""
        event = bytes(self.buffer).rstrip(b"\r\n")
        return [event] if event.strip() else []


def event_data(event: bytes) -> bytes | None:
    """An SSE event's data: its `data:` fields' values joined by newlines (SSE's rule), whatever other
    fields (`id:`, `event:`) or comment lines come with them; None when it has none."""
    if event.startswith(b"data:") and b"\n" not in event and b"\r" not in event:  # the usual event: one data line
        return event[6:] if event.startswith(b"data: ") else event[5:]
    values = []
    for line in event.splitlines():
        name, _, value = line.partition(b":")
        if name == b"data":
            values.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(values) if values else None


class Relay:
    """An upstream's answer on its way to the client: a whole one read at once; a stream passed on
    event by event, its usage chunk read (and dropped if the client did not ask for it), an upstream
    failing mid-stream (or sending an event over `limit` bytes) ending it with an error event. What it
    came to settles `settled` as the stream ends (`outcome`); the text kept of it (`keep_text`) is at most `limit`
    bytes too."""

    def __init__(self, opened: OpenedStream, keep_usage: bool, keep_text: bool, limit: int) -> None:
        self.opened, self.keep_usage, self.keep_text, self.limit = opened, keep_usage, keep_text, limit
        self.settled: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self.text: list[str] = []
        self.kept = 0  # the text's length so far
        self.cut = False  # the text outgrew the limit: not kept, the outcome is not whole
        self.usage: dict[str, Any] = {}
        self.finish_reason: str | None = None
        self.done = False  # [DONE] came, the text whole

    def settle(self) -> None:
        if not self.settled.done():
            self.settled.set_result(self.outcome())

    def outcome(self) -> Outcome:
        text = "".join(self.text) if self.done else ""
        return Outcome(text, self.finish_reason, self.usage, done=self.done)

    async def events(self) -> AsyncIterator[bytes]:
        events = Events(self.limit)
        try:
            chunk: bytes | None = self.opened.first
            while chunk is not None:
                for event in events.feed(chunk):
                    if (passed := self.read(event)) is not None:
                        yield passed + b"\n\n"
                chunk = await anext(self.opened.chunks, None)
            for event in events.rest():
                if (passed := self.read(event)) is not None:
                    yield passed + b"\n\n"
        except (UpstreamFailed, OverflowError) as exc:
            self.done = False
            if isinstance(exc, UpstreamFailed):
                error = failed(self.opened, exc, "mid-stream")
            else:
                error = too_large(self.opened, self.limit, "one SSE event")
            yield sse(error.body()).encode()
            yield sse("[DONE]").encode()
        finally:
            self.settle()
            await self.opened.close()

    def read(self, event: bytes) -> bytes | None:
        """Note what an event says; what of it to pass on (None: nothing)."""
        data = event_data(event)
        if data is None:
            # SSE dispatches no event without data; the openai SDK reads one with an `id:` as an empty
            # chunk and fails on it. Its comments (keep-alives) still keep the client's connection open.
            comments = [line for line in event.splitlines() if line.startswith(b":")]
            return b"\n".join(comments) or None
        if data.strip() == b"[DONE]":  # settled before it goes out: the route counts and keeps the answer then
            self.done = not self.cut
            self.settle()
            return event
        if not self.keep_text and b'"usage"' not in data:
            return event
        try:
            chunk = json.loads(data)
        except ValueError:
            return event
        if not isinstance(chunk, dict):
            return event
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
            if not chunk.get("choices"):
                return event if self.keep_usage else None
        for choice in chunk.get("choices") or ():
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                self.keep((choice.get("delta") or {}).get("content") or "")
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return event

    def keep(self, text: str) -> None:
        self.text.append(text)
        self.kept += len(text)
        if self.kept > self.limit:
            self.keep_text, self.cut, self.text = False, True, []

    def read_whole(self, content: bytes) -> Outcome:
        """What a whole answer came to."""
        if self.opened.status != 200:
            return Outcome()
        try:
            answer = json.loads(content)
        except ValueError:
            return Outcome()
        if not isinstance(answer, dict):
            return Outcome()
        usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
        choice = (answer.get("choices") or [{}])[0]
        if not isinstance(choice, dict):
            return Outcome(usage=usage)
        text = (choice.get("message") or {}).get("content") or ""
        return Outcome(text, choice.get("finish_reason"), usage, done=True)
