"""Anthropic's Message (as the anthropic SDK's `anthropic.types.Message` reads it) made from a chat
completion, whole or streamed: content blocks, stop reason and usage; and the model list as its SDKs read it.

Usage as Anthropic counts it: `input_tokens` are the prompt tokens computed for this request, and
`cache_read_input_tokens` those whose KV was reused, so their sum is the prompt. kvgate writes no
cache entry a caller pays for: `cache_creation_input_tokens` is 0."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime
from typing import Any

from kvgate.gateway.errors import STATUS_OF, anthropic_error, internal
from kvgate.gateway.render import DONE, Data

STOPS = {"length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}


def new_id() -> str:
    return "msg_" + uuid.uuid4().hex


def skeleton(message_id: str, model: str) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage_of(None),
    }


def usage_of(usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": max((usage.get("prompt_tokens") or 0) - cached, 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": usage.get("completion_tokens") or 0,
    }


def stop_of(choice: dict[str, Any], stops: list[str]) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a chat choice that ended (`stop_reason`: the stop
    string matched, as vLLM and kvgate report it)."""
    finish, matched = choice.get("finish_reason"), choice.get("stop_reason")
    if finish == "stop" and isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return STOPS.get(finish or "", "end_turn"), None


def tool_input(arguments: Any) -> Any:
    """A tool call's arguments as the input object (text that is no JSON object is kept as text)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments or "{}")
    except ValueError:
        return {"arguments": arguments}
    return parsed if isinstance(parsed, dict) else {"arguments": parsed}


def message_of(chat: dict[str, Any], message_id: str, model: str, stops: list[str]) -> dict[str, Any]:
    """A whole chat completion as a Message."""
    choice = (chat.get("choices") or [{}])[0]
    said = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if said.get("content"):
        content.append({"type": "text", "text": said["content"]})
    for call in said.get("tool_calls") or ():
        function = call.get("function") or {}
        block = {"type": "tool_use", "id": call.get("id"), "name": function.get("name")}
        content.append(block | {"input": tool_input(function.get("arguments"))})
    reason, sequence = stop_of(choice, stops)
    usage = usage_of(chat.get("usage"))
    ended = {"content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": usage}
    return skeleton(message_id, model) | ended


def event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n".encode()


class MessagesTranslator:
    """A Message's stream from its chat chunks: message_start, a ping, each content block started,
    its text or input JSON in deltas, stopped; message_delta with the stop reason and usage;
    message_stop. An error mid-stream is an `error` event, as Anthropic sends it."""

    def __init__(self, message: dict[str, Any], stops: list[str]) -> None:
        self.message, self.stops = message, stops
        self.blocks = 0  # content blocks started
        self.open: str | None = None  # "text", or "tool:<chat index>", of the block being written
        self.choice: dict[str, Any] = {}
        self.usage: dict[str, Any] | None = None

    async def events(self, chunks: AsyncIterator[Data]) -> AsyncIterator[bytes]:
        yield event("message_start", {"message": self.message})
        yield event("ping", {})
        try:
            async for chunk in chunks:
                if chunk == DONE:
                    break
                assert isinstance(chunk, dict)
                if "error" in chunk:  # the rest is drained: the chat side counts the answer when it ends
                    yield failure(chunk["error"])
                    async for _ in chunks:
                        pass
                    return
                for out in self.chunk(chunk):
                    yield out
        except Exception as exc:  # the stream has begun: its last event says what failed
            yield failure(internal(exc).body()["error"])
            return
        for out in self.close():
            yield out
        reason, sequence = stop_of(self.choice, self.stops)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        yield event("message_delta", {"delta": delta, "usage": usage_of(self.usage)})
        yield event("message_stop", {})

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[bytes] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self.switch("text", {"type": "text", "text": ""})
                out.append(self.delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                block = {"type": "tool_use", "id": call.get("id"), "name": function.get("name"), "input": {}}
                out += self.switch(f"tool:{call.get('index', 0)}", block)
                if function.get("arguments"):
                    out.append(self.delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
            if choice.get("finish_reason") is not None:
                self.choice = choice
        return out

    def switch(self, key: str, block: dict[str, Any]) -> list[bytes]:
        """The block `key` open: the one before it stopped and this one started, unless it is open."""
        if self.open == key:
            return []
        out = self.close()
        self.open, self.blocks = key, self.blocks + 1
        return [*out, event("content_block_start", {"index": self.blocks - 1, "content_block": block})]

    def delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": self.blocks - 1, "delta": delta})

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.blocks - 1})]


def failure(error: dict[str, Any]) -> bytes:
    status = STATUS_OF.get(str(error.get("type")), 500)
    body = anthropic_error(status, str(error.get("message") or "the answer failed"))
    return f"event: error\ndata: {json.dumps(body)}\n\n".encode()


def anthropic_client(headers: Mapping[str, str]) -> bool:
    """A caller speaking Anthropic's API: its SDKs send `anthropic-version`, and the key as `x-api-key`."""
    return "anthropic-version" in headers or ("x-api-key" in headers and "authorization" not in headers)


def model_info(card: dict[str, Any]) -> dict[str, Any]:
    """A model card (OpenAI's shape) as Anthropic's API describes a model."""
    created = datetime.fromtimestamp(card.get("created", 0), tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    info = {"type": "model", "id": card["id"], "display_name": card["id"], "created_at": created}
    info["lifecycle"] = "active"
    return info | ({"max_input_tokens": card["max_model_len"]} if card.get("max_model_len") else {})


def model_page(cards: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """Anthropic's model list: `limit` of them (1 to 1,000; 20), after `after_id` or before `before_id`."""
    try:
        limit = min(max(int(query.get("limit") or 20), 1), 1000)
    except ValueError:
        limit = 20
    ids = [c["id"] for c in cards]
    before, after = query.get("before_id"), query.get("after_id")
    if before is not None:
        stop = ids.index(before) if before in ids else 0
        start = max(0, stop - limit)
        more = start > 0
    else:
        start = ids.index(after) + 1 if after in ids else 0 if after is None else len(ids)
        stop = min(start + limit, len(ids))
        more = stop < len(ids)
    page = [model_info(c) for c in cards[start:stop]]
    first, last = (page[0]["id"], page[-1]["id"]) if page else (None, None)
    return {"data": page, "has_more": more, "first_id": first, "last_id": last}
