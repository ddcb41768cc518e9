"""Proxy mode, the relay: how kvgate passes an upstream's bytes on, and where it never sends them.

The upstream here is a raw HTTP/1.1 server on loopback (asyncio streams) whose every write is scripted: an SSE
event cut mid-`data:` line, mid-UTF-8 character and mid-terminator, several events in one write, CRLF line
endings and `: keep-alive` comments; pauses between events; a 429 with a `Retry-After`. A real server would
rarely frame its stream that badly, which is the point: kvgate must re-frame whatever arrives. What it sends
on is fixed here: each event as the upstream wrote it, up to its terminator, ended with `\\n\\n`; comment events
passed on (they keep the client's connection alive too), of an event without data only its comments; the usage
chunk kvgate asked for dropped; then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import openai

from kvgate.gateway.proxy import Events, Relay, event_data
from kvgate.gateway.settings import Settings
from kvgate.gateway.upstreams import Upstream
from tests.servers import serving

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
    values = {"upstreams": upstreams, "semantic_cache": False, "cache_dir": tmp_path, "proxy_backoff_s": 0.01}
    return Settings(**{**values, **overrides})


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
        raw = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
    assert [c.choices[0].delta.content for c in chunks] == [*PIECES, None]  # every piece whole, in order
    assert chunks[-1].choices[0].finish_reason == "stop" and all(c.usage is None for c in chunks)
    assert len(upstream.seen) == 2 and json.loads(upstream.seen[0].body)["stream_options"] == {"include_usage": True}
    # On the wire: the upstream's events as it wrote them, each ended by `\n\n` (its CRLFs gone with the
    # terminators), the comments kept, the usage chunk kvgate asked for dropped, then [DONE].
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    wire = [b": keep-alive", *(b"data: " + e for e in events[:3]), b": keep-alive"]
    wire += [*(b"data: " + e for e in events[3:-1]), b"data: [DONE]"]
    assert raw.content == b"".join(event + b"\n\n" for event in wire)


def relayed(tmp_path: Path, pieces: list[bytes]) -> tuple[list[str | None], bytes]:
    """The chunks' texts the SDK reads through kvgate, and the bytes a raw client gets, the upstream writing
    `pieces` 30 ms apart."""
    upstream = RawUpstream(lambda seen: sse_stream(*((0.03, piece) for piece in pieces)))
    with upstream, serving(front(tmp_path, upstream.url), None) as url:
        chunks = list(sdk(url).chat.completions.create(model="stub-a", messages=HELLO, stream=True))
        body = {"model": "stub-a", "messages": HELLO, "stream": True}
        raw = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
    assert raw.status_code == 200
    return [c.choices[0].delta.content for c in chunks], raw.content


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


def test_a_429_whose_retry_after_is_too_long_goes_to_the_next_upstream_at_once(tmp_path: Path) -> None:
    limited = RawUpstream(lambda seen: json_answer({"error": {"message": "slow down"}}, 429, {"retry-after": "3"}))
    other = RawUpstream(lambda seen: json_answer(completion("from the next one")))
    with limited, other, serving(front(tmp_path, limited.url, other.url), None) as url:
        started = time.monotonic()
        raw = sdk(url, timeout_s=20).chat.completions.with_raw_response.create(model="stub-a", messages=HELLO)
        took = time.monotonic() - started
    assert raw.headers["x-kvgate-upstream"] == "up-1"
    assert raw.parse().choices[0].message.content == "from the next one"
    assert (len(limited.seen), len(other.seen)) == (1, 1)  # never asked again: its limit lifts in 3 s, over 2 s
    assert took < 1.5  # no wait at all (one honoured, even capped at 2 s, would be 2 s)


def test_a_429_whose_retry_after_is_2_s_is_waited_for_on_the_same_upstream(tmp_path: Path) -> None:
    answers = iter([json_answer({"error": {"message": "slow down"}}, 429, {"retry-after": "2"})])
    limited = RawUpstream(lambda seen: next(answers, None) or json_answer(completion("after the wait")))
    other = RawUpstream(lambda seen: json_answer(completion("from the next one")))
    with limited, other, serving(front(tmp_path, limited.url, other.url), None) as url:
        started = time.monotonic()
        raw = sdk(url, timeout_s=20).chat.completions.with_raw_response.create(model="stub-a", messages=HELLO)
        took = time.monotonic() - started
    assert raw.headers["x-kvgate-upstream"] == "up-0"
    assert raw.parse().choices[0].message.content == "after the wait"
    assert (len(limited.seen), len(other.seen)) == (2, 0)
    assert took >= 1.9  # Retry-After: 2 honoured whole (the backoff alone is 10 ms)


# ---- /v1/documents stays with kvgate's own workers ------------------------------------------------

SECRET_TEXT = "The merger closes on 3 March; do not tell anyone."


def test_documents_never_reach_an_upstream_kvgate_does_not_own(tmp_path: Path) -> None:
    """Without workers the document routes are a 404 `no_workers`; with workers that fail, the worker's
    error is the answer. Either way the hosted upstream, which serves the same model, sees nothing."""
    hosted = RawUpstream(lambda seen: json_answer({"id": "doc-hosted", "object": "document"}))
    worker_up = RawUpstream(lambda seen: json_answer({"error": {"message": "busy"}}, 503))
    with hosted, worker_up:
        with serving(front(tmp_path, hosted.url), None) as url:
            added = httpx.post(url + "/v1/documents", json={"text": SECRET_TEXT}, timeout=10)
            shown = httpx.get(url + "/v1/documents/doc-hosted", timeout=10)
            dropped = httpx.delete(url + "/v1/documents/doc-hosted", timeout=10)
        for answer in (added, shown, dropped):
            assert answer.status_code == 404 and answer.json()["error"]["code"] == "no_workers"
            said = answer.json()["error"]["message"]
            assert said == "documents are kept by kvgate's runtime workers; this gateway has none"
        worker = Upstream("worker-0", worker_up.url, {"stub-a": "stub-a"}, worker=True, secret="front-secret")
        with serving(front(tmp_path, hosted.url), None, workers=(worker,)) as url:
            added = httpx.post(url + "/v1/documents", json={"text": SECRET_TEXT}, timeout=10)
            shown = httpx.get(url + "/v1/documents/doc-1", timeout=10)
        assert added.status_code == 503 and added.headers["x-kvgate-upstream"] == "worker-0"
        assert shown.status_code == 503 and shown.headers["x-kvgate-upstream"] == "worker-0"
    assert [(s.method, s.path) for s in worker_up.seen] == [("POST", "/v1/documents")] * 3 + [
        ("GET", "/v1/documents/doc-1")
    ] * 3  # retried there, as any 503 is
    assert SECRET_TEXT.encode() in worker_up.seen[0].body and worker_up.seen[3].body == b""
    assert hosted.seen == []


# ---- events with other fields: read by their data ------------------------------------------------


def test_events_with_id_fields_are_read_by_their_data(tmp_path: Path) -> None:
    """SSE lets an event carry `id:` (or `event:`) lines before its data. Such an event is read like any
    other: its text is kept (the semantic cache replays the whole answer, not its tail), and a usage chunk
    the client did not ask for is dropped."""
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    usage = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    events = [chunk({"role": "assistant", "content": "Paris"}), chunk({"content": " is the capital."})]
    events += [chunk({}, finish="stop"), chunk({}, usage=usage)]
    writes = [(0.0, b"id: %d\nevent: message\ndata: " % i + e + b"\n\n") for i, e in enumerate(events)]
    upstream = RawUpstream(lambda seen: sse_stream(*writes, (0.0, b"data: [DONE]\n\n")))
    with upstream, serving(front(tmp_path, upstream.url, semantic_cache=True), None) as url:
        first = list(sdk(url).chat.completions.create(model="stub-a", messages=ask, stream=True, temperature=0))
        assert all(c.usage is None and c.choices for c in first)  # the usage chunk kvgate asked for: dropped
        assert "".join(c.choices[0].delta.content or "" for c in first) == "Paris is the capital."
        for _ in range(50):  # the answer is kept after it went out
            again = sdk(url).chat.completions.with_raw_response.create(
                model="stub-a", messages=ask, stream=True, temperature=0
            )
            if again.headers.get("x-kvgate-cache") == "hit":
                break
            time.sleep(0.1)
        assert again.headers.get("x-kvgate-cache") == "hit"
        replay = "".join(c.choices[0].delta.content or "" for c in again.parse() if c.choices)
    assert replay == "Paris is the capital."


def test_events_without_data_pass_on_only_their_comments(tmp_path: Path) -> None:
    """SSE dispatches no event without data, but the openai SDK reads one that carries an `id:` as an
    empty chunk and fails to parse it. kvgate passes on such an event's comment lines (a keep-alive still
    keeps the client's connection open) and nothing else of it."""
    events = [chunk({"role": "assistant", "content": PIECES[0]}), chunk({"content": PIECES[1]})]
    framed = [b"data: " + e + b"\n\n" for e in events]
    writes = [(0.0, framed[0]), (0.0, b"id: 7\n: keep-alive\n\n"), (0.0, b"id: 8\nevent: ping\n\n")]
    writes += [(0.0, framed[1]), (0.0, b"data: [DONE]\n\n")]
    texts, wire = relayed(tmp_path, [piece for _, piece in writes])
    assert texts == PIECES[:2]
    assert wire == framed[0] + b": keep-alive\n\n" + framed[1] + b"data: [DONE]\n\n"


