"""Proxy mode, the relay: how kvgate passes an upstream's bytes on, and where it never sends them.

The upstream is tests/helpers/raw_upstream.py's, every write scripted: an SSE event cut mid-`data:` line, mid-UTF-8
character and mid-terminator, several events in one write, CRLF line endings and `: keep-alive` comments; pauses
between events; a 429 with a `Retry-After`. A real server would rarely frame its stream that badly, which is the
point: kvgate must re-frame whatever arrives. What it sends on is fixed here: each event as the upstream wrote it,
up to its terminator, ended with `\\n\\n`; comment events passed on (they keep the client's connection alive
too); the usage chunk kvgate asked for dropped; then `data: [DONE]`. What it reads of them: test_proxy_events.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx

from kvgate.gateway.app import create_app
from kvgate.gateway.backend import make_backend
from kvgate.gateway.upstreams import Upstream
from tests.helpers import loopback
from tests.helpers.raw_upstream import (
    HELLO,
    PIECES,
    RawUpstream,
    chunk,
    completion,
    cut,
    front,
    json_answer,
    relayed,
    sdk,
    sse_stream,
)
from tests.helpers.servers import serving

# ---- SSE re-framing ------------------------------------------------------------------------------


def test_events_cut_and_merged_anyhow_reach_the_client_whole_in_order_and_lf_framed(tmp_path: Path) -> None:
    keep_alive = b": keep-alive\r\n\r\n"
    events = [chunk({"role": "assistant", "content": PIECES[0]})]
    events += [chunk({"content": piece}) for piece in PIECES[1:]]
    usage = {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}
    events += [chunk({}, finish="stop"), chunk({}, usage=usage)]
    framed = [b"data: " + event + b"\r\n\r\n" for event in events]
    stream = keep_alive + b"".join(framed[:3]) + keep_alive + b"".join(framed[3:]) + b"data: [DONE]\r\n\r\n"
    pieces = cut(
        stream,
        keep_alive + b"da",  # a comment, then an event cut inside `data:`
        "ü".encode()[:1],  # ...and inside the two bytes of `ü`
        b"\r\n\r",  # ...and inside its terminator
        "日".encode()[:2],  # the next event, cut after two of the three bytes of `日`
        keep_alive,  # the rest of it, a whole event and a comment in one write
        b'"completion_tokens": 5',  # three events and half the usage chunk
    )  # last: the usage chunk's end and [DONE]
    assert len(pieces) == 7 and b"".join(pieces) == stream
    upstream = RawUpstream(lambda seen: sse_stream(*((0.03, piece) for piece in pieces)))
    with upstream, serving(front(tmp_path, upstream.url), None) as url:
        chunks = list(sdk(url).chat.completions.create(model="stub-a", messages=HELLO, stream=True))
        body = {"model": "stub-a", "messages": HELLO, "stream": True}
        raw = loopback.post(url + "/v1/chat/completions", json=body, timeout=10)
    assert [c.choices[0].delta.content for c in chunks] == [*PIECES, None]  # every piece whole, in order
    assert chunks[-1].choices[0].finish_reason == "stop" and all(c.usage is None for c in chunks)
    assert len(upstream.seen) == 2 and json.loads(upstream.seen[0].body)["stream_options"] == {"include_usage": True}
    # On the wire: the upstream's events as it wrote them, each ended by `\n\n` (its CRLFs gone with the
    # terminators), the comments kept, the usage chunk kvgate asked for dropped, then [DONE].
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    wire = [b": keep-alive", *(b"data: " + e for e in events[:3]), b": keep-alive"]
    wire += [*(b"data: " + e for e in events[3:-1]), b"data: [DONE]"]
    assert raw.content == b"".join(event + b"\n\n" for event in wire)


def test_events_ended_by_bare_crs_reach_the_client_whole(tmp_path: Path) -> None:
    """SSE lines may end with a CR alone: `\\r\\r` ends an event as `\\n\\n` does. A CR last in a write ends
    nothing yet (an LF may come next); the stream's end ends its last event, `data: [DONE]\\r\\r`."""
    events = [b"data: " + chunk({"role": "assistant", "content": PIECES[0]}), b": keep-alive"]
    events += [b"id: %d\revent: message\rdata: " % i + chunk({"content": p}) for i, p in enumerate(PIECES[1:], 1)]
    events += [b"data: " + chunk({}, finish="stop"), b"data: [DONE]"]
    stream = b"".join(event + b"\r\r" for event in events)
    # cut between an event's two CRs, after a CR inside one (`id: 1\\r`), and just after an event's two CRs
    pieces = cut(stream, b"\r", b"id: 1\r", b"\r\r")
    texts, wire = relayed(tmp_path, pieces)
    assert texts == [*PIECES, None]
    assert wire == b"".join(event + b"\n\n" for event in events)  # each event as written, its CRs within


