"""The Python SDK, kvgate.client.Client and AsyncClient, against a real server over the real model.

A few tests use httpx's MockTransport instead, where they show what goes on the wire or what the
server only sends when something breaks (an error in the middle of a stream)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from kvgate.client import AsyncClient, ChatStream, Client
from kvgate.errors import (
    APIConnectionError,
    APITimeoutError,
    BadRequestError,
    InternalServerError,
    NotFoundError,
    RateLimitError,
    error_for,
)
from kvgate.types import ChatCompletion, Document, Reuse
from tests.helpers.servers import free_port

QUESTION = "Which river flows through Brackwater?"
# Each test reads its own documents: whether a text was read before decides what is reused.
TOWN = "Brackwater is a small market town in the north of the county of Elmshire, known for its wool fair."
RIVER = "The river Osk flows through Brackwater on its way to the sea at Saltmouth."
FAST = {"max_tokens": 6, "temperature": 0}  # the model runs on a small CPU


@pytest.fixture
def kv(base_url: str, model_name: str) -> Iterator[Client]:
    # Documents belong to the caller's tenant (here, a hash of this key).
    with Client(base_url, api_key="sdk-tests", model=model_name, timeout=120) as client:
        yield client


def test_documents_are_stored_shown_and_forgotten(kv: Client) -> None:
    doc = kv.documents.add("The lighthouse at Saltmouth was built in 1852 and painted red in 1901.")
    assert doc.id.startswith("doc-") and doc.tokens > 0 and doc.cached
    assert kv.documents.get(doc.id) == doc
    both = kv.documents.add(["Saltmouth has two harbours.", "The older harbour silted up in 1790."])
    assert [type(d) for d in both] == [Document, Document] and both[0].id != both[1].id

    kv.documents.delete(doc.id)
    with pytest.raises(NotFoundError) as gone:
        kv.documents.get(doc.id)
    assert gone.value.status_code == 404 and gone.value.code == "document_not_found"
    with pytest.raises(NotFoundError) as cited:
        kv.chat(QUESTION, documents=[doc], **FAST)
    assert cited.value.param == "documents.0.id"


def test_chat_answers_with_text_usage_and_what_was_reused(base_url: str, model_name: str) -> None:
    with Client(f"{base_url}/v1") as kv:  # /v1 or not; the model is the server's first
        reply = kv.chat("What is the capital of France?", **FAST)
    assert kv.model == model_name
    assert isinstance(reply, ChatCompletion) and reply.model == model_name
    assert reply.text and reply.text == reply.choices[0]["message"]["content"]
    assert reply.finish_reason in ("stop", "length")
    assert 0 < reply.usage["completion_tokens"] <= 6 and reply.usage["prompt_tokens"] > 0
    assert reply.reuse.request_id and reply.id == f"chatcmpl-{reply.reuse.request_id}"


def test_a_document_is_reused_once_kvgate_has_read_it(kv: Client) -> None:
    fresh = kv.chat(QUESTION, documents=[RIVER], **FAST)
    assert fresh.reuse.reused_tokens == 0  # read for the first time: computed for this request

    town = kv.documents.add(TOWN)  # computed now, ahead of any question
    by_id = kv.chat(QUESTION, documents=[town, RIVER], recompute_ratio=0.2, **FAST)
    reuse = by_id.reuse
    assert reuse.mode == "blend" and reuse.reused_tokens > 0 and reuse.recomputed_tokens > 0
    # Both documents came from the cache; a fifth of their tokens were computed again.
    assert reuse.reused_tokens + reuse.recomputed_tokens > town.tokens
    assert by_id.usage["prompt_tokens_details"]["cached_tokens"] == reuse.reused_tokens

    by_text = kv.chat(QUESTION, documents=[{"text": TOWN}, RIVER], recompute_ratio=0.2, **FAST)
    assert by_text.reuse == Reuse(**{**vars(reuse), "request_id": by_text.reuse.request_id})
    assert by_text.text == by_id.text

    full = kv.chat(QUESTION, documents=[town, RIVER], reuse="full", **FAST)
    assert (full.reuse.mode, full.reuse.reused_tokens) == ("full", 0)


def test_a_program_keeps_its_context_between_turns(kv: Client) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    first = kv.chat(messages, program="sdk-task-1", **FAST)
    assert first.reuse.program == "sdk-task-1" and first.reuse.pin_ttl_s is not None
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Another?"}]
    second = kv.chat(messages, program="sdk-task-1", **FAST)
    assert second.reuse.mode == "program" and second.reuse.reused_tokens > 0
    assert second.reuse.fidelity.startswith("numerics; rows=")  # its answer's rows were decoded


def test_a_stream_reports_reuse_first_then_text_as_it_comes(kv: Client) -> None:
    doc = kv.documents.add("Elmshire's wool fair has been held every October since 1420.")
    question = "When is the wool fair held?"
    with kv.chat(question, documents=[doc], stream=True, stream_options={"include_usage": True}, **FAST) as stream:
        assert isinstance(stream, ChatStream)
        # Known before the first chunk: the headers come once the prompt is prefilled.
        assert stream.reuse.mode == "blend" and stream.reuse.reused_tokens > 0
        chunks = list(stream)
    deltas = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
    assert stream.text and stream.text == "".join(deltas)
    assert stream.finish_reason in ("stop", "length")
    assert stream.usage is not None and stream.usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert kv.chat(question, documents=[doc], **FAST).text == stream.text


def test_the_async_client_is_the_same_api_awaited(base_url: str) -> None:
    async def session() -> tuple[ChatCompletion, str, list[dict]]:
        async with AsyncClient(base_url, api_key="sdk-tests") as kv:
            doc = await kv.documents.add("Saltmouth's ferry to the islands runs twice a day.")
            assert await kv.documents.get(doc.id) == doc
            reply = await kv.chat("How often does the ferry run?", documents=[doc], **FAST)
            async with await kv.chat("How often does the ferry run?", documents=[doc], stream=True, **FAST) as stream:
                chunks = [chunk async for chunk in stream]
            await kv.documents.delete(doc.id)
            with pytest.raises(NotFoundError):
                await kv.documents.get(doc.id)
            return reply, stream.text, chunks

    reply, streamed, chunks = asyncio.run(session())
    assert reply.reuse.reused_tokens > 0 and reply.text
    assert streamed == reply.text and chunks


def test_an_invalid_field_is_a_bad_request_that_names_it(kv: Client) -> None:
    with pytest.raises(BadRequestError) as caught:
        kv.chat("Hi", temperature=5, max_tokens=2)
    error = caught.value
    assert error.status_code == 400 and error.param == "temperature" and error.code == "invalid_value"
    assert error.type == "invalid_request_error" and "temperature" in error.message
    assert error.request_id and error.body["error"]["param"] == "temperature"


def test_an_unknown_model_is_not_found_even_for_a_stream(kv: Client) -> None:
    for stream in (False, True):  # a stream opens when chat is called: its error status raises there
        with pytest.raises(NotFoundError) as caught:
            kv.chat("Hi", model="no-such-model", stream=stream, max_tokens=2)
        assert caught.value.code == "model_not_found" and caught.value.param == "model"


def test_an_unreachable_server_is_a_connection_error() -> None:
    with Client(f"http://127.0.0.1:{free_port()}", model="any") as kv:
        with pytest.raises(APIConnectionError) as caught:
            kv.chat("Hi")
        assert isinstance(caught.value.__cause__, httpx.ConnectError)
        with pytest.raises(APIConnectionError):
            kv.documents.add("text")


def test_a_timeout_is_a_connection_error_of_its_own(base_url: str, model_name: str) -> None:
    with Client(base_url, model=model_name, timeout=0.001) as kv, pytest.raises(APITimeoutError):
        kv.chat("Write a long story.", **FAST)


def test_chat_puts_documents_and_kvgate_options_in_the_body() -> None:
    sent: list[dict] = []

    def server(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        assert request.headers["authorization"] == "Bearer key"
        return httpx.Response(200, json={"choices": []}, headers={"x-kvgate-reused-tokens": "3"})

    http = httpx.Client(transport=httpx.MockTransport(server))
    with Client("http://kvgate.test/v1", "key", model="m", http_client=http) as kv:
        reply = kv.chat(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            documents=["a text", Document("doc-1", 5, True), {"id": "doc-2"}],
            program="p-1",
            reuse="naive",
            recompute_ratio=0.3,
            cache=False,
            seed=7,
            stop=["\n"],
        )
        kv.chat("Hi")  # a str is one user message
    assert reply.reuse.reused_tokens == 3 and reply.text == ""
    assert sent == [
        {
            "model": "m",
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "seed": 7,
            "stop": ["\n"],
            "documents": [{"text": "a text"}, {"id": "doc-1"}, {"id": "doc-2"}],
            "kvgate": {"program_id": "p-1", "reuse": "naive", "recompute_ratio": 0.3, "cache": False},
        },
        {"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
    ]


def mock_client(body: str) -> Client:
    """A client whose server answers every request with this SSE body."""
    http = httpx.Client(transport=httpx.MockTransport(lambda _: httpx.Response(200, text=body)))
    return Client("http://kvgate.test", model="m", http_client=http)


HEL = 'data: {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": null}]}\n\n'


def test_an_error_in_the_middle_of_a_stream_raises_it() -> None:
    failed = {"error": {"message": "generation failed: boom", "type": "server_error", "param": None, "code": "x"}}
    with mock_client(f"{HEL}data: {json.dumps(failed)}\n\ndata: [DONE]\n\n") as kv:
        stream = kv.chat("Hi", stream=True)
        with pytest.raises(InternalServerError, match="boom"):
            list(stream)
    assert stream.text == "Hel"


def test_a_stream_ends_at_done_and_only_there() -> None:
    with mock_client(f"{HEL}data: [DONE]\n\ndata: not JSON, and after the end\n\n") as kv:
        assert len(list(kv.chat("Hi", stream=True))) == 1
    with mock_client(HEL) as kv, kv.chat("Hi", stream=True) as stream:  # cut short, as by a failing proxy
        with pytest.raises(APIConnectionError, match=r"before \[DONE\]"):
            list(stream)
    assert stream.text == "Hel"


def test_errors_read_any_body_robustly() -> None:
    limited = error_for(429, b'{"error": {"message": "slow down", "type": "rate_limit_error"}}', {"Retry-After": "2"})
    assert isinstance(limited, RateLimitError) and limited.retry_after == 2.0 and limited.message == "slow down"
    proxy = error_for(502, "<html>Bad Gateway</html>")
    assert isinstance(proxy, InternalServerError) and proxy.message == "<html>Bad Gateway</html>"
    assert proxy.status_code == 502 and proxy.code is None


def test_reuse_is_read_from_headers_in_any_case() -> None:
    headers = {
        "X-KVGate-Reuse": "full; rope cannot shift",
        "X-Kvgate-Recomputed-Tokens": "4",
        "x-kvgate-cache": "miss",
        "x-kvgate-cache-category": "factual",
        "x-kvgate-cache-refused": "numbers",
        "x-kvgate-pin-ttl": "2.500",
        "x-kvgate-program-id": "task-42",
        "x-kvgate-upstream": "vllm-a",
        "x-request-id": "r-1",
    }
    assert Reuse.from_headers(headers) == Reuse(
        mode="full",
        note="rope cannot shift",
        recomputed_tokens=4,
        cache="miss",
        cache_category="factual",
        cache_refused="numbers",
        pin_ttl_s=2.5,
        program="task-42",
        upstream="vllm-a",
        request_id="r-1",
    )
    hit = Reuse.from_headers({"x-kvgate-cache": "hit", "x-kvgate-similarity": "0.9731", "x-kvgate-cache-entry": "e-7"})
    assert (hit.cache, hit.similarity, hit.cache_entry, hit.mode, hit.reused_tokens) == ("hit", 0.9731, "e-7", "", 0)
