"""Documents in a chat prompt: one fixed template, each document tokenized on its own.

The prompt is split into pieces

    [head][document 1]...[document n][tail]

head: the chat template's rendering up to the start of the first user message's content;
document i: DOCUMENT_TEMPLATE with its text, tokenized alone (so its token ids, and so its
cached KV, never depend on its neighbours or its place in the list);
tail: the first user message's own content, the rest of the conversation and the generation
prompt.

The split is found by rendering the template with a marker that no client can know (a random
string made at start-up) in front of the first user message, never by searching user text.
"""

from __future__ import annotations

import secrets
from typing import Any

from transformers import PreTrainedTokenizerBase

from kvgate.runtime.document_text import DOCUMENT_TEMPLATE
from kvgate.runtime.errors import TemplateError

_MARKER = f"kvgate-documents-{secrets.token_hex(16)}"


def document_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer.encode(DOCUMENT_TEMPLATE.format(text=text), add_special_tokens=False)


def chat_pieces(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], list[int]]:
    """The head and tail token ids around the documents."""
    if not tokenizer.chat_template:
        raise TemplateError("this model has no chat template; documents need chat completions")
    first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if first_user is None:
        raise TemplateError("documents need a user message to precede")
    marked = [dict(m) for m in messages]
    marked[first_user]["content"] = _MARKER + (marked[first_user].get("content") or "")
    text = render(tokenizer, marked, add_generation_prompt, tools)
    head, found, tail = text.partition(_MARKER)
    if not found or _MARKER in tail:
        raise TemplateError("the model's chat template does not render the user message verbatim")
    return tokenizer.encode(head, add_special_tokens=False), tokenizer.encode(tail, add_special_tokens=False)


def message_pieces(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[list[int]], list[bool]]:
    """The chat prompt cut around every message's content: token ids of the template's text and
    of each content, tokenized alone (so it is the same span wherever it reappears); and which
    pieces are contents."""
    if not tokenizer.chat_template:
        raise TemplateError("this model has no chat template")
    marked, contents = [], []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), str) and m["content"]:
            contents.append(m["content"])
            m["content"] = _MARKER + m["content"] + _MARKER
        marked.append(m)
    parts = render(tokenizer, marked, add_generation_prompt, tools).split(_MARKER)
    # A template that trims or escapes contents would pass the markers through yet render the
    # unmarked messages otherwise: the pieces must join to the very prompt.
    verbatim = parts[1::2] == contents and len(parts) == 2 * len(contents) + 1
    if not verbatim or "".join(parts) != render(tokenizer, messages, add_generation_prompt, tools):
        raise TemplateError("the model's chat template does not render message contents verbatim")
    pieces, spans = [], []
    for i, part in enumerate(parts):
        if part:
            pieces.append(tokenizer.encode(part, add_special_tokens=False))
            spans.append(i % 2 == 1)
    return pieces, spans


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None,
) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except Exception as exc:  # jinja raises its own errors for messages a template rejects
        raise TemplateError(f"the model's chat template rejected the messages: {exc}") from exc
