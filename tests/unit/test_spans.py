"""Spans shared across agents (KVCOMM) on the real model: sources, anchors, the gate, the modes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvgate.agents.anchors import AnchorConfig, AnchorPool
from kvgate.bench.multiagent import messages, write
from kvgate.chunk_cache import ChunkStore, fingerprint
from kvgate.runtime.blend import BlendConfig
from kvgate.runtime.documents import message_pieces
from kvgate.runtime.errors import TemplateError
from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.model import Run, forward
from kvgate.runtime.reuse import Reuser
from kvgate.runtime.spans import Shared, Span, Spans, local

SOLVER = "You are a careful math tutor. Solve the problem step by step."
CHECKER = "You are a strict reviewer. Check the solution above and give the final number."
QUESTION = "A quilt takes 2 rolls of red cloth and half that much grey cloth. How many rolls in total does it take?"
OTHER = "Mira buys a boat for $9,000 and spends $4,000 mending it. How much did the boat cost her in all?"
UNRELATED = "Lorem ipsum: 0xDEADBEEF; ¿Dónde está la biblioteca? 東京は日本の首都です。🙂🙂 #!/usr/bin/env zsh"


@pytest.fixture
def spans(loaded: LoadedModel) -> Spans:
    reuser = Reuser(loaded.model, loaded.tokenizer, ChunkStore.from_config(), fingerprint("test"), BlendConfig())
    return Spans(reuser, AnchorPool(AnchorConfig()))


def prompt(spans: Spans, system: str, *contents: str, cue: bool = False) -> tuple[list[list[int]], list[bool]]:
    """[system][user: the first content][assistant: each other content], then the agent's cue."""
    roles = ["user", *["assistant"] * (len(contents) - 1)]
    messages = [{"role": "system", "content": system}]
    messages += [{"role": r, "content": c} for r, c in zip(roles, contents)]
    if cue:
        messages.append({"role": "user", "content": "Your turn: is the answer above right?"})
    return message_pieces(spans.reuser.tokenizer, messages)


def run(spans: Spans, pieces, kinds, mode: str, agent: str, ratio: float = 0.0):
    """The prompt's KV and last logits under `mode`, its lessons learnt as the engine does."""
    kv = spans.reuser.new_kv()
    shared = spans.prefill(kv, pieces, kinds, mode, agent, "", ratio)
    logits = shared.prefilled.logits
    if logits is None:
        ids = [t for p in pieces for t in p]
        logits = forward(spans.reuser.model, [Run(kv, ids[len(kv) :], len(kv))])[0]
    spans.settle(kv, shared, agent, "")
    return kv, logits, shared


def question(spans: Spans, shared: Shared, text: str = QUESTION) -> Span:
    ids = spans.reuser.tokenizer.encode(text, add_special_tokens=False)
    return next(s for s in shared.spans if s.token_ids == ids)


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    p, q = p.log_softmax(-1), q.log_softmax(-1)
    return float((p.exp() * (p - q)).sum())


def test_message_pieces_cut_at_every_content_and_join_to_the_prompt(spans: Spans) -> None:
    pieces, kinds = prompt(spans, SOLVER, QUESTION, "It takes 3 rolls.")
    tok = spans.reuser.tokenizer
    assert kinds.count(True) == 3
    contents = [tok.decode(p) for p, k in zip(pieces, kinds) if k]
    assert contents == [SOLVER, QUESTION, "It takes 3 rolls."]
    assert tok.decode([t for p in pieces for t in p]).startswith("<|im_start|>system\n" + SOLVER)


def test_a_template_that_trims_contents_gets_no_pieces(spans: Spans) -> None:
    """Llama 3's template trims each content: the markers hide that, the joined pieces do not."""
    tok = spans.reuser.tokenizer
    template = tok.chat_template
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}\n{% endfor %}"
    try:
        message_pieces(tok, [{"role": "user", "content": "plain"}])  # nothing to trim: fine
        with pytest.raises(TemplateError):
            message_pieces(tok, [{"role": "user", "content": " padded "}])
    finally:
        tok.chat_template = template


def test_a_span_is_stored_where_first_computed_under_its_slot_and_tenant(spans: Spans) -> None:
    pieces, kinds = prompt(spans, SOLVER, QUESTION)
    run(spans, pieces, kinds, "full", "solver")
    ids = spans.reuser.tokenizer.encode(QUESTION, add_special_tokens=False)
    found = spans.source(ids, "")
    assert found is not None and found[1] == "said::solver"
    assert spans.source(ids, "another tenant") is None


