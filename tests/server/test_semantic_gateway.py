"""The semantic cache through the gateway: a real uvicorn server, the real model, the openai SDK."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import yaml

from kvgate.gateway.settings import Settings
from kvgate.runtime.engine import Engine
from kvgate.semantic_cache.config import DEFAULT_CATEGORIES
from tests.helpers import loopback
from tests.helpers.servers import serving

KEYS = {"key-alice": "alice", "key-bob": "bob"}
ADMIN = "admin-secret"
QUESTION = "What is the capital of France?"
PARAPHRASE = "What's the capital city of France?"


# The shipped categories without their error bound: the threshold and the guards decide, so that a
# paraphrase hits at once (the bound through the gateway: test_semantic_feedback.py).
UNBOUNDED = [{**c, "max_error_rate": None} for c in yaml.safe_load(DEFAULT_CATEGORIES.read_text())["categories"]]


@pytest.fixture(scope="module")
def url(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("semantic") / "semantic.sqlite3"
    settings = Settings(
        engine={"max_num_seqs": 4},
        semantic_cache={"path": path, "categories": UNBOUNDED},
        security={"api_keys": KEYS, "admin_key": ADMIN},
    )
    with serving(settings, engine) as base:
        yield base


def client(url: str, key: str = "key-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def ask(url: str, question: str, key: str = "key-alice", headers: dict | None = None, **kw):
    kw.setdefault("temperature", 0)
    messages = kw.pop("messages", None) or [{"role": "user", "content": question}]
    return client(url, key).chat.completions.with_raw_response.create(
        model=kw.pop("model", "SmolLM2-135M-Instruct"), messages=messages, max_tokens=16, extra_headers=headers, **kw
    )


def unique(question: str) -> str:
    """Questions differ per test, so that tests sharing the server do not see each other's entries."""
    return f"{question} ({time.monotonic_ns()})"


def test_a_paraphrase_is_answered_from_the_cache(url: str, model_name: str) -> None:
    first = ask(url, QUESTION, model=model_name)
    assert first.headers["x-kvgate-cache"] == "miss" and first.headers["x-kvgate-cache-category"] == "factual"
    again = ask(url, PARAPHRASE, model=model_name)
    assert again.headers["x-kvgate-cache"] == "hit"
    assert 0.88 <= float(again.headers["x-kvgate-similarity"]) < 1
    assert again.parse().choices[0].message.content == first.parse().choices[0].message.content
    assert again.parse().usage.completion_tokens == first.parse().usage.completion_tokens


def test_a_negated_question_is_refused_by_its_guard(url: str, model_name: str) -> None:
    ask(url, "Is coffee good for your health?", model=model_name)
    refused = ask(url, "Is coffee not good for your health?", model=model_name)
    assert refused.headers["x-kvgate-cache"] == "miss" and refused.headers["x-kvgate-cache-refused"] == "negation"


def test_tenant_a_entries_never_hit_for_tenant_b(url: str, model_name: str) -> None:
    question = "Name three primary colors."
    ask(url, question, model=model_name)
    assert ask(url, question, model=model_name).headers["x-kvgate-cache"] == "hit"
    assert ask(url, question, key="key-bob", model=model_name).headers["x-kvgate-cache"] == "miss"


def test_an_unknown_key_is_refused_when_keys_are_configured(url: str, model_name: str) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        ask(url, QUESTION, key="key-mallory", model=model_name)
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"


def test_a_different_system_prompt_or_documents_never_hit(url: str, model_name: str) -> None:
    question = unique("How do birds fly?")

    def with_system(system: str, **kw):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return ask(url, question, messages=messages, model=model_name, **kw)

    with_system("You are a poet.")
    assert with_system("You are a poet.").headers["x-kvgate-cache"] == "hit"
    assert with_system("You are a biologist.").headers["x-kvgate-cache"] == "miss"
    docs = {"documents": [{"text": "Birds fly by flapping their wings."}]}
    assert with_system("You are a poet.", extra_body=docs).headers["x-kvgate-cache"] == "miss"
    other = {"documents": [{"text": "Birds are descended from dinosaurs."}]}
    assert with_system("You are a poet.", extra_body=other).headers["x-kvgate-cache"] == "miss"
    assert with_system("You are a poet.", extra_body=docs).headers["x-kvgate-cache"] == "hit"


