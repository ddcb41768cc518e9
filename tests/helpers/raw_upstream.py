"""A raw HTTP/1.1 upstream on loopback whose every write is scripted, for the proxy's relay tests: an SSE
event cut anywhere, pauses between writes, a body cut short, a 429 with a `Retry-After`; and the chunks,
answers and settings those tests build."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import openai

from kvgate.gateway.settings import Settings
from tests.helpers import loopback
from tests.helpers.servers import serving

R = TypeVar("R")
HELLO = [{"role": "user", "content": "hello"}]
PIECES = ["Grüße", " aus ", "日本", " ✓", " fin"]  # multi-byte characters, to be cut mid-character


@dataclass
class Seen:
    """One request as the upstream received it."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Answer:
    """What the upstream answers: a status, headers, and its body as writes, each `(pause_s, bytes)`: wait,
    then write the bytes as one HTTP chunk and flush them. `chunked=False`: one body with a Content-Length."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    writes: Sequence[tuple[float, bytes]] = ()
    chunked: bool = True
    cut: bool = False  # the connection closes before the body's end (a chunked body without its last chunk)


class RawUpstream:
    """An HTTP/1.1 server on a loopback port, in a thread of its own, answering each request with what
    `answer` says for it, byte for byte. It keeps every request it received (`seen`) and when each write of
    a body left (`written`, time.monotonic())."""

    def __init__(self, answer: Callable[[Seen], Answer]) -> None:
        self.answer = answer
        self.seen: list[Seen] = []
        self.written: list[float] = []
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._serve(),), daemon=True)
        self._ready = threading.Event()

    def __enter__(self) -> RawUpstream:
        self._thread.start()
        assert self._ready.wait(10), "the raw upstream did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self._ready.set()
        await self._stop.wait()
        server.close()
        # Answers still being written (an upstream scripted to stall) end with the server, not after its loop.
        handlers = asyncio.all_tasks() - {asyncio.current_task()}
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request a connection (answered with `connection: close`)."""
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            method, path, _ = head[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in head[1:] if line)}
            seen = Seen(method, path, headers, await reader.readexactly(int(headers.get("content-length", "0"))))
            self.seen.append(seen)
            answer = self.answer(seen)
            framing = {"transfer-encoding": "chunked"}
            if not answer.chunked:
                framing = {"content-length": str(sum(len(data) for _, data in answer.writes))}
            lines = [f"HTTP/1.1 {answer.status} Scripted", "connection: close"]
            lines += [f"{k}: {v}" for k, v in {**answer.headers, **framing}.items()]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
            await writer.drain()
            for pause_s, data in answer.writes:
                await asyncio.sleep(pause_s)
                writer.write(b"%x\r\n%s\r\n" % (len(data), data) if answer.chunked else data)
                await writer.drain()
                self.written.append(time.monotonic())
            if answer.chunked and not answer.cut:
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the other side left
        finally:
            writer.close()


def json_answer(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Answer:
    data = json.dumps(body).encode()
    return Answer(status, {"content-type": "application/json", **(headers or {})}, [(0.0, data)], chunked=False)


def completion(text: str) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    choices = [{"index": 0, "message": message, "finish_reason": "stop"}]
    body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "stub-a"}
    return {**body, "choices": choices, "usage": usage}


def chunk(delta: dict[str, Any], finish: str | None = None, usage: dict[str, int] | None = None) -> bytes:
    """One chat.completion.chunk, its JSON as a server sends it (UTF-8, not escaped to ASCII)."""
    choices = [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]
    body = {"id": "chatcmpl-relay", "object": "chat.completion.chunk", "created": 0, "model": "stub-a"}
    return json.dumps({**body, "choices": choices, **({"usage": usage} if usage else {})}, ensure_ascii=False).encode()


def sse_stream(*writes: tuple[float, bytes]) -> Answer:
    return Answer(200, {"content-type": "text/event-stream", "cache-control": "no-cache"}, writes)


def front(tmp_path: Path, *urls: str, **overrides: Any) -> Settings:
    upstreams = [{"name": f"up-{i}", "base_url": url + "/v1", "models": ["stub-a"]} for i, url in enumerate(urls)]
    proxy = {"upstreams": upstreams, "backoff_s": 0.01}
    return Settings(proxy=proxy, semantic_cache={"enabled": False}, cache_dir=tmp_path).model_copy(update=overrides)


def sdk(url: str, timeout_s: float = 10) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="anything", max_retries=0, timeout=timeout_s)


def cut(stream: bytes, *marks: bytes) -> list[bytes]:
    """`stream` cut just after each mark (found in order, each after the previous cut)."""
    pieces, start = [], 0
    for mark in marks:
        end = stream.index(mark, start) + len(mark)
        pieces.append(stream[start:end])
        start = end
    return [*pieces, stream[start:]]


def relayed(tmp_path: Path, pieces: list[bytes]) -> tuple[list[str | None], bytes]:
    """The chunks' texts the SDK reads through kvgate, and the bytes a raw client gets, the upstream writing
    `pieces` 30 ms apart."""
    upstream = RawUpstream(lambda seen: sse_stream(*((0.03, piece) for piece in pieces)))
    with upstream, serving(front(tmp_path, upstream.url), None) as url:
        chunks = list(sdk(url).chat.completions.create(model="stub-a", messages=HELLO, stream=True))
        body = {"model": "stub-a", "messages": HELLO, "stream": True}
        raw = loopback.post(url + "/v1/chat/completions", json=body, timeout=10)
    assert raw.status_code == 200
    return [c.choices[0].delta.content for c in chunks], raw.content


def until_hit(ask: Callable[[], R]) -> R:
    """`ask()` again until the semantic cache answers it (an answer is kept after it went out), 5 s at most:
    the last answer."""
    for _ in range(50):
        answer = ask()
        if answer.headers.get("x-kvgate-cache") == "hit":  # type: ignore[attr-defined]
            break
        time.sleep(0.1)
    return answer
