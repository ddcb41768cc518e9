"""Documents as prompt text: the one fixed form kvgate reads a document in, which is also how the gateway
pastes documents into the prompt for an engine that is not kvgate (vLLM, SGLang), so that the engine's own
prefix cache hits whenever the same documents come again in the same order after the same head.

Each document is DOCUMENT_TEMPLATE with its text; they go, in the order given, in front of the content of
the first user message. No torch or tokenizer here: a proxy front imports it."""

from __future__ import annotations

from typing import Any

DOCUMENT_TEMPLATE = "<document>\n{text}\n</document>\n\n"


def pasted(messages: list[dict[str, Any]], texts: list[str]) -> list[dict[str, Any]]:
    """The messages with the documents in front of the first user message's content (a copy); as given
    when there is no user message to put them before."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if first is None or not texts:
        return messages
    documents = "".join(DOCUMENT_TEMPLATE.format(text=text) for text in texts)
    content = messages[first].get("content")
    if isinstance(content, list):  # content parts: the documents are a text part of their own, first
        content = [{"type": "text", "text": documents}, *content]
    else:
        content = documents + (content or "")
    return [*messages[:first], {**messages[first], "content": content}, *messages[first + 1 :]]
