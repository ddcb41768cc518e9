"""What the Responses tests share: the openai SDK on a server, a chat message, full prefill's answer, a tool."""

from __future__ import annotations

from typing import Any

import openai

BRIEF = "You answer in one short sentence."
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FUNCTION = {"name": "get_weather", "description": "The weather in a city.", "parameters": CITY}
WEATHER = [{"type": "function", **FUNCTION}]  # Responses' flat shape; chat's is {"type", "function": FUNCTION}


def sdk(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def said(role: str, content: Any, **more: Any) -> dict[str, Any]:
    return {"role": role, "content": content, **more}


def truth(url: str, model: str, messages: list[dict[str, Any]], max_tokens: int, **more: Any) -> Any:
    """The chat answer by full prefill, for a tenant of its own (nothing of the others' KV)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **more}
    return sdk(url, "truth").chat.completions.create(**body, extra_body={"kvgate": {"reuse": "full"}})
