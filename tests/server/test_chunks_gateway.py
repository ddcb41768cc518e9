"""Content-defined chunks through the OpenAI SDK, with no kvgate field: documents a RAG framework pastes
into the prompt, asked again in another order, and an agent's answer quoted inside another agent's
message are found by their content and reused as documents are, reported where any client reads it
(`x-kvgate-reused-tokens`, `usage.prompt_tokens_details.cached_tokens`, `x-kvgate-reuse`,
`x-kvgate-fidelity`); "prefix" and "full" read none; the cost model keeps reuse from being slower."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.helpers.corpus import musique_rows


@pytest.fixture(scope="module")
def client(prefix_base_url: str) -> openai.OpenAI:
    """The server with prefix caching and content-defined chunks on (tests/conftest.py), as by default."""
    return openai.OpenAI(base_url=f"{prefix_base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def passages(seed: int, words: int = 100) -> tuple[list[str], str]:
    """Four retrieved passages no other test sends, cut to their first `words` words (a passage has ~200: twice
    the prefill, and no other code), and the question they answer."""
    row = musique_rows(1, seed=seed)[0]
    return [" ".join(str(p).split()[:words]) for p in row["passages"][:4]], str(row["question"])


def pasted(passages: list[str], question: str) -> list[dict[str, str]]:
    """A prompt as LangChain's "stuff" chain makes it: the retrieved documents pasted into one message."""
    context = "\n\n".join(passages)
    return [
        {"role": "system", "content": "Answer the question from the context. Be brief."},
        {"role": "user", "content": f"Context:\n{context}\n\nQuestion: {question}"},
    ]


def ask(client: openai.OpenAI, model: str, messages: list[dict[str, str]], reuse: dict | None = None, **kw: Any):
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=messages,
        temperature=0,
        max_tokens=kw.pop("max_tokens", 8),
        extra_body={"kvgate": reuse} if reuse else None,
        **kw,
    )
    reply = raw.parse()
    reused = int(raw.headers["x-kvgate-reused-tokens"])
    assert reply.usage.prompt_tokens_details.cached_tokens == reused  # the header and the usage agree
    return raw, reply, reused


def test_documents_pasted_in_the_prompt_are_reused_in_another_order(client, model_name, loaded) -> None:
    docs, question = passages(101)
    _, _, reused = ask(client, model_name, pasted(docs, question))
    assert reused < 40  # at most the template's opening, from earlier prompts' blocks
    raw, reply, reused = ask(client, model_name, pasted(docs[::-1], "Which town trades in salt?"))
    recomputed = int(raw.headers["x-kvgate-recomputed-tokens"])
    pasted_tokens = sum(len(loaded.tokenizer.encode(d, add_special_tokens=False)) for d in docs)
    # Found: all but the first document's opening (it followed "Context:" where it was first read)...
    assert reused + recomputed >= 0.8 * pasted_tokens, (reused, recomputed, pasted_tokens)
    assert 0 < recomputed < reused  # ...and reused, some of it recomputed (it moved)
    how = raw.headers["x-kvgate-reuse"]
    assert how.startswith("blend") and "chunks found by content" in how
    assert "ratio=" in raw.headers["x-kvgate-fidelity"]  # how far it moved the answer, as last measured
    assert reply.choices[0].message.content


def test_a_blended_prompt_asked_again_is_read_whole_as_the_blend_left_it_and_never_as_exact(client, model_name) -> None:
    """A prompt that blended chunks leaves its exact blocks only up to its first chunk; its KV is kept in a chain
    of blocks of its own, so the same prompt asked again reads all but its last token (as a repeat does with
    prefix caching) and answers as it did, while `prefix` (exact KV only) still reads none of it."""
    docs, question = passages(104)
    ask(client, model_name, pasted(docs, question))
    again = pasted(docs[::-1], "Which river is named in the context?")
    raw, first, _ = ask(client, model_name, again)
    assert "chunks found by content" in raw.headers["x-kvgate-reuse"]
    raw, repeat, reused = ask(client, model_name, again)
    assert (
        raw.headers["x-kvgate-reuse"].startswith("blend")
        and "as a blend of the same tokens" in raw.headers["x-kvgate-reuse"]
    ), raw.headers["x-kvgate-reuse"]
    assert reused == repeat.usage.prompt_tokens - 1 and int(raw.headers["x-kvgate-recomputed-tokens"]) == 0
    assert "ratio=" in raw.headers["x-kvgate-fidelity"]  # not "exact"
    assert repeat.choices[0].message.content == first.choices[0].message.content
    _, _, exact = ask(client, model_name, again, {"reuse": "prefix"})
    assert exact < 40  # the template's opening: the blend's KV is never read as exact
    # A new prompt sharing only that opening, which the exact blocks hold too: computed, not read as the blend.
    raw, _, _ = ask(client, model_name, pasted(["A passage no prompt held."], "What does it say?"))
    assert "as a blend" not in raw.headers.get("x-kvgate-reuse", ""), raw.headers.get("x-kvgate-reuse")


