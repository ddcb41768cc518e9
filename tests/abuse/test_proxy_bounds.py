"""An upstream cannot make a proxy front hold more than `proxy.max_response_bytes` of one answer: a
whole answer over it is a 502 (the rest never read), one SSE event over it ends the stream with an
error event, a long stream of small events passes through event by event, and the text the semantic
cache would keep of it stops being kept. The upstream is a small real server written here, answering
without end where asked: a front that buffered it would never answer."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvgate.gateway.settings import Settings
from tests.helpers import loopback
from tests.helpers.servers import free_port, serving
from tests.helpers.waiting import wait_until

LIMIT = 1 << 20  # the front's proxy_max_response_bytes here
PIECE = 64 << 10
ENDLESS = {"sent": 0, "open": 0}  # bytes the upstream sent of its endless answers; those still sending


async def endless(request: Request, head: bytes) -> AsyncIterator[bytes]:
    """Until the client is gone (a send to a closed connection returns at once: it is asked each time)."""
    ENDLESS["open"] += 1
    try:
        yield head
        while not await request.is_disconnected():
            ENDLESS["sent"] += PIECE
            yield b"x" * PIECE
    finally:
        ENDLESS["open"] -= 1


async def stall(request: Request, head: bytes) -> AsyncIterator[bytes]:
    yield head
    while not await request.is_disconnected():
        await asyncio.sleep(0.05)


def event(content: str, finish: str | None = None) -> bytes:
    chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": content}}]}
    chunk["choices"][0]["finish_reason"] = finish
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


async def long_stream(events: int, size: int) -> AsyncIterator[bytes]:
    for _ in range(events):
        yield event("y" * size)
    yield event("", "stop")
    yield b"data: [DONE]\n\n"


def exactly(size: int) -> bytes:
    """A whole answer of exactly `size` bytes."""
    answer = {"message": {"role": "assistant", "content": ""}, "finish_reason": "stop", "index": 0}
    empty = len(json.dumps({"object": "chat.completion", "choices": [answer]}).encode())
    answer["message"]["content"] = "x" * (size - empty)
    return json.dumps({"object": "chat.completion", "choices": [answer]}).encode()


async def pieces(body: bytes) -> AsyncIterator[bytes]:
    """In 64 KiB pieces, the last after a pause: a front holding exactly the limit by then must read on."""
    starts = range(0, len(body), PIECE)
    for start in starts:
        if start == starts[-1]:
            await asyncio.sleep(0.2)
        yield body[start : start + PIECE]


def upstream() -> FastAPI:
    """Answers by the model asked for: `endless` without end (JSON or one SSE event), `declared` says
    4 MiB will come, `long` a 4 MiB stream of 1 KiB events, `short` a small answer, `limit` and `limit+1`
    an answer of exactly the limit and one byte more, with its length declared or (`chunked`) not."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        model, stream = body["model"], body.get("stream") is True
        if model == "endless":
            kind = "text/event-stream" if stream else "application/json"
            return StreamingResponse(endless(request, b"data: " if stream else b'{"choices": "'), media_type=kind)
        if model == "declared":  # then stalls: only a front that believes the length answers at once
            stalled = stall(request, b"{")
            return StreamingResponse(stalled, media_type="application/json", headers={"content-length": str(4 * LIMIT)})
        if model.startswith("limit"):
            body = exactly(LIMIT + model.count("+1"))
            if model.endswith("chunked"):
                return StreamingResponse(pieces(body), media_type="application/json")
            return Response(body, media_type="application/json")
        if model == "long":
            return StreamingResponse(long_stream(4 * LIMIT // 1024, 1024), media_type="text/event-stream")
        if stream:
            return StreamingResponse(long_stream(3, 8), media_type="text/event-stream")
        answer = {"message": {"role": "assistant", "content": "short"}, "finish_reason": "stop", "index": 0}
        return JSONResponse({"object": "chat.completion", "choices": [answer], "usage": {"total_tokens": 1}})

    return app


@contextmanager
def running(app: FastAPI) -> Iterator[str]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "uvicorn did not start")
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running(upstream()) as up:
        models = ["endless", "declared", "long", "short", "limit", "limit+1", "limit chunked", "limit+1 chunked"]
        settings = Settings(
            proxy={
                "upstreams": [{"name": "up", "base_url": up, "models": models}],
                "max_response_bytes": LIMIT,
                "retries": 0,
            },
            semantic_cache={"enabled": True},
            cache_dir=tmp_path_factory.mktemp("front"),
        )
        with serving(settings, None) as url:
            yield url


def ask(url: str, model: str, **body: object) -> httpx.Response:
    payload = {"model": model, "messages": [{"role": "user", "content": f"Tell me about {model}."}], **body}
    return loopback.post(url + "/v1/chat/completions", json=payload, timeout=30)


def too_large(error: dict, what: str = "one answer") -> None:
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "upstream_response_too_large" and error["type"] == "server_error"
    assert f"more than {LIMIT} bytes in {what} (proxy_max_response_bytes)" in error["message"]


def test_an_endless_answer_is_cut_with_a_502_and_let_go(front: str) -> None:
    began = time.monotonic()
    r = ask(front, "endless")
    took = time.monotonic() - began
    assert r.status_code == 502
    too_large(r.json()["error"])
    print(f"502 after {took:.2f} s, the upstream having sent {ENDLESS['sent'] >> 20} MiB")
    assert took < 5
    # the front closed the connection: the upstream stopped sending
    wait_until(lambda: not ENDLESS["open"], 2, "the upstream kept sending", every_s=0.05)


def test_a_declared_length_over_the_limit_is_refused_unread(front: str) -> None:
    began = time.monotonic()
    r = ask(front, "declared")
    assert r.status_code == 502 and time.monotonic() - began < 5
    too_large(r.json()["error"])


@pytest.mark.parametrize("framing", ["", " chunked"])
def test_an_answer_of_exactly_the_limit_passes_and_one_byte_more_is_a_502(front: str, framing: str) -> None:
    """With its length declared (refused unread when over) or not (counted as it is read)."""
    r = ask(front, "limit" + framing)
    assert r.status_code == 200 and len(r.content) == LIMIT and r.headers.get("content-length") == str(LIMIT)
    over = ask(front, "limit+1" + framing)
    assert over.status_code == 502
    too_large(over.json()["error"])


def test_one_endless_sse_event_ends_the_stream_with_an_error(front: str) -> None:
    began = time.monotonic()
    r = ask(front, "endless", stream=True)
    assert r.status_code == 200 and time.monotonic() - began < 5
    events = [line for line in r.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and len(events) == 2
    too_large(json.loads(events[0].removeprefix("data: "))["error"], "one SSE event")


def test_a_long_stream_of_small_events_passes_and_is_not_kept(front: str) -> None:
    """4 MiB in 1 KiB events: over the limit in all, but no event is. Passed on whole; the text the
    semantic cache would keep outgrew the limit, so asking again is a miss, where a short one is a hit."""
    for model, again in (("long", "miss"), ("short", "hit")):
        first = ask(front, model, stream=True, temperature=0)
        assert first.status_code == 200 and first.headers["x-kvgate-cache"] == "miss"
        texts = [json.loads(e[6:])["choices"][0]["delta"]["content"] for e in first.text.split("\n\n") if "{" in e]
        assert sum(map(len, texts)) == (4 * LIMIT if model == "long" else 3 * 8)
        assert ask(front, model, stream=True, temperature=0).headers["x-kvgate-cache"] == again
