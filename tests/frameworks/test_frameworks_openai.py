"""The openai SDK's tool calling and structured outputs against kvgate: a tool loop by hand, a streamed
call accumulated by the SDK's stream helper, and `parse` with a pydantic response format."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from tests.helpers.frameworks import (
    MAX_TOKENS,
    SYSTEM,
    ReusedTokens,
    assert_ran_once_with_a_city,
    assert_resumed,
    question,
    weather,
)

WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


class GetWeather(BaseModel):
    """Get the weather for a city."""

    city: str


class City(BaseModel):
    name: str
    country: str


@pytest.fixture
def reused() -> ReusedTokens:
    return ReusedTokens()


@pytest.fixture
def client(base_url: str, reused: ReusedTokens) -> Iterator[openai.OpenAI]:
    http = reused.client()
    yield openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, http_client=http)
    http.close()


def test_openai_sdk_tool_loop(client: openai.OpenAI, model_name: str, reused: ReusedTokens) -> None:
    calls: list[str] = []

    def get_weather(city: str) -> str:
        calls.append(city)
        return weather(city)

    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question("Paris")}]
    settings: Any = {"model": model_name, "tools": [WEATHER_TOOL], "max_tokens": MAX_TOKENS, "temperature": 0}
    first = client.chat.completions.create(
        messages=messages, tool_choice="required", parallel_tool_calls=False, **settings
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    messages.append(choice.message.model_dump(exclude_none=True))  # the answer as given
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.function.name == "get_weather"
        result = get_weather(**json.loads(call.function.arguments))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})

    second = client.chat.completions.create(messages=messages, **settings)  # tool_choice auto: it answers

    assert_ran_once_with_a_city(calls)
    assert second.choices[0].finish_reason in ("stop", "length") and second.choices[0].message.content
    assert first.usage and second.usage and second.usage.prompt_tokens_details
    assert_resumed(first.usage.prompt_tokens, second.usage.prompt_tokens_details.cached_tokens)
    # The same count in the response header, seen by an httpx event hook.
    assert reused.seen == [0, second.usage.prompt_tokens_details.cached_tokens]


def test_openai_sdk_stream_helper_accumulates_a_streamed_call(client: openai.OpenAI, model_name: str) -> None:
    calls: list[str] = []

    def get_weather(city: str) -> str:
        calls.append(city)
        return weather(city)

    # pydantic_function_tool: a strict schema, and the helper parses the arguments back into GetWeather.
    tools = [openai.pydantic_function_tool(GetWeather, name="get_weather")]
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question("Lisbon")}]
    settings: Any = {"model": model_name, "tools": tools, "max_tokens": MAX_TOKENS, "temperature": 0}
    settings["stream_options"] = {"include_usage": True}
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    with client.chat.completions.stream(
        messages=messages, tool_choice=named, parallel_tool_calls=False, **settings
    ) as stream:
        events = [event.type for event in stream]
        first = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in events and "tool_calls.function.arguments.done" in events

    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(call.function.parsed_arguments, GetWeather)
    result = get_weather(**call.function.parsed_arguments.model_dump())
    messages.append(choice.message.model_dump(include={"role", "content", "tool_calls"}))  # the answer as given
    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})

    with client.chat.completions.stream(messages=messages, **settings) as stream:
        second = stream.get_final_completion()

    assert_ran_once_with_a_city(calls)
    assert second.choices[0].message.content
    assert first.usage and second.usage and second.usage.prompt_tokens_details
    assert_resumed(first.usage.prompt_tokens, second.usage.prompt_tokens_details.cached_tokens)


def test_openai_sdk_a_call_cut_short_by_max_tokens_keeps_what_the_model_wrote(
    client: openai.OpenAI, model_name: str
) -> None:
    messages: Any = [{"role": "user", "content": question("Paris")}]
    settings: Any = {"model": model_name, "tools": [WEATHER_TOOL], "tool_choice": "required", "temperature": 0}
    cut = client.chat.completions.create(messages=messages, parallel_tool_calls=False, max_tokens=28, **settings)
    streamed = client.chat.completions.create(
        messages=messages, parallel_tool_calls=False, max_tokens=28, stream=True, **settings
    )
    fragments = [
        c.function.arguments or "" for chunk in streamed for ch in chunk.choices for c in ch.delta.tool_calls or ()
    ]
    # A second call (parallel_tool_calls unset: allowed) cut before its arguments start.
    two = client.chat.completions.create(messages=messages, max_tokens=44, **settings)

    (call,) = cut.choices[0].message.tool_calls or []
    arguments = call.function.arguments
    assert cut.choices[0].finish_reason == "length"
    assert arguments.count('"city"') <= 1 and "</" not in arguments, arguments  # the JSON written, once
    assert "".join(fragments) == arguments  # a stream says what the whole answer says
    assert two.choices[0].finish_reason == "length" and not two.choices[0].message.content  # no markup as text


def test_openai_sdk_parse_with_a_pydantic_response_format(client: openai.OpenAI, model_name: str) -> None:
    completion = client.chat.completions.parse(
        model=model_name,
        messages=[{"role": "user", "content": "Paris is the capital of France. Extract the city."}],
        response_format=City,  # sent as a strict json_schema; kvgate's grammar holds the answer to it
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, City) and message.parsed.name and message.parsed.country
    assert City.model_validate_json(message.content or "") == message.parsed
