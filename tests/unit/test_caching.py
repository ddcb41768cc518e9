"""runtime/caching.py's `choose` (through a prompt's PromptKV, which keeps the check it may be due): which reuse a
prompt gets. A ratio asked is run as asked; a ratio
left to the server is the gate's rung or the stored calibration's, whichever recomputes more, and is
priced at that ratio against full prefill (a blend) or against the prompt after its exact prefix
(spans); other modes are never priced."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kvgate.runtime.blend import OVERHEAD
from kvgate.runtime.calibration import Calibration, model_fingerprint, path, save
from kvgate.runtime.config import EngineConfig
from kvgate.runtime.engine import Engine
from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.model import Run, forward
from kvgate.runtime.request import Plan
from kvgate.runtime.reuse import ReuseMode
from kvgate.runtime.sampling import SamplingParams
from kvgate.runtime.sequence import Sequence

MEETS, MISSES = {"kl": 0.01, "top1": 0.99}, {"kl": 0.5, "top1": 0.5}
# One document meets the target at the base 15%, two need 30%, three 80% (a blend of short documents
# then costs more than full prefill, at 15% much less), four never meet it.
TABLE = {
    "1": {"0.15": MEETS},
    "2": {"0.15": MISSES, "0.3": MEETS},
    "3": {"0.15": MISSES, "0.8": MEETS},
    "4": {"0.15": MISSES, "0.5": MISSES},
}
CALIBRATION = Calibration(ratio=0.15, deviation_limit=1e9, target=0.95, metric="top1", items=8, curve={}, table=TABLE)


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    cache_dir = tmp_path_factory.mktemp("caching")
    save(CALIBRATION, path(Path(cache_dir), model_fingerprint(loaded)))
    engine = Engine(EngineConfig(cache_dir=cache_dir, blend_select="deviation"), loaded)
    yield engine
    engine.shutdown()


def chosen(engine: Engine, plan: Plan, in_context: frozenset[str] = frozenset()) -> tuple[ReuseMode, str]:
    """`in_context`: the keys of documents new to the cache that the prompt's full prefill would keep."""
    ids = [t for piece in plan.pieces for t in piece]
    seq = Sequence(ids, SamplingParams(), engine.reuser.new_kv(), frozenset(), 100, plan=plan)
    seq.prompt.in_context = set(in_context)  # as `lacking` finds them
    return seq.prompt.choose(engine.caches, plan)


def documents(count: int, tokens: int = 20) -> Plan:
    """`count` documents of `tokens` tokens, then a question: a blend the cost model finds cheaper."""
    pieces = [[7] * tokens for _ in range(count)] + [[9] * 8]
    return Plan(pieces, [True] * count + [False])


def test_the_calibrated_ratio_for_as_many_documents_is_served_over_the_gates_rung(engine: Engine) -> None:
    assert engine.caches.calibration is not None and engine.gate.base("blend") == 0.15
    assert chosen(engine, documents(2)) == (ReuseMode("blend", 0.3), "")
    assert chosen(engine, documents(1, tokens=60)) == (ReuseMode("blend"), "")  # the base ratio: none named


def test_where_no_calibrated_ratio_meets_the_target_the_prompt_is_prefilled_in_full(engine: Engine) -> None:
    reuse, why = chosen(engine, documents(4))
    assert reuse == ReuseMode("full") and why.startswith("no calibrated recompute ratio meets the fidelity target")
    assert "for 4 documents" in why


def test_the_calibration_is_of_blends_kvcomm_spans_keep_their_own_rung(engine: Engine) -> None:
    spans = Plan([[5] * 20, [6] * 20], [False, False], ReuseMode("kvcomm"), spans=[False, True])
    assert chosen(engine, spans) == (ReuseMode("kvcomm"), "")


def test_a_blend_is_priced_at_the_ratio_it_would_run_at(engine: Engine) -> None:
    reuse, why = chosen(engine, documents(3))
    tokens = 3 * 20 + 8  # a blend's work: all of them up to the check layer, 80% of the reused above it
    work = (tokens * 2 + (8 + 0.8 * 60) * 28) / 30 + OVERHEAD
    assert (
        reuse == ReuseMode("full")
        and why == f"reuse would be slower than full prefill here (cost model: {work:.0f} vs {tokens} tokens)"
    )


def spans(engine: Engine, before: int, span: int) -> Plan:
    """`before` tokens, then a span of `span` tokens whose source this engine holds, then a cue."""
    ids = [6] * span
    kv = engine.reuser.new_kv()
    forward(engine.model, [Run(kv, ids, 0)])
    engine.spans.store(kv, 0, ids, "", "said::solver")
    return Plan([[5] * before, ids, [8] * 2], [False, False, False], ReuseMode("kvcomm"), spans=[False, True, False])


def test_span_reuse_is_priced_against_computing_the_prompt_after_its_exact_prefix(engine: Engine) -> None:
    layers = engine.reuser.kv_shape[0]
    reuse, why = chosen(engine, spans(engine, 56, 4))
    tokens = 56 + 4 + 2  # KVCOMM at ratio 0: the reused rows skip every layer but the first
    work = (tokens + (tokens - 4) * (layers - 1)) / layers + OVERHEAD
    assert reuse == ReuseMode("full") and why == (
        "span reuse (KVCOMM) would be slower than computing the prompt after its exact prefix here "
        f"(cost model: {work:.0f} vs {tokens} tokens)"
    )
    assert chosen(engine, spans(engine, 8, 80)) == (ReuseMode("kvcomm"), "")  # most of the prompt: it pays


def test_a_ratio_asked_is_run_as_asked_even_where_the_cost_model_says_it_is_slower(engine: Engine) -> None:
    asked = replace(documents(3), reuse=ReuseMode("blend", 0.8))
    assert chosen(engine, asked) == (ReuseMode("blend", 0.8), "")


def test_only_reuse_left_to_the_server_is_priced(engine: Engine) -> None:
    # A prefix reuse of a prompt too short for any blend to pay: reused as asked, never priced.
    tiny = Plan([[5] * 4, [6] * 2], [True, False], ReuseMode("prefix"))
    assert chosen(engine, tiny) == (ReuseMode("prefix"), "")
    assert chosen(engine, replace(tiny, reuse=ReuseMode("blend")))[0] == ReuseMode("full")


def test_new_documents_of_a_tenants_prompt_are_prefilled_in_full_and_say_so(engine: Engine) -> None:
    plan = replace(documents(2), scope="tenant-a")
    why = "documents new to the cache: prefilled in full, their KV kept as computed here"
    assert chosen(engine, plan, frozenset({"a document's key"})) == (ReuseMode("full"), why)
