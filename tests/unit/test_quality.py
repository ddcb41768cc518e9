"""runtime/quality.py and runtime/shadow.py: the gate's ladder, and shadow checks on a real engine
that close it when the stored KV is perturbed and open it again once the KV is sound."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from kvgate.bench.gate import ask as ask_engine
from kvgate.runtime.config import EngineConfig
from kvgate.runtime.engine import Engine
from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.planner import Planner
from kvgate.runtime.quality import FULL, QualityConfig, QualityGate, shape_key
from kvgate.runtime.request import Plan, Request, Result
from kvgate.runtime.reuse import ReuseMode
from kvgate.runtime.sampling import SamplingParams
from kvgate.runtime.sequence import Sequence
from kvgate.runtime.shadow import compare

CONFIG = QualityConfig(shadow_rate=1.0, window=4, min_checks=2, ratios=(0.5,))
GOOD, BAD = (0.001, True), (0.4, False)
MEH = (0.08, True)  # over the KL target, but one more perfect check would bring the mean under it


def earned(gate: QualityGate, key: str) -> None:
    """A new shape is withheld until its checks (of the reuse it withholds) keep answers: min_checks of them."""
    for _ in range(gate.config.min_checks):
        gate.record(key, gate.probe(key), *GOOD, 1.0)
    assert gate.serve(key) == (gate.base(key), "")


def test_a_mode_climbs_one_rung_per_min_checks_missed_and_names_why() -> None:
    gate = QualityGate(CONFIG, {"blend": 0.15})
    assert gate.serve("blend") == (0.15, "")
    gate.record("blend", 0.15, *MEH)
    assert gate.serve("blend")[0] == 0.15  # one check is not enough while the next could still make up for it
    gate.record("blend", 0.15, *MEH)
    ratio, why = gate.serve("blend")
    assert ratio == 0.5 and "quality gate" in why and "KL 0.080" in why and "raised to 50%" in why
    for _ in range(2):
        gate.record("blend", 0.5, *MEH)
    ratio, why = gate.serve("blend")
    assert ratio == FULL and "withheld" in why


def test_a_rung_climbs_before_min_checks_once_no_perfect_check_could_save_it() -> None:
    config = replace(CONFIG, min_checks=4)
    gate = QualityGate(config, {"blend": 0.15, "kvcomm": 0.0})
    gate.record("blend", 0.15, *BAD)  # KL 0.4 over 4 checks is 0.1 at best: over 0.05
    ratio, why = gate.serve("blend")
    assert ratio == 0.5 and "over the last 1 shadow checks" in why
    gate.record("blend", 0.5, 0.0, False)  # top-1 3 of 4 at best: under 95%
    assert gate.serve("blend")[0] == FULL
    shape = shape_key("kvcomm", "critic")
    earned(gate, shape)
    gate.record(shape, 0.0, *GOOD, 0.7)  # (0.7 + 3) / 4 = 0.925: could still meet 0.9
    assert gate.serve(shape)[0] == 0.0
    gate.record(shape, 0.0, *GOOD, 0.5)  # (1.2 + 2) / 4 = 0.8: cannot
    assert gate.serve(shape)[0] == FULL


def test_at_full_prefill_checks_probe_the_rung_below_and_reopen_it() -> None:
    gate = QualityGate(CONFIG, {"blend": 0.15})
    for ratio in (0.15, 0.15, 0.5, 0.5):
        gate.record("blend", ratio, *BAD)
    assert gate.serve("blend")[0] == FULL and gate.probe("blend") == 0.5
    for _ in range(CONFIG.window - 1):
        gate.record("blend", 0.5, *GOOD)
    assert gate.serve("blend")[0] == FULL  # a whole window first
    gate.record("blend", 0.5, *GOOD)
    assert gate.serve("blend")[0] == 0.5
    for _ in range(CONFIG.window):
        gate.record("blend", 0.5, *GOOD)
    assert gate.serve("blend") == (0.15, "")


def test_a_check_of_a_rung_left_meanwhile_only_counts_in_the_totals() -> None:
    gate = QualityGate(CONFIG, {"blend": 0.15})
    gate.record("blend", 0.15, *BAD)
    gate.record("blend", 0.15, *BAD)  # climbs to 50%
    gate.record("blend", 0.15, *BAD)  # taken at 15%, landed after the climb
    stats = dict(gate.stats())["blend"]
    assert stats["checks"] == 3 and stats["ratio"] == 0.5
    assert torch.isnan(torch.tensor(stats["window_kl"]))


def test_top1_alone_can_close_the_gate() -> None:
    gate = QualityGate(CONFIG, {"blend": 0.15})
    gate.record("blend", 0.15, 0.0, False)
    gate.record("blend", 0.15, 0.0, True)
    assert gate.serve("blend")[0] == 0.5  # 50% agreement is under 95%, whatever the KL


def test_the_shadow_rate_checks_evenly_and_zero_never() -> None:
    gate = QualityGate(QualityConfig(shadow_rate=0.25), {"blend": 0.15})
    assert [gate.due() for _ in range(8)] == [False, False, False, True] * 2
    assert not any(QualityGate(QualityConfig(), {"blend": 0.15}).due() for _ in range(100))


def test_a_shapes_rung_checked_fewer_than_min_checks_times_is_checked_on_every_request() -> None:
    gate = QualityGate(QualityConfig(shadow_rate=0.25, min_checks=2, window=4), {"blend": 0.15})
    shape = shape_key("blend", "agent-critic")
    assert [gate.due(shape) for _ in range(6)] == [True, True, False, False, False, True]
    earned(gate, shape)  # comes down to its reuse: the new rung is unknown, so checked at once again
    assert [gate.due(shape) for _ in range(3)] == [True, True, False]
    fresh = QualityGate(QualityConfig(shadow_rate=0.25, min_checks=2, window=4), {"blend": 0.15})
    assert [fresh.due("blend") for _ in range(4)] == [False, False, False, True]  # the mode's own: the rate alone
    assert not any(QualityGate(QualityConfig(), {"blend": 0.15}).due(shape) for _ in range(100))


def test_a_check_that_came_to_nothing_is_asked_again_while_its_rung_stands() -> None:
    gate = QualityGate(QualityConfig(shadow_rate=0.25, min_checks=2, window=4), {"kvcomm": 0.0})
    shape = shape_key("kvcomm", "reviewer")
    assert gate.due(shape) and gate.due(shape)
    gate.void(shape, gate.probe(shape))  # dropped, or its prompt had nothing to reuse
    assert gate.due(shape)  # the shape is still learning: checked again
    assert not gate.due(shape)
    gate.void(shape, 0.5)  # a check of a rung the ladder does not probe gives nothing back
    assert not gate.due(shape)


def test_a_new_shape_is_withheld_until_its_checks_keep_answers_where_checks_run() -> None:
    gate = QualityGate(CONFIG, {"kvcomm": 0.0})
    shape = shape_key("kvcomm", "reviewer")
    ratio, why = gate.serve(shape)
    assert ratio == FULL and "a new agent's reuse, served once 2 shadow checks meet the targets" in why
    assert gate.probe(shape) == 0.0  # its checks compute the reuse it withholds
    gate.record(shape, 0.0, *GOOD, 0.5)
    gate.record(shape, 0.0, *GOOD, 1.0)
    assert gate.serve(shape)[0] == FULL  # answers 0.75: not earned
    for _ in range(CONFIG.window):  # the latest checks, up to a window, decide
        gate.record(shape, 0.0, *GOOD, 1.0)
    assert gate.serve(shape) == (0.0, "")
    unchecked = QualityGate(replace(CONFIG, shadow_rate=0.0), {"kvcomm": 0.0})
    assert unchecked.serve(shape) == (0.0, "")  # no checks: nothing could earn it, so reuse is served


def test_kvcomm_shapes_climb_apart_and_say_so() -> None:
    gate = QualityGate(CONFIG, {"blend": 0.15, "kvcomm": 0.0})
    bad, good = shape_key("kvcomm", "reviewer-reads-support"), shape_key("kvcomm", "critic-reads-solver")
    earned(gate, bad)
    earned(gate, good)
    for _ in range(2):
        gate.record(bad, 0.0, *BAD)
    gate.record(bad, 0.0, *BAD)  # landed after the climb: the totals only
    gate.record(bad, 0.0, *GOOD)  # at full prefill a check probes the rung below
    ratio, why = gate.serve(bad)
    assert ratio == FULL and "quality gate (this agent)" in why and "withheld" in why
    assert gate.serve(good) == (0.0, "") and gate.serve("blend") == (0.15, "")
    kvcomm = dict(gate.stats())["kvcomm"]
    assert kvcomm["ladders"] == 3 and kvcomm["withheld"] == 1 and kvcomm["checks"] == 8 and kvcomm["ratio"] == FULL


def test_a_shape_is_also_held_to_its_answers_the_modes_own_ladder_is_not() -> None:
    gate = QualityGate(CONFIG, {"blend": 0.15, "kvcomm": 0.0})
    shape = shape_key("kvcomm", "reviewer-reads-support")
    earned(gate, shape)
    for key in (shape, "blend"):  # first tokens as full prefill's, answers apart after a few tokens
        gate.record(key, gate.probe(key), *GOOD, 0.95)
        gate.record(key, gate.probe(key), *GOOD, 0.65)
    ratio, why = gate.serve(shape)
    assert ratio == FULL and "answers 0.80" in why and "answers >= 0.90" in why
    assert gate.serve("blend") == (0.15, "")
    for _ in range(CONFIG.window):  # answers as full prefill's again: the shape's reuse comes back
        gate.record(shape, 0.0, *GOOD, 1.0)
    assert gate.serve(shape) == (0.0, "")
    other = shape_key("kvcomm", "critic-reads-solver")
    earned(gate, other)
    for _ in range(2):  # answers that part at once: a mean of 0.0 misses too
        gate.record(other, 0.0, *GOOD, 0.0)
    assert gate.serve(other)[0] == FULL


def test_shapes_are_bounded_the_least_recently_served_goes() -> None:
    gate = QualityGate(replace(CONFIG, shapes=2), {"kvcomm": 0.0})
    for shape in ("a", "b", "a", "c"):
        gate.serve(shape_key("kvcomm", shape))
    assert list(gate.shapes) == ["kvcomm/a", "kvcomm/c"]
    assert dict(gate.stats())["kvcomm"]["ladders"] == 3  # the mode's own, and two shapes


def test_bad_configs_are_refused() -> None:
    for bad in ({"shadow_rate": 1.5}, {"window": 2, "min_checks": 3}, {"ratios": (1.0,)}, {"shapes": 0}):
        with pytest.raises(ValueError):
            QualityConfig(**bad)


def test_compare_is_zero_for_the_same_distribution() -> None:
    logits = torch.randn(50)
    assert compare(logits, logits) == (pytest.approx(0.0, abs=1e-6), True)
    kl, agree = compare(logits, -logits)
    assert kl > 0.1 and not agree


# ---- on a real engine ------------------------------------------------------------------------

DOCS = [
    "The lighthouse on Mirren Point was built in 1871 from granite quarried on the island itself. "
    "Its keeper, Agnes Dunmore, kept the lamp lit for forty-one years without missing a night.",
    "Mirren Point lies at the northern tip of the island of Calloway, where the ferry from Brask "
    "docks twice a day in summer and once a day in winter, weather permitting.",
]


@pytest.fixture(scope="module")
def gated(loaded: LoadedModel, tmp_path_factory: pytest.TempPathFactory):
    # Targets a sound blend of two short documents meets, and a perturbed one cannot.
    quality = QualityConfig(shadow_rate=1.0, target_kl=0.2, target_top1=0.9, window=4, min_checks=2, ratios=(0.5,))
    # Blends are the subject: no prefix blocks, which would read a repeated head and documents exactly. The
    # ladder of an operator's ratio (15%): an uncalibrated one opens only where its checks do (test_calibrating.py).
    cache_dir = tmp_path_factory.mktemp("quality")
    config = EngineConfig(cache_dir=cache_dir, quality=quality, prefix_caching=False, recompute_ratio=0.15)
    engine = Engine(config, loaded)
    yield engine, Planner(engine.reuser)
    engine.shutdown()


def ask(engine: Engine, planner: Planner, question: str, docs: list[str] = DOCS, scope: str = "") -> Result:
    """A chat over `docs` through the engine, once its shadow check (if any) is done."""
    return ask_engine(engine, planner, question, docs, scope, wait_s=60)


def test_perturbed_document_kv_closes_the_gate_and_sound_kv_reopens_it(gated) -> None:
    engine, planner = gated
    questions = [f"Question {i}: who kept the lamp on Mirren Point?" for i in range(40)]
    first = ask(engine, planner, questions[0])
    assert first.report.mode == "blend" and "quality gate" not in str(first.report)
    assert dict(engine.gate.stats())["blend"]["checks"] == 1

    # A fault no real part produces on demand: stored document KV perturbed in place.
    entries = [engine.reuser.store.get(engine.reuser.key(planner.tokens(d))) for d in DOCS]
    saved = [(e.keys.clone(), e.values.clone()) for e in entries]
    for e in entries:
        e.values.mul_(-3.0)
    served = [ask(engine, planner, q) for q in questions[1:9]]
    assert served[-1].report.mode == "full" and "quality gate" in str(served[-1].report)
    assert served[-1].report.reused == 0
    assert dict(engine.gate.stats())["blend"]["ratio"] == FULL

    for e, (k, v) in zip(entries, saved):
        e.keys.copy_(k)
        e.values.copy_(v)
    served = []
    for q in questions[9:40]:  # until the gate lets a blend read the documents' KV again
        served.append(ask(engine, planner, q))
        if "quality gate" not in str(served[-1].report) and served[-1].report.reused > 0:
            break
    reopened = next(i for i, r in enumerate(served) if "quality gate" not in str(r.report))
    assert reopened <= 2 * CONFIG.window
    assert served[-1].report.mode == "blend" and served[-1].report.reused > 0


def test_a_blend_slower_than_full_prefill_is_not_run_and_says_why(gated) -> None:
    engine, planner = gated
    result = ask(engine, planner, "Hi?", ["Tiny."])
    assert result.report.mode == "full" and "slower than full prefill" in str(result.report)
    assert result.report.reused == 0


def test_kvcomm_spans_climb_the_ladder_of_their_reader(gated) -> None:
    engine, _ = gated
    plan = Plan([[1, 2], [3, 4]], [False, False], ReuseMode("kvcomm"), spans=[False, True], agent="agent-reviewer")
    seq = Sequence([1, 2, 3, 4], SamplingParams(), engine.reuser.new_kv(), frozenset(), 100, plan=plan)
    key = engine.caches.ladder(plan, "kvcomm", program=False)
    reuse, why = seq.prompt.choose(engine.caches, plan)  # a new reader: its spans' reuse checked before it is served
    assert reuse == ReuseMode("full") and "a new agent's reuse" in why and seq.prompt.gated == (key, FULL)
    earned(engine.gate, key)
    assert seq.prompt.choose(engine.caches, plan) == (ReuseMode("kvcomm"), "") and seq.prompt.gated == (key, 0.0)
    blend = dict(engine.gate.stats())["blend"]["ratio"]
    for _ in range(2):
        engine.gate.record(key, 0.0, 0.5, False)
    reuse, why = seq.prompt.choose(engine.caches, plan)  # a shape's rungs: its reuse, or the prompt after its head
    assert reuse == ReuseMode("full") and "quality gate (this agent)" in why and seq.prompt.gated == (key, FULL)
    assert dict(engine.gate.stats())["blend"]["ratio"] == blend  # one mode's checks never move another
    asked = Plan(plan.pieces, plan.documents, ReuseMode("kvcomm", 0.0), spans=plan.spans, agent=plan.agent)
    assert seq.prompt.choose(engine.caches, asked) == (ReuseMode("kvcomm", 0.0), "")  # a ratio asked is not gated

    # Another reader of the same span climbs its own ladder.
    other = Plan(plan.pieces, plan.documents, ReuseMode("kvcomm"), spans=plan.spans, agent="agent-critic")
    earned(engine.gate, engine.caches.ladder(other, "kvcomm", program=False))
    assert seq.prompt.choose(engine.caches, other) == (ReuseMode("kvcomm"), "")


def test_a_span_prefill_that_reused_no_span_is_not_checked(gated) -> None:
    """No source held (or no anchor close enough): the prompt was computed densely, and a check would
    compare full prefill with itself, vouching for a shape that reused nothing."""
    engine, _ = gated
    ids = engine.reuser.tokenizer.encode("A message no agent has read before, about granite.")
    plan = Plan([ids[:3], ids[3:]], [False, False], ReuseMode("kvcomm"), spans=[False, True], agent="agent-new")
    due = engine.gate.due_count

    async def first() -> None:
        async for _ in engine.generate(Request(ids, SamplingParams(max_tokens=1, temperature=0), plan)):
            pass

    asyncio.run(first())
    assert engine.gate.due_count == due and not engine.shadow.busy


def test_chunks_found_in_a_programs_prompt_climb_the_ladder_of_its_reader(gated) -> None:
    engine, _ = gated
    chunks = Plan([[1, 2], [3, 4]], [False, True], ReuseMode("blend"), agent="agent-critic")
    assert engine.caches.ladder(chunks, "blend", program=False) == "blend"  # a plain prompt: the server's blend
    assert engine.caches.ladder(chunks, "blend", program=True) == shape_key("blend", "agent-critic")  # a turn's