# ---- an upstream failing after its first bytes: the client is told, in the OpenAI format --------------


def failing(tmp_path: Path, answer: Answer, stream: bool) -> httpx.Response:
    """What a raw client gets from kvgate when the upstream answers so (a read timeout of 0.5 s)."""
    upstream = RawUpstream(lambda seen: answer)
    with upstream, serving(front(tmp_path, upstream.url, proxy_read_timeout_s=0.5, proxy_retries=0), None) as url:
        body = {"model": "stub-a", "messages": HELLO, "stream": stream}
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=10)


def test_a_whole_answer_cut_short_is_a_502_and_one_stalled_a_504(tmp_path: Path) -> None:
    data = json.dumps(completion("Bonjour")).encode()
    halves = [(0.0, data[:20]), (0.0, data[20:])]
    cut = failing(tmp_path, Answer(200, {"content-type": "application/json"}, halves[:1], cut=True), stream=False)
    stalled = failing(tmp_path, Answer(200, {"content-type": "application/json"}, [halves[0], (2.0, data[20:])]), False)
    for r, status in ((cut, 502), (stalled, 504)):
        error = r.json()["error"]
        assert r.status_code == status and error["code"] == "upstream_error" and error["type"] == "server_error"
        assert "failed mid-answer" in error["message"]


