"""Documents over HTTP: the `documents` and `kvgate` fields of chat completions, `/v1/documents`."""

from __future__ import annotations

import json

import openai
import pytest

from kvgate.chunk_cache import DiskTier
from tests.helpers import loopback


@pytest.fixture(scope="module")
def base_url(prefix_base_url: str) -> str:
    """The server with prefix caching on (tests/conftest.py): what a client meets by default."""
    return prefix_base_url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


QUESTION = "Where was the author of The Lantern Road educated?"
# Fictional, written for this test: a two-hop question over three short documents.
DOCS = [
    "The Lantern Road is a novel about a ferry town on the river Ashen, written by Oriel Thatchwood. "
    "It was first printed in 1874 by the Greyhaven Press.",
    "Oriel Thatchwood was a writer and cartographer. She was educated at Quenmere College in Vellmoor "
    "and moved to Ostford in 1866.",
    "Quenmere College is the oldest of the colleges of Vellmoor, founded in 1412 on the bank of the Ashen.",
]


def own(tag: str) -> list[dict]:
    """DOCS as a test of its own reads them: texts no other test sends, so no test's order matters."""
    return [{"text": f"{d} ({tag})"} for d in DOCS]


# Documents are their tenant's: requests sent with httpx carry the key the chat client uses.
AS_CLIENT = {"authorization": "Bearer unused"}


def ask(client: openai.OpenAI, model: str, documents: list[dict], reuse: dict | None = None, **kw):
    extra = {"documents": documents, **({"kvgate": reuse} if reuse else {})}
    return client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=12,
        extra_body=extra,
        **kw,
    )


def test_documents_by_text_are_reused_and_reported(client, model_name) -> None:
    docs = own("reuse test")
    first = ask(client, model_name, docs, {"reuse": "blend", "recompute_ratio": 0.2})
    # Read for the first time: computed now, so no document counts as reused yet (earlier prompts' prefix
    # blocks may give the template's opening, read exactly).
    assert int(first.headers["x-kvgate-reused-tokens"]) < 40 and first.headers["x-kvgate-recomputed-tokens"] == "0"
    raw = ask(client, model_name, docs, {"reuse": "blend", "recompute_ratio": 0.2})
    reply = raw.parse()
    reused, recomputed = int(raw.headers["x-kvgate-reused-tokens"]), int(raw.headers["x-kvgate-recomputed-tokens"])
    assert reused > 0 and recomputed > 0
    assert reply.usage.prompt_tokens_details.cached_tokens == reused
    assert reused + recomputed < reply.usage.prompt_tokens  # head and question are always computed
    assert raw.headers["x-kvgate-reuse"] == "blend" and reply.choices[0].message.content
    # And how far that moved the answer: nothing has measured 20% on this server (tests/unit/test_fidelity.py has
    # a server that measured), so it says so rather than claim a KL.
    assert first.headers.get("x-kvgate-fidelity", "exact") == "exact"  # nothing blended, nothing moved
    assert raw.headers["x-kvgate-fidelity"] == "ratio=0.2; source=none"


def test_blend_at_ratio_one_answers_as_full_prefill(client, model_name) -> None:
    docs = own("ratio one test")
    # Read once, in the other order: a blend at ratio 1 has cached KV to (not) reuse, and no prefix blocks
    # hold this order (those would be read exactly, with nothing left to blend).
    ask(client, model_name, docs[::-1])
    full = ask(client, model_name, docs, {"reuse": "full"})
    blend = ask(client, model_name, docs, {"reuse": "blend", "recompute_ratio": 1.0})
    assert full.headers["x-kvgate-reused-tokens"] == "0" and full.headers["x-kvgate-reuse"] == "full"
    assert blend.headers["x-kvgate-reuse"].startswith("blend")
    recomputed = int(blend.headers["x-kvgate-recomputed-tokens"])
    # Read exactly: the template's head and the first document's opening (`<document>`), as the other order had.
    assert recomputed > 0 and int(blend.headers["x-kvgate-reused-tokens"]) < 32
    assert blend.parse().choices[0].message.content == full.parse().choices[0].message.content


