"""A long document never stalls other streams: its ingest and its blend run in chunks of
max_num_batched_tokens, between the decode steps of every other sequence.

Probe: POST /v1/documents with a long text (and then a chat reusing it) while another client
streams; before, the document was computed in one piece on the engine thread and the stream got
no token until it was done."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
import torch

from kvgate.gateway.settings import Settings
from kvgate.runtime.engine import Engine
from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.model import Run, forward
from tests.helpers import loopback
from tests.helpers.servers import serving

BUDGET = 32  # tokens a step computes: a 600-token document takes 16 steps or more
TEXT = " ".join(f"Entry {i}: the {('red', 'green', 'blue', 'amber')[i % 4]} lamp number {i * 7}." for i in range(50))


@pytest.fixture(scope="module")
def chunked(settings: Settings, loaded: LoadedModel) -> Iterator[tuple[Engine, str]]:
    small = settings.model_copy(update={"engine": {"max_num_batched_tokens": BUDGET}})
    engine = Engine(small.engine_config(), loaded)
    try:
        with serving(small, engine) as url:
            yield engine, url
    finally:
        engine.shutdown()


async def tokens_during(url: str, model: str, work: httpx.Request) -> tuple[int, httpx.Response]:
    """Stream a long completion; once it runs, send `work`: the stream's tokens that arrived while
    `work` was being answered, and its response."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        body = {"model": model, "prompt": "Count:", "max_tokens": 400, "ignore_eos": True, "stream": True}
        arrived: list[float] = []
        started = asyncio.Event()

        async def stream() -> None:
            async with client.stream("POST", "/v1/completions", json=body) as events:
                async for line in events.aiter_lines():
                    if line.startswith("data: {"):
                        arrived.append(asyncio.get_running_loop().time())
                        started.set()

        streaming = asyncio.create_task(stream())
        await asyncio.wait_for(started.wait(), 120)
        sent = asyncio.get_running_loop().time()
        response = await client.send(work)
        answered = asyncio.get_running_loop().time()
        streaming.cancel()
        return sum(sent < t < answered for t in arrived), response


def test_a_long_document_is_ingested_between_other_streams_steps(chunked, model_name) -> None:
    engine, url = chunked
    post = httpx.Request("POST", f"{url}/v1/documents", json={"text": TEXT + " (ingest)"})
    during, response = asyncio.run(tokens_during(url, model_name, post))
    card = response.json()
    assert response.status_code == 200 and card["tokens"] > 12 * BUDGET
    assert during >= 8  # one piece: 0 (the stream waited for the whole document)


def test_a_long_blend_is_spread_over_steps(chunked, model_name) -> None:
    engine, url = chunked
    stored = loopback.post(f"{url}/v1/documents", json={"text": TEXT + " (blend)"}, timeout=300).json()
    chat = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Which lamp is amber?"}],
        "documents": [{"id": stored["id"]}],
        "kvgate": {"reuse": "blend", "recompute_ratio": 1.0},
        "max_tokens": 4,
        "temperature": 0,
    }
    post = httpx.Request("POST", f"{url}/v1/chat/completions", json=chat)
    during, response = asyncio.run(tokens_during(url, model_name, post))
    assert response.status_code == 200
    assert int(response.headers["x-kvgate-recomputed-tokens"]) > 12 * BUDGET  # the blend did its work
    assert during >= 8  # one piece: the blend ran in one step, the stream waited


def test_a_document_computed_in_chunks_has_the_kv_of_one_piece(chunked) -> None:
    engine, _ = chunked
    ids = engine.reuser.tokenizer.encode(TEXT + " (fidelity)")
    assert asyncio.run(engine.ingest(ids)) == 0  # computed now, in len(ids) / BUDGET steps
    stored = engine.reuser.store.get(engine.reuser.key(ids), engine.model_fp)
    assert stored is not None and stored.token_ids == tuple(ids)
    whole = engine.reuser.new_kv()
    forward(engine.model, [Run(whole, ids, 0)])
    for layer in (0, whole.num_layers - 1):
        keys, values = whole.layer(layer, len(ids))
        torch.testing.assert_close(stored.keys[layer], keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(stored.values[layer], values, atol=1e-4, rtol=1e-4)
    assert asyncio.run(engine.ingest(ids)) == len(ids)  # found: nothing computed again
