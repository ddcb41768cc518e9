"""Proxy mode in front of a real kvgate runtime: the session's server, running the real model, is the upstream of
a second kvgate on loopback that has no model of its own. Through that front, with the official SDK, a client
gets what the runtime answers: chat, streamed chat, completions, and the model list. (Failures are scripted
against stub upstreams in tests/server/test_proxy.py and tests/server/test_proxy_relay.py.)"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from kvgate.gateway.settings import Settings
from tests.helpers.servers import serving

ASK = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 8  # the model runs on CPU


@pytest.fixture(scope="module")
def front(base_url: str, model_name: str) -> Iterator[openai.OpenAI]:
    """The SDK's client of a proxy-mode kvgate whose one upstream is the session's runtime server."""
    upstream = {"name": "runtime", "base_url": f"{base_url}/v1", "models": [model_name]}
    with serving(Settings(proxy={"upstreams": [upstream]}, semantic_cache={"enabled": False}), None) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_front_lists_the_upstreams_model(front: openai.OpenAI, model_name: str) -> None:
    assert [m.id for m in front.models.list()] == [model_name]


def test_a_chat_completion_through_the_front_is_the_runtimes_answer(
    front: openai.OpenAI, client: openai.OpenAI, model_name: str
) -> None:
    raw = front.chat.completions.with_raw_response.create(
        model=model_name, messages=ASK, max_tokens=MAX_TOKENS, temperature=0
    )
    answer = raw.parse()
    direct = client.chat.completions.create(model=model_name, messages=ASK, max_tokens=MAX_TOKENS, temperature=0)
    assert raw.headers["x-kvgate-upstream"] == "runtime"
    assert answer.choices[0].message.content and answer.choices[0].message.content == direct.choices[0].message.content
    assert answer.usage is not None and answer.usage.completion_tokens == direct.usage.completion_tokens


def test_a_streamed_chat_through_the_front_arrives_in_chunks_that_make_the_whole_answer(
    front: openai.OpenAI, model_name: str
) -> None:
    whole = front.chat.completions.create(model=model_name, messages=ASK, max_tokens=MAX_TOKENS, temperature=0)
    stream = front.chat.completions.create(
        model=model_name, messages=ASK, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([p for p in pieces if p]) > 1  # token by token, not the answer in one event
    assert "".join(pieces) == whole.choices[0].message.content


def test_a_completion_through_the_front_is_the_runtimes_answer(
    front: openai.OpenAI, client: openai.OpenAI, model_name: str
) -> None:
    prompt = "The capital of France is"
    answer = front.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    direct = client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert answer.choices[0].text and answer.choices[0].text == direct.choices[0].text