def test_offsets_from_the_same_content_under_the_same_prefix_reproduce_dense_kv(spans: Spans) -> None:
    run(spans, *prompt(spans, SOLVER, QUESTION), "full", "solver")
    checker = prompt(spans, CHECKER, QUESTION)
    dense_kv, dense, first = run(spans, *checker, "kvcomm", "checker")
    # No anchor yet: the question is computed densely (so is everything), and becomes an anchor.
    assert first.gated == 1 and first.prefilled.logits is None
    assert first.prefilled.note.startswith("kvcomm: 1 of 1 spans had no close anchor")
    assert len(spans.offsets) == 1

    kv, logits, again = run(spans, *checker, "kvcomm", "checker")
    span = question(spans, again)
    system = again.spans[0]  # exact: its source was computed after the same tokens (the first checker's)
    assert not span.dense and not span.exact and system.exact and again.prefilled.mode == "kvcomm"
    assert again.prefilled.reused == len(span.token_ids) + len(system.token_ids)
    n = len(span.token_ids)
    for got, want in zip(
        local(spans.reuser.model, kv, span.start, n), local(spans.reuser.model, dense_kv, span.start, n)
    ):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    assert kl(dense, logits) < 1e-6
    # Naive reuse of the same source, without the offset, moves the answer.
    _, naive, _ = run(spans, *checker, "naive", "checker")
    assert kl(dense, naive) > 100 * kl(dense, logits)


def test_a_span_read_twice_in_one_prompt_gets_an_offset_for_each_place(spans: Spans) -> None:
    """Two agents wrote the same answer: the reader reads one source twice, in two contexts."""
    answer = "It takes 2 + 1 = 3 rolls."
    run(spans, *prompt(spans, SOLVER, QUESTION, answer), "full", "solver")
    checker = prompt(spans, CHECKER, QUESTION, answer, answer)
    dense_kv, dense, first = run(spans, *checker, "kvcomm", "checker")
    assert first.gated == 3
    kv, logits, again = run(spans, *checker, "kvcomm", "checker")
    ids = spans.reuser.tokenizer.encode(answer, add_special_tokens=False)
    twice = [s for s in again.spans if s.token_ids == ids]
    assert [s.reader for s in twice] == ["checker", "checker#2"] and not any(s.dense for s in twice)
    for s in twice:
        for got, want in zip(
            local(spans.reuser.model, kv, s.start, len(ids)), local(spans.reuser.model, dense_kv, s.start, len(ids))
        ):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    assert kl(dense, logits) < 1e-6


def test_a_span_after_the_same_tokens_as_its_source_is_reused_as_it_is(spans: Spans) -> None:
    """Another task of the same agent: a new program, so no context of its own to resume, but its
    system prompt's source was computed after the very same template tokens."""
    run(spans, *prompt(spans, CHECKER, QUESTION), "full", "checker")
    pieces, kinds = prompt(spans, CHECKER, OTHER)
    dense = forward(spans.reuser.model, [Run(spans.reuser.new_kv(), [t for p in pieces for t in p], 0)])[0]
    _, logits, shared = run(spans, pieces, kinds, "kvcomm", "checker")
    system = shared.spans[0]
    assert system.exact and not system.dense and shared.gated == 0
    assert shared.prefilled.reused == len(system.token_ids) and kl(dense, logits) < 1e-6


def test_a_prompt_that_ends_in_a_span_computes_it_for_the_first_token(spans: Spans) -> None:
    run(spans, *prompt(spans, SOLVER, QUESTION), "full", "solver")
    pieces, kinds = prompt(spans, CHECKER, QUESTION)
    end = max(i for i, k in enumerate(kinds) if k) + 1  # cut after the question: the prompt ends in it
    pieces, kinds = pieces[:end], kinds[:end]
    dense = forward(spans.reuser.model, [Run(spans.reuser.new_kv(), [t for p in pieces for t in p], 0)])[0]
    _, logits, shared = run(spans, pieces, kinds, "naive", "checker")
    assert question(spans, shared).dense and kl(dense, logits) < 1e-6


