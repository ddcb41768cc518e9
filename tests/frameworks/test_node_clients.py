"""The official JavaScript SDKs against a real kvgate server: the openai Node SDK (chat, a stream, a forced tool call
and its answer, a conversation's turn 2 reading turn 1's KV) and the Anthropic TypeScript SDK (/v1/messages, its
stream, /v1/models in Anthropic's shapes). One node process per SDK runs tests/js/*.mjs, which prints a JSON
result per step; the tests here assert on it.

`make test` installs Node (from the distribution's packages, where `node` is missing) and the SDKs at
tests/js/package-lock.json's versions; run directly without them, these tests skip."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvgate.gateway.settings import Settings
from kvgate.runtime.engine import Engine
from tests.helpers.frameworks import assert_resumed
from tests.helpers.servers import serving

JS = Path(__file__).resolve().parents[1] / "js"
KEY = "sk-node-clients"  # a tenant of its own: its first prompt finds nothing another module left
SDKS = ("openai", "@anthropic-ai/sdk", "ai", "@ai-sdk/openai", "zod")
Result = dict[str, Any]


@pytest.fixture(scope="session")
def node() -> str:
    """Node, with the SDKs installed; checked before the server starts."""
    found = shutil.which("node")
    if found is None:
        pytest.skip("node is not installed: `make node` (apt-get install nodejs npm), or `make test`")
    missing = [sdk for sdk in SDKS if not (JS / "node_modules" / sdk / "package.json").is_file()]
    if missing:
        pytest.skip(f"the JS SDKs {missing} are not installed: `make js` (cd tests/js && npm ci), or `make test`")
    return found


@pytest.fixture(scope="module")
def gateway(prefix_settings: Settings, prefix_engine: Engine) -> Iterator[str]:
    """A server as kvgate runs by default (prefix caching on), with API keys: each SDK sends its own header."""
    keys = {"security": {"api_keys": {KEY: "node-clients"}}}
    with serving(prefix_settings.model_copy(update=keys), prefix_engine) as url:
        yield url


def run(node: str, script: str, base_url: str, model: str) -> dict[str, Result]:
    done = subprocess.run(
        [node, str(JS / script), base_url, model, KEY], capture_output=True, text=True, timeout=120, cwd=JS
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results: dict[str, Result] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


def step(results: dict[str, Result], name: str) -> Result:
    """One step's result; a step that threw reads as the SDK's error."""
    result = results[name]
    assert "failed" not in result, result["failed"]
    return result


@pytest.fixture(scope="module")
def openai_js(node: str, gateway: str, model_name: str) -> dict[str, Result]:
    return run(node, "openai_client.mjs", gateway, model_name)


@pytest.fixture(scope="module")
def anthropic_js(node: str, gateway: str, model_name: str) -> dict[str, Result]:
    return run(node, "anthropic_client.mjs", gateway, model_name)


def test_openai_node_sdk_chat_and_a_conversations_turn_two_reading_turn_ones_kv(openai_js: dict[str, Result]) -> None:
    turns = step(openai_js, "conversation")
    first, second = turns["first"], turns["second"]
    assert first["object"] == "chat.completion" and first["id"].startswith("chatcmpl-")
    assert first["content"] and first["finish_reason"] in ("stop", "length")
    assert first["usage"]["cached_tokens"] == 0 and first["usage"]["completion_tokens"] > 0
    # Turn 2 reads turn 1's prompt and answer (kept when it finished), and computes the new question.
    cached = second["usage"]["cached_tokens"]
    assert first["usage"]["prompt_tokens"] < cached < second["usage"]["prompt_tokens"], (first, second)
    assert second["reused_header"] == cached  # x-kvgate-reused-tokens, read from the SDK's raw response


def test_openai_node_sdk_stream_adds_up_to_the_same_answer(openai_js: dict[str, Result]) -> None:
    streamed, whole = step(openai_js, "stream"), step(openai_js, "conversation")["first"]
    assert streamed["object"] == "chat.completion.chunk" and streamed["chunks"] > 2
    assert streamed["content"] == whole["content"] and streamed["finish_reason"] == whole["finish_reason"]
    usage = streamed["usage"]  # stream_options.include_usage: the last chunk's
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"]


def test_openai_node_sdk_forced_tool_call_and_its_answer(openai_js: dict[str, Result]) -> None:
    loop = step(openai_js, "tool_call")
    first, second = loop["first"], loop["second"]
    assert first["finish_reason"] == "tool_calls" and len(first["tool_calls"]) == 1
    (call,) = first["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather" and call["id"]
    assert isinstance(loop["arguments"]["city"], str) and loop["arguments"]["city"].strip()  # the schema's string
    assert second["content"] and not second["tool_calls"]
    assert_resumed(first["usage"]["prompt_tokens"], second["usage"]["cached_tokens"])


def test_openai_node_sdk_raises_its_own_error_class(openai_js: dict[str, Result]) -> None:
    raised = step(openai_js, "unknown_model")
    assert raised["raised"] == "NotFoundError" and raised["status"] == 404
    assert raised["error"]["code"] == "model_not_found" and raised["error"]["param"] == "model"


def test_anthropic_ts_sdk_message_and_its_stream(anthropic_js: dict[str, Result]) -> None:
    message = step(anthropic_js, "create")
    assert message["type"] == "message" and message["role"] == "assistant" and message["id"].startswith("msg_")
    assert [b["type"] for b in message["content"]] == ["text"] and message["content"][0]["text"]
    assert message["stop_reason"] in ("end_turn", "max_tokens") and message["usage"]["output_tokens"] > 0

    streamed = step(anthropic_js, "stream")
    events = streamed["events"]
    assert events[:2] == ["message_start", "content_block_start"] and "content_block_delta" in events
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    built = streamed["message"]  # what the SDK's MessageStream built from the events
    assert built["content"] == message["content"] and built["stop_reason"] == message["stop_reason"]
    assert built["usage"]["output_tokens"] == message["usage"]["output_tokens"]
    both = (built["usage"], message["usage"])
    assert len({u["input_tokens"] + u["cache_read_input_tokens"] for u in both}) == 1, both


def test_anthropic_ts_sdk_lists_pages_and_retrieves_models_in_anthropics_shape(
    anthropic_js: dict[str, Result], model_name: str
) -> None:
    models = step(anthropic_js, "models")
    ids = [m["id"] for m in models["data"]]
    assert ids[0] == model_name and len(ids) > 1 and not models["has_more"]
    for info in models["data"]:
        assert set(info) <= {"type", "id", "display_name", "created_at", "lifecycle", "max_input_tokens"}, info
        assert info["type"] == "model" and info["display_name"] == info["id"] and info["lifecycle"] == "active"
        assert info["created_at"].endswith("Z")  # RFC 3339, not OpenAI's `created` seconds
    assert models["data"][0]["max_input_tokens"] > 0
    assert models["paged"] == ids  # the SDK's auto-pagination, a model a page, found them all
    assert models["first_page"] == {"ids": ids[:1], "has_more": True, "first_id": ids[0], "last_id": ids[0]}
    assert models["retrieved"] == models["data"][0]


def test_anthropic_ts_sdk_raises_its_own_error_class(anthropic_js: dict[str, Result]) -> None:
    raised = step(anthropic_js, "unknown_model")
    assert raised["raised"] == "NotFoundError" and raised["status"] == 404
    assert raised["error"]["type"] == "error" and raised["error"]["error"]["type"] == "not_found_error"


@pytest.fixture(scope="module")
def aisdk_js(node: str, gateway: str, model_name: str) -> dict[str, Result]:
    return run(node, "aisdk_conversation.mjs", gateway, model_name)


def test_the_ai_sdks_default_provider_holds_a_conversation_on_its_kv(aisdk_js: dict[str, Result]) -> None:
    """The AI SDK's createOpenAI speaks /v1/responses with store: true and sends earlier answers back as
    `item_reference`s: each request after the first reads at least 80% of the one before from cache, in one program."""
    requests = step(aisdk_js, "conversation")["requests"]
    assert [r["turn"] for r in requests] == [1, 2, 2, 3]  # turn 2: the tool call, then the answer to its result
    assert [len(r["calls"]) for r in requests] == [0, 1, 0, 0] and requests[1]["calls"][0]["name"] == "getWeather"
    assert "item_reference" in requests[-1]["items"], requests[-1]  # the earlier answers, by id
    assert len({r["program"] for r in requests}) == 1 and requests[0]["program"].startswith("responses:")
    for before, after in zip(requests, requests[1:]):
        assert after["cached"] >= 0.8 * before["prompt"], (before, after)
