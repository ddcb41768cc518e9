"""/v1/embeddings in runtime mode: the official openai SDK against a real server, the vectors checked
against the embedding model's own; the micro-batcher and its bound on the real embedder."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.gateway.backend import Call, Reply
from kvgate.gateway.embeddings import Embeddings
from kvgate.gateway.errors import APIError
from kvgate.gateway.settings import Settings
from kvgate.semantic_cache.embedder import MiniLM, make_embedder
from tests.helpers import loopback

T = TypeVar("T")
NAME = "all-MiniLM-L6-v2"
TEXTS = [
    "Oriel Thatchwood was a writer and cartographer, educated at Quenmere College, Vellmoor.",
    "Short.",
    "Why is the sky blue? Rayleigh scattering of sunlight by the air's molecules.",
    "Paris is the capital of France.",
]


@pytest.fixture(scope="module")
def embedder() -> MiniLM:
    made = make_embedder("minilm")
    assert isinstance(made, MiniLM)
    return made


def own(embedder: MiniLM, texts: list[str]) -> np.ndarray:
    """What the embedder gives each text alone."""
    return np.stack([embedder.embed([t])[0] for t in texts])


def tokens(embedder: MiniLM, text: str) -> int:
    return len(embedder.tokenizer(text)["input_ids"])


def close(got: list[list[float]] | np.ndarray, want: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == want.shape
    cosines = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosines.min() > 0.9999, cosines


def post(base_url: str, **body) -> httpx.Response:
    return loopback.post(f"{base_url}/v1/embeddings", json=body, timeout=60)


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" or status >= 500
    return error


# ---- through the server, with the openai SDK ------------------------------------------------------


def counted(base_url: str) -> float:
    """The prompt tokens /metrics has counted for the embedding model (what limits spend too)."""
    for family in text_string_to_metric_families(loopback.get(f"{base_url}/metrics").text):
        for sample in family.samples:
            if sample.name == "kvgate_prompt_tokens_total" and sample.labels.get("model") == NAME:
                return sample.value
    return 0.0


def test_float_vectors_are_the_embedders_own_in_order(base_url, client, embedder) -> None:
    before = counted(base_url)
    r = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="float")
    assert r.object == "list" and r.model == NAME
    assert [d.index for d in r.data] == list(range(len(TEXTS))) and {d.object for d in r.data} == {"embedding"}
    close([d.embedding for d in r.data], own(embedder, TEXTS))
    assert r.usage.prompt_tokens == sum(tokens(embedder, t) for t in TEXTS)
    assert r.usage.total_tokens == r.usage.prompt_tokens
    assert counted(base_url) - before == r.usage.prompt_tokens


def test_base64_the_sdks_default(client, embedder) -> None:
    r = client.embeddings.create(model=NAME, input=TEXTS[::-1])  # the SDK asks for base64 and decodes it
    close([d.embedding for d in r.data], own(embedder, TEXTS[::-1]))
    one = client.embeddings.create(model=NAME, input=TEXTS[0], user="someone")
    assert len(one.data) == 1 and one.usage.prompt_tokens == tokens(embedder, TEXTS[0])
    close([one.data[0].embedding], own(embedder, TEXTS[:1]))


def test_raw_base64_is_little_endian_float32(base_url, embedder) -> None:
    r = post(base_url, model=NAME, input=[TEXTS[2]], encoding_format="base64")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"object", "data", "model", "usage"} and set(body["usage"]) == {"prompt_tokens", "total_tokens"}
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert vector.shape == (384,)
    close(vector[None], own(embedder, TEXTS[2:3]))
    assert post(base_url, model=NAME, input="x", dimensions=384).status_code == 200  # its own size is fine


def test_models_lists_the_embedding_model(client, model_name) -> None:
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {model_name, NAME}
    assert cards[NAME].owned_by == "kvgate" and client.models.retrieve(NAME).id == NAME


def test_concurrent_requests_get_their_own_vectors(client, embedder) -> None:
    async def many() -> list[list[float]]:
        async with openai.AsyncOpenAI(base_url=str(client.base_url), api_key="unused", max_retries=0) as aclient:
            replies = await asyncio.gather(*(aclient.embeddings.create(model=NAME, input=t) for t in TEXTS * 2))
        return [r.data[0].embedding for r in replies]

    close(asyncio.run(many()), own(embedder, TEXTS * 2))


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"input": ""}, "input", "invalid_value"),
        ({"input": []}, "input", "invalid_value"),
        ({"input": ["fine", ""]}, "input", "invalid_value"),
        ({"input": [101, 7592, 102]}, "input", "invalid_value"),
        ({"input": [[101, 7592, 102]]}, "input", "invalid_value"),
        ({"input": ["x"] * 2049}, "input", "invalid_value"),
        ({"input": 5}, "input", "invalid_value"),
        ({"input": None}, "input", "invalid_value"),
        ({}, "input", "missing_field"),
        ({"input": "x", "dimensions": 128}, "dimensions", "invalid_value"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format", "invalid_value"),
        ({"input": "word " * 300}, "input", "context_length_exceeded"),
    ],
)
def test_bad_inputs_are_openai_400s(base_url, fields, param, code) -> None:
    error = error_of(post(base_url, model=NAME, **fields))
    assert (error["param"], error["code"]) == (param, code)


def test_bad_inputs_say_why(base_url, client) -> None:
    for ids in ([1, 2], [[1, 2]]):
        assert "token ids" in error_of(post(base_url, model=NAME, input=ids))["message"]
    assert "256" in error_of(post(base_url, model=NAME, input="word " * 300))["message"]
    assert "2048" in error_of(post(base_url, model=NAME, input=["x"] * 2049))["message"]
    assert post(base_url, model=NAME, input="word " * 254).status_code == 200  # 254 + [CLS] + [SEP]: the limit
    with pytest.raises(openai.BadRequestError) as raised:
        client.embeddings.create(model=NAME, input="")
    assert raised.value.param == "input"


def test_models_are_not_crossed(base_url, client, model_name) -> None:
    error = error_of(post(base_url, model=model_name, input="x"))
    assert error["param"] == "model" and NAME in error["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert raised.value.param == "model"
    assert error_of(post(base_url, model=f"sentence-transformers/{NAME}", input="x"), 404)["param"] == "model"


# ---- the batcher and its bound, on the real embedder ------------------------------------------------


def loaded(settings: Settings, embedder: MiniLM, **kw) -> Embeddings:
    embeddings = Embeddings(settings, **kw)
    embeddings.embedder = embedder  # the module's copy: one load for these tests
    return embeddings


def call(text: str) -> Call:
    body = {"model": NAME, "input": text, "encoding_format": "float"}
    return Call(path="/v1/embeddings", body=body, raw=b"", model=NAME, tenant="tenant", request_id="id")


def vector(reply: Reply) -> list[float]:
    assert reply.content is not None
    return json.loads(reply.content)["data"][0]["embedding"]


async def until(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


class Hold:
    """The embedder's forward lock, held by the test: a forward blocks until `release`."""

    def __init__(self, embedder: MiniLM) -> None:
        self.lock, self.held = embedder.lock, embedder.lock.acquire()

    def release(self) -> None:
        if self.held:  # once: after that the lock is the embedding thread's to take
            self.held = False
            self.lock.release()


