"""/v1/responses as the official openai SDK and the OpenAI Agents SDK use it: a real uvicorn server on loopback
over the real model (and, in proxy mode, over the stub upstream), answered through chat completions.

The Agents SDK owns the import name `agents`, which from the repository root is the repository's own folder:
its runs are subprocesses started elsewhere, isolated (as in tests/unit/test_package.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.responses import Response

from kvgate.bench.upstream import serve_upstream
from kvgate.gateway.settings import Settings
from tests.helpers import loopback
from tests.helpers.responses import BRIEF, WEATHER, said, sdk, truth
from tests.helpers.servers import serving

ROOT = Path(__file__).resolve().parents[2]
STUB_ANSWER = "w0 w1 w2 w3 w4 w5 w6 w7 "


def test_a_response_is_the_chat_answer_to_the_same_messages(client, base_url, model_name):
    question = "What is the capital of France?"
    raw = client.responses.with_raw_response.create(
        model=model_name, instructions=BRIEF, input=question, max_output_tokens=48, temperature=0, metadata={"k": "v"}
    )
    response = raw.parse()
    chat = truth(base_url, model_name, [said("system", BRIEF), said("user", question)], 48)
    assert isinstance(response, Response) and response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content
    assert (response.status, chat.choices[0].finish_reason, response.incomplete_details) == ("completed", "stop", None)
    (message,) = response.output
    assert (message.type, message.role, message.status, message.id[:4]) == ("message", "assistant", "completed", "msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == chat.usage.total_tokens and usage.output_tokens_details.reasoning_tokens == 0
    assert (response.model, response.instructions, response.metadata) == (model_name, BRIEF, {"k": "v"})
    assert (response.temperature, response.tool_choice, response.tools, response.store) == (0, "auto", [], True)
    assert raw.headers["x-kvgate-cache"] == "bypass" and raw.headers["x-kvgate-reused-tokens"] == "0"


def test_max_output_tokens_cut_the_answer_short_as_incomplete(client, model_name):
    response = client.responses.create(model=model_name, input="Tell me a long story.", max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"


def test_a_stream_is_the_responses_events_ending_with_the_response(client, base_url, model_name):
    ask = {"model": model_name, "instructions": BRIEF, "input": "What is the capital of Spain?", "temperature": 0}
    events = list(client.responses.create(**ask, max_output_tokens=48, stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    opening = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    closing = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert types[:4] == opening and types[-4:] == [*closing, "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == final.output_text == events[-4].text
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    assert final.status == "completed" and final.usage.output_tokens > 0
    assert client.responses.retrieve(final.id).output_text == text
    assert client.responses.create(**ask, max_output_tokens=48).output_text == text
    with client.responses.stream(**ask, max_output_tokens=48) as stream:  # the SDK's own bookkeeping of the events
        assert stream.get_final_response().output_text == text
    with loopback.stream("POST", base_url + "/v1/responses", json={**ask, "max_output_tokens": 4, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    named = [line.removeprefix("event: ") for line in lines[0::2]]
    assert named == [json.loads(line.removeprefix("data: "))["type"] for line in lines[1::2]]
    assert named[-1] == "response.incomplete"


BAD = [
    ({"input": [said("user", [{"type": "input_image", "image_url": "http://x/y.png"}])]}, "input.0.content.0.type"),
    ({"input": ["hi"]}, "input"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0.type"),
    ({"input": [{"role": "tool", "content": "hi"}]}, "input.0.role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": []}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "name": "has space"}]}, "tools.0.name"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "has space", "schema": {}}}}, "text.format.name"),
    ({"temperature": 3}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
]


@pytest.mark.parametrize(("fields", "param"), BAD, ids=[p for _, p in BAD])
def test_what_cannot_be_honoured_is_a_400_naming_the_param(base_url, model_name, fields, param):
    r = loopback.post(base_url + "/v1/responses", json={"model": model_name, "input": "hi", **fields}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error


def test_a_function_call_streams_its_arguments(client, model_name):
    named = {"type": "function", "name": "get_weather"}
    ask = {"tools": WEATHER, "tool_choice": named, "parallel_tool_calls": False, "temperature": 0}
    with client.responses.stream(model=model_name, input="What is the weather in Rome?", **ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (call,) = final.output
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == call.arguments and json.loads(call.arguments)["city"]
    ending = ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e.type for e in events][-3:] == ending
    assert events[2].item.type == "function_call" and events[2].item.call_id == call.call_id


def test_documents_and_kvgate_options_reach_the_chat_side(client, model_name):
    doc = {"text": "Oriel Thatchwood was a writer and cartographer, educated at Quenmere College, Vellmoor."}
    extra = {"documents": [doc], "kvgate": {"reuse": "naive"}}
    for _ in range(2):
        raw = client.responses.with_raw_response.create(
            model=model_name, input="Where was Oriel Thatchwood educated?", max_output_tokens=4, extra_body=extra
        )
    assert raw.headers["x-kvgate-reuse"] == "naive"
    reused = int(raw.headers["x-kvgate-reused-tokens"])
    assert reused > 0 and raw.parse().usage.input_tokens_details.cached_tokens == reused


# ---- proxy mode: an upstream that speaks chat completions ----------------------------------------------------


@pytest.fixture(scope="module")
def stub() -> Iterator[str]:
    with serve_upstream(models=("stub-a",)) as url:
        yield url


def front(tmp_path: Path, upstream: str, semantic: bool = False) -> Settings:
    upstreams = [{"name": "up-0", "base_url": upstream + "/v1", "models": ["stub-a"]}]
    return Settings(proxy={"upstreams": upstreams}, semantic_cache={"enabled": semantic}, cache_dir=tmp_path)


def sent(upstream: str) -> dict[str, Any]:
    return loopback.get(upstream + "/_stats").json()["last_body"]


def test_in_proxy_mode_a_chat_upstream_answers(tmp_path, stub):
    loopback.post(stub + "/_reset")
    with serving(front(tmp_path, stub), None) as url:
        first = sdk(url).responses.create(model="stub-a", instructions="Be brief.", input="hello")
        assert (first.output_text, first.status, first.usage.output_tokens) == (STUB_ANSWER, "completed", 8)
        assert sent(stub)["messages"] == [said("system", "Be brief."), said("user", "hello")]
        again = {"input": "again", "previous_response_id": first.id, "stream": True}
        events = list(sdk(url).responses.create(model="stub-a", **again))
        assert events[-1].type == "response.completed" and events[-1].response.output_text == STUB_ANSWER
        assert events[-1].response.usage.output_tokens == 8
        assert [m["content"] for m in sent(stub)["messages"]] == ["hello", STUB_ANSWER, "again"]
        text = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}
        call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
        result = {"type": "function_call_output", "call_id": "c1", "output": "done"}
        sdk(url).responses.create(model="stub-a", input=[said("user", "hi"), text, call, result])
        tool_calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
        answered = [said("assistant", "ok", tool_calls=tool_calls), said("tool", "done", tool_call_id="c1")]
        assert sent(stub)["messages"] == [said("user", "hi"), *answered]  # text and calls: one chat message
        loopback.post(stub + "/_script", json={"actions": [{"drop_after": 2}]})
        events = list(sdk(url).responses.create(model="stub-a", input="hello", stream=True))
        assert events[-1].type == "response.failed" and events[-1].response.status == "failed"
        assert "failed mid-stream" in events[-1].response.error.message
        loopback.post(stub + "/_script", json={"actions": [{"status": 400}]})
        with pytest.raises(openai.BadRequestError, match="Scripted failure 400"):
            sdk(url).responses.create(model="stub-a", input="hello")


def test_the_semantic_cache_answers_responses_as_it_answers_chat(tmp_path, stub):
    loopback.post(stub + "/_reset")
    with serving(front(tmp_path, stub, semantic=True), None) as url:
        ask = {"model": "stub-a", "input": "What is the capital of France?", "temperature": 0}
        assert sdk(url).responses.with_raw_response.create(**ask).headers["x-kvgate-cache"] == "miss"
        again = sdk(url).responses.with_raw_response.create(**ask, stream=True)
        assert again.headers["x-kvgate-cache"] == "hit"
        assert list(again.parse())[-1].response.output_text == STUB_ANSWER
    assert loopback.get(stub + "/_stats").json()["requests"] == 1


# ---- the OpenAI Agents SDK, its default model: OpenAIResponsesModel ---------------------------------------------

AGENT_RUN = """
import asyncio, json, os, sys

