"""AutoGen's AssistantAgent against kvgate's default server: a tool call, then its reflection on the
tool's result. The reflection call sends no tools, so kvgate's tool message is gone and the prompt
differs from its first token: the program's own KV cannot be resumed. The task's text is found by its
content (runtime/chunks.py) and reused, with no kvgate field."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from autogen_agentchat.agents import AssistantAgent
from autogen_ext.models.openai import OpenAIChatCompletionClient

from tests.helpers.corpus import musique_rows
from tests.helpers.frameworks import ReusedTokens, assert_ran_once_with_a_city, weather

INFO = {"vision": False, "function_calling": True, "json_output": True, "family": "unknown", "structured_output": True}


class CallingClient(OpenAIChatCompletionClient):
    """AutoGen's client, asking for a tool call whenever tools are offered: SmolLM2-135M never calls one
    on its own (the other framework tests force theirs with `tool_choice` too)."""

    async def create(self, messages: Any, *, tools: Any = (), tool_choice: Any = "auto", **kw: Any) -> Any:
        return await super().create(messages, tools=tools, tool_choice="required" if tools else tool_choice, **kw)


@pytest.fixture
def reused() -> ReusedTokens:
    return ReusedTokens()


def test_autogen_reflection_reuses_the_task_it_read_before_the_tool_call(
    prefix_base_url: str, model_name: str, reused: ReusedTokens, loaded
) -> None:
    calls: list[str] = []

    def get_weather(city: str) -> str:
        """Get the weather for a city."""
        calls.append(city)
        return weather(city)

    # A task with a briefing to read (as agents get: a retrieved page, a ticket, a file).
    briefing = "\n\n".join(musique_rows(1, seed=201)[0]["passages"][:2])
    task = f"Briefing:\n\n{briefing}\n\nWhat is the weather in Oslo?"

    async def run() -> None:
        http = httpx.AsyncClient(event_hooks={"response": [reused.arecord]}, timeout=300)
        client = CallingClient(
            model=model_name,
            base_url=f"{prefix_base_url}/v1",
            api_key="unused",
            model_info=INFO,
            temperature=0,
            max_tokens=40,
            http_client=http,
        )
        agent = AssistantAgent("assistant", model_client=client, tools=[get_weather], reflect_on_tool_use=True)
        result = await agent.run(task=task)
        assert result.messages[-1].source == "assistant"
        await client.close()
        await http.aclose()

    asyncio.run(run())
    assert_ran_once_with_a_city(calls)
    assert len(reused.seen) == 2  # the call, then the reflection
    task_tokens = len(loaded.tokenizer.encode(briefing, add_special_tokens=False))
    assert reused.seen[1] >= 0.8 * task_tokens, (reused.seen, task_tokens)