def test_prefix_and_full_read_no_chunk(client, model_name) -> None:
    docs, question = passages(102)
    ask(client, model_name, pasted(docs, question))
    again = pasted(docs[::-1], "Which town trades in salt?")
    raw, _, reused = ask(client, model_name, again, {"reuse": "prefix"})
    assert reused < 40 and "chunks" not in raw.headers.get("x-kvgate-reuse", "")
    program = {"x-kvgate-program-id": "prefix-reader"}  # a program's prompt asking prefix: its own context only
    other = pasted(docs[2:] + docs[:2], "Which town trades in salt?")  # an order no prefix blocks hold
    raw, _, reused = ask(client, model_name, other, {"reuse": "prefix"}, extra_headers=program)
    assert reused < 40 and "chunks" not in raw.headers.get("x-kvgate-reuse", "")
    raw, _, reused = ask(client, model_name, again, {"reuse": "full"})
    assert reused == 0 and raw.headers["x-kvgate-reuse"] == "full"
    again = pasted(docs[1:] + docs[:1], "Who is the mayor?")  # another order: no prefix blocks hold it
    raw, _, reused = ask(client, model_name, again)  # left to the server: found
    assert "chunks found by content" in raw.headers["x-kvgate-reuse"] and reused > 100


@pytest.mark.parametrize("program", [None, "writer-1"], ids=["no markup", "program id"])
def test_an_agents_answer_quoted_in_another_agents_message_is_reused(client, model_name, program) -> None:
    """CrewAI's sequential crew: the writer's task quotes the researcher's output inside a larger message.
    As a program of its own (KVCOMM's spans are whole messages, and this one is new) chunks find it too."""
    researcher = [
        {"role": "system", "content": "You are a researcher. Write thorough notes."},
        {"role": "user", "content": f"Write ten numbered facts about {'lighthouses' if program else 'rivers'}."},
    ]
    _, reply, _ = ask(client, model_name, researcher, max_tokens=80)
    notes = reply.choices[0].message.content
    assert len(notes.split()) > 40
    writer = [
        {"role": "system", "content": "You are a writer. Turn research into a short article."},
        {"role": "user", "content": f"The researcher's notes:\n\n{notes}\n\nWrite the article's first sentence."},
    ]
    headers = {"x-kvgate-program-id": f"{program}-{model_name}"} if program else None
    raw, _, reused = ask(client, model_name, writer, extra_headers=headers)
    assert "chunks found by content" in raw.headers["x-kvgate-reuse"], (notes, reused, raw.headers["x-kvgate-reuse"])
    assert reused >= 40


def test_a_chunk_too_small_to_pay_is_computed_and_the_header_says_why(client, model_name, loaded) -> None:
    """One short paragraph found in a long new prompt: a blend would cost more than full prefill (its
    check layers run every token), so the cost model runs full prefill, and `x-kvgate-reuse` says so."""
    paragraph = "The old ferry keeper, Marten Hale, rings the brass bell twice at dusk each day."
    assert 16 <= len(loaded.tokenizer.encode(paragraph, add_special_tokens=False)) <= 20  # one chunk, and small
    before = "Log of the north quay, week one. Nothing else happened that day at the harbour office."
    ask(client, model_name, [{"role": "user", "content": f"{before}\n\n{paragraph}\n\nSummarise the log."}])
    after = " ".join(f"Cargo {i} of salt and rope was weighed at the south pier, then sent on." for i in range(20))
    messages = [
        {"role": "system", "content": "You read shipping records."},
        {"role": "user", "content": f"{after}\n\n{paragraph}\n\nWhat happens at dusk?"},
    ]
    raw, _, reused = ask(client, model_name, messages)
    how = raw.headers["x-kvgate-reuse"]
    assert "1 chunks found by content" in how and "reuse would be slower than full prefill" in how, how
    assert reused < 40 and raw.headers["x-kvgate-recomputed-tokens"] == "0"  # at most the template's opening
