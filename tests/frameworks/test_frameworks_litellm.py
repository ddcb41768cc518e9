"""litellm against kvgate as an OpenAI-compatible provider (`openai/<model>` at `api_base`): a forced
call streamed and rebuilt with `stream_chunk_builder`, the tool's result sent back, an answer."""

from __future__ import annotations

import json
import os
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm's bundled model map: no network
import litellm  # noqa: E402

from tests.helpers.frameworks import MAX_TOKENS, SYSTEM, assert_ran_once_with_a_city, assert_resumed, question, weather  # noqa: E402

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_litellm_tool_loop(base_url: str, model_name: str) -> None:
    calls: list[str] = []

    def get_weather(city: str) -> str:
        calls.append(city)
        return weather(city)

    provider: dict[str, Any] = {"model": f"openai/{model_name}", "api_base": f"{base_url}/v1", "api_key": "unused"}
    settings: dict[str, Any] = {**provider, "tools": [WEATHER_TOOL], "max_tokens": MAX_TOKENS, "temperature": 0}
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question("Berlin")}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(
        litellm.completion(
            messages=messages,
            tool_choice=named,
            parallel_tool_calls=False,
            stream=True,
            stream_options={"include_usage": True},
            **settings,
        )
    )
    first: Any = litellm.stream_chunk_builder(chunks, messages=messages)  # the streamed deltas as one response
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    messages.append(choice.message.model_dump())  # the answer as given
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather"
        result = get_weather(**json.loads(call.function.arguments))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})

    second: Any = litellm.completion(messages=messages, **settings)

    assert_ran_once_with_a_city(calls)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert_resumed(first.usage.prompt_tokens, second.usage.prompt_tokens_details.cached_tokens)