def test_a_stream_stalled_after_its_first_event_ends_with_a_server_error_event(tmp_path: Path) -> None:
    first = b"data: " + chunk({"role": "assistant", "content": PIECES[0]}) + b"\n\n"
    r = failing(tmp_path, sse_stream((0.0, first), (2.0, b"data: [DONE]\n\n")), stream=True)
    events = [e for e in r.content.split(b"\n\n") if e]
    assert r.status_code == 200 and events[0] + b"\n\n" == first and events[-1] == b"data: [DONE]"
    error = json.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["code"] == "upstream_error" and error["type"] == "server_error"
    assert "failed mid-stream" in error["message"] and "stopped sending" in error["message"]


def test_an_events_data_is_its_data_fields_joined_whatever_comes_with_them(tmp_path: Path) -> None:
    """Data first or after other fields, no space after `data:`, LF or CR line ends, data over two lines:
    each event is read by its data (the usage chunk dropped, the text kept for the semantic cache), and
    data that is not a JSON object passes on as it came."""
    ask = [{"role": "user", "content": "Where is the lighthouse?"}]
    usage = {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}
    first, second = chunk({"role": "assistant", "content": "On the"}), chunk({"content": " cliff."})
    odd = [b'data: "usage" is not JSON', b'data: ["usage"]']  # passed on whole, read as nothing
    half = second.index(b", ") + 1  # data over two lines: JSON split between two of its values
    events = [b"data:" + first + b"\nid: 1", b"data: " + second[:half] + b"\rdata: " + second[half:] + b"\rid: 2"]
    # Choices no client asked for (index 1, from an upstream that misbehaves) are passed on, not kept; a choice
    # without an index is the first; a chunk with choices and usage passes on (its usage is read).
    stray = chunk({"content": " (stray)"}).replace(b'"index": 0', b'"index": 1')
    final = json.loads(chunk({"content": ""}, finish="stop"))
    del final["choices"][0]["index"]
    final = json.dumps({**final, "usage": usage}).encode()
    events += [*odd, b"data: " + stray, b"data:" + final + b"\n: end of the answer", b"data: " + chunk({}, usage=usage)]
    writes = [(0.0, e + b"\n\n") for e in [*events, b"data: [DONE]"]]
    upstream = RawUpstream(lambda seen: sse_stream(*writes))
    with upstream, serving(front(tmp_path, upstream.url, semantic_cache=True), None) as url:
        body = {"model": "stub-a", "messages": ask, "stream": True, "temperature": 0}
        wire = httpx.post(url + "/v1/chat/completions", json=body, timeout=10).content
        for _ in range(50):  # kept after it went out: the whole text, read from every event's data
            again = httpx.post(url + "/v1/chat/completions", json={**body, "stream": False}, timeout=10)
            if again.headers.get("x-kvgate-cache") == "hit":
                break
            time.sleep(0.1)
    assert wire == b"".join(
        e + b"\n\n" for e in [*events[:-1], b"data: [DONE]"]
    )  # usage alone dropped, the rest as sent
    assert again.headers.get("x-kvgate-cache") == "hit"
    assert again.json()["choices"][0]["message"]["content"] == "On the cliff."


