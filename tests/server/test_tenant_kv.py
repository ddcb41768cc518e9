"""Tenants and KV reuse, as clients see it: with API keys, the KV one tenant's requests leave behind
(its documents, its exact prefixes, its conversations) is reused by that tenant's later requests and
never by another tenant's, whose same text is computed afresh (`caches.tenant_scoped`, the default). With
`caches.tenant_scoped: false`, document KV is everyone's; prefix blocks stay each tenant's (a shared prefix cache
would tell one tenant, by its speed, what another sent). What was reused is read where any
OpenAI client reads it: `x-kvgate-reused-tokens` and `usage.prompt_tokens_details.cached_tokens`.

A test that only asks whether tenant B can *see* tenant A's document (a 404) passes even when B
silently reuses A's KV; these tests count the tokens B reused."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import openai
import pytest

import kvgate
from kvgate.gateway.settings import Settings
from kvgate.runtime.engine import Engine
from tests.helpers.servers import serving

A, B = "sk-tenant-a", "sk-tenant-b"
KEYS = {A: "tenant-a", B: "tenant-b"}
BLEND = {"reuse": "blend", "recompute_ratio": 0.2}  # a ratio asked is run as asked: no calibration, no cost model
PREFIX = {"reuse": "prefix"}


def notes(subject: str) -> str:
    """A document no other test sends, so only this test's requests can have left its KV behind."""
    return (
        f"Internal notes on {subject}: the harbour office opens at seven, the pilot boats leave from the "
        f"north quay, and every manifest is checked twice before a vessel may berth."
    )


@contextmanager
def keyed_server(settings: Settings, engine: Engine, **more: Any) -> Iterator[str]:
    """A server over the session's engine where each key is a tenant of its own."""
    with serving(settings.model_copy(update={"security": {"api_keys": KEYS}, **more}), engine) as url:
        yield url


@pytest.fixture(scope="module")
def scoped(settings: Settings, engine: Engine) -> Iterator[str]:
    """Two tenants, KV kept per tenant (the default), over the session's engine (no prefix blocks: what the
    tests of documents and conversations count is then theirs alone)."""
    with keyed_server(settings, engine) as url:
        yield url


@pytest.fixture(scope="module")
def unscoped(settings: Settings, engine: Engine) -> Iterator[str]:
    """Two tenants, `caches.tenant_scoped: false`: document KV shared by all."""
    with keyed_server(settings, engine, caches={"tenant_scoped": False}) as url:
        yield url


@pytest.fixture(scope="module")
def scoped_blocks(prefix_settings: Settings, prefix_engine: Engine) -> Iterator[str]:
    """Two tenants, prefix caching on (the default)."""
    with keyed_server(prefix_settings, prefix_engine) as url:
        yield url


@pytest.fixture(scope="module")
def unscoped_blocks(prefix_settings: Settings, prefix_engine: Engine) -> Iterator[str]:
    with keyed_server(prefix_settings, prefix_engine, caches={"tenant_scoped": False}) as url:
        yield url


@dataclass(frozen=True)
class Answer:
    """What a client learns about a chat completion's reuse."""

    text: str
    reused: int  # x-kvgate-reused-tokens, which usage.prompt_tokens_details.cached_tokens repeats
    reuse: str  # x-kvgate-reuse: the mode that ran ("" when nothing was reused)
    program: str  # x-kvgate-program-id: the program the turn belongs to ("" when none)


def ask(
    url: str,
    key: str,
    model: str,
    messages: list[dict[str, Any]] | str,
    documents: list[dict[str, str]] | None = None,
    reuse: dict[str, Any] | None = None,
    **kw: Any,
) -> Answer:
    """One temperature-0 chat completion through the openai SDK, kvgate's fields in `extra_body`."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    extra: dict[str, Any] = {}
    if documents is not None:
        extra["documents"] = documents
    if reuse is not None:
        extra["kvgate"] = reuse
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, temperature=0, max_tokens=8, extra_body=extra or None, **kw
    )
    completion, reused = raw.parse(), int(raw.headers["x-kvgate-reused-tokens"])
    assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == reused  # the header and the usage agree
    headers = raw.headers
    text = completion.choices[0].message.content or ""
    return Answer(text, reused, headers.get("x-kvgate-reuse", ""), headers.get("x-kvgate-program-id", ""))


# ---- documents ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kept_by", ["documents API", "a chat"])
def test_a_tenants_document_kv_is_reused_by_that_tenant_only(scoped: str, model_name: str, kept_by: str) -> None:
    """Tenant A's document KV, kept through `POST /v1/documents` or by a chat that cited the text: B
    citing the same text reuses none of it (its own copy is computed), while A's next request does."""
    text = notes(f"tenant A, kept by {kept_by}")
    question = "When does the harbour office open?"
    if kept_by == "documents API":
        with kvgate.Client(scoped, api_key=A, model=model_name) as kvgate_client:
            card = kvgate_client.documents.add(text)
        assert card.cached and card.tokens > 0
    else:  # a plain chat citing it, left to the server's default reuse
        assert ask(scoped, A, model_name, question, [{"text": text}]).reused == 0  # read for the first time

    assert ask(scoped, B, model_name, question, [{"text": text}], BLEND).reused == 0
    assert ask(scoped, A, model_name, question, [{"text": text}], BLEND).reused > 0
    assert ask(scoped, B, model_name, question, [{"text": text}], BLEND).reused > 0  # now B's own copy


