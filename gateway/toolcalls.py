"""Tool calls out of a model's text, as OpenAI's deltas: content, then each call's id and name,
then its arguments in fragments. A whole answer is parsed by feeding it all at once, so a stream
and a whole answer can never disagree.

Calls held to their schemas by a grammar are streamed as they are written (`incremental`). Calls
nothing held are buffered until they close, then checked: one that is not a JSON object naming a
known tool, with object arguments, is passed on as the text it is.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from kvgate.gateway.protocol import ChatCompletionRequest, NamedTool
from kvgate.runtime.grammar import ANY_OBJECT, NO_ARGUMENTS, Calls, calls_grammar, json_grammar
from kvgate.runtime.tools import ToolFormat, partial_suffix

Delta = dict[str, Any]
DECODER = json.JSONDecoder()


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class StreamedCall:
    index: int
    id: str
    name: str
    arguments: str = ""

    def write(self, fragment: str) -> Delta:
        """More of the call's arguments: the delta that says them."""
        self.arguments += fragment
        return {"tool_calls": [{"index": self.index, "function": {"arguments": fragment}}]}


@dataclass
class CallStream:
    """One choice's text in, its deltas out."""

    fmt: ToolFormat
    names: frozenset[str]
    incremental: bool
    buffer: str = ""
    inside: bool = False  # within an open call
    current: StreamedCall | None = None  # the call being streamed (incremental)
    calls: list[StreamedCall] = field(default_factory=list)
    space: str = ""  # whitespace after a call, held until more than whitespace follows

    def __post_init__(self) -> None:
        self.tag = self.fmt.open.strip()
        self.end_tag = self.fmt.close.strip()
        args = re.escape(self.fmt.arguments)
        self.head = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"' + args + r'"\s*:\s*(?=\S)')
        self.hold = len("}" + self.fmt.close) + 2  # what may still close the call: never streamed

    def feed(self, text: str) -> list[Delta]:
        if not self.tag:  # a format without tags: the whole answer is read at the end
            self.buffer += text
            return []
        self.buffer += text
        out: list[Delta] = []
        while True:
            if not self.inside:
                at = self.buffer.find(self.tag)
                if at < 0:
                    keep = partial_suffix(self.buffer, self.tag)
                    out += self.say(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    return out
                out += self.say(self.buffer[:at])
                self.buffer, self.inside = self.buffer[at + len(self.tag) :], True
            if self.incremental:
                out += self.stream_call()
                closed = self.closing()  # the call's head may have been taken off
            else:
                closed = self.buffer.find(self.end_tag)
                if closed >= 0:
                    out += self.whole_call(self.buffer[:closed])
            if closed < 0:
                return out
            self.buffer, self.inside, self.current = self.buffer[closed + len(self.end_tag) :], False, None

    def closing(self) -> int:
        """Where the open call's end tag is: for a call being streamed, the first one after its
        arguments' JSON (an argument string may hold the tag's text)."""
        if self.current is None:
            return self.buffer.find(self.end_tag)
        try:
            _, end = DECODER.raw_decode(self.buffer)
        except json.JSONDecodeError:
            return -1
        return self.buffer.find(self.end_tag, end)

    def stream_call(self) -> list[Delta]:
        out: list[Delta] = []
        closed = self.closing()
        if self.current is None:
            head = self.head.match(self.buffer)
            if head is None:
                return self.whole_call(self.buffer[:closed]) if closed >= 0 else []
            out.append(self.open_call(json.loads(f'"{head.group(1)}"')))
            self.buffer = self.buffer[head.end() :]
            closed = self.closing()
        call = self.current
        assert call is not None
        if closed >= 0:
            body = self.buffer[:closed].rstrip()
            written = body[:-1].rstrip() if body.endswith("}") else body
        else:
            written = self.buffer[: max(len(self.buffer) - self.hold, len(call.arguments))]
        if len(written) > len(call.arguments):
            out.append(call.write(written[len(call.arguments) :]))
        return out

    def whole_call(self, body: str) -> list[Delta]:
        try:
            parsed = json.loads(body)
        except json.JSONDecodeError:
            parsed = None
        ok = isinstance(parsed, dict) and parsed.get("name") in self.names
        args = parsed.get(self.fmt.arguments, {}) if ok and isinstance(parsed, dict) else None
        if not isinstance(args, dict):
            return content(self.tag + body + self.end_tag)
        opened = self.open_call(str(parsed["name"]))
        return [opened, self.calls[-1].write(json.dumps(args, ensure_ascii=False))]

    def say(self, text: str) -> list[Delta]:
        """Text outside calls; once a call is out, only text with more than whitespace (the
        separator between calls is not the answer's content)."""
        if not self.calls:
            return content(text)
        self.space += text
        if not self.space.strip():
            return []
        text, self.space = self.space, ""
        return content(text)

    def open_call(self, name: str) -> Delta:
        self.current = StreamedCall(len(self.calls), call_id(), name)
        self.calls.append(self.current)
        header = {"index": self.current.index, "id": self.current.id, "type": "function"}
        return {"tool_calls": [header | {"function": {"name": name, "arguments": ""}}]}

    def end(self) -> list[Delta]:
        """The answer is over: what is still held back."""
        rest, self.buffer = self.buffer, ""
        if not self.tag:
            return self.untagged(rest)
        if not self.inside:
            return self.say(rest)
        if self.current is not None:  # cut short while writing its arguments: they stay cut
            rest = rest[: len(rest) - partial_suffix(rest, "}" + self.fmt.close.rstrip(), whole=True)]
            return (
                [self.current.write(rest[len(self.current.arguments) :])]
                if len(rest) > len(self.current.arguments)
                else []
            )
        # A call cut before its name: nothing to call. Held to a grammar it was never text; otherwise it was.
        return [] if self.incremental else content(self.tag + rest)

    def untagged(self, text: str) -> list[Delta]:
        """A format whose calls are bare JSON (Llama 3.1): the answer is calls only, or text."""
        found = []
        for part in text.strip().split(self.fmt.separator.strip() or None):
            try:
                parsed = json.loads(part)
            except json.JSONDecodeError:
                return content(text)
            args = parsed.get(self.fmt.arguments) if isinstance(parsed, dict) else None
            if parsed.get("name") not in self.names or not isinstance(args, dict):
                return content(text)
            found.append((parsed["name"], args))
        out = []
        for name, args in found:
            out.append(self.open_call(name))
            out.append(self.calls[-1].write(json.dumps(args, ensure_ascii=False)))
        return out


def content(text: str) -> list[Delta]:
    return [{"content": text}] if text else []


def message(stream: CallStream, text: str) -> dict[str, Any]:
    """A whole answer's message: content (None when only calls), tool_calls when there are any."""
    deltas = stream.feed(text) + stream.end()
    said = "".join(d.get("content", "") for d in deltas).strip()
    out: dict[str, Any] = {"role": "assistant", "content": said or None}
    if stream.calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in stream.calls
        ]
    elif not said:
        out["content"] = text
    return out