assert os.environ["KVGATE_REPO"] not in sys.path and "" not in sys.path, sys.path

from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled
from agents.models.multi_provider import MultiProvider
from openai import AsyncOpenAI
from openai.types.responses import ResponseTextDeltaEvent

set_tracing_disabled(True)
client = AsyncOpenAI(base_url=os.environ["KVGATE_URL"] + "/v1", api_key="agents", max_retries=0, timeout=120)
set_default_openai_client(client, use_for_tracing=False)
MODEL, calls = os.environ["KVGATE_MODEL"], []


@function_tool
def get_weather(city: str) -> str:
    \"\"\"The weather in a city.\"\"\"
    calls.append(city)
    return f"Sunny in {city}, 22 C."


async def text():
    settings = ModelSettings(temperature=0, max_tokens=48)
    brief = "You answer in one short sentence."
    agent = Agent(name="assistant", instructions=brief, model=MODEL, model_settings=settings)
    done = await Runner.run(agent, "What is the capital of France?", max_turns=1)
    streamed = Runner.run_streamed(agent, "What is the capital of Italy?", max_turns=1)
    deltas = [
        e.data.delta async for e in streamed.stream_events()
        if e.type == "raw_response_event" and isinstance(e.data, ResponseTextDeltaEvent)
    ]
    model = type(MultiProvider().get_model(MODEL)).__name__
    ids = [r.response_id for r in done.raw_responses + streamed.raw_responses]
    said = {"final": done.final_output, "deltas": "".join(deltas), "streamed": streamed.final_output}
    return {"model": model, "ids": ids, **said}


