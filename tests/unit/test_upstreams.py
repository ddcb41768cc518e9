"""gateway/upstreams.py: a body cut short by its upstream still passes on every byte that arrived.

aiohttp's reader raises a cut body's error before the bytes it had already buffered. Over loopback that
happens only when the cut lands between two reads (test_proxy's stream dropped midway saw it once in a
full run: 1 of its 3 events passed on). Here the same real `aiohttp.StreamReader` is fed the events and
the error before it is read, the order a busy machine produces; only the response around it is a
stand-in (chunks_of reads nothing else of it)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp.base_protocol import BaseProtocol

from kvgate.gateway.upstreams import UpstreamFailed, chunks_of

EVENTS = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b'data: {"n": 3}\n\n']


async def read_cut(first_read: bool) -> tuple[bytes, BaseException | None]:
    loop = asyncio.get_running_loop()
    reader = aiohttp.StreamReader(BaseProtocol(loop), 2**16, loop=loop)
    body = chunks_of(SimpleNamespace(content=reader))  # type: ignore[arg-type]
    got, error = b"", None
    reader.feed_data(EVENTS[0])
    if first_read:
        got += await anext(body)  # the first event read before the rest arrives with the cut
    for event in EVENTS[1:]:
        reader.feed_data(event)
    reader.set_exception(aiohttp.ClientPayloadError("Response payload is not completed"))
    try:
        async for chunk in body:
            got += chunk
    except UpstreamFailed as exc:
        error = exc
    return got, error


@pytest.mark.parametrize("first_read", [False, True], ids=["cut-before-any-read", "cut-after-one-read"])
def test_a_cut_body_yields_every_byte_received_before_its_error(first_read: bool) -> None:
    got, error = asyncio.run(read_cut(first_read))
    assert got == b"".join(EVENTS)
    assert isinstance(error, UpstreamFailed) and str(error) == "ClientPayloadError"