def constraint(body: ChatCompletionRequest, fmt: ToolFormat) -> tuple[str | None, bool]:
    """The lark grammar a request's answer must match (None: free text), and whether it holds
    tool calls to their schemas (then they stream as they are written)."""
    answer = None
    if body.response_format is not None and body.response_format.type == "json_object":
        answer = ANY_OBJECT
    elif body.response_format is not None and body.response_format.json_schema is not None:
        answer = body.response_format.json_schema.schema_
    functions = {t.function.name: t.function.parameters or NO_ARGUMENTS for t in body.tools or ()}
    choice = body.tool_choice
    if not body.calls_tools:
        return (json_grammar(answer) if answer is not None else None), False
    if isinstance(choice, NamedTool):
        name = choice.function.name
        return calls_grammar(fmt, Calls({name: functions[name]}, True, False)), True
    if choice == "required":
        return calls_grammar(fmt, Calls(functions, True, body.parallel_tool_calls)), True
    if fmt.open:  # auto: free text, or a JSON answer, until the model opens a call
        return calls_grammar(fmt, Calls(functions, False, body.parallel_tool_calls), answer), True
    return (json_grammar(answer) if answer is not None else None), False


def repeat_guard(body: Any, fmt: ToolFormat) -> tuple[str, str] | None:
    """The tags a repeated call is found by (runtime/sequence.py ends the answer before one), where a chat's
    answer may hold calls written between tags."""
    calls = isinstance(body, ChatCompletionRequest) and body.calls_tools
    return (fmt.open.strip(), fmt.close.strip()) if calls and fmt.open.strip() else None
