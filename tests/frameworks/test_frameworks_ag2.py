"""AG2 (the `ag2` package, its Agent API) against kvgate: an `Agent` over `OpenAIConfig` at kvgate's base URL.

On the wire AG2 sends plain Chat Completions through the openai SDK: the agent's prompt as the system
message, the question, and its tools as `tools`; when the model calls one, AG2 runs the function, appends
the call (an assistant message with `tool_calls`) and its result (a `tool` message) and asks again, until
an answer comes with no call. The request after the call resends the first one's messages unchanged:
kvgate continues the same program, and AG2's own usage report (`AgentReply.usage()`, read from
`prompt_tokens_details.cached_tokens`) shows the whole first prompt as cached, with no kvgate field.
A `response_schema` goes out as a strict `json_schema` response_format; `streaming=True` streams the
answer with `stream_options.include_usage`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from ag2 import Agent
from ag2.config import LLMClient
from ag2.config.openai import OpenAIConfig
from ag2.context import ConversationContext
from ag2.events import BaseEvent, ModelMessageChunk, ModelResponse, ToolResultsEvent
from ag2.usage import UsageReport
from pydantic import BaseModel

from tests.helpers.frameworks import MAX_TOKENS, SYSTEM, assert_ran_once_with_a_city, assert_resumed, question, weather


class City(BaseModel):
    name: str
    country: str


class CallsFirst(OpenAIConfig):
    """`OpenAIConfig` sending tool_choice "required" while the conversation has no tool result yet, and
    its own tool_choice after. SmolLM2-135M never calls a tool on its own, and AG2 takes tool_choice only
    as a static option of the config: forced on every call, its loop (which runs while the model calls
    tools, with no limit on steps) would never end. Middleware wraps the call but cannot change its
    options; a config is what makes the turn's client (`ModelConfig.create`), so it picks per call."""

    def create(self) -> LLMClient:
        forced, free = OpenAIConfig.create(self.copy(tool_choice="required")), OpenAIConfig.create(self)

        async def call(messages: Sequence[BaseEvent], context: ConversationContext, **kw: Any) -> ModelResponse:
            answered = any(isinstance(m, ToolResultsEvent) for m in messages)
            return await (free if answered else forced)(messages, context, **kw)

        return call


@pytest.fixture
def options(base_url: str, model_name: str) -> dict[str, Any]:
    """What every test's config holds: kvgate's URL, temperature 0, a short answer."""
    url = f"{base_url}/v1"
    return dict(model=model_name, base_url=url, api_key="unused", temperature=0, max_tokens=MAX_TOKENS, max_retries=0)


def test_ag2_agent_tool_loop_resumes_the_first_prompt(options: dict[str, Any]) -> None:
    # One call per response: allowed more, the forced model writes the same call again until max_tokens.
    calls: list[str] = []

    def get_weather(city: str) -> str:
        """Get the weather for a city."""
        calls.append(city)
        return weather(city)

    async def run() -> tuple[ModelResponse, UsageReport]:
        agent = Agent("assistant", SYSTEM, config=CallsFirst(**options, parallel_tool_calls=False), tools=[get_weather])
        reply = await agent.ask(question("Vienna"))
        return reply.response, await reply.usage()

    answer, report = asyncio.run(run())
    assert_ran_once_with_a_city(calls)
    assert answer.content and answer.content.strip() and not answer.tool_calls  # the loop ended on an answer
    first, second = (r.usage for r in report.records)
    assert [r.finish_reason for r in report.records] == ["tool_calls", "stop"], report.records
    assert_resumed(int(first.prompt_tokens or 0), int(second.cache_read_input_tokens or 0))


def test_ag2_structured_output(options: dict[str, Any]) -> None:
    agent = Agent("extractor", config=OpenAIConfig(**options), response_schema=City)

    async def run() -> City | None:
        reply = await agent.ask("Paris is the capital of France. Extract the city.")
        return await reply.content()

    city = asyncio.run(run())
    assert isinstance(city, City) and city.name.strip() and city.country.strip(), city


def test_ag2_streaming_gives_the_same_answer(options: dict[str, Any]) -> None:
    agent = Agent("assistant", SYSTEM, config=OpenAIConfig(**options))
    chunks: list[str] = []

    async def chunk(event: ModelMessageChunk) -> None:
        chunks.append(event.content)

    async def run() -> tuple[str | None, str | None]:
        plain = await agent.ask(question("Prague"))
        async with agent.run(question("Prague"), config=OpenAIConfig(**options, streaming=True)) as streamed:
            with streamed.stream.where(ModelMessageChunk).sub_scope(chunk):
                reply = await streamed.result()
        return plain.body, reply.body

    plain, streamed = asyncio.run(run())
    assert plain and plain.strip(), plain
    assert streamed == plain, (streamed, plain)
    assert len(chunks) > 1 and "".join(chunks) == streamed, chunks