@pytest.fixture
def held(embedder: MiniLM) -> Iterator[Hold]:
    hold = Hold(embedder)
    try:
        yield hold
    finally:
        hold.release()


def running(hold: Hold, go: Callable[[], Awaitable[T]]) -> T:
    """`go` on a new loop; the lock let go before the loop ends, even when `go` fails (the loop waits
    for its embedding thread, which waits for the lock)."""

    async def guarded() -> T:
        try:
            return await go()
        finally:
            hold.release()

    return asyncio.run(guarded())


def test_the_model_loads_on_first_use(settings) -> None:
    embeddings = Embeddings(settings)
    assert embeddings.serves(NAME) and not embeddings.serves("SmolLM2-135M-Instruct")
    assert embeddings.cards(7) == [{"id": NAME, "object": "model", "created": 7, "owned_by": "kvgate"}]
    assert embeddings.embedder is None


def test_requests_that_arrive_during_a_forward_share_the_next(settings, embedder, held) -> None:
    embeddings = loaded(settings, embedder)

    async def go() -> list[Reply]:
        first = asyncio.create_task(embeddings.answer(call(TEXTS[0])))
        await until(lambda: embeddings.batcher.forwards == 1)  # blocked in its forward
        rest = [asyncio.create_task(embeddings.answer(call(t))) for t in TEXTS * 2]
        await until(lambda: len(embeddings.batcher.jobs) == len(rest))
        held.release()
        return await asyncio.gather(first, *rest)

    replies = running(held, go)
    assert embeddings.batcher.forwards == 2
    close([vector(r) for r in replies], own(embedder, [TEXTS[0], *TEXTS * 2]))


def test_in_flight_requests_are_bounded(settings, embedder, held) -> None:
    embeddings = loaded(settings, embedder, max_requests=3)

    async def go() -> list[Reply]:
        admitted = [asyncio.create_task(embeddings.answer(call(t))) for t in TEXTS[:3]]
        await until(lambda: embeddings.in_flight == 3)  # none can finish: the forward is held
        with pytest.raises(APIError) as refused:
            await asyncio.wait_for(embeddings.answer(call("one too many")), 5)
        assert refused.value.status == 503 and refused.value.headers["retry-after"]
        held.release()
        return await asyncio.gather(*admitted)

    assert len(running(held, go)) == 3
    assert embeddings.in_flight == 0


def test_a_caller_that_left_is_not_embedded(settings, embedder, held) -> None:
    embeddings = loaded(settings, embedder)

    async def go() -> None:
        first = asyncio.create_task(embeddings.answer(call(TEXTS[0])))
        await until(lambda: embeddings.batcher.forwards == 1)
        gone = asyncio.create_task(embeddings.answer(call(TEXTS[1])))
        await until(lambda: len(embeddings.batcher.jobs) == 1)
        gone.cancel()
        held.release()
        await first
        await until(lambda: embeddings.batcher.worker is not None and embeddings.batcher.worker.done())

    running(held, go)
    assert embeddings.batcher.forwards == 1 and embeddings.in_flight == 0
