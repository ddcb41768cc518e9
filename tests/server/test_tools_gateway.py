"""Tool calls and structured outputs through the real server, with the official openai SDK: forced
calls whose arguments validate, streamed calls the SDK's helpers accumulate, `parse` with a pydantic
model, clear 400s for what kvgate cannot honour, and a tool loop's next turn reusing the KV of the
turn before, found by its messages alone (no kvgate field), within its tenant only."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pydantic
import pytest

from tests.helpers import loopback
from tests.helpers.servers import serving

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "A city's weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0, "max_tokens": 48}


OPEN = {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int


def test_a_forced_call_has_an_id_a_name_and_arguments_that_validate(client, model_name):
    done = client.chat.completions.create(model=model_name, messages=ASK, **FORCED)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    if call.function.name == "get_weather":
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    else:
        assert call.function.name == "get_time" and isinstance(json.loads(call.function.arguments), dict)


def test_a_named_call_streams_and_the_sdk_accumulates_it(client, model_name):
    named = {"type": "function", "function": {"name": "get_weather"}}
    fragments = []
    with client.chat.completions.stream(
        model=model_name, messages=ASK, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=48
    ) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta" and event.arguments_delta:
                fragments.append(event.arguments_delta)
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and final.choices[0].finish_reason == "tool_calls"
    assert len(fragments) > 1 and "".join(fragments) == call.function.arguments  # fragments, not one piece
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    whole = client.chat.completions.create(
        model=model_name, messages=ASK, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=48
    )
    assert whole.choices[0].message.tool_calls[0].function.arguments == call.function.arguments


def test_parse_with_a_pydantic_model_and_json_object(client, model_name):
    parsed = client.chat.completions.parse(
        model=model_name,
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format=Person,
        temperature=0,
        max_tokens=40,
    )
    assert isinstance(parsed.choices[0].message.parsed, Person)
    free = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "A JSON object about cats."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=40,
    )
    if free.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(free.choices[0].message.content), dict)


def test_a_strict_schema_is_closed_and_every_property_required_as_openai_means_it(client, model_name):
    """As smolagents sends pydantic's schema: no additionalProperties, a property not required. Strict, the
    answer holds exactly the properties (the model would not write `zip_code` unasked, nor stop adding keys)."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "zip_code": {"type": "integer", "maximum": 99}},
        "required": ["name"],
    }
    done = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": schema}},
        temperature=0,
        max_tokens=40,
    )
    assert done.choices[0].finish_reason == "stop"
    assert set(json.loads(done.choices[0].message.content)) == {"name", "zip_code"}


def test_every_choice_of_n_is_parsed_for_its_calls(client, model_name):
    done = client.chat.completions.create(model=model_name, messages=ASK, n=2, seed=1, **{**FORCED, "temperature": 1})
    assert [c.finish_reason for c in done.choices] == ["tool_calls", "tool_calls"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/x"}}}}, None),
        (  # strict, yet open: OpenAI refuses it too
            {"tools": [{"type": "function", "function": {**TOOLS[1]["function"], "strict": True, "parameters": OPEN}}]},
            "tools.0.function",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"strict": True, "schema": OPEN}}},
            "response_format.json_schema",
        ),
    ],
)
def test_what_kvgate_cannot_honour_is_a_400_never_ignored(client, model_name, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model_name, messages=ASK, max_tokens=4, **extra)
    error = caught.value.body
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    else:
        assert "constrained decoding" in error["message"]


def tool_loop(client: openai.OpenAI, model_name: str) -> tuple[int, int, str]:
    """A forced call, its result, the next turn: (turn 1's prompt tokens, turn 2's cached, program)."""
    first = client.chat.completions.with_raw_response.create(model=model_name, messages=ASK, **FORCED)
    done = first.parse()
    said = done.choices[0].message
    history = [
        *ASK,
        said.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": said.tool_calls[0].id, "content": "Sunny, 21 C"},
    ]
    second = client.chat.completions.with_raw_response.create(
        model=model_name, messages=history, tools=TOOLS, temperature=0, max_tokens=8
    )
    again = second.parse()
    assert second.headers["x-kvgate-program-id"] == first.headers["x-kvgate-program-id"]
    return (
        done.usage.prompt_tokens,
        again.usage.prompt_tokens_details.cached_tokens,
        first.headers["x-kvgate-program-id"],
    )


def test_the_turn_after_a_tool_call_reuses_the_turn_before_without_markup(client, model_name):
    prompt, cached, program = tool_loop(client, model_name)
    assert program.startswith("conv-")
    assert cached >= prompt  # the whole earlier prompt, and some of the call the model wrote


@pytest.fixture(scope="module")
def tenants(settings, engine) -> Iterator[str]:
    keys = {"sk-one": "one", "sk-two": "two"}
    with serving(settings.model_copy(update={"security": {"api_keys": keys}}), engine) as base:
        yield base


def test_another_tenant_resending_the_same_history_starts_afresh(tenants, model_name):
    one = openai.OpenAI(base_url=tenants + "/v1", api_key="sk-one", max_retries=0)
    prompt, cached, _ = tool_loop(one, model_name)
    assert cached >= prompt
    first = one.chat.completions.create(model=model_name, messages=ASK, **FORCED)
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True)]
    history.append({"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id, "content": "Rain"})
    body = {"model": model_name, "messages": history, "tools": TOOLS, "temperature": 0, "max_tokens": 2}
    stranger = loopback.post(tenants + "/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-two"})
    assert stranger.status_code == 200
    assert stranger.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    owner = loopback.post(tenants + "/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-one"})
    assert owner.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt
    assert stranger.headers["x-kvgate-program-id"] != owner.headers["x-kvgate-program-id"]


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
LOOPING = {
    "messages": [{"role": "user", "content": "What is the weather in Lima?"}],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}],
    "tool_choice": "required",  # parallel calls allowed: SmolLM2-135M, greedy, writes this call until max_tokens
    "temperature": 0,
    "max_tokens": 96,  # room for a call and its whole repeat (64 tokens cut the repeat short)
}


@pytest.fixture(scope="module")
def keeping(settings, engine) -> Iterator[openai.OpenAI]:
    with serving(settings.model_copy(update={"engine": {"repeated_tool_calls": "keep"}}), engine) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_call_written_again_word_for_word_ends_the_answer_before_it(client, keeping, model_name):
    """`repeated_tool_calls: end` (the default): the loop a small model falls into ends at its first repeat,
    whole or streamed (the repeat is held back while it may be one: never sent); `keep` passes it on."""
    kept = keeping.chat.completions.create(model=model_name, **LOOPING).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in kept.message.tool_calls]
    assert kept.finish_reason == "length" and len(calls) > len(set(calls)) >= 1  # the loop, as written
    done = client.chat.completions.create(model=model_name, **LOOPING)
    assert done.choices[0].finish_reason == "tool_calls" and done.usage.completion_tokens < LOOPING["max_tokens"]
    assert [(c.function.name, c.function.arguments) for c in done.choices[0].message.tool_calls] == calls[:1]
    with client.chat.completions.stream(model=model_name, **LOOPING) as stream:
        indices = {c.index for e in stream if e.type == "chunk" for c in e.chunk.choices[0].delta.tool_calls or ()}
        final = stream.get_final_completion()
    assert indices == {0} and final.choices[0].finish_reason == "tool_calls"
    assert final.choices[0].message.tool_calls[0].function.arguments == calls[0][1]
