"""The OpenAI Agents SDK over kvgate's chat completions (`OpenAIChatCompletionsModel`): an agent with a
function tool it is required to call, and an agent with a pydantic `output_type`.

From the repository root `import agents` finds the repository's agents/ folder, not the SDK: the SDK
runs in a subprocess started in a temporary folder, isolated (-I), against the session's server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers.frameworks import MAX_TOKENS, SYSTEM, assert_ran_once_with_a_city, assert_resumed, question, weather

MODEL = """
import json, os, sys

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI
from pydantic import BaseModel

set_tracing_disabled(True)
model = OpenAIChatCompletionsModel(
    model=os.environ["KVGATE_MODEL"],
    openai_client=AsyncOpenAI(base_url=os.environ["KVGATE_URL"] + "/v1", api_key="unused", max_retries=0, timeout=120),
)
config = json.loads(os.environ["KVGATE_TEST"])


def usage(result):
    return [
        {"input_tokens": r.usage.input_tokens, "cached_tokens": r.usage.input_tokens_details.cached_tokens}
        for r in result.raw_responses
    ]
"""

TOOL_LOOP = (
    MODEL
    + """
calls = []


@function_tool
def get_weather(city: str) -> str:
    \"\"\"Get the weather for a city.\"\"\"
    calls.append(city)
    return config["result"].format(city=city)


# tool_choice="required" forces the first call; the SDK's default reset_tool_choice=True sends the
# next turn with the choice reset (auto), so the model answers and the run ends.
agent = Agent(
    name="assistant",
    instructions=config["instructions"],
    model=model,
    tools=[get_weather],
    model_settings=ModelSettings(
        tool_choice="required", parallel_tool_calls=False, max_tokens=config["max_tokens"], temperature=0
    ),
)
result = Runner.run_sync(agent, config["question"], max_turns=3)
print(json.dumps({
    "calls": calls,
    "items": [type(item).__name__ for item in result.new_items],
    "final_output": result.final_output,
    "usage": usage(result),
}))
"""
)

OUTPUT_TYPE = (
    MODEL
    + """
class City(BaseModel):
    name: str
    country: str


# A pydantic output_type: the SDK sends it as a strict json_schema response_format.
agent = Agent(
    name="extractor",
    instructions="Extract the city.",
    model=model,
    output_type=City,
    model_settings=ModelSettings(max_tokens=config["max_tokens"], temperature=0),
)
result = Runner.run_sync(agent, config["question"], max_turns=1)
print(json.dumps({"type": type(result.final_output).__name__, "final_output": result.final_output.model_dump()}))
"""
)


def run_sdk(script: str, base_url: str, model_name: str, cwd: Path, **config: Any) -> dict[str, Any]:
    env = {
        **os.environ,
        "KVGATE_URL": base_url,
        "KVGATE_MODEL": model_name,
        "KVGATE_TEST": json.dumps(config),
        "OPENAI_AGENTS_DISABLE_TRACING": "1",  # nothing but loopback can be reached
    }
    done = subprocess.run(
        [sys.executable, "-I", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_agents_sdk_chat_completions_model_tool_loop(base_url: str, model_name: str, tmp_path: Path) -> None:
    city = "Vienna"
    out = run_sdk(
        TOOL_LOOP,
        base_url,
        model_name,
        tmp_path,
        instructions=SYSTEM,
        question=question(city),
        result=weather("{city}"),
        max_tokens=MAX_TOKENS,
    )
    assert_ran_once_with_a_city(out["calls"])
    assert out["items"] == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert isinstance(out["final_output"], str) and out["final_output"].strip()
    first, second = out["usage"]  # one raw response per model call
    assert first["cached_tokens"] == 0
    assert_resumed(first["input_tokens"], second["cached_tokens"])


def test_agents_sdk_chat_completions_model_output_type(base_url: str, model_name: str, tmp_path: Path) -> None:
    out = run_sdk(
        OUTPUT_TYPE,
        base_url,
        model_name,
        tmp_path,
        question="Paris is the capital of France.",
        max_tokens=MAX_TOKENS,
    )
    assert out["type"] == "City"
    assert out["final_output"]["name"] and out["final_output"]["country"]
