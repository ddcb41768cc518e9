"""kvgate.LLM: the SDK's calls in-process, over a runtime of its own (no server, no HTTP)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import kvgate
from kvgate.gateway.backend import Call, Reply
from kvgate.gateway.protocol import ChatCompletionRequest
from kvgate.gateway.render import DONE, Data
from kvgate.gateway.settings import Settings
from tests.helpers.waiting import wait_until

CHAT = "/v1/chat/completions"
FACTS = [
    "The town of Varnholt lies on the river Esk and is known for its glass bells.",
    "Mirela Odven founded the Varnholt bell foundry in 1871 and ran it for forty years.",
]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[kvgate.LLM]:
    folder = tmp_path_factory.mktemp("llm")
    settings = Settings(
        engine={"max_num_seqs": 4},
        caches={"dir": folder / "chunks", "prefix_caching": False},  # these tests count documents' reuse alone
        semantic_cache={"enabled": False},
    )
    with kvgate.LLM(settings) as llm:
        yield llm


def test_chat_answers_in_the_openai_shape(llm: kvgate.LLM) -> None:
    reply = llm.chat("What is the capital of France?", max_tokens=6, temperature=0)
    assert isinstance(reply, kvgate.ChatCompletion)
    assert reply.raw["object"] == "chat.completion" and reply.model == llm.model
    assert reply.text and reply.usage["completion_tokens"] <= 6 and reply.finish_reason in ("stop", "length")


def test_a_second_question_over_the_same_documents_reuses_their_kv(llm: kvgate.LLM) -> None:
    stored = llm.documents.add(FACTS)
    assert [d.tokens > 0 and d.cached for d in stored] == [True, True]
    assert llm.documents.get(stored[0].id) == stored[0]
    first = llm.chat("Who founded the foundry?", documents=stored, max_tokens=4, temperature=0)
    again = llm.chat("Which river is Varnholt on?", documents=FACTS, max_tokens=4, temperature=0)
    # Cited by id: both stored, every token of them reused (kept, or recomputed by blend).
    assert first.reuse.reused_tokens + first.reuse.recomputed_tokens == sum(d.tokens for d in stored)
    assert again.reuse.reused_tokens == first.reuse.reused_tokens  # cited by text: the same KV
    assert again.reuse.mode == "blend" and again.usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_stream_reports_reuse_first_and_joins_to_the_whole_answer(llm: kvgate.LLM) -> None:
    whole = llm.chat("Name a colour.", documents=FACTS[:1], max_tokens=6, temperature=0)
    with llm.chat("Name a colour.", documents=FACTS[:1], max_tokens=6, temperature=0, stream=True) as stream:
        assert stream.reuse.reused_tokens > 0  # known before any chunk: the prompt is prefilled first
        deltas = [c["choices"][0]["delta"].get("content") or "" for c in stream if c["choices"]]
    assert "".join(deltas) == stream.text == whole.text and stream.finish_reason == whole.finish_reason


def test_a_stream_left_early_frees_the_engine(llm: kvgate.LLM) -> None:
    stream = llm.chat("Count to one hundred.", max_tokens=1000, ignore_eos=True, temperature=0, stream=True)
    next(iter(stream))
    stream.close()
    # the abort reaches the engine thread between two steps
    wait_until(lambda: not llm.engine.load_stats["running"], 10, "the engine kept decoding for a stream left early")
    assert llm.engine.load_stats == {"waiting": 0, "running": 0}


def test_errors_are_the_sdks(llm: kvgate.LLM) -> None:
    with pytest.raises(kvgate.BadRequestError) as bad:
        llm.chat("Hi", temperature=5)
    assert bad.value.status_code == 400 and bad.value.param == "temperature"
    with pytest.raises(kvgate.NotFoundError):
        llm.chat("Hi", model="not-this-one")
    with pytest.raises(kvgate.NotFoundError):
        llm.documents.get("doc-" + "0" * 64)
    with pytest.raises(kvgate.BadRequestError) as bad:
        llm.documents.add("")
    assert bad.value.param == "text"
    doc = llm.documents.add("A document to delete, about the harbour of Quellmouth.")
    llm.documents.delete(doc.id)
    with pytest.raises(kvgate.NotFoundError):
        llm.documents.get(doc.id)


def test_the_engine_answers_in_objects_no_one_reads_back_from_bytes(llm: kvgate.LLM) -> None:
    """In process nothing is encoded to JSON and parsed again: the local backend's answers are objects,
    whole or streamed (the routes encode them once, as they leave)."""
    body = {"model": llm.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for stream in (False, True):
        asked = body | {"stream": stream}
        call = Call.of(CHAT, asked, ChatCompletionRequest.model_validate(asked), tenant="local", request_id="r")
        reply = llm._run(llm.backend.generate(call))
        assert reply.content is None and reply.events is None
        if not stream:
            assert reply.answer is not None and reply.answer["object"] == "chat.completion"
            continue
        assert reply.chunks is not None
        chunks = llm._run(drained(reply))
        assert chunks[-1] == DONE and all(isinstance(c, dict) for c in chunks[:-1])


async def drained(reply: Reply) -> list[Data]:
    try:
        return [chunk async for chunk in reply.data()]
    finally:
        if reply.close is not None:
            await reply.close()
