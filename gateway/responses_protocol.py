"""The Responses API's request (POST /v1/responses) and its translation onto a chat completion body:
input items become chat messages, flat function tools chat tools, `text.format` a `response_format`.

What kvgate cannot honour is a 400 naming the param, never ignored: built-in tools, images and
files, reasoning effort, background runs, `include`. Reasoning items in the input are dropped: they
are another model's hidden reasoning (kvgate never writes any), which no chat template reads."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from kvgate.gateway.errors import APIError, bad_request
from kvgate.gateway.protocol import Body, DocumentRef, ReuseOptions

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
DROPPED = ("reasoning",)
# Fields whose mere presence asks for what kvgate does not do (any value but null or empty).
REFUSED = {
    "conversation": "conversations are not supported; use previous_response_id",
    "prompt": "prompt templates are not supported; send input and instructions",
    "top_logprobs": "logprobs are not supported on /v1/responses",
    "max_tool_calls": "max_tool_calls is not supported",
    "context_management": "context_management (compaction) is not supported",
}


class ResponsesRequest(Body):
    """POST /v1/responses as kvgate reads it; kvgate's own `documents` and `kvgate` as in chat."""

    model: str
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    user: str | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    store: bool = True
    stream: bool = False
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool = False
    truncation: Literal["auto", "disabled"] = "disabled"
    documents: list[DocumentRef] | None = Field(None, max_length=256)  # kvgate extension
    kvgate: ReuseOptions | None = None  # kvgate extension


def refuse_unsupported(req: ResponsesRequest) -> None:
    """A 400 for each field that would change the answer in a way kvgate cannot."""
    for name, said in REFUSED.items():
        if (req.model_extra or {}).get(name) not in (None, [], {}, 0):
            raise unsupported(said, name)
    if req.background:
        raise unsupported("background responses are not supported", "background")
    if req.include:
        raise unsupported(f"include values are not supported: {', '.join(map(str, req.include))}", "include")
    if req.truncation == "auto":
        raise unsupported("truncation 'auto' is not supported; a prompt over the window is a 400", "truncation")
    reasoning = req.reasoning or {}
    if reasoning.get("effort") not in (None, "none"):
        raise unsupported("reasoning effort is not supported: this model does not reason", "reasoning.effort")
    if reasoning.get("summary") is not None or reasoning.get("generate_summary") is not None:
        raise unsupported("reasoning summaries are not supported: this model does not reason", "reasoning.summary")
    if (req.text or {}).get("verbosity") not in (None, "medium"):
        raise unsupported("text.verbosity other than 'medium' is not supported", "text.verbosity")


def unsupported(message: str, param: str, code: str = "unsupported_parameter") -> APIError:
    return bad_request(message, param, code)


# ---- input items -> chat messages -----------------------------------------------------------


def messages_of(items: str | list[dict[str, Any]], param: str = "input") -> list[dict[str, Any]]:
    """Responses input (or output) items as chat messages. An assistant message and the function
    calls after it are one chat message, as a chat answer with text and tool calls is."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        at = f"{param}.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            out.append(message_of(item, at))
        elif kind == "function_call":
            call = tool_call_of(item, at)
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(
                {"role": "tool", "tool_call_id": text_field(item, "call_id", at), "content": output_of(item, at)}
            )
        elif kind not in DROPPED:
            raise unsupported(f"input items of type '{kind}' are not supported", f"{at}.type", "unsupported_item")
    return out


def message_of(item: dict[str, Any], at: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise bad_request(f"a message's role must be one of {', '.join(ROLES)}", f"{at}.role", "invalid_value")
    content = item.get("content")
    if isinstance(content, list):
        content = "\n".join(part_text(part, f"{at}.content.{j}") for j, part in enumerate(content))
    elif not isinstance(content, str):
        raise bad_request("a message's content must be a string or a list of parts", f"{at}.content", "invalid_value")
    return {"role": role, "content": content}


def part_text(part: Any, at: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS:
        return text_field(part, "text", at)
    if kind == "refusal":
        return text_field(part, "refusal", at)
    said = f"content parts of type '{kind}' are not supported by this model; only text"
    raise unsupported(said, f"{at}.type", "unsupported_content")


def tool_call_of(item: dict[str, Any], at: str) -> dict[str, Any]:
    function = {"name": text_field(item, "name", at), "arguments": text_field(item, "arguments", at)}
    return {"id": text_field(item, "call_id", at), "type": "function", "function": function}


def output_of(item: dict[str, Any], at: str) -> str:
    output = item.get("output")
    if isinstance(output, list):
        return "\n".join(part_text(part, f"{at}.output.{j}") for j, part in enumerate(output))
    return text_field(item, "output", at)


def text_field(item: Any, name: str, at: str) -> str:
    value = item.get(name) if isinstance(item, dict) else None
    if not isinstance(value, str):
        missing = value is None
        said = f"missing required field '{at}.{name}'" if missing else f"'{at}.{name}' must be a string"
        raise bad_request(said, f"{at}.{name}", "missing_field" if missing else "invalid_value")
    return value


# ---- tools, tool_choice, text.format ------------------------------------------------------------


def tools_of(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flat function tools ({type, name, description, parameters, strict}) as chat tools."""
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            said = f"tools of type '{tool.get('type')}' are not supported; only 'function'"
            raise unsupported(said, f"tools.{i}.type", "unsupported_tool")
        if tool.get("defer_loading"):
            raise unsupported("deferred tools (tool search) are not supported", f"tools.{i}.defer_loading")
        function = {"name": text_field(tool, "name", f"tools.{i}")}
        function |= {k: tool[k] for k in ("description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def tool_choice_of(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": text_field(choice, "name", "tool_choice")}}
    said = f"tool_choice of type '{choice.get('type')}' is not supported; use none, auto, required or a function"
    raise unsupported(said, "tool_choice.type", "unsupported_value")


def response_format_of(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (None: plain text)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise bad_request("a json_schema format needs a 'schema' object", "text.format.schema", "invalid_value")
        spec = {"name": text_field(fmt, "name", "text.format"), "schema": schema}
        spec |= {k: fmt[k] for k in ("description", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    said = "text.format.type must be one of text, json_object, json_schema"
    raise bad_request(said, "text.format.type", "invalid_value")


# ---- the chat body --------------------------------------------------------------------------


def chat_body(req: ResponsesRequest, body: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion request that answers `req`; `messages` are the conversation so far and
    the new input. kvgate's own fields go as the client sent them."""
    lead = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    chat: dict[str, Any] = {"model": req.model, "messages": lead + messages, "stream": req.stream}
    if req.stream:
        chat["stream_options"] = {"include_usage": True}  # the final event's usage
    if req.tools:
        chat |= {"tools": tools_of(req.tools), "parallel_tool_calls": req.parallel_tool_calls}
    if req.tools or "tool_choice" in req.model_fields_set:
        chat["tool_choice"] = tool_choice_of(req.tool_choice)
    fields = {
        "response_format": response_format_of(req.text),
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "user": req.user,
        "documents": body.get("documents"),
        "kvgate": body.get("kvgate"),
    }
    return chat | {k: v for k, v in fields.items() if v is not None}


def arguments_text(arguments: Any) -> str:
    """A tool call's arguments as the JSON text Responses carries."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
