"""A chat completion's SSE stream as the Responses API's: `response.created`, `.in_progress`, each
output item added, its text or arguments in deltas, done, then `response.completed` (or
`.incomplete`, or `.failed` for an error mid-stream), every event numbered by `sequence_number`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from kvgate.gateway.errors import internal
from kvgate.gateway.render import DONE, Data
from kvgate.gateway.responses_output import call_item, failed, finished, message_item, new_id, status_of


class ResponsesTranslator:
    """One response's events, from its chat chunks. `keep` is awaited with the finished response
    before the event that says it finished goes out (a client may continue it at once)."""

    def __init__(self, response: dict[str, Any], keep: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        self.response, self.keep = response, keep
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.text: dict[str, Any] | None = None  # the message item being written
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool call index -> its item
        self.open: list[dict[str, Any]] = []  # items added and not yet done
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    async def events(self, chunks: AsyncIterator[Data]) -> AsyncIterator[bytes]:
        yield self.event("response.created", response=self.response)
        yield self.event("response.in_progress", response=self.response)
        try:
            async for event in self.translated(chunks):
                yield event
        except Exception as exc:  # the stream has begun: its last event says what failed
            yield self.failure(internal(exc).body()["error"])

    async def translated(self, chunks: AsyncIterator[Data]) -> AsyncIterator[bytes]:
        async for chunk in chunks:
            if chunk == DONE:
                break
            assert isinstance(chunk, dict)
            if "error" in chunk:  # the rest is drained: the chat side counts the answer when it ends
                yield self.failure(chunk["error"])
                async for _ in chunks:
                    pass
                return
            for event in self.chunk(chunk):
                yield event
        if self.finish_reason is None:
            yield self.failure({"message": "the answer ended before it was finished"})
            return
        for event in self.closing():
            yield event
        done = finished(self.response, self.output, self.usage, self.finish_reason)
        await self.keep(done)
        yield self.event(f"response.{done['status']}", response=done)  # completed or incomplete

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()

    def failure(self, error: Any) -> bytes:
        message = error.get("message") if isinstance(error, dict) else None
        return self.event("response.failed", response=failed(self.response, str(message or "the answer failed")))

    def chunk(self, chunk: dict[str, Any]) -> Iterator[bytes]:
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            if isinstance(delta.get("content"), str) and delta["content"]:
                yield from self.text_delta(delta["content"])
            for call in delta.get("tool_calls") or ():
                yield from self.call_delta(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def added(self, item: dict[str, Any], **shown: Any) -> bytes:
        """An item begins (`shown`: how it looks until it is done, where that differs)."""
        self.output.append(item)
        self.open.append(item)
        return self.event("response.output_item.added", output_index=len(self.output) - 1, item=item | shown)

    def text_delta(self, text: str) -> Iterator[bytes]:
        if self.text not in self.open:  # none yet, or text again after tool calls
            yield from self.start_text()
        assert self.text is not None
        self.text["content"][0]["text"] += text
        yield self.in_part("response.output_text.delta", self.text, delta=text, logprobs=[])

    def start_text(self) -> Iterator[bytes]:
        self.text = message_item(new_id("msg"), "", "in_progress")
        yield self.added(self.text, content=[])
        yield self.in_part("response.content_part.added", self.text, part=self.text["content"][0])

    def call_delta(self, call: Any) -> Iterator[bytes]:
        """A chat tool call chunk: the first of a call names it, the rest carry its arguments."""
        if not isinstance(call, dict):
            return
        function = call.get("function") if isinstance(call.get("function"), dict) else {}
        item = self.calls.get(call.get("index", 0))
        if item is None:
            if self.text in self.open:  # the text before the calls is done
                yield from self.close(self.text)
            call_id, name = call.get("id") or new_id("call"), function.get("name") or ""
            item = self.calls[call.get("index", 0)] = call_item(new_id("fc"), call_id, name, "", "in_progress")
            yield self.added(item)
        if isinstance(function.get("arguments"), str) and function["arguments"]:
            item["arguments"] += function["arguments"]
            yield self.event("response.function_call_arguments.delta", **self.at(item), delta=function["arguments"])

    def at(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.output.index(item)}

    def in_part(self, kind: str, item: dict[str, Any], **fields: Any) -> bytes:
        """An event of a message's one text part."""
        return self.event(kind, **self.at(item), content_index=0, **fields)

    def closing(self) -> Iterator[bytes]:
        """Every item still open, done; a message with no text when there is nothing else."""
        if not self.output:
            yield from self.start_text()
        for item in list(self.open):
            yield from self.close(item)

    def close(self, item: dict[str, Any]) -> Iterator[bytes]:
        self.open.remove(item)
        item["status"] = status_of(self.finish_reason)
        if item["type"] == "message":
            part = item["content"][0]
            yield self.in_part("response.output_text.done", item, text=part["text"], logprobs=[])
            yield self.in_part("response.content_part.done", item, part=part)
        else:
            yield self.event("response.function_call_arguments.done", **self.at(item), arguments=item["arguments"])
        yield self.event("response.output_item.done", output_index=self.output.index(item), item=item)
