"""The Response object (as the openai SDK's `openai.types.responses.Response` reads it) made from a
chat completion: its output items, status and usage."""

from __future__ import annotations

import time
import uuid
from typing import Any

from kvgate.gateway.responses_protocol import ResponsesRequest, arguments_text, response_format_of

INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def skeleton(req: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
    """The response as it starts: what the request asked for, echoed; no output yet."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "completed_at": None,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "model": model,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": req.store,
        "temperature": req.temperature,
        "text": text_config(req),
        "tool_choice": req.tool_choice,
        "tools": [tool_echo(t) for t in req.tools or ()],
        "top_p": req.top_p,
        "truncation": req.truncation,
        "usage": None,
        "user": req.user,
    }


def text_config(req: ResponsesRequest) -> dict[str, Any]:
    fmt = (req.text or {}).get("format") if response_format_of(req.text) is not None else None
    return {"format": fmt or {"type": "text"}, "verbosity": "medium"}


def tool_echo(tool: dict[str, Any]) -> dict[str, Any]:
    return {"description": None, "parameters": None, "strict": None, **tool}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": [part]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(message: dict[str, Any], status: str) -> list[dict[str, Any]]:
    """A chat answer's message as output items: its text (always, when it calls no tool), then
    each tool call."""
    calls = [c for c in message.get("tool_calls") or () if isinstance(c, dict)]
    content = message.get("content")
    items = []
    if content or not calls:
        items.append(message_item(new_id("msg"), content if isinstance(content, str) else "", status))
    for call in calls:
        function = call.get("function") or {}
        call_id = call.get("id") or new_id("call")
        name, arguments = str(function.get("name") or ""), arguments_text(function.get("arguments") or "")
        items.append(call_item(new_id("fc"), call_id, name, arguments, status))
    return items


def usage_of(usage: dict[str, Any] | None) -> dict[str, Any]:
    """Chat usage as Responses usage."""
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    input_tokens, output_tokens = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens") or 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.get("total_tokens") or input_tokens + output_tokens,
    }


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason in INCOMPLETE else "completed"


def finished(
    response: dict[str, Any], output: list[dict[str, Any]], usage: dict[str, Any] | None, finish_reason: str | None
) -> dict[str, Any]:
    """The response once its answer ended (`finish_reason`: chat's)."""
    status = status_of(finish_reason)
    reason = INCOMPLETE.get(finish_reason or "")
    return response | {
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "incomplete_details": {"reason": reason} if reason else None,
        "output": output,
        "usage": usage_of(usage),
    }


def failed(response: dict[str, Any], message: str) -> dict[str, Any]:
    return response | {"status": "failed", "error": {"code": "server_error", "message": message}}


def answered(response: dict[str, Any], chat: dict[str, Any]) -> dict[str, Any]:
    """The response made from a whole chat completion."""
    choice = (chat.get("choices") or [{}])[0]
    finish_reason = choice.get("finish_reason")
    output = output_items(choice.get("message") or {}, status_of(finish_reason))
    return finished(response, output, chat.get("usage"), finish_reason)