def test_sse_fields_are_read_as_sse_says() -> None:
    assert event_data(b"data:{}") == b"{}" and event_data(b"data: {}") == b"{}"
    assert event_data(b"id: 1\ndata:{}") == b"{}" and event_data(b"data:  x") == b" x"  # one space is the separator
    assert event_data(b"data: a\r\ndata: b") == b"a\nb" and event_data(b"data: a\rid: 2") == b"a"
    assert event_data(b": only a comment\nid: 3") is None and event_data(b"data:") == b""


def test_a_stream_ends_its_last_event_at_its_end() -> None:
    """What a stream ends with, unterminated, is its last event, less only its trailing line ends."""
    events = Events(limit=1 << 10)
    assert events.feed(b"data: 1\n\n: last, X \r\n") == [b"data: 1"] and events.rest() == [b": last, X "]
    events = Events(limit=1 << 10)
    assert events.feed(b"data: [DONE]X\r\n") == [] and events.rest() == [b"data: [DONE]X"]
    events = Events(limit=1 << 10)
    assert events.feed(b"data: 1\n\n\r\n") == [b"data: 1"] and events.rest() == []


def test_an_event_or_a_text_of_exactly_the_limit_is_held() -> None:
    events = Events(limit=len(b"data: 12"))
    assert events.feed(b"data: 12") == [] and events.feed(b"\n\ndata: 34\n\n") == [b"data: 12", b"data: 34"]
    relay = Relay(None, keep_usage=False, keep_text=True, limit=5)  # type: ignore[arg-type]  # keep reads no answer
    relay.keep("abc")
    relay.keep("de")
    assert relay.text == ["abc", "de"] and not relay.cut
    relay.keep("f")
    assert relay.cut and relay.text == [] and not relay.keep_text


def test_a_stream_cut_midway_is_never_kept_for_the_semantic_cache(tmp_path: Path) -> None:
    """What a failed stream said is passed on, but it is not an answer (even with its finish_reason read): asking
    again goes upstream."""
    cut_short = [(0.0, b"data: " + chunk({"role": "assistant", "content": "The lighthouse is"}) + b"\n\n")]
    cut_short.append((0.0, b"data: " + chunk({}, finish="stop") + b"\n\n"))  # finished, then cut before [DONE]
    whole = [(0.0, b"data: " + chunk({"role": "assistant", "content": "Fine."}) + b"\n\n")]
    whole += [(0.0, b"data: " + chunk({}, finish="stop") + b"\n\n"), (0.0, b"data: [DONE]\n\n")]
    lighthouse = [{"role": "user", "content": "Where is the lighthouse?"}]
    weather = [{"role": "user", "content": "How is the weather?"}]

    def answer(seen: Seen) -> Answer:
        return replace(sse_stream(*cut_short), cut=True) if b"lighthouse" in seen.body else sse_stream(*whole)

    upstream = RawUpstream(answer)
    with upstream, serving(front(tmp_path, upstream.url, semantic_cache=True, proxy_retries=0), None) as url:

        def ask(messages: list[dict[str, str]]) -> httpx.Response:
            body = {"model": "stub-a", "messages": messages, "stream": True, "temperature": 0}
            return httpx.post(url + "/v1/chat/completions", json=body, timeout=10)

        failed = ask(lighthouse)
        assert b"failed mid-stream" in failed.content and failed.content.endswith(b"data: [DONE]\n\n")
        ask(weather)
        for _ in range(50):  # a whole answer asked for after the cut one is kept: the cut one's turn is past
            if ask(weather).headers.get("x-kvgate-cache") == "hit":
                break
            time.sleep(0.1)
        assert ask(weather).headers.get("x-kvgate-cache") == "hit"
        again = ask(lighthouse)
    assert again.headers.get("x-kvgate-cache") != "hit" and b"failed mid-stream" in again.content
    assert sum(b"lighthouse" in s.body for s in upstream.seen) == 2


def test_a_whole_answer_without_usage_or_text_is_passed_on_and_replayed_as_it_was(tmp_path: Path) -> None:
    """`usage: null` and `content: null` (a model may say nothing): the answer passes on as sent, and what the
    semantic cache keeps of it, if anything, is what it said: no text."""
    silent = completion("")
    silent["choices"][0]["message"]["content"] = None
    silent["usage"] = None
    upstream = RawUpstream(lambda seen: json_answer(silent))
    ask = {"model": "stub-a", "messages": [{"role": "user", "content": "Say nothing."}], "temperature": 0}
    with upstream, serving(front(tmp_path, upstream.url, semantic_cache=True), None) as url:
        first = httpx.post(url + "/v1/chat/completions", json=ask, timeout=10)
        replies = [httpx.post(url + "/v1/chat/completions", json=ask, timeout=10) for _ in range(5)]
    assert first.status_code == 200 and first.json() == silent
    for again in replies:
        assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] in (None, "")
