"""Agent programs at the gateway: the program id of a request (header `x-kvgate-program-id` or
body `kvgate.program_id`), its prompt cut at its messages for KVCOMM, its turn in the program,
and the headers that report the turn."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from typing import Any

from fastapi import Request
from kvgate.chunk_cache import fingerprint
from kvgate.gateway.errors import bad_request
from kvgate.gateway.protocol import ChatCompletionRequest
from kvgate.gateway.serving import Served
from kvgate.runtime.documents import message_pieces
from kvgate.runtime.reuse import Reuse
from kvgate.runtime.sequence import Plan, Turn
from kvgate.runtime.tokens import TemplateError

HEADER = "x-kvgate-program-id"
PROGRAM_ID = re.compile(r"^[A-Za-z0-9._:/@+=-]{1,256}$")


def program_of(request: Request, given: object) -> str | None:
    """The program id of a request: its header, or `given` (the body's kvgate.program_id)."""
    header = request.headers.get(HEADER)
    if header is not None and given is not None and header != given:
        raise bad_request(f"the {HEADER} header and kvgate.program_id differ", "kvgate.program_id")
    program = header if header is not None else given
    if program is not None and not (isinstance(program, str) and PROGRAM_ID.match(program)):
        raise bad_request(
            "a program id is 1 to 256 letters, digits or ._:/@+=- characters", "kvgate.program_id", "invalid_value"
        )
    return program


def of(request: Request, body: ChatCompletionRequest) -> str | None:
    return program_of(request, body.kvgate.program_id if body.kvgate else None)


def plan(
    served: Served, body: ChatCompletionRequest, messages: list[dict[str, Any]], program: str, scope: str
) -> Plan | None:
    """A program's prompt cut at its messages' contents, which may be spans other programs read
    or wrote (runs in a worker thread). None: the program reuses only its own context, because
    it asked for "prefix", KVCOMM is off, or the chat template alters message contents."""
    options = body.kvgate
    mode = options.reuse if options is not None and "reuse" in options.model_fields_set else "kvcomm"
    if mode == "prefix" or (mode == "kvcomm" and served.anchors is None):
        return None
    try:
        pieces, spans = message_pieces(served.tokenizer, messages, body.add_generation_prompt, body.tools)
    except TemplateError:
        return None
    ratio = options.recompute_ratio if options is not None else None
    if ratio is None and mode == "kvcomm":
        ratio = served.settings.kvcomm_recompute_ratio
    reuse = Reuse(mode, ratio)
    return Plan(pieces, [False] * len(pieces), reuse, scope, spans, agent_of(messages, body.tools))


def agent_of(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """Which agent reads a prompt, as KVCOMM's anchors know agents: by its prefix (the leading
    system messages and the tools), not its program id, which is new for every task of a
    pipeline while the agent's prefix, and so how it moves what it reads, stays the same."""
    lead = [m.get("content") for m in itertools.takewhile(lambda m: m.get("role") in ("system", "developer"), messages)]
    return "agent-" + fingerprint(json.dumps([lead, tools], sort_keys=True, default=str))[:16]


def begin(
    request: Request, served: Served, program: str | None, messages: list[dict[str, Any]], tokens: int
) -> Turn | None:
    """The request's turn in its program; None for a request without a program id."""
    if program is None:
        return None
    return served.programs.begin(program, request.state.tenant, messages, tokens)


async def end(request: Request, served: Served, turn: Turn | None) -> None:
    """The turn is over (its context kept or not); off the event loop, as a lower tier may be remote."""
    if turn is not None:
        await asyncio.to_thread(served.programs.end, request.state.tenant, turn)


def headers(turn: Turn | None) -> dict[str, str]:
    if turn is None:
        return {}
    return {HEADER: turn.program, "x-kvgate-pin-ttl": f"{turn.pin_s:.3f}"}