def test_different_sampling_parameters_or_earlier_turns_never_hit(url: str, model_name: str) -> None:
    question = unique("Why is the sky blue?")
    ask(url, question, model=model_name)
    assert ask(url, question, model=model_name, top_p=0.5).headers["x-kvgate-cache"] == "miss"
    earlier = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": question},
    ]
    assert ask(url, question, messages=earlier, model=model_name).headers["x-kvgate-cache"] == "miss"


def test_a_long_user_turn_hits_only_with_the_same_text_before_its_end(url: str, model_name: str) -> None:
    """Only the end of a long turn is embedded: the pasted text before it must be the same."""
    pasted = unique("The Harbor Line opened in 1911 and runs from Pier Street to the Old Mill. ") * 20
    other = pasted.replace("opened", "was planned", 1)  # at the start: far from the embedded end
    question = " When did the Harbor Line open?"
    ask(url, pasted + question, model=model_name)
    assert ask(url, pasted + question, model=model_name).headers["x-kvgate-cache"] == "hit"
    assert ask(url, other + question, model=model_name).headers["x-kvgate-cache"] == "miss"


def test_only_deterministic_requests_are_stored_unless_opted_in(url: str, model_name: str) -> None:
    question = unique("Give me a tip for sleeping well.")
    assert ask(url, question, model=model_name, temperature=0.8).headers["x-kvgate-cache"] == "bypass"
    assert ask(url, question, model=model_name, temperature=0.8).headers["x-kvgate-cache"] == "bypass"
    opted = {"kvgate": {"cache": True}}
    assert ask(url, question, model=model_name, temperature=0.8, extra_body=opted).headers["x-kvgate-cache"] == "miss"
    assert ask(url, question, model=model_name, temperature=0.8, extra_body=opted).headers["x-kvgate-cache"] == "hit"
    off = {"kvgate": {"cache": False}}
    assert ask(url, question, model=model_name, temperature=0.8, extra_body=off).headers["x-kvgate-cache"] == "bypass"


def test_cache_control_no_cache_skips_the_lookup_and_no_store_the_write(url: str, model_name: str) -> None:
    question = unique("Describe a cat in one sentence.")
    assert (
        ask(url, question, model=model_name, headers={"cache-control": "no-store"}).headers["x-kvgate-cache"] == "miss"
    )
    assert ask(url, question, model=model_name).headers["x-kvgate-cache"] == "miss"  # nothing was stored
    assert (
        ask(url, question, model=model_name, headers={"cache-control": "no-cache"}).headers["x-kvgate-cache"]
        == "bypass"
    )
    assert ask(url, question, model=model_name).headers["x-kvgate-cache"] == "hit"