def test_a_stored_document_cited_by_id_answers_as_its_text(client, model_name, base_url) -> None:
    stored = [
        loopback.post(f"{base_url}/v1/documents", json={"text": d}, headers=AS_CLIENT, timeout=60).json() for d in DOCS
    ]
    assert all(s["id"].startswith("doc-") and s["tokens"] > 0 and s["cached"] for s in stored)
    shown = loopback.get(f"{base_url}/v1/documents/{stored[0]['id']}", headers=AS_CLIENT).json()
    assert shown == stored[0]
    other = loopback.get(f"{base_url}/v1/documents/{stored[0]['id']}", headers={"authorization": "Bearer other"})
    assert other.status_code == 404  # another tenant does not see it

    by_id = ask(client, model_name, [{"id": s["id"]} for s in stored]).parse()
    by_text = ask(client, model_name, [{"text": d} for d in DOCS]).parse()
    assert by_id.choices[0].message.content == by_text.choices[0].message.content
    assert (by_id.usage.prompt_tokens, by_id.usage.completion_tokens) == (
        by_text.usage.prompt_tokens,
        by_text.usage.completion_tokens,
    )


def test_a_stored_document_is_on_disk_when_its_card_says_so(base_url, settings) -> None:
    text = "The Old Mill station closes at nine; the last train leaves Pier Street at half past eight."
    card = loopback.post(f"{base_url}/v1/documents", json={"text": text}, headers=AS_CLIENT, timeout=60).json()
    assert card["cached"] and card["durable"] and card["tier"] == "disk"
    # Whole on disk as the server answers: another process opening the directory reads it.
    assert DiskTier(settings.caches.dir, 1 << 30).get(card["id"].removeprefix("doc-")) is not None


def test_exact_prefix_reuse_finds_an_earlier_prompt(client, model_name, grid) -> None:
    docs = own("prefix test")
    first = ask(client, model_name, docs, {"reuse": "prefix"})
    again = ask(client, model_name, docs, {"reuse": "prefix"})
    # The first finds what earlier prompts began with (the template's head, the first document but for its tag);
    # the repeat all but its last token, whose logits start the answer.
    assert int(first.headers["x-kvgate-reused-tokens"]) < int(again.headers["x-kvgate-reused-tokens"])
    read = again.parse().usage.prompt_tokens - 1  # down to the grid: the rest computed as full prefill does
    assert int(again.headers["x-kvgate-reused-tokens"]) == read - read % grid
    assert again.parse().choices[0].message.content == first.parse().choices[0].message.content
    assert again.headers["x-kvgate-fidelity"] == "exact"  # the very KV full prefill computes


def test_streaming_with_documents_carries_the_reuse_headers(client, model_name, base_url) -> None:
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": QUESTION}],
        "documents": own("streaming test"),
        "temperature": 0,
        "max_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    ask(client, model_name, body["documents"])  # read once, so that the stream reuses them
    with loopback.stream("POST", f"{base_url}/v1/chat/completions", json=body, headers=AS_CLIENT, timeout=120) as r:
        assert r.status_code == 200
        reused = int(r.headers["x-kvgate-reused-tokens"])
        # Out with the headers, before the first token: the same prompt again, read from its prefix blocks.
        assert r.headers["x-kvgate-fidelity"] == "exact" and r.headers["x-kvgate-reuse"] == "prefix"
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert reused > 0 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == reused
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])

    # The official SDK streams it too.
    stream = client.chat.completions.create(
        model=model_name,
        messages=body["messages"],
        temperature=0,
        max_tokens=12,
        stream=True,
        extra_body={"documents": body["documents"]},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_deleted_document_is_gone(base_url, client, model_name) -> None:
    doc = loopback.post(f"{base_url}/v1/documents", json={"text": "A document to delete."}).json()
    gone = loopback.delete(f"{base_url}/v1/documents/{doc['id']}")
    assert gone.status_code == 200 and gone.json()["deleted"] is True
    assert loopback.get(f"{base_url}/v1/documents/{doc['id']}").status_code == 404
    with pytest.raises(openai.NotFoundError) as err:
        ask(client, model_name, [{"id": doc["id"]}])
    assert err.value.body["code"] == "document_not_found" and err.value.body["param"] == "documents.0.id"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"documents": [{"text": "a", "id": "doc-x"}]}, "documents.0"),
        ({"documents": [{}]}, "documents.0"),
        ({"documents": [{"text": ""}]}, "documents.0.text"),
        ({"documents": [{"text": "a"}], "kvgate": {"reuse": "sometimes"}}, "kvgate.reuse"),
        ({"documents": [{"text": "a"}], "kvgate": {"recompute_ratio": 2}}, "kvgate.recompute_ratio"),
    ],
)
def test_bad_documents_are_400s(client, model_name, extra, param) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body=extra
        )
    assert err.value.body["param"] == param


def test_unknown_document_id_is_a_404(base_url) -> None:
    r = loopback.get(f"{base_url}/v1/documents/doc-nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "document_not_found"
    assert loopback.post(f"{base_url}/v1/documents", json={}).status_code == 400
