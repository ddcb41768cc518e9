"""Anthropic's Messages request (POST /v1/messages) and its translation onto a chat completion body:
system blocks become the system message, `tool_use` blocks an assistant's tool calls, `tool_result`
blocks tool messages, `input_schema` tools function tools, `output_config.format` a strict
`response_format`.

What kvgate cannot honour is a 400 naming it, never ignored: images, documents and search results
in content, extended thinking, server tools, MCP servers, containers, effort. Thinking blocks sent
back are dropped: another model's reasoning (kvgate never writes any), which no chat template reads.
`cache_control` is accepted and needs nothing: kvgate reuses every prompt's KV without being asked."""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, field_validator

from kvgate.gateway.errors import APIError, bad_request
from kvgate.gateway.protocol import Body, DocumentRef, ReuseOptions

DROPPED = ("thinking", "redacted_thinking")
REFUSED = {
    "mcp_servers": "MCP servers are not supported; run the tools yourself and send their results",
    "container": "containers (code execution) are not supported",
    "context_management": "context_management is not supported",
}


class MessagesRequest(Body):
    """POST /v1/messages as kvgate reads it; kvgate's own `documents` and `kvgate` as in chat."""

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    documents: list[DocumentRef] | None = Field(None, max_length=256)  # kvgate extension
    kvgate: ReuseOptions | None = None  # kvgate extension

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, stops: list[str] | None) -> list[str] | None:
        if stops and any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops


class CountRequest(Body):
    """POST /v1/messages/count_tokens: a message request's prompt, without its sampling."""

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    documents: list[DocumentRef] | None = Field(None, max_length=256)  # kvgate extension


def refuse_unsupported(req: MessagesRequest | CountRequest) -> None:
    """A 400 for each field that would change the answer in a way kvgate cannot."""
    for name, said in REFUSED.items():
        if (req.model_extra or {}).get(name) not in (None, [], {}):
            raise bad_request(said, name)
    if (req.thinking or {}).get("type") not in (None, "disabled"):
        raise bad_request("extended thinking is not supported: this model does not reason", "thinking")
    config = getattr(req, "output_config", None) or {}
    if config.get("effort") is not None:
        raise bad_request("output_config.effort is not supported", "output_config.effort")


