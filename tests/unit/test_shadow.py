"""runtime/shadow.py: checks run on idle capacity and on a share of a busy engine's time; a check's
full prefill starts from the previous one's KV where the prompts begin alike, and on a busy engine
its rows ride in the engine's own steps."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Generator

import pytest
import torch

from kvgate.runtime.config import EngineConfig
from kvgate.runtime.engine import Engine
from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.model import Run, forward
from kvgate.runtime.planner import Chat, Planner
from kvgate.runtime.quality import FULL, QualityConfig, QualityGate, shape_key
from kvgate.runtime.request import Output, Plan, Request
from kvgate.runtime.reuse import ReuseMode
from kvgate.runtime.sampling import SamplingParams
from kvgate.runtime.shadow import ANSWER, MAX_BUDGET_S, Job, Shadow, common
from tests.conftest import QUESTIONS
from tests.helpers.kv import new_kv
from tests.helpers.waiting import wait_until

DOCS = [
    "The lighthouse on Mirren Point was built in 1871 from granite quarried on the island itself. "
    "Its keeper, Agnes Dunmore, kept the lamp lit for forty-one years without missing a night.",
    "Mirren Point lies at the northern tip of the island of Calloway, where the ferry from Brask "
    "docks twice a day in summer and once a day in winter, weather permitting.",
]


def engine_with(loaded: LoadedModel, tmp_path, share: float) -> Engine:
    # Every blend checked, with targets a sound blend meets (the gate stays where it is); blends are the
    # subject, so no prefix blocks, and served at an operator's ratio (an uncalibrated engine's first blends are
    # the checks of its calibration: tests/server/test_calibrating.py).
    quality = QualityConfig(shadow_rate=1.0, target_kl=10.0, target_top1=0.0, shadow_share=share)
    config = EngineConfig(cache_dir=tmp_path, quality=quality, prefix_caching=False, recompute_ratio=0.15)
    return Engine(config, loaded)


def checks(engine: Engine) -> int:
    return int(dict(engine.gate.stats())["blend"]["checks"])


def busy_with_a_long_answer(engine: Engine, chat_ids) -> tuple[int, threading.Event]:
    """A request that decodes for a while (no end-of-sequence): the engine is never idle meanwhile."""
    ended = threading.Event()

    def callback(out: Output | BaseException) -> None:
        if isinstance(out, BaseException) or out.finish_reason is not None:
            ended.set()

    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    return engine.submit(Request(chat_ids(QUESTIONS[0]), params), callback), ended


def blend(engine: Engine) -> None:
    """One token of a chat over DOCS, served as a blend (its check is then due)."""
    planner = Planner(engine.reuser)
    messages = [{"role": "user", "content": "Who kept the lamp?"}]
    ids, plan = planner.chat(Chat(messages, documents=[{"text": d} for d in DOCS]))

    async def first() -> None:
        async for out in engine.generate(Request(ids, SamplingParams(max_tokens=1, temperature=0.0), plan)):
            assert not str(out.report) or out.report.mode == "blend"

    asyncio.run(first())


@pytest.mark.parametrize("share", [0.5, 0.0])
def test_a_busy_engine_checks_on_its_share_of_the_time_and_with_none_only_once_idle(
    loaded: LoadedModel, tmp_path, chat_ids, share: float
) -> None:
    engine = engine_with(loaded, tmp_path, share)
    try:
        blend(engine)  # the documents' KV stored, and read back as a blend: a check, on an idle engine
        wait_until(lambda: checks(engine) >= 1 and not engine.shadow.busy, 60, "the first check, on an idle engine")
        before = checks(engine)
        long_id, ended = busy_with_a_long_answer(engine, chat_ids)
        blend(engine)
        if share:
            wait_until(lambda: checks(engine) == before + 1, 30, "a check while the engine decodes the long answer")
            assert not ended.is_set()
            assert engine.shadow.rides >= 1  # its full prefill's rows computed in the engine's decode steps
        else:
            time.sleep(3)
            assert checks(engine) == before and engine.shadow.busy and not ended.is_set()
        engine.abort(long_id)
        wait_until(lambda: checks(engine) == before + 1, 60, "the check, once the engine is idle")
    finally:
        engine.shutdown()


def test_the_budget_is_the_share_of_busy_time_and_never_piles_up(engine: Engine) -> None:
    shadow = Shadow(engine.gate, engine.reuser, engine.spans)  # the session engine: shadow_share 0.05
    shadow.earn(2.0)
    assert shadow.budget_s == pytest.approx(0.1)
    assert not shadow.affordable  # nothing waits to be checked
    shadow.earn(3600.0)
    assert shadow.budget_s == MAX_BUDGET_S


def run(check: Generator[float | Run, torch.Tensor | None, object], model) -> tuple[float, object]:
    """Drive a check's parts to the end, computing the rows it asks for: the tokens computed, and its result."""
    tokens, computed = 0.0, None
    while True:
        try:
            part = check.send(computed)
        except StopIteration as stop:
            return tokens, stop.value
        if isinstance(part, Run):
            tokens, computed = tokens + len(part.token_ids), forward(model, [part])[0]
        else:
            tokens, computed = tokens + part, None


