"""/v1/messages as the official anthropic SDK (and Claude Code) uses it: a real uvicorn server on loopback over the
real model, answered through chat completions: the same answer, its KV reused across a tool loop, Anthropic's
stream events, stop reasons, usage and error shapes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from kvgate.gateway.settings import Settings
from tests.helpers import loopback
from tests.helpers.servers import serving

BRIEF = "You answer in one short sentence."
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": CITY}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # the SDK no longer names the sampling fields; older SDKs and other clients send them


def sdk(url: str, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(base_url: str) -> anthropic.Anthropic:
    return sdk(base_url)


def test_the_anthropic_sdk_lists_and_retrieves_models_in_its_own_shape(
    claude: anthropic.Anthropic, client: openai.OpenAI, model_name: str
) -> None:
    """`models.list()` and `models.retrieve()` of the anthropic SDK get Anthropic's shapes, typed with nothing extra
    (the openai SDK's, on the same path, OpenAI's); a page of one says there is more, and the next page has it."""
    listed = claude.models.list()
    ids = [m.id for m in listed.data]
    assert ids == [m.id for m in client.models.list().data] and ids[0] == model_name and len(ids) > 1
    for m in listed.data:
        assert m.type == "model" and m.display_name == m.id and m.lifecycle == "active" and not m.model_extra
    assert listed.data[0].max_input_tokens and listed.data[0].created_at.year >= 2024
    retrieved = claude.models.retrieve(model_name)
    assert retrieved == listed.data[0] and not retrieved.model_extra
    first = claude.models.list(limit=1)
    assert [m.id for m in first.data] == ids[:1] and first.has_more and first.first_id == first.last_id == ids[0]
    after = claude.models.list(limit=1, after_id=ids[0])
    assert [m.id for m in after.data] == ids[1:2] and claude.models.list(limit=5, before_id=ids[1]).data == first.data
    assert client.models.retrieve(model_name).owned_by == "kvgate"  # OpenAI's card for an OpenAI client


def test_a_message_is_the_chat_completions_answer(claude: anthropic.Anthropic, client: openai.OpenAI, model_name: str):
    """System and messages become the chat that answers them: the same greedy text, the same prompt tokens."""
    message = claude.messages.create(
        model=model_name, max_tokens=12, system=BRIEF, messages=ASK, extra_body=GREEDY, metadata={"user_id": "u1"}
    )
    chat = client.chat.completions.create(
        model=model_name, messages=[{"role": "system", "content": BRIEF}, *ASK], max_tokens=12, extra_body=GREEDY
    )
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens


def test_system_blocks_with_cache_control_read_as_one_system_prompt(claude: anthropic.Anthropic, model_name: str):
    blocks = [{"type": "text", "text": BRIEF, "cache_control": {"type": "ephemeral"}}]
    plain = claude.messages.create(model=model_name, max_tokens=6, system=BRIEF, messages=ASK, extra_body=GREEDY)
    blocked = claude.messages.create(model=model_name, max_tokens=6, system=blocks, messages=ASK, extra_body=GREEDY)
    assert blocked.content[0].text == plain.content[0].text


def test_a_stop_sequence_says_which_one_stopped_it(claude: anthropic.Anthropic, model_name: str):
    whole = claude.messages.create(model=model_name, max_tokens=16, messages=ASK, extra_body=GREEDY)
    text = whole.content[0].text
    stop = text.split()[2]  # a word the answer writes
    stopped = claude.messages.create(
        model=model_name, max_tokens=16, messages=ASK, extra_body=GREEDY, stop_sequences=["zzzq", stop]
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.index(stop)]


def test_forced_tool_use_then_its_result_continue_on_the_first_turns_kv(claude: anthropic.Anthropic, model_name: str):
    """The tool loop as the SDK runs it: a forced tool_use with schema-valid input, then the tool_result turn,
    which reuses the KV of the turn before it (found by its messages: no kvgate field)."""
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "tool", "name": "get_weather"}
    first = claude.messages.create(
        model=model_name,
        max_tokens=64,
        system=BRIEF,
        messages=asked,
        tools=[WEATHER],
        tool_choice=choice,
        extra_body=GREEDY,
    )
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input, dict) and isinstance(use.input["city"], str)
    turn = [
        *asked,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C."}]},
    ]
    second = claude.messages.create(
        model=model_name, max_tokens=8, system=BRIEF, messages=turn, tools=[WEATHER], extra_body=GREEDY
    )
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= 0.8 * prompt
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_a_stream_is_anthropics_event_sequence_and_the_whole_answer(
    claude: anthropic.Anthropic, base_url: str, model_name: str
):
    ask = {"model": model_name, "max_tokens": 10, "messages": ASK, "extra_body": GREEDY}
    whole = claude.messages.create(**ask)
    with claude.messages.stream(**ask) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens > 0
    names = [e["type"] for e in raw_events(base_url, {**ask, **GREEDY, "stream": True, "extra_body": None})]
    deltas = names[4:-3]
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert set(deltas) == {"content_block_delta"} and len(deltas) >= 2  # token by token
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_a_streamed_tool_use_sends_its_input_as_json_deltas(claude: anthropic.Anthropic, model_name: str):
    with claude.messages.stream(
        model=model_name,
        max_tokens=64,
        extra_body=GREEDY,  # sampled (Anthropic's default temperature is 1), the city may run past max_tokens
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds and final.stop_reason == "tool_use"
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input["city"], str)


def test_structured_output_follows_its_schema(claude: anthropic.Anthropic, model_name: str):
    schema = {**CITY, "additionalProperties": False}
    message = claude.messages.create(
        model=model_name,
        max_tokens=24,
        extra_body=GREEDY,  # sampled, the string may run past max_tokens (seen: a 20-token "city", cut)
        messages=[{"role": "user", "content": "Name a city in Italy, as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert set(json.loads(message.content[0].text)) == {"city"}


def test_count_tokens_is_the_prompt_a_message_reads(claude: anthropic.Anthropic, model_name: str):
    ask = {"model": model_name, "system": BRIEF, "messages": ASK, "tools": [WEATHER]}
    counted = claude.messages.count_tokens(**ask)
    message = claude.messages.create(**ask, max_tokens=1, extra_body=GREEDY, tool_choice={"type": "none"})
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens > 0


def test_a_request_shaped_like_claude_codes_is_answered(claude: anthropic.Anthropic, model_name: str):
    """System blocks with cache_control, a dozen tools (Claude Code sends dozens: each one only adds prefill here),
    a tool_result of text blocks, thinking blocks sent back."""
    tools = [
        {
            "name": f"tool_{i}",
            "description": f"Tool number {i}.",
            "input_schema": CITY,
            "cache_control": {"type": "ephemeral"},
        }
        for i in range(12)
    ]
    system = [
        {"type": "text", "text": "You are a coding agent."},
        {"type": "text", "text": BRIEF, "cache_control": {"type": "ephemeral"}},
    ]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "List the files."}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I should list them.", "signature": "sig"},
                {"type": "text", "text": "Listing."},
                {"type": "tool_use", "id": "toolu_1", "name": "tool_3", "input": {"city": "."}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "a.py b.py"}]},
                {"type": "text", "text": "Which one is Python?", "cache_control": {"type": "ephemeral"}},
            ],
        },
    ]
    message = claude.messages.create(model=model_name, max_tokens=8, system=system, messages=messages, tools=tools)
    assert message.content and message.stop_reason in ("end_turn", "max_tokens", "tool_use")


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ({"messages": ASK}, "max_tokens"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "images"),
        ({"max_tokens": 8, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"max_tokens": 8, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "s"}]}, "server tools"),
        ({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, "role"),
        ({"max_tokens": 8, "messages": ASK, "temperature": 1.5}, "temperature"),
        ({"max_tokens": 8, "messages": [*ASK, {"role": "assistant", "content": "The"}]}, "prefill"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_in_anthropics_shape(
    base_url: str, model_name: str, body: dict[str, Any], said: str
):
    response = loopback.post(f"{base_url}/v1/messages", json={"model": model_name, **body}, timeout=60)
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert said in error["error"]["message"]


def test_the_sdk_raises_anthropics_errors(claude: anthropic.Anthropic):
    with pytest.raises(anthropic.NotFoundError) as found:
        claude.messages.create(model="no-such-model", max_tokens=8, messages=ASK)
    assert found.value.body["error"]["type"] == "not_found_error"


@pytest.fixture(scope="module")
def keyed(settings: Settings, engine: Any) -> Iterator[str]:
    with serving(
        settings.model_copy(update={"security": {"api_keys": {"sk-anthropic-test": "anthropic-tenant"}}}), engine
    ) as url:
        yield url


def test_x_api_key_is_the_key(keyed: str, model_name: str):
    """Anthropic's clients send x-api-key; a wrong one is a 401 in Anthropic's shape."""
    answered = sdk(keyed, "sk-anthropic-test").messages.create(model=model_name, max_tokens=2, messages=ASK)
    assert answered.content
    with pytest.raises(anthropic.AuthenticationError) as refused:
        sdk(keyed, "sk-wrong").messages.create(model=model_name, max_tokens=2, messages=ASK)
    assert refused.value.body["error"]["type"] == "authentication_error"


def test_a_front_without_a_model_answers_and_counts_through_its_upstream(
    claude: anthropic.Anthropic, model_name: str, base_url: str
):
    """Proxy mode: the message goes to the upstream as a chat completion, the count to its /tokenize."""
    upstream = {"name": "runtime", "base_url": f"{base_url}/v1", "models": [model_name]}
    ask = {"model": model_name, "max_tokens": 6, "messages": ASK, "extra_body": GREEDY}
    with serving(Settings(proxy={"upstreams": [upstream]}, semantic_cache={"enabled": False}), None) as url:
        front = sdk(url)
        assert front.messages.create(**ask).content[0].text == claude.messages.create(**ask).content[0].text
        count = {"model": model_name, "messages": ASK}
        assert front.messages.count_tokens(**count).input_tokens == claude.messages.count_tokens(**count).input_tokens


def raw_events(base_url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The SSE events as sent: each `event:` name is its data's type."""
    body = {k: v for k, v in body.items() if v is not None}
    events = []
    with loopback.stream("POST", f"{base_url}/v1/messages", json=body, timeout=120) as response:
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == name
                events.append(data)
    return events
