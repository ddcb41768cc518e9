"""What the agent-framework tests (tests/frameworks/test_frameworks_*.py) share.

Each test runs one framework's own tool loop against the session's real server and real model:
the model is forced to call a weather tool (SmolLM2-135M never calls one on its own; `tool_choice`
makes it, and kvgate's grammar holds the arguments to the tool's schema), the framework runs the
Python function with the arguments the model wrote, sends the result back, and the model answers.
That answer's request resends the first turn's messages, the call as the model gave it and the
tool's result: kvgate continues the same program, so the turn after the call reports the whole
first prompt as cached tokens, read wherever the framework exposes usage (no kvgate field).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx

SYSTEM = "You answer in one short sentence."
# Enough for one forced call, `<tool_call>\n{"name": "get_weather", "arguments": {"city": "..."}}\n</tool_call>`
# (about 30 tokens), and for a short answer; a call cut short by max_tokens is not a call.
MAX_TOKENS = 40
REUSED = "x-kvgate-reused-tokens"


def question(city: str) -> str:
    return f"What is the weather in {city}?"


def weather(city: str) -> str:
    """What every test's get_weather tool returns."""
    return f"Sunny and 21 degrees in {city}."


def assert_ran_once_with_a_city(calls: list[str]) -> None:
    """The tool ran once, with the `city` the model wrote: a string, as its schema says. Which city is
    the model's to choose (for "Athens" SmolLM2-135M writes "Aegean Islands")."""
    assert len(calls) == 1, calls
    assert isinstance(calls[0], str) and calls[0].strip(), calls


def assert_resumed(first_prompt_tokens: int, cached_tokens: int | None) -> None:
    """The turn after the tool call reused the KV of (at least) the whole first prompt."""
    assert first_prompt_tokens > 0
    assert cached_tokens is not None and cached_tokens >= first_prompt_tokens, (cached_tokens, first_prompt_tokens)


@dataclass
class ReusedTokens:
    """httpx event hooks recording each chat completion's `x-kvgate-reused-tokens` header, in order,
    for frameworks that take an httpx client."""

    seen: list[int] = field(default_factory=list)

    def record(self, response: httpx.Response) -> None:
        if response.url.path.endswith("/chat/completions"):
            self.seen.append(int(response.headers[REUSED]))

    async def arecord(self, response: httpx.Response) -> None:
        self.record(response)

    def client(self) -> httpx.Client:
        return httpx.Client(event_hooks={"response": [self.record]}, timeout=120)

    def async_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(event_hooks={"response": [self.arecord]}, timeout=120)