def test_a_check_starts_from_the_previous_checks_kv_where_the_prompts_agree(engine: Engine, chat_ids) -> None:
    shadow = Shadow(engine.gate, engine.reuser, engine.spans)
    first = chat_ids(QUESTIONS[1] + " " + QUESTIONS[2])
    second = first[:-6] + chat_ids(QUESTIONS[3])[-9:]  # the same head, another ending
    shared = common(first, second)
    assert len(first) - 6 <= shared < len(second)
    assert run(shadow.full(first), engine.model)[0] == len(first)
    computed, (_, logits) = run(shadow.full(second), engine.model)
    assert computed == len(second) - shared  # only what the second prompt does not share with the first
    whole = forward(engine.model, [Run(new_kv(engine.loaded), second, 0)])[0]
    assert torch.allclose(logits, whole, atol=1e-4)
    assert run(shadow.full(second), engine.model)[0] == 1  # the very same prompt: its last token, for the logits


def greedy(engine: Engine, ids: list[int], plan=None, tokens: int = 8) -> list[int]:
    """A greedy answer of `tokens` tokens served by the engine (as `plan` says)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    async def answer() -> list[int]:
        got: list[int] = []
        async for out in engine.generate(Request(ids, params, plan)):
            got += out.token_ids
        return got

    return asyncio.run(answer())


def test_a_check_counts_the_answers_leading_tokens_full_prefill_would_choose_too(loaded: LoadedModel, tmp_path) -> None:
    engine = engine_with(loaded, tmp_path, 0.0)
    try:
        blend(engine)  # the documents' KV stored, read back as a blend, checked
        wait_until(lambda: checks(engine) == 1 and not engine.shadow.busy, 60, "the first check")
        planner = Planner(engine.reuser)
        for text in DOCS:  # a fault no real part produces on demand: stored KV perturbed, the answer moves
            engine.reuser.store.get(engine.reuser.key(planner.tokens(text))).values.mul_(-3.0)
        messages = [{"role": "user", "content": "Who kept the lamp?"}]
        ids, plan = planner.chat(Chat(messages, documents=[{"text": d} for d in DOCS]))
        served = greedy(engine, ids, plan)
        wait_until(lambda: checks(engine) == 2 and not engine.shadow.busy, 60, "the answer's check")
        truth = greedy(engine, ids, Plan([ids], [False], ReuseMode("full")))
        assert truth != served
        assert engine.gate.ladders["blend"].answers[-1] == common(truth, served) / len(served)
    finally:
        engine.shutdown()


def test_an_answer_is_compared_token_by_token_up_to_where_the_choices_part(engine: Engine, chat_ids) -> None:
    shadow = Shadow(engine.gate, engine.reuser, engine.spans)
    ids = chat_ids(QUESTIONS[4])
    truth = greedy(engine, ids, Plan([ids], [False], ReuseMode("full")))
    for greedy_choices, share in ((truth, 1.0), (truth[:5] + [0] * 3, 5 / 8)):
        kv, logits = run(shadow.full(ids), engine.model)[1]
        job = Job(0, ids, Plan([ids], [False]), "blend", 0.15, logits, truth, greedy_choices)
        assert run(shadow.answer(kv, int(logits.argmax()), job), engine.model) == (7.0, share)


def test_a_check_compares_the_answer_once_it_is_written_or_its_sequence_ended(engine: Engine, chat_ids) -> None:
    gate = QualityGate(QualityConfig(), {"blend": 0.15})
    shadow = Shadow(gate, engine.reuser, engine.spans)
    ids = chat_ids(QUESTIONS[5])
    truth = greedy(engine, ids, Plan([ids], [False], ReuseMode("full")), tokens=ANSWER)
    for written in (ANSWER, 3):
        logits = forward(engine.model, [Run(new_kv(engine.loaded), ids, 0)])[0]
        job = Job(0, ids, Plan([ids], [False]), "blend", 0.15, logits, truth[:1], truth[:1])
        check = shadow.check(job)
        computed = None
        while isinstance(part := check.send(computed), Run):  # full prefill's parts, then it waits for the answer
            computed = forward(engine.model, [part])[0]
        assert part == 0.0
        assert next(check) == 0.0  # still waiting: one token written
        job.answer += truth[1:written]
        job.greedy += truth[1:written]
        if written < ANSWER:
            assert next(check) == 0.0
            job.over = True  # the sequence ended with what it wrote
        run(check, engine.model)
        assert gate.ladders["blend"].answers[-1] == 1.0 and len(job.greedy) == written


def test_a_check_of_withheld_reuse_that_would_reuse_nothing_records_nothing(engine: Engine, chat_ids) -> None:
    """Served at full prefill, a shape's check computes the reuse withheld; where its spans have nothing to
    reuse, that is full prefill again, and a check would vouch for a reuse it never saw."""
    gate = QualityGate(QualityConfig(shadow_rate=1.0), {"kvcomm": 0.0})
    shadow = Shadow(gate, engine.reuser, engine.spans)
    ids = chat_ids("A message no agent has written before, about basalt columns.")
    key = shape_key("kvcomm", "agent-unread")
    plan = Plan([ids[:4], ids[4:]], [False, False], ReuseMode("kvcomm"), spans=[False, True], agent="agent-unread")
    logits = forward(engine.model, [Run(new_kv(engine.loaded), ids, 0)])[0]
    assert gate.due(key)
    run(shadow.check(Job(0, ids, plan, key, FULL, logits, [], [], over=True)), engine.model)
    assert gate.ladder(key).totals.checks == 0 and not shadow.followed
    assert gate.ladder(key).asked == 0  # asked again: the shape earns its reuse from checks that compared


def test_checks_run_newest_first_and_one_of_a_rung_left_since_is_dropped_unrun(engine: Engine) -> None:
    """Under a backlog the latest served say most of where the gate stands; a check of a rung the ladder has
    left would only count in the totals, so it is dropped unrun and its budget goes to one that decides."""
    gate = QualityGate(QualityConfig(shadow_rate=1.0), {"blend": 0.15})
    shadow = Shadow(gate, engine.reuser, engine.spans)

    def job(seq: int, written: int) -> Job:
        plan = Plan([[1, 2]], [False])
        return Job(seq, [1, 2], plan, "blend", gate.probe("blend"), torch.zeros(4), [0] * written, [0] * written)

    shadow.jobs.extend([job(1, ANSWER), job(2, ANSWER), job(3, 1)])  # 3: its answer not yet written
    shadow.followed.update({j.seq: j for j in shadow.jobs})
    assert shadow.next_job().seq == 2  # the newest whose answer is written
    gate.ladder("blend").move(+1, "missed")  # the rung 1 and 3 were served at is left
    shadow.jobs.append(job(4, 1))
    shadow.followed[4] = shadow.jobs[-1]
    assert shadow.next_job().seq == 4 and not shadow.jobs  # 1 and 3 dropped unrun
    assert gate.dropped == 2 and set(shadow.followed) == {2, 4}
