"""Haystack's Agent and OpenAIChatGenerator against kvgate's default server.

On the wire Haystack is the openai SDK's `chat.completions.create` (`.parse` when `response_format` is set):
the messages as OpenAI dicts, every tool as a function with its JSON schema (Haystack strips the
titles), and `generation_kwargs` as they are, the same ones on every step of an Agent's run. A streamed
call asks for no usage (no `stream_options`). The Agent resends the whole conversation each step: system
prompt, question, the assistant's tool call with its id, the tool's result. kvgate continues the same
program, so the answer after the tool call reuses the KV of the first request's whole prompt, seen in the
`x-kvgate-reused-tokens` header (through Haystack's `http_client_kwargs`) and in the reply's
`meta["usage"]["prompt_tokens_details"]["cached_tokens"]`, with no kvgate field in the request.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any

os.environ["HAYSTACK_TELEMETRY_ENABLED"] = "False"  # read at import; nothing off loopback is reachable
from haystack.components.agents import Agent  # noqa: E402
from haystack.components.generators.chat import OpenAIChatGenerator  # noqa: E402
from haystack.dataclasses import ChatMessage, StreamingChunk  # noqa: E402
from haystack.tools import create_tool_from_function  # noqa: E402
from haystack.utils import Secret  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from tests.helpers.frameworks import (  # noqa: E402
    MAX_TOKENS,
    SYSTEM,
    ReusedTokens,
    assert_ran_once_with_a_city,
    assert_resumed,
    question,
    weather,
)


class City(BaseModel):
    name: str
    country: str


def generator(base_url: str, model_name: str, reused: ReusedTokens) -> OpenAIChatGenerator:
    return OpenAIChatGenerator(
        api_key=Secret.from_token("unused"),
        model=model_name,
        api_base_url=f"{base_url}/v1",
        generation_kwargs={"max_completion_tokens": MAX_TOKENS, "temperature": 0},
        timeout=120,
        max_retries=0,
        # Haystack builds a legacy httpx.Client from these (the openai 3 SDK takes it beside httpx2's).
        http_client_kwargs={"event_hooks": {"response": [reused.record]}},
    )


def cached(message: ChatMessage) -> int | None:
    return ((message.meta.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")


def test_haystack_agent_tool_loop(base_url: str, model_name: str) -> None:
    """Haystack sends an Agent run's `generation_kwargs` on every step, so a run with tool_choice "required"
    would call the tool until `max_agent_steps`. The first run ends on `exit_conditions=["get_weather"]`
    once the tool has run; a second run continues from its messages with tool_choice "none" (the tools stay
    listed, so the prompt is the same program) and stops on the model's text. `parallel_tool_calls` false:
    otherwise kvgate's grammar allows a second call, the 135M model opens one and is cut by max tokens
    (the first call is returned whole, finish_reason "length")."""
    calls: list[str] = []

    def get_weather(city: Annotated[str, "the city's name"]) -> str:
        """Get the weather for a city."""
        calls.append(city)
        return weather(city)

    reused = ReusedTokens()
    agent = Agent(
        chat_generator=generator(base_url, model_name, reused),
        tools=[create_tool_from_function(get_weather)],
        exit_conditions=["get_weather"],
        max_agent_steps=2,
    )
    asked = [ChatMessage.from_system(SYSTEM), ChatMessage.from_user(question("Lisbon"))]
    first = agent.run(asked, generation_kwargs={"tool_choice": "required", "parallel_tool_calls": False})
    assert first["exit_reason"] == "get_weather" and first["step_count"] == 1, first
    call, result = first["messages"][2:]
    assert [c.tool_name for c in call.tool_calls] == ["get_weather"] and call.meta["finish_reason"] == "tool_calls"
    assert result.tool_call_result.origin.id == call.tool_call.id and not result.tool_call_result.error
    assert result.tool_call_result.result == weather(calls[0])

    second = agent.run(first["messages"], generation_kwargs={"tool_choice": "none"})
    assert second["exit_reason"] == "text" and second["step_count"] == 1, second
    answer = second["last_message"]
    assert second["messages"][:-1] == first["messages"] and answer.text and not answer.tool_calls, answer
    assert_ran_once_with_a_city(calls)
    assert len(reused.seen) == 2 and reused.seen[0] == cached(call) == 0, (reused.seen, call.meta)
    assert reused.seen[1] == cached(answer), (reused.seen, answer.meta)
    assert_resumed(call.meta["usage"]["prompt_tokens"], reused.seen[1])


def test_haystack_streaming_matches_the_plain_reply(base_url: str, model_name: str) -> None:
    reused = ReusedTokens()
    llm = generator(base_url, model_name, reused)
    messages = [ChatMessage.from_system(SYSTEM), ChatMessage.from_user("Name three primary colors.")]
    plain = llm.run(messages)["replies"][0]

    chunks: list[StreamingChunk] = []
    streamed = llm.run(messages, streaming_callback=chunks.append)["replies"][0]

    texts = [c.content for c in chunks if c.content]
    assert len(texts) > 1, chunks
    assert "".join(texts) == streamed.text == plain.text and plain.text, (texts, plain.text)
    assert streamed.meta["finish_reason"] == plain.meta["finish_reason"], (streamed.meta, plain.meta)
    assert len(reused.seen) == 2  # the header comes with the stream's response too


def test_haystack_structured_output(base_url: str, model_name: str) -> None:
    # A pydantic model as response_format: Haystack calls the SDK's `parse`, which sends it as a strict
    # json_schema (additionalProperties false); kvgate's grammar holds the reply to it.
    llm = generator(base_url, model_name, ReusedTokens())
    ask = "Paris is the capital of France. Extract the city."
    reply = llm.run([ChatMessage.from_user(ask)], generation_kwargs={"response_format": City})["replies"][0]
    data: dict[str, Any] = json.loads(reply.text or "")
    assert set(data) == {"name", "country"} and City.model_validate(data).name, data
    assert reply.meta["finish_reason"] == "stop", reply.meta