def chat_body(req: MessagesRequest | CountRequest, body: dict[str, Any]) -> dict[str, Any]:
    """The chat completion body that answers `req` (`body`: the request as sent, for kvgate's fields)."""
    chat: dict[str, Any] = {"model": req.model, "messages": chat_messages(req)}
    if req.tools:
        chat["tools"] = [function_tool(t, i) for i, t in enumerate(req.tools)]
    choice, parallel = tool_choice(req.tool_choice)
    if choice is not None:
        chat["tool_choice"] = choice
    if not parallel:
        chat["parallel_tool_calls"] = False
    for name in ("documents", "kvgate"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if not isinstance(req, MessagesRequest):
        return chat
    if req.messages[-1].get("role") == "assistant":
        said = "the last message is the assistant's: continuing it (prefill) is not supported; end with a user turn"
        raise bad_request(f"messages: {said}", f"messages.{len(req.messages) - 1}.role")
    chat["max_tokens"] = req.max_tokens
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            chat[name] = getattr(req, name)
    if req.stop_sequences:
        chat["stop"] = req.stop_sequences
    if isinstance(user := (req.metadata or {}).get("user_id"), str):
        chat["user"] = user
    if (fmt := (req.output_config or {}).get("format")) is not None:
        chat["response_format"] = response_format(fmt)
    if req.stream:
        chat |= {"stream": True, "stream_options": {"include_usage": True}}
    return chat


def chat_messages(req: MessagesRequest | CountRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages: the system prompt, then each message's blocks in order
    (a user's tool results as tool messages, before the text that follows them)."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": text_of(req.system, "system")})
    for i, message in enumerate(req.messages):
        role, content = message.get("role"), message.get("content")
        where = f"messages.{i}"
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role: expected 'user' or 'assistant'", f"{where}.role", "invalid_value")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out += user_turn(content, where) if role == "user" else assistant_turn(content, where)
        else:
            raise bad_request(f"{where}.content: expected a string or a list of blocks", f"{where}.content")
    return out


def user_turn(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    results, texts = [], []
    for j, block in enumerate(blocks):
        kind = kind_of(block, f"{where}.content.{j}")
        if kind == "tool_result":
            results.append(tool_message(block, f"{where}.content.{j}"))
        elif kind == "text":
            texts.append(text_block(block, f"{where}.content.{j}"))
        elif kind not in DROPPED:
            raise unsupported_block(kind, f"{where}.content.{j}")
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])


def assistant_turn(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        kind, at = kind_of(block, f"{where}.content.{j}"), f"{where}.content.{j}"
        if kind == "text":
            texts.append(text_block(block, at))
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad_request(f"{at}: a tool_use block needs a string id and name", at)
            function = {"name": block["name"], "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}
            calls.append({"id": block["id"], "type": "function", "function": function})
        elif kind not in DROPPED:
            raise unsupported_block(kind, at)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return [message]


def tool_message(block: dict[str, Any], at: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        said = f"{at}.tool_use_id: a tool_result block needs the tool_use_id it answers"
        raise bad_request(said, f"{at}.tool_use_id")
    content = block.get("content")
    text = "" if content is None else content if isinstance(content, str) else text_of(content, f"{at}.content")
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def text_of(blocks: str | list[Any], at: str) -> str:
    """Text blocks' text, joined by newlines (a string is itself)."""
    if isinstance(blocks, str):
        return blocks
    texts = []
    for j, block in enumerate(blocks):
        kind = kind_of(block, f"{at}.{j}")
        if kind != "text":
            raise unsupported_block(kind, f"{at}.{j}")
        texts.append(text_block(block, f"{at}.{j}"))
    return "\n".join(texts)


def kind_of(block: Any, at: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad_request(f"{at}: a content block is an object with a type", at)
    return block["type"]


def text_block(block: dict[str, Any], at: str) -> str:
    if not isinstance(block.get("text"), str):
        raise bad_request(f"{at}.text: a text block needs its text", f"{at}.text")
    return block["text"]


def unsupported_block(kind: str, at: str) -> APIError:
    said = {"image": "images", "document": "document blocks", "search_result": "search results"}.get(kind)
    what = f"{said} are" if said else f"'{kind}' blocks are"
    return bad_request(f"{at}: {what} not supported by this model (text, tool_use and tool_result are)", f"{at}.type")


def function_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A client tool as a chat function tool; a server tool (web search, bash, ...) is refused."""
    if tool.get("type") not in (None, "custom"):
        raise bad_request(
            f"tools.{i}: server tools ('{tool.get('type')}') are not supported; send client tools with an input_schema",
            f"tools.{i}.type",
        )
    if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
        raise bad_request(f"tools.{i}: a tool needs a name and an input_schema", f"tools.{i}")
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    if tool.get("strict") is True:
        function["strict"] = True
    return {"type": "function", "function": function}


def tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool]:
    """Chat's tool_choice, and whether calls may come in parallel."""
    if choice is None:
        return None, True
    kind, parallel = choice.get("type"), not choice.get("disable_parallel_tool_use", False)
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice: a 'tool' choice names the tool", "tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    named = {"auto": "auto", "any": "required", "none": "none"}
    if kind not in named:
        raise bad_request("tool_choice.type: one of 'auto', 'any', 'tool', 'none'", "tool_choice.type", "invalid_value")
    return named[kind], parallel


def response_format(fmt: Any) -> dict[str, Any]:
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request("output_config.format: {'type': 'json_schema', 'schema': {...}}", "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}
