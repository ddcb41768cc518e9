"""pydantic-ai against kvgate: an Agent over `OpenAIChatModel` with an OpenAI provider at kvgate's
base URL, a tool it must call on its first step, and a structured `output_type`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from pydantic import BaseModel
from pydantic_ai import Agent, RunContext
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings

from tests.helpers.frameworks import MAX_TOKENS, SYSTEM, assert_ran_once_with_a_city, assert_resumed, question, weather

SETTINGS = ModelSettings(max_tokens=MAX_TOKENS, temperature=0, parallel_tool_calls=False)


class City(BaseModel):
    name: str
    country: str


@dataclass
class FirstStepCalls(AbstractCapability[None]):
    """tool_choice naming `tool` on the run's first step only. pydantic-ai refuses a static forced
    tool_choice (every step would have to call it, and the run could never end); settings that vary
    per step come from a capability."""

    tool: str

    def get_model_settings(self) -> Callable[[RunContext[None]], ModelSettings]:
        def settings(ctx: RunContext[None]) -> ModelSettings:
            return ModelSettings(tool_choice=[self.tool]) if ctx.run_step == 1 else ModelSettings()

        return settings


@pytest.fixture
def model(base_url: str, model_name: str) -> OpenAIChatModel:
    return OpenAIChatModel(model_name, provider=OpenAIProvider(base_url=f"{base_url}/v1", api_key="unused"))


def test_pydantic_ai_agent_tool_loop(model: OpenAIChatModel) -> None:
    calls: list[str] = []
    agent = Agent(model, instructions=SYSTEM, model_settings=SETTINGS, capabilities=[FirstStepCalls("get_weather")])

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Get the weather for a city."""
        calls.append(city)
        return weather(city)

    result = agent.run_sync(question("Madrid"))

    assert_ran_once_with_a_city(calls)
    assert isinstance(result.output, str) and result.output.strip()  # the loop ended on an answer
    first, second = [m for m in result.all_messages() if isinstance(m, ModelResponse)]
    assert [type(p) for p in first.parts] == [ToolCallPart] and first.finish_reason == "tool_call"
    assert [type(p) for p in second.parts] == [TextPart]
    returned = [p for m in result.all_messages() for p in m.parts if isinstance(p, ToolReturnPart)]
    assert [p.tool_call_id for p in returned] == [first.parts[0].tool_call_id]
    assert first.usage.cache_read_tokens == 0
    assert_resumed(first.usage.input_tokens, second.usage.cache_read_tokens)
    assert result.usage.requests == 2 and result.usage.tool_calls == 1


def test_pydantic_ai_structured_output(model: OpenAIChatModel) -> None:
    # The default tool output: City as a `final_result` tool, sent with tool_choice "required".
    agent = Agent(model, output_type=City, model_settings=SETTINGS)
    result = agent.run_sync("Paris is the capital of France. Extract the city.")
    assert isinstance(result.output, City) and result.output.name and result.output.country
    (response,) = [m for m in result.all_messages() if isinstance(m, ModelResponse)]
    assert [type(p) for p in response.parts] == [ToolCallPart] and response.finish_reason == "tool_call"
    assert response.parts[0].tool_name == "final_result"
