"""smolagents' ToolCallingAgent against kvgate's default server. Each step sends its ~1,200-token system
prompt, the task and every earlier step rendered again as messages (its own tool-call format, as text):
with no kvgate field, each step reuses what the steps before it sent, by prefix blocks and, where
smolagents re-renders the history, by content-defined chunks."""

from __future__ import annotations

import httpx
from smolagents import ActionStep, OpenAIServerModel, ToolCallingAgent, tool

from tests.helpers.frameworks import ReusedTokens, weather


def test_smolagents_steps_reuse_what_the_steps_before_them_sent(prefix_base_url: str, model_name: str) -> None:
    @tool
    def get_weather(city: str) -> str:
        """Get the weather for a city.

        Args:
            city: the city's name.
        """
        return weather(city)

    reused = ReusedTokens()
    http = httpx.Client(event_hooks={"response": [reused.record]}, timeout=300)
    model = OpenAIServerModel(
        model_id=model_name,
        api_base=f"{prefix_base_url}/v1",
        api_key="unused",
        client_kwargs={"http_client": http, "max_retries": 0},
        temperature=0,
        max_tokens=30,  # every step is cut there (60: twice the decode, the same steps)
    )
    # smolagents asks for a tool call at every step (tool_choice "required"); SmolLM2-135M never gives a
    # final answer, so the agent runs its steps and then one closing call of its own.
    agent = ToolCallingAgent(tools=[get_weather], model=model, max_steps=3, verbosity_level=0)
    agent.run("What is the weather in Oslo?")
    http.close()

    steps = [s for s in agent.memory.steps if isinstance(s, ActionStep) and s.token_usage is not None]
    prompts = [s.token_usage.input_tokens for s in steps]
    assert len(prompts) == len(reused.seen) >= 3, (prompts, reused.seen)
    assert reused.seen[0] < 0.25 * prompts[0]  # the first step's prompt: new, but for what earlier tests sent
    for before, now in zip(prompts[:2], reused.seen[1:3]):
        assert now >= 0.9 * before, (prompts, reused.seen)  # the step before's prompt, and more
    # The closing call has a system prompt of its own and the steps re-rendered as text after it: no prefix
    # is shared past the template's opening, the steps' text is found by its content.
    assert reused.seen[-1] >= 0.4 * prompts[-1], (prompts, reused.seen)