# ---- exact prefixes and conversations -------------------------------------------------------------


@pytest.mark.parametrize("shared_documents", [False, True], ids=["scoped", "caches.tenant_scoped false"])
def test_an_exact_prefix_is_reused_within_its_tenant_only(
    scoped_blocks: str, unscoped_blocks: str, model_name: str, shared_documents: bool
) -> None:
    """Prefix blocks are found by the tenant that left them: A's repeat reads all but its last token; B
    sending the very same prompt reads none of them (at most its own earlier prompts' `<|im_start|>system`),
    even where tenants share document KV."""
    url = unscoped_blocks if shared_documents else scoped_blocks
    # A system prompt of this test's own: no other request's prompt starts the same way past its first tokens.
    system = {"role": "system", "content": f"{'Shared' if shared_documents else 'Scoped'}: harbour records."}
    messages = [system, {"role": "user", "content": "Where do the pilot boats leave from?"}]
    documents = [{"text": notes(f"exact prefixes {shared_documents}")}]
    first = ask(url, A, model_name, messages, documents, PREFIX)
    assert first.reused <= 3
    again = ask(url, A, model_name, messages, documents, PREFIX)
    assert again.reused > 40 and again.reuse == "prefix" and again.text == first.text
    assert ask(url, B, model_name, messages, documents, PREFIX).reused <= 3
    assert ask(url, B, model_name, messages, documents, PREFIX).reused == again.reused  # now B's own


@pytest.mark.parametrize("shared_documents", [False, True], ids=["scoped", "caches.tenant_scoped false"])
def test_pasted_text_is_found_by_its_tenant_only(
    scoped_blocks: str, unscoped_blocks: str, model_name: str, shared_documents: bool
) -> None:
    """Content-defined chunks are the tenant's, like prefix blocks, even where tenants share document KV:
    B pasting the passages A pasted, in another order, finds none of A's chunks; A does."""
    url = scoped_blocks if not shared_documents else unscoped_blocks
    passages = [notes(f"chunks {shared_documents} {i}") + " " + notes(f"pier {i}") for i in range(3)]

    def pasted(order: list[str], question: str) -> str:
        return "Context:\n\n" + "\n\n".join(order) + f"\n\nQuestion: {question}"

    ask(url, A, model_name, pasted(passages, "When does the office open?"))
    other = ask(url, B, model_name, pasted(passages[::-1], "Where do boats leave from?"))
    assert "chunks" not in other.reuse and other.reused < 40  # at most its own template opening
    again = ask(url, A, model_name, pasted(passages[::-1], "Where do boats leave from?"))
    assert "chunks found by content" in again.reuse and again.reused > 40


@pytest.mark.parametrize("named", [True, False], ids=["program id", "no markup"])
def test_a_conversation_is_continued_within_its_tenant_only(scoped: str, model_name: str, named: bool) -> None:
    """A conversation's next turn resumes the KV its previous turn left (prompt and answer), whether
    the program is named (`x-kvgate-program-id`, the same name for both tenants) or found from the
    resent messages. Tenant B sending A's exact next turn resumes nothing of A's."""
    program = {"extra_headers": {"x-kvgate-program-id": "harbour-shift"}} if named else {}
    history = [
        {"role": "user", "content": "Who checks the manifests at the harbour?"},
        {"role": "assistant", "content": "The harbour office checks every manifest twice."},
        {"role": "user", "content": "And when does that office open?"},
    ]
    first = ask(scoped, A, model_name, history, **program)
    following = [*history, {"role": "assistant", "content": first.text}, {"role": "user", "content": "Who leads?"}]

    other = ask(scoped, B, model_name, following, **program)
    assert other.reused == 0
    if not named:  # found from the messages: B's turn starts a program of its own, never joins A's
        assert other.program.startswith("conv-") and other.program != first.program
    again = ask(scoped, A, model_name, following, **program)
    assert again.reused > 0 and again.reuse == "program" and again.program == first.program


# ---- caches.tenant_scoped: false ---------------------------------------------------------------


def test_without_tenant_scoped_caches_tenants_share_document_kv(unscoped: str, model_name: str) -> None:
    """`caches.tenant_scoped: false`: tenant B reuses the document KV tenant A kept (prefix blocks: above)."""
    text = notes("tenants sharing KV")
    with kvgate.Client(unscoped, api_key=A, model=model_name) as kvgate_client:
        card = kvgate_client.documents.add(text)
    assert card.cached
    assert ask(unscoped, B, model_name, "When does the office open?", [{"text": text}], BLEND).reused > 0