def test_a_crlf_split_between_two_writes_is_one_line_end(tmp_path: Path) -> None:
    """A write may end between the CR and the LF of a CRLF: one line end, never a CR's and an LF's (an empty
    line: the event cut short). Cut so inside an event (`id: 0\\r` | `\\ndata:`) and in an event's terminator:
    `\\r\\n\\r` | `\\n`, and `\\r` | `\\n\\r\\n`."""
    events = [b"id: %d\r\ndata: " % i + chunk({"content": p}) for i, p in enumerate(PIECES)] + [b"data: [DONE]"]
    stream = b"".join(event + b"\r\n\r\n" for event in events)
    pieces = cut(stream, b"id: 0\r", b"\r\n\r", b"}\r")
    assert pieces[1].endswith(b"}\r\n\r") and pieces[2].startswith(b"\nid: 1") and pieces[3].startswith(b"\n\r\n")
    texts, wire = relayed(tmp_path, pieces)
    assert texts == PIECES
    assert wire == b"".join(event + b"\n\n" for event in events)


# ---- events leave as they arrive -----------------------------------------------------------------


def test_each_event_reaches_the_client_before_the_upstream_writes_the_next(tmp_path: Path) -> None:
    """The upstream pauses 0.6 s before each event after the first: a relay that held the stream (or any
    event) back until more arrived would hand the client its first chunk only after the last was written."""
    pause_s = 0.6
    writes = [(0.0 if i == 0 else pause_s, b"data: " + chunk({"content": p}) + b"\n\n") for i, p in enumerate(PIECES)]
    upstream = RawUpstream(lambda seen: sse_stream(*writes, (pause_s, b"data: [DONE]\n\n")))
    received: list[float] = []
    with upstream, serving(front(tmp_path, upstream.url), None) as url:
        texts = []
        for c in sdk(url).chat.completions.create(model="stub-a", messages=HELLO, stream=True):
            received.append(time.monotonic())
            texts.append(c.choices[0].delta.content)
    written = upstream.written
    assert texts == PIECES and len(written) == len(PIECES) + 1
    assert received[0] < written[-2] - 2 * pause_s  # the first chunk, long before the last event left
    for i in range(len(PIECES)):
        assert received[i] < written[i + 1], f"chunk {i} arrived only after the upstream wrote the next event"


# ---- a 429's Retry-After: honoured up to 2 s, longer goes to the next upstream at once --------------


def asked(upstream: RawUpstream) -> list:
    """The chats an upstream was sent (the front also reads each one's /metrics, for its load)."""
    return [seen for seen in upstream.seen if seen.path == "/v1/chat/completions"]


def test_a_429_whose_retry_after_is_too_long_goes_to_the_next_upstream_at_once(tmp_path: Path) -> None:
    limited = RawUpstream(lambda seen: json_answer({"error": {"message": "slow down"}}, 429, {"retry-after": "3"}))
    other = RawUpstream(lambda seen: json_answer(completion("from the next one")))
    with limited, other, serving(front(tmp_path, limited.url, other.url), None) as url:
        started = time.monotonic()
        raw = sdk(url, timeout_s=20).chat.completions.with_raw_response.create(model="stub-a", messages=HELLO)
        took = time.monotonic() - started
    assert raw.headers["x-kvgate-upstream"] == "up-1"
    assert raw.parse().choices[0].message.content == "from the next one"
    assert (len(asked(limited)), len(asked(other))) == (1, 1)  # never asked again: its limit lifts in 3 s, over 2 s
    assert took < 1.5  # no wait at all (one honoured, even capped at 2 s, would be 2 s)


def test_a_429_whose_retry_after_is_2_s_is_waited_for_on_the_same_upstream(tmp_path: Path) -> None:
    answers = iter([json_answer({"error": {"message": "slow down"}}, 429, {"retry-after": "2"})])
    limited = RawUpstream(  # the script is the chats' (the front's read of /metrics, racing them, gets a 404)
        lambda seen: (
            json_answer({}, 404)
            if seen.path == "/metrics"
            else next(answers, None) or json_answer(completion("after the wait"))
        )
    )
    other = RawUpstream(lambda seen: json_answer(completion("from the next one")))
    with limited, other, serving(front(tmp_path, limited.url, other.url), None) as url:
        started = time.monotonic()
        raw = sdk(url, timeout_s=20).chat.completions.with_raw_response.create(model="stub-a", messages=HELLO)
        took = time.monotonic() - started
    assert raw.headers["x-kvgate-upstream"] == "up-0"
    assert raw.parse().choices[0].message.content == "after the wait"
    assert (len(asked(limited)), len(asked(other))) == (2, 0)
    assert took >= 1.9  # Retry-After: 2 honoured whole (the backoff alone is 10 ms)