async def tool():
    settings = ModelSettings(temperature=0, max_tokens=48, tool_choice="required", parallel_tool_calls=False)
    brief = "You report the weather."
    agent = Agent(name="weather", instructions=brief, model=MODEL, tools=[get_weather], model_settings=settings)
    done = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    cached = [r.usage.input_tokens_details.cached_tokens for r in done.raw_responses]
    return {"calls": calls, "final": done.final_output, "cached": cached}


print(json.dumps(asyncio.run({"text": text, "tool": tool}[sys.argv[1]]())))
"""


def run_agent(base_url: str, model_name: str, tmp_path: Path, mode: str) -> dict[str, Any]:
    env = {**os.environ, "KVGATE_URL": base_url, "KVGATE_MODEL": model_name, "KVGATE_REPO": str(ROOT)}
    env["OPENAI_AGENTS_DISABLE_TRACING"] = "1"  # nothing but loopback can be reached
    done = subprocess.run(
        [sys.executable, "-I", "-c", AGENT_RUN, mode],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_agent_answers_on_the_agents_sdks_default_responses_model(base_url, model_name, tmp_path):
    seen = run_agent(base_url, model_name, tmp_path, "text")
    assert seen["model"] == "OpenAIResponsesModel"
    assert len(seen["ids"]) == 2 and all(i.startswith("resp_") for i in seen["ids"])  # the Responses API answered
    assert isinstance(seen["final"], str) and seen["final"].strip()
    assert seen["deltas"].strip() and seen["deltas"] == seen["streamed"]


def test_an_agent_calls_a_function_tool_and_finishes(base_url, model_name, tmp_path):
    """tool_choice required for the first turn; the SDK resets it after the call, and the model answers."""
    seen = run_agent(base_url, model_name, tmp_path, "tool")
    assert len(seen["calls"]) == 1 and seen["calls"][0].strip()  # the Python tool ran, with the model's argument
    assert isinstance(seen["final"], str) and seen["final"].strip()
    assert len(seen["cached"]) == 2 and seen["cached"][1] > 0  # the second turn continued the first's KV
