"""gateway/relay.py: what the relay reads of an answer: an SSE event by its data whatever other fields come with it
(an event without data passes on only its comments), a whole answer's text and usage, an upstream that fails
after its first bytes (the client is told, in the OpenAI format), and what the semantic cache keeps of it all.
The upstream is tests/helpers/raw_upstream.py's, scripted byte for byte."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import httpx

from kvgate.gateway.relay import Events, Relay, event_data
from tests.helpers import loopback
from tests.helpers.raw_upstream import (
    HELLO,
    PIECES,
    Answer,
    RawUpstream,
    Seen,
    chunk,
    completion,
    front,
    json_answer,
    relayed,
    sdk,
    sse_stream,
    until_hit,
)
from tests.helpers.servers import serving

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
    with upstream, serving(front(tmp_path, upstream.url, semantic_cache={"enabled": True}), None) as url:
        first = list(sdk(url).chat.completions.create(model="stub-a", messages=ask, stream=True, temperature=0))
        assert all(c.usage is None and c.choices for c in first)  # the usage chunk kvgate asked for: dropped
        assert "".join(c.choices[0].delta.content or "" for c in first) == "Paris is the capital."
        again = until_hit(
            lambda: sdk(url).chat.completions.with_raw_response.create(
                model="stub-a", messages=ask, stream=True, temperature=0
            )
        )
        assert again.headers.get("x-kvgate-cache") == "hit"
        replay = "".join(c.choices[0].delta.content or "" for c in again.parse() if c.choices)
    assert replay == "Paris is the capital."


def test_events_without_data_pass_on_only_their_comments(tmp_path: Path) -> None:
    """SSE dispatches no event without data, but the openai SDK reads one that carries an `id:` as an
    empty chunk and fails to parse it. kvgate passes on such an event's comment lines (a keep-alive still
    keeps the client's connection open) and nothing else of it."""
    events = [chunk({"role": "assistant", "content": PIECES[0]}), chunk({"content": PIECES[1]})]
    framed = [b"data: " + e + b"\n\n" for e in events]
    writes = [(0.0, framed[0]), (0.0, b"id: 7\n: keep-alive\n: still here\n\n"), (0.0, b"id: 8\nevent: ping\n\n")]
    writes += [(0.0, framed[1]), (0.0, b"data: [DONE]\n\n")]
    texts, wire = relayed(tmp_path, [piece for _, piece in writes])
    assert texts == PIECES[:2]
    assert wire == framed[0] + b": keep-alive\n: still here\n\n" + framed[1] + b"data: [DONE]\n\n"


# ---- an upstream failing after its first bytes: the client is told, in the OpenAI format --------------


def failing(tmp_path: Path, answer: Answer, stream: bool) -> httpx.Response:
    """What a raw client gets from kvgate when the upstream answers so (a read timeout of 0.5 s)."""
    upstream = RawUpstream(lambda seen: answer)
    with upstream, serving(front(tmp_path, upstream.url, proxy={"read_timeout_s": 0.5, "retries": 0}), None) as url:
        body = {"model": "stub-a", "messages": HELLO, "stream": stream}
        return loopback.post(url + "/v1/chat/completions", json=body, timeout=10)


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
    with upstream, serving(front(tmp_path, upstream.url, semantic_cache={"enabled": True}), None) as url:
        body = {"model": "stub-a", "messages": ask, "stream": True, "temperature": 0}
        wire = loopback.post(url + "/v1/chat/completions", json=body, timeout=10).content
        # Kept after it went out: the whole text, read from every event's data.
        again = until_hit(
            lambda: loopback.post(url + "/v1/chat/completions", json={**body, "stream": False}, timeout=10)
        )
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

    async def made() -> Relay:  # its outcome is a future of the loop it runs in
        return Relay(None, keep_usage=False, keep_text=True, limit=5)  # type: ignore[arg-type]  # reads no answer

    relay = asyncio.run(made())
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
    with (
        upstream,
        serving(front(tmp_path, upstream.url, semantic_cache={"enabled": True}, proxy={"retries": 0}), None) as url,
    ):

        def ask(messages: list[dict[str, str]]) -> httpx.Response:
            body = {"model": "stub-a", "messages": messages, "stream": True, "temperature": 0}
            return loopback.post(url + "/v1/chat/completions", json=body, timeout=10)

        failed = ask(lighthouse)
        assert b"failed mid-stream" in failed.content and failed.content.endswith(b"data: [DONE]\n\n")
        ask(weather)
        # A whole answer asked for after the cut one is kept: the cut one's turn is past.
        assert until_hit(lambda: ask(weather)).headers.get("x-kvgate-cache") == "hit"
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
    with upstream, serving(front(tmp_path, upstream.url, semantic_cache={"enabled": True}), None) as url:
        first = loopback.post(url + "/v1/chat/completions", json=ask, timeout=10)
        replies = [loopback.post(url + "/v1/chat/completions", json=ask, timeout=10) for _ in range(5)]
    assert first.status_code == 200 and first.json() == silent
    for again in replies:
        assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] in (None, "")