def test_a_similar_span_passes_the_gate_an_unrelated_one_adds_an_anchor(spans: Spans) -> None:
    for text in (QUESTION, OTHER, UNRELATED):
        run(spans, *prompt(spans, SOLVER, text), "full", "solver")
    run(spans, *prompt(spans, CHECKER, QUESTION), "kvcomm", "checker")  # the question's anchor

    _, _, similar = run(spans, *prompt(spans, CHECKER, OTHER), "kvcomm", "checker")
    assert not question(spans, similar, OTHER).dense and similar.prefilled.reused >= len(
        question(spans, similar, OTHER).token_ids
    )
    before = len(spans.offsets)
    _, _, unrelated = run(spans, *prompt(spans, CHECKER, UNRELATED), "kvcomm", "checker")
    assert question(spans, unrelated, UNRELATED).dense
    assert len(spans.offsets) == before + 1


def test_in_a_pipeline_kvcomm_moves_the_answer_less_than_naive_reuse_and_blend(spans: Spans, gsm8k: Path) -> None:
    """The benchmark's pipeline, two agents: a checker reads each GSM8K-like question (tests/helpers/corpus.py),
    the solver's greedy answer and its own cue. From the third question on, those spans come from the
    solver's context (or its own, under other messages) with offsets learnt on the first two."""
    with gsm8k.open() as f:
        questions = [json.loads(line)["question"] for _, line in zip(range(5), f)]
    model, eos = spans.reuser.model, frozenset({spans.reuser.tokenizer.eos_token_id})
    moved: dict[str, list[float]] = {"naive": [], "blend": [], "kvcomm": []}
    for i, question in enumerate(questions):
        pieces, kinds = message_pieces(spans.reuser.tokenizer, messages(question, [], 0))
        kv, first, _ = run(spans, pieces, kinds, "full", "solver")
        n = len(kv)
        answer = write(spans.reuser, kv, first, eos, 16)
        ids = spans.reuser.tokenizer.encode(answer, add_special_tokens=False)
        kv.truncate(n)
        forward(model, [Run(kv, ids, n)])
        spans.wrote(kv, n, ids, answer, "solver", "")
        checker = message_pieces(spans.reuser.tokenizer, messages(question, [answer], 1))
        dense = forward(model, [Run(spans.reuser.new_kv(), [t for p in checker[0] for t in p], 0)])[0]
        for mode in moved:
            _, logits, _ = run(spans, *checker, mode, "checker", ratio=0.15 if mode == "blend" else 0.0)
            if i >= 2:
                moved[mode].append(kl(dense, logits))
    mean = {mode: sum(v) / len(v) for mode, v in moved.items()}
    # Measured with 16-token answers: kvcomm 0.026, blend 0.053, naive 0.083 (with 32: 0.032, 0.123, 0.168).
    assert mean["kvcomm"] < mean["blend"] and mean["kvcomm"] < mean["naive"], mean


def test_an_answer_becomes_a_span_written_by_its_agent(spans: Spans) -> None:
    pieces, kinds = prompt(spans, SOLVER, QUESTION)
    kv, logits, _ = run(spans, pieces, kinds, "full", "solver")
    text = "It takes 2 + 1 = 3 rolls."
    ids = spans.reuser.tokenizer.encode(text, add_special_tokens=False)
    prompt_len = len(kv)
    forward(spans.reuser.model, [Run(kv, ids[:-1], prompt_len)])  # as decoding leaves it: the last token unfed
    spans.wrote(kv, prompt_len, ids + [2], text, "solver", "")
    found = spans.source(ids, "")
    assert found is not None and found[1] == "wrote::solver"
    # Its KV is the answer's KV in the solver's context.
    whole = spans.reuser.new_kv()
    forward(spans.reuser.model, [Run(whole, [t for p in pieces for t in p] + ids, 0)])
    want = local(spans.reuser.model, whole, prompt_len, len(ids))[1]
    torch.testing.assert_close(found[0].values, want, atol=1e-4, rtol=0)  # one batch against token by token


def test_without_sources_a_span_prefill_is_dense(spans: Spans) -> None:
    kv = spans.reuser.new_kv()
    shared: Shared = spans.prefill(kv, *prompt(spans, SOLVER, QUESTION), "kvcomm", "solver", "", 0.1)
    assert shared.prefilled.logits is None and len(kv) == 0 and shared.gated == 0
