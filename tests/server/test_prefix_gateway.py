"""Automatic prefix caching as a client meets it, through the official SDK against the real server: no kvgate
field, and what was read is in `usage.prompt_tokens_details.cached_tokens` and the `x-kvgate-*` headers. A
repeat reads all but its last token and answers as full prefill does; a shared system prompt is read by every
new question; a conversation's next turn reads the last turn's prompt and answer; completions too."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def base_url(prefix_base_url: str) -> str:
    """The server with prefix caching on (tests/conftest.py): what a client meets by default."""
    return prefix_base_url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


# A system prompt of this module's own, long enough to span several blocks.
SYSTEM = (
    "You are the harbour master's assistant at Port Callow. You answer questions about berths, tides, pilots, "
    "fees and the harbour's rules. Berths one to six take cargo vessels; seven to nine take ferries and the "
    "pilot boats. High tide is at six in the morning and half past six in the evening this week. Pilots are "
    "required for every vessel longer than forty metres. Fees are charged per metre per day, doubled after the "
    "third day. Answer in one short sentence."
)


def chat(client: openai.OpenAI, model: str, messages: list[dict], **kw):
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, temperature=0, max_tokens=12, logprobs=True, **kw
    )
    reply = raw.parse()
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert str(cached) == raw.headers["x-kvgate-reused-tokens"]  # the header and the usage agree
    return reply, raw.headers


def tokens(reply) -> list[float]:
    return [t.logprob for t in reply.choices[0].logprobs.content]


def test_a_repeat_reads_its_blocks_and_answers_as_full_prefill(client, model_name, grid) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When is high tide?"}]
    first, _ = chat(client, model_name, messages)
    again, headers = chat(client, model_name, messages)
    prompt = again.usage.prompt_tokens  # read down to the grid: the rest as its whole prefill computes it
    assert again.usage.prompt_tokens_details.cached_tokens == (prompt - 1) - (prompt - 1) % grid > 0
    assert headers["x-kvgate-reuse"] == "prefix" and headers["x-kvgate-fidelity"] == "exact"
    truth, truth_headers = chat(client, model_name, messages, extra_body={"kvgate": {"reuse": "full"}})
    assert truth_headers["x-kvgate-reused-tokens"] == "0"  # full prefill reads no block
    assert again.choices[0].message.content == truth.choices[0].message.content == first.choices[0].message.content
    assert tokens(again) == pytest.approx(tokens(truth), abs=1e-3)


def test_every_new_question_reads_the_shared_system_prompt(client, model_name, loaded, grid) -> None:
    system_tokens = len(loaded.tokenizer.encode(SYSTEM, add_special_tokens=False))
    for question in ("Who needs a pilot?", "What are the fees?", "Which berths take ferries?"):
        reply, headers = chat(
            client, model_name, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        )
        read = reply.usage.prompt_tokens_details.cached_tokens  # down to the grid
        assert system_tokens >= 64 and read >= system_tokens - system_tokens % grid and read % grid == 0
        assert headers["x-kvgate-fidelity"] == "exact"


def test_a_conversations_next_turn_reads_the_last_turns_prompt_and_answer(client, model_name) -> None:
    history = [{"role": "system", "content": f"Ferry desk. {SYSTEM}"}, {"role": "user", "content": "Is berth 7 free?"}]
    first, _ = chat(client, model_name, history)
    history += [{"role": "assistant", "content": first.choices[0].message.content}]
    history += [{"role": "user", "content": "And berth 8?"}]
    second, _ = chat(client, model_name, history)
    # Past the first prompt: the answer's blocks were kept when it finished (as vLLM keeps decode blocks).
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens


def test_completions_read_prefix_blocks_too(client, model_name, grid) -> None:
    # A text of its own: the other tests' chat prompts left SYSTEM's lines as content-defined chunks, which a
    # completion beginning with SYSTEM would find and blend, keeping its exact blocks only up to them.
    customs = (
        "You are the clerk of the customs house at Port Callow. Duty is charged per tonne of cargo landed, "
        "wine and spirits at twice the rate of grain, timber at half. Manifests are lodged before noon on the "
        "day of landing; late ones pay a fine of four shillings. Answer in one short sentence."
    )
    prompt = f"{customs}\n\nQuestion: what is charged per tonne?\nAnswer:"
    client.completions.create(model=model_name, prompt=prompt, max_tokens=4, temperature=0)
    raw = client.completions.with_raw_response.create(model=model_name, prompt=prompt, max_tokens=4, temperature=0)
    read = raw.parse().usage.prompt_tokens - 1  # all but the last token, down to the grid
    assert int(raw.headers["x-kvgate-reused-tokens"]) == read - read % grid > 0


def test_a_blend_leaves_blocks_only_up_to_its_first_reused_document(client, model_name, loaded) -> None:
    """Blended KV is not full prefill's: a later prompt must not read it as exact."""
    docs = [
        "The night ferry leaves berth 8 at eleven and returns at dawn (blend blocks test).",
        "Pilot boats wait at berth 9; their crews change at noon (blend blocks test).",
    ]
    question = [{"role": "user", "content": "When does the night ferry leave?"}]
    client.chat.completions.create(
        model=model_name, messages=question, max_tokens=2, extra_body={"documents": [{"text": d} for d in docs]}
    )  # documents read once, in this order
    body = {"documents": [{"text": d} for d in reversed(docs)], "kvgate": {"reuse": "blend", "recompute_ratio": 0.2}}
    _, headers = chat(client, model_name, question, extra_body=body)
    assert headers["x-kvgate-reuse"].startswith("blend")
    again, _ = chat(client, model_name, question, extra_body={**body, "kvgate": {"reuse": "prefix"}})
    # Exact: the head, and the first document, which the head's blocks cut into (`<document>` opens both) and
    # which so was computed fresh. The second was placed from its own KV: computed again, not read as exact.
    blended = len(loaded.tokenizer.encode(docs[0], add_special_tokens=False))
    assert again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens - blended
