"""ReuseMode planning: a chat request's prompt, in pieces the engine knows how to reuse.

A request with documents becomes [head][document 1]...[document n][tail] (runtime/documents.py),
each document's KV found by its content; an agent program's request is cut at its messages'
contents, which may be spans other programs read or wrote (runtime/spans.py); anything else is
the chat template's plain prompt. Which reuse runs is decided here, below the gateway."""

from __future__ import annotations

import itertools
import json
from dataclasses import KW_ONLY, dataclass
from typing import Any

from kvgate.chunk_cache import Tier, fingerprint
from kvgate.runtime.documents import chat_pieces, document_ids, message_pieces
from kvgate.runtime.errors import DocumentNotFound, TemplateError
from kvgate.runtime.request import Plan
from kvgate.runtime.reuse import ReuseMode, Reuser
from kvgate.runtime.tokens import chat_prompt

PREFIX = "doc-"  # a document's id is PREFIX + its chunk key


@dataclass(frozen=True)
class Chat:
    """A chat request as the planner reads it."""

    messages: list[dict[str, Any]]
    _: KW_ONLY  # the rest by name: a list passed in the wrong place would be read as tools
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    documents: list[dict[str, str]] | None = None  # each {"text"} or {"id"}
    mode: str | None = None  # the reuse asked for; None: the default of the request's kind
    ratio: float | None = None  # blend's recompute ratio; None: the calibrated one
    program: str | None = None
    scope: str = ""  # whose document KV: the tenant's (tenant_scoped_kv) or everyone's ("")
    tenant: str = ""  # whose program spans: always the tenant's


class Planner:
    def __init__(self, reuser: Reuser, kvcomm: bool = True) -> None:
        self.reuser, self.tokenizer = reuser, reuser.tokenizer
        self.kvcomm = kvcomm

    def chat(self, chat: Chat) -> tuple[list[int], Plan | None]:
        """The prompt's token ids, and its plan when some of it may be reused (TemplateError for
        messages the chat template cannot render, DocumentNotFound for an unknown document id)."""
        plan = None
        if chat.documents:
            plan = self.documents(chat)
        elif chat.program is not None:
            plan = self.spans(chat)
        if plan is not None:
            return [t for piece in plan.pieces for t in piece], plan
        prompt = chat_prompt(self.tokenizer, chat.messages, chat.add_generation_prompt, chat.tools)
        if chat.mode is not None:  # a plain prompt (a program's too), the reuse asked kept: "prefix" finds no chunk
            return prompt, Plan([prompt], [False], ReuseMode(chat.mode, chat.ratio), chat.scope)
        return prompt, None

    def documents(self, chat: Chat) -> Plan:
        """[head][documents...][tail]; documents have no anchors: kvcomm is blend for them."""
        docs = []
        for i, ref in enumerate(chat.documents or ()):
            if "text" in ref:
                docs.append(document_ids(self.tokenizer, ref["text"]))
            else:
                docs.append(list(self.find(ref["id"], chat.scope, i)[1]))
        head, tail = chat_pieces(self.tokenizer, chat.messages, chat.add_generation_prompt, chat.tools)
        mode = "blend" if chat.mode in (None, "kvcomm") else chat.mode
        return Plan([head, *docs, tail], [False, *[True] * len(docs), False], ReuseMode(mode, chat.ratio), chat.scope)

    def spans(self, chat: Chat) -> Plan | None:
        """A program's prompt cut at its messages' contents. None: the program reuses only its own
        context, because it asked for "prefix", KVCOMM is off, or the template alters contents.
        Spans hold their first reader's context: they are shared within a tenant only, always."""
        mode = chat.mode or "kvcomm"
        if mode == "prefix" or (mode == "kvcomm" and not self.kvcomm):
            return None
        try:
            pieces, spans = message_pieces(self.tokenizer, chat.messages, chat.add_generation_prompt, chat.tools)
        except TemplateError:
            return None
        agent = agent_of(chat.messages, chat.tools)
        return Plan(pieces, [False] * len(pieces), ReuseMode(mode, chat.ratio), chat.tenant, spans, agent)

    # ---- stored documents -----------------------------------------------------------------

    def tokens(self, text: str) -> list[int]:
        return document_ids(self.tokenizer, text)

    def document_id(self, token_ids: list[int], scope: str) -> str:
        """The id of a document (its KV computed and kept by Engine.ingest)."""
        return PREFIX + self.reuser.key(token_ids, scope)

    def find(self, document_id: str, scope: str, index: int | None = None) -> tuple[str, tuple[int, ...]]:
        """A stored document's key and tokens."""
        key = document_id.removeprefix(PREFIX)
        tokens = self.reuser.tokens_of(key) if document_id.startswith(PREFIX) and len(key) == 64 else None
        if tokens is None or self.reuser.key(list(tokens), scope) != key:
            raise DocumentNotFound(document_id, index)
        return key, tokens

    def cached(self, key: str, settle: bool = False) -> Tier | None:
        """The tier holding a document's KV: the lowest durable one that does, else the first that does;
        None when none does. `settle` (blocking, bounded): first wait until its queued writes landed."""
        store = self.reuser.store
        return store.settle(key) if settle else store.where(key)

    def forget(self, document_id: str, scope: str) -> None:
        key, _ = self.find(document_id, scope)
        if not self.reuser.forget(key):
            raise DocumentNotFound(document_id)


def agent_of(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """Which agent reads a prompt, as KVCOMM's anchors know agents: by its prefix (the leading
    system messages and the tools), not its program id, which is new for every task of a
    pipeline while the agent's prefix, and so how it moves what it reads, stays the same."""
    lead = [m.get("content") for m in itertools.takewhile(lambda m: m.get("role") in ("system", "developer"), messages)]
    return "agent-" + fingerprint(json.dumps([lead, tools], sort_keys=True, default=str))[:16]
