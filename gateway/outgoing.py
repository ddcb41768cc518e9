"""A request as an upstream gets it: the headers that name it (and, to kvgate's own workers, its tenant),
and the body an engine that is not kvgate can read (documents pasted in the prompt)."""

from __future__ import annotations

import hashlib
from typing import Any

from kvgate.gateway import tracing
from kvgate.gateway.errors import bad_request
from kvgate.gateway.programs import HEADER
from kvgate.runtime.document_text import pasted


def headers_for(request_id: str, tenant: str, upstream_is_worker: bool, program: str | None = None) -> dict[str, str]:
    sent = {"x-request-id": request_id, **tracing.headers()}  # the trace goes on there
    if program is not None:
        sent[HEADER] = program
    # A worker scopes its caches by the bearer token, one per tenant: believed only with the secret
    # its front sends (gateway/workers.py), and named there by an HMAC of it (gateway/keys.py).
    if upstream_is_worker:
        sent["authorization"] = "Bearer tenant-" + hashlib.sha256(tenant.encode()).hexdigest()
    return sent


def pasted_documents(body: dict[str, Any]) -> dict[str, Any]:
    """A chat body for an engine that is not kvgate: its documents pasted in the one fixed form kvgate reads
    them in (runtime/document_text.py), so that engine's prefix cache hits on them. A document it cannot
    paste is a 400 here (an id names KV that only kvgate's runtime keeps)."""
    documents, messages = body.get("documents"), body.get("messages")
    if documents is None or not isinstance(messages, list):
        return body
    if not isinstance(documents, list):
        raise bad_request("documents must be an array of {text} or {id}", "documents", "invalid_type")
    texts = []
    for i, doc in enumerate(documents):
        if isinstance(doc, dict) and isinstance(doc.get("text"), str):
            texts.append(doc["text"])
        elif isinstance(doc, dict) and "id" in doc:
            said = "a stored document lives in kvgate's runtime; this model's upstream is another engine: send its text"
            raise bad_request(said, f"documents.{i}.id", "invalid_value")
        else:
            raise bad_request(f"documents.{i} must be {{text}} or {{id}}", f"documents.{i}", "invalid_type")
    for i, message in enumerate(messages):  # what pasting reads: each message, the first user one's content
        if not isinstance(message, dict):
            raise bad_request(f"messages.{i} must be an object", f"messages.{i}", "invalid_type")
        if message.get("role") == "user":
            if not isinstance(message.get("content"), str | list | None):
                said = f"messages.{i}.content must be a string or an array of content parts"
                raise bad_request(said, f"messages.{i}.content", "invalid_type")
            break
    return {**{k: v for k, v in body.items() if k != "documents"}, "messages": pasted(messages, texts)}