# ---- a client gone as its stream starts --------------------------------------------------------


def test_a_client_gone_as_its_stream_starts_hands_the_upstream_slot_on(tmp_path: Path) -> None:
    """The upstream's first bytes are in, the answer's head is being sent, and the client leaves while its
    connection's window is full (the server's `send` waits, as uvicorn's does on a paused transport): the
    relay never starts, so only the reply's own `close` lets the upstream go. The next request, at an
    upstream that takes one at a time, must get the slot.

    The gateway is driven at the ASGI level (the upstream is real): a client cannot time its leaving into
    that one await over a socket."""
    first = b"data: " + chunk({"role": "assistant", "content": PIECES[0]}) + b"\n\n"
    upstream = RawUpstream(
        lambda seen: (
            sse_stream((0.0, first), (30.0, b"data: [DONE]\n\n"))
            if json.loads(seen.body).get("stream")
            else json_answer(completion("next"))
        )
    )
    body = json.dumps({"model": "stub-a", "messages": HELLO, "stream": True}).encode()
    gone = asyncio.Event()
    exchanged: list[str] = []

    async def receive() -> dict[str, Any]:
        if not exchanged:
            exchanged.append("request")
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        exchanged.append(message["type"])
        if message["type"] == "http.response.start":
            gone.set()
            await asyncio.sleep(0.05)  # a paused transport's drain

    async def scenario(app: Any) -> httpx.Response:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        path = "/v1/chat/completions"
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "root_path": "", "headers": headers, "client": ("127.0.0.1", 40000), "server": ("gw", 80)}  # fmt: skip
        try:
            async with asyncio.timeout(10):
                await app(scope, receive, send)
            assert exchanged == ["request", "http.response.start"]  # gone before any event was sent
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client, asyncio.timeout(5):
                return await client.post(path, json={"model": "stub-a", "messages": HELLO})
        finally:
            await app.state.backend.close()

    with upstream:
        one_at_a_time = [{"name": "up-0", "base_url": upstream.url + "/v1", "models": ["stub-a"], "max_in_flight": 1}]
        settings = front(tmp_path, upstream.url, proxy={"upstreams": one_at_a_time})
        after = asyncio.run(scenario(create_app(settings, make_backend(settings))))
    assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"] == "next"
    assert len(upstream.seen) == 2


# ---- /v1/documents stays with kvgate's own workers ------------------------------------------------

SECRET_TEXT = "The merger closes on 3 March; do not tell anyone."


def test_documents_never_reach_an_upstream_kvgate_does_not_own(tmp_path: Path) -> None:
    """Without workers the document routes are a 404 `no_workers`; with workers that fail, the worker's
    error is the answer. Either way the hosted upstream, which serves the same model, sees nothing."""
    hosted = RawUpstream(lambda seen: json_answer({"id": "doc-hosted", "object": "document"}))
    worker_up = RawUpstream(lambda seen: json_answer({"error": {"message": "busy"}}, 503))
    with hosted, worker_up:
        with serving(front(tmp_path, hosted.url), None) as url:
            added = loopback.post(url + "/v1/documents", json={"text": SECRET_TEXT}, timeout=10)
            shown = loopback.get(url + "/v1/documents/doc-hosted", timeout=10)
            dropped = loopback.delete(url + "/v1/documents/doc-hosted", timeout=10)
        for answer in (added, shown, dropped):
            assert answer.status_code == 404 and answer.json()["error"]["code"] == "no_workers"
            said = answer.json()["error"]["message"]
            assert said == "documents are kept by kvgate's runtime workers; this gateway has none"
        worker = Upstream("worker-0", worker_up.url, {"stub-a": "stub-a"}, worker=True, secret="front-secret")
        with serving(front(tmp_path, hosted.url), None, workers=(worker,)) as url:
            added = loopback.post(url + "/v1/documents", json={"text": SECRET_TEXT}, timeout=10)
            shown = loopback.get(url + "/v1/documents/doc-1", timeout=10)
        assert added.status_code == 503 and added.headers["x-kvgate-upstream"] == "worker-0"
        assert shown.status_code == 503 and shown.headers["x-kvgate-upstream"] == "worker-0"
    assert [(s.method, s.path) for s in worker_up.seen] == [("POST", "/v1/documents")] * 3 + [
        ("GET", "/v1/documents/doc-1")
    ] * 3  # retried there, as any 503 is
    assert SECRET_TEXT.encode() in worker_up.seen[0].body and worker_up.seen[3].body == b""
    assert hosted.seen == []
