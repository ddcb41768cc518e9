"""LlamaIndex's FunctionAgent against kvgate, over `llama_index.llms.litellm.LiteLLM` (a FunctionCallingLLM
that speaks to any OpenAI-compatible server through litellm).

Why not `llama-index-llms-openai` / `OpenAILike`: every release of llama-index-llms-openai (through 0.8.3,
which llama-index-llms-openai-like 0.8 needs) requires openai<3, and this environment has openai 3.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from pydantic import BaseModel, ConfigDict

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm's bundled model map: no network
import litellm  # noqa: E402
from llama_index.core.agent.workflow import AgentOutput, FunctionAgent, ToolCallResult  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402
from llama_index.llms.litellm import LiteLLM  # noqa: E402

from tests.helpers.frameworks import MAX_TOKENS, SYSTEM, assert_ran_once_with_a_city, assert_resumed, question, weather  # noqa: E402


def untitled(schema: dict[str, Any]) -> None:
    for spec in schema["properties"].values():
        spec.pop("title", None)


class WeatherArgs(BaseModel):
    """get_weather's parameters. LlamaIndex sends pydantic's JSON schema without `additionalProperties`,
    so kvgate's grammar (rightly) allows more keys than `city`; given pydantic's `"title": "City"` the
    135M model writes schema-like extras ({"city": "Paris", "title": "City", "type": "string"}) that the
    function cannot take. Without the titles it writes the one argument."""

    model_config = ConfigDict(json_schema_extra=untitled)

    city: str


def test_llamaindex_function_agent(base_url: str, model_name: str) -> None:
    calls: list[str] = []

    def get_weather(city: str) -> str:
        """Get the weather for a city."""
        calls.append(city)
        return weather(city)

    # FunctionAgent asks the LLM's metadata whether it calls functions; litellm knows only the models in
    # its map, so this one is registered as a function-calling chat model.
    litellm.register_model(
        {f"openai/{model_name}": {"litellm_provider": "openai", "mode": "chat", "supports_function_calling": True}}
    )
    llm = LiteLLM(
        model=f"openai/{model_name}", api_base=f"{base_url}/v1", api_key="unused", max_tokens=MAX_TOKENS, temperature=0
    )
    agent = FunctionAgent(
        tools=[FunctionTool.from_defaults(get_weather, fn_schema=WeatherArgs)],
        llm=llm,
        system_prompt=SYSTEM,
        # Sent as tool_choice on the first LLM call only. A tool's name ("get_weather") would go to the
        # server as the bare string, which no OpenAI-compatible server takes: "required" is the way here.
        initial_tool_choice="required",
        allow_parallel_tool_calls=False,
        # Not streamed: the LLM's raw response then holds the usage (asked for in a stream,
        # llama-index-llms-litellm fails on the usage chunk, whose `choices` is empty, as OpenAI's is).
        streaming=False,
    )

    async def run() -> tuple[Any, list[AgentOutput], list[ToolCallResult]]:
        handler = agent.run(user_msg=question("Athens"))
        outputs, results = [], []
        async for event in handler.stream_events():
            if isinstance(event, AgentOutput):
                outputs.append(event)
            elif isinstance(event, ToolCallResult):
                results.append(event)
        return await handler, outputs, results

    final, outputs, results = asyncio.run(run())

    assert_ran_once_with_a_city(calls)
    assert [(r.tool_name, r.tool_kwargs, r.tool_output.is_error) for r in results] == [
        ("get_weather", {"city": calls[0]}, False)
    ]
    assert final.response.content  # the loop ended on an answer, with the run's tool calls
    assert [(r.tool_name, r.tool_kwargs) for r in final.tool_calls] == [("get_weather", {"city": calls[0]})]
    first, second = (output.raw["usage"] for output in outputs)  # one AgentOutput per LLM call
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert_resumed(first["prompt_tokens"], second["prompt_tokens_details"]["cached_tokens"])
