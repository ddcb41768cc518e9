"""Programs without markup: the earlier answered turn a request continues, found by its messages.

An agent framework sends no program id; each turn of its loop resends the whole history: the
earlier prompt's messages, the assistant's answer as it was given (content and tool calls), then
the tool results. So every answered turn is remembered under a digest of its messages plus its
answer, and a request whose messages begin with such a history continues that turn's program.

Messages are compared by what the model reads: the role, the text, the calls' names and arguments
(as JSON, key order aside); not the call ids, which frameworks may rewrite. Digests are per
tenant: one tenant never continues another's program, whatever its messages.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any

ROLES = {"developer": "system", "function": "tool"}


def canonical(message: dict[str, Any]) -> str:
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        calls.append([function.get("name"), arguments])
    role = message.get("role")
    text = message.get("content")
    said = (text or "").strip() if isinstance(text, str | None) else json.dumps(text, sort_keys=True, default=str)
    return json.dumps([ROLES.get(role, role), said, calls], sort_keys=True, default=str)


def digests(tenant: str, tools: list[dict[str, Any]] | None, messages: list[dict[str, Any]]) -> list[bytes]:
    """The digest of every leading run of the messages: [i] covers messages[:i + 1]."""
    h = hashlib.sha256(json.dumps(["kvgate.conversation.v1", tenant, tools], sort_keys=True).encode())
    out = []
    for m in messages:
        h.update(canonical(m).encode() + b"\0")
        out.append(h.copy().digest())
    return out


class Conversations:
    """Answered turns by digest -> their program; the newest `capacity` kept; thread-safe."""

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.turns: OrderedDict[bytes, str] = OrderedDict()
        self.lock = threading.Lock()

    def find(self, tenant: str, tools: list[dict[str, Any]] | None, messages: list[dict[str, Any]]) -> str | None:
        """The program of the longest answered history these messages begin with (and go on from)."""
        found = digests(tenant, tools, messages[:-1])
        with self.lock:
            for i in range(len(found) - 1, -1, -1):
                if messages[i].get("role") == "assistant" and (program := self.turns.get(found[i])):
                    self.turns.move_to_end(found[i])
                    return program
        return None

    def remember(
        self,
        tenant: str,
        tools: list[dict[str, Any]] | None,
        messages: list[dict[str, Any]],
        answer: dict[str, Any],
        program: str,
    ) -> None:
        key = digests(tenant, tools, [*messages, answer])[-1]
        with self.lock:
            self.turns[key] = program
            self.turns.move_to_end(key)
            while len(self.turns) > self.capacity:
                self.turns.popitem(last=False)

    def __len__(self) -> int:
        return len(self.turns)