def test_a_streamed_hit_replays_the_stored_text(url: str, model_name: str) -> None:
    question = unique("Write a haiku about the sea.")
    stored = ask(url, question, model=model_name).parse()
    with loopback.stream(
        "POST",
        f"{url}/v1/chat/completions",
        headers={"authorization": "Bearer key-alice"},
        json={
            "model": model_name,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 16,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=60,
    ) as response:
        assert response.headers["x-kvgate-cache"] == "hit"
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == stored.choices[0].message.content
    assert chunks[-2]["choices"][0]["finish_reason"] == stored.choices[0].finish_reason
    assert chunks[-1]["usage"]["completion_tokens"] == stored.usage.completion_tokens


def test_a_streamed_miss_is_stored_for_the_next_request(url: str, model_name: str) -> None:
    question = unique("What is Python used for?")
    stream = client(url).chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": question}], max_tokens=16, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    again = ask(url, question, model=model_name)
    assert again.headers["x-kvgate-cache"] == "hit" and again.parse().choices[0].message.content == streamed


def test_admin_endpoints_need_the_admin_key_and_invalidate(url: str, model_name: str) -> None:
    question = unique("How do plants make food?")
    ask(url, question, model=model_name)
    hit = ask(url, question, model=model_name)
    entry = hit.headers["x-kvgate-cache-entry"]
    admin = httpx.Client(base_url=f"{url}/admin/semantic-cache", headers={"authorization": f"Bearer {ADMIN}"})
    assert loopback.get(f"{url}/admin/semantic-cache").status_code == 401
    denied = loopback.get(f"{url}/admin/semantic-cache", headers={"authorization": "Bearer key-alice"})
    assert denied.status_code == 403 and denied.json()["error"]["type"] == "permission_error"
    assert admin.get(f"{url}/admin/semantic-cache").json()["entries"] >= 1
    assert admin.delete(f"/entries/{entry}").json()["deleted"] == 1
    assert admin.delete(f"/entries/{entry}").status_code == 404
    assert ask(url, question, model=model_name).headers["x-kvgate-cache"] == "miss"
    assert admin.delete("/categories/no-such-category").status_code == 404
    assert admin.delete("/tenants/alice").json()["deleted"] >= 1
    assert ask(url, question, model=model_name).headers["x-kvgate-cache"] == "miss"


def test_admin_endpoints_are_closed_without_an_admin_key(engine: Engine, tmp_path: Path) -> None:
    settings = Settings(semantic_cache={"path": tmp_path / "s.sqlite3"})
    with serving(settings, engine) as base:
        closed = loopback.get(f"{base}/admin/semantic-cache", headers={"authorization": "Bearer anything"})
    assert closed.status_code == 403 and closed.json()["error"]["code"] == "admin_disabled"


def test_without_keys_callers_with_different_tokens_do_not_share(engine: Engine, tmp_path: Path) -> None:
    settings = Settings(semantic_cache={"path": tmp_path / "s.sqlite3"})
    model = engine.loaded.name
    with serving(settings, engine) as base:
        ask(base, QUESTION, key="token-one", model=model)
        assert ask(base, QUESTION, key="token-one", model=model).headers["x-kvgate-cache"] == "hit"
        assert ask(base, QUESTION, key="token-two", model=model).headers["x-kvgate-cache"] == "miss"


def entries(url: str) -> int:
    return loopback.get(f"{url}/admin/semantic-cache", headers={"authorization": f"Bearer {ADMIN}"}).json()["entries"]


def test_n_above_one_or_logprobs_are_never_answered_from_the_cache(url: str, model_name: str) -> None:
    question = unique("Name a large ocean.")
    ask(url, question, model=model_name)
    assert ask(url, question, model=model_name).headers["x-kvgate-cache"] == "hit"  # stored, as a plain request
    two = ask(url, question, model=model_name, n=2)
    assert two.headers["x-kvgate-cache"] == "bypass" and len(two.parse().choices) == 2
    scored = ask(url, question, model=model_name, logprobs=True, top_logprobs=2)
    assert scored.headers["x-kvgate-cache"] == "bypass"
    tokens = scored.parse().choices[0].logprobs.content
    assert len(tokens) == scored.parse().usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in tokens)


def test_answers_to_n_above_one_or_logprobs_are_never_stored(url: str, model_name: str) -> None:
    question = unique("Name a tall mountain.")
    before = entries(url)
    for _ in range(2):  # the second of each would be a hit had the first been stored
        assert ask(url, question, model=model_name, n=2).headers["x-kvgate-cache"] == "bypass"
        assert ask(url, question, model=model_name, logprobs=True).headers["x-kvgate-cache"] == "bypass"
    assert entries(url) == before


def test_anthropics_messages_are_answered_from_the_cache_as_messages(url: str, model_name: str) -> None:
    """/v1/messages goes the chat route's way: a question asked as a chat completion is a hit for the same
    question asked of the Messages API, whole or streamed, in Anthropic's shape."""
    question = "Which city is the capital of Germany?"
    first = ask(url, question, model=model_name).parse().choices[0].message.content
    claude = anthropic.Anthropic(base_url=url, api_key="key-alice", max_retries=0, timeout=120)
    asked = {"model": model_name, "max_tokens": 16, "messages": [{"role": "user", "content": question}]}
    raw = claude.messages.with_raw_response.create(**asked, extra_body={"temperature": 0})
    assert raw.headers["x-kvgate-cache"] == "hit" and raw.parse().content[0].text == first
    with claude.messages.stream(**asked, extra_body={"temperature": 0}) as stream:
        assert "".join(stream.text_stream) == first
