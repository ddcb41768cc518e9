"""A backend's Reply: an upstream's bytes or this process's objects, each read in the other form once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvgate.gateway.backend import Reply
from kvgate.gateway.errors import APIError
from kvgate.gateway.render import DONE, Data, dumps

ANSWER = {"id": "chatcmpl-1", "choices": [{"index": 0, "message": {"role": "assistant", "content": "é ✓"}}]}
CHUNKS: list[Data] = [
    {"choices": [{"index": 0, "delta": {"content": "é"}}]},
    {"choices": [], "usage": {"total_tokens": 3}},
    {"error": {"message": "cut short"}},
    DONE,
]


async def pieces(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


async def objects() -> AsyncIterator[Data]:
    for chunk in CHUNKS:
        yield chunk


async def read(events: AsyncIterator[object]) -> list[object]:
    return [event async for event in events]


def test_a_whole_answer_reads_the_same_made_here_or_sent_as_bytes() -> None:
    made, sent = Reply(answer=ANSWER), Reply(content=dumps(ANSWER))
    assert not made.streamed and not sent.streamed
    assert made.json() is ANSWER and sent.json() == ANSWER
    assert made.body() == sent.body() == dumps(ANSWER)


@pytest.mark.parametrize("content", [b"[1, 2]", b"not json", b""])
def test_an_upstream_answer_that_is_no_json_object_is_a_502(content: bytes) -> None:
    with pytest.raises(APIError) as caught:
        Reply(content=content).json()
    assert caught.value.status == 502


@pytest.mark.parametrize("size", [1, 7, 4096])
def test_a_stream_reads_the_same_made_here_or_sent_as_bytes_however_cut(size: int) -> None:
    events = asyncio.run(read(Reply(chunks=objects()).sse()))
    assert all(isinstance(e, bytes) and e.startswith(b"data: ") and e.endswith(b"\n\n") for e in events)
    assert events[-1] == b"data: [DONE]\n\n"
    sent = Reply(events=pieces(b"".join(events), size))  # type: ignore[arg-type]
    assert sent.streamed and asyncio.run(read(sent.data())) == CHUNKS
    made = Reply(chunks=objects())
    assert asyncio.run(read(made.data())) == CHUNKS  # objects pass as they are
