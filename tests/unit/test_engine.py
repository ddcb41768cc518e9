"""runtime/engine.py: continuous batching, stop conditions, seeds, aborts."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvgate.runtime.config import EngineConfig
from kvgate.runtime.engine import Engine
from kvgate.runtime.errors import PromptTooLong
from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.request import Request
from kvgate.runtime.sampling import SamplingParams
from tests.conftest import QUESTIONS
from tests.helpers.waiting import wait_until

GREEDY = SamplingParams(max_tokens=12, temperature=0)  # 12 tokens show what 24 would, in half the steps


def test_concurrent_requests_equal_their_serial_runs(engine: Engine, chat_ids) -> None:
    prompts = [chat_ids(q) for q in QUESTIONS]
    serial = [engine.generate_sync(ids, GREEDY) for ids in prompts]
    steps_before = engine.steps
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda ids: engine.generate_sync(ids, GREEDY), prompts))
    assert [r.token_ids for r in together] == [r.token_ids for r in serial]
    assert [r.text for r in together] == [r.text for r in serial]
    # Batched: far fewer steps than the tokens generated (a serial engine needs one step per token).
    assert engine.steps - steps_before < sum(len(r.token_ids) for r in together) / 2


def test_request_joins_a_running_batch(engine: Engine, chat_ids) -> None:
    long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    first = ThreadPoolExecutor(1).submit(engine.generate_sync, chat_ids(QUESTIONS[0]), long)
    wait_until(lambda: engine.load_stats["running"], 30, "the first request never ran", every_s=0.01)
    second = engine.generate_sync(chat_ids(QUESTIONS[1]), GREEDY)
    assert not first.done()  # the second finished while the first was still decoding
    assert second.token_ids == engine.generate_sync(chat_ids(QUESTIONS[1]), GREEDY).token_ids
    assert len(first.result().token_ids) == 60


def test_chunked_prefill_gives_the_same_answer(loaded: LoadedModel, engine: Engine, chat_ids) -> None:
    small = Engine(EngineConfig(max_num_batched_tokens=16, max_num_seqs=4), loaded)
    try:
        ids = chat_ids(QUESTIONS[6])
        assert len(ids) > 16
        assert small.generate_sync(ids, GREEDY).token_ids == engine.generate_sync(ids, GREEDY).token_ids
    finally:
        small.shutdown()


def test_blend_selects_as_configured(loaded: LoadedModel) -> None:
    attention = Engine(EngineConfig(blend_select="attention", recompute_ratio=0.2), loaded)
    try:
        assert attention.reuser.blend.select == "attention" and attention.reuser.blend.ratio == 0.2
    finally:
        attention.shutdown()


def test_the_engine_thread_alone_computes_on_its_cores(loaded: LoadedModel) -> None:
    """Two OpenMP teams on the same cores make libgomp sleep between parallel regions (runtime/threads.py)."""
    torch.set_num_threads(2)
    two = Engine(EngineConfig(threads=2, prefix_caching=False, content_chunks=False), loaded)
    try:
        assert two.call(torch.get_num_threads).result() == 2
        assert torch.get_num_threads() == 1  # the thread that built it
        with ThreadPoolExecutor(1) as pool:  # and a thread that computes from now on
            assert pool.submit(torch.get_num_threads).result() == 1
    finally:
        two.shutdown()
        torch.set_num_threads(1)


def test_max_tokens_and_eos(engine: Engine, chat_ids) -> None:
    short = engine.generate_sync(chat_ids(QUESTIONS[2]), SamplingParams(max_tokens=3, temperature=0))
    assert short.finish_reason == "length" and len(short.token_ids) == 3
    full = engine.generate_sync(chat_ids(QUESTIONS[0]), SamplingParams(max_tokens=200, temperature=0))
    assert full.finish_reason == "stop" and full.token_ids[-1] in engine.loaded.eos_token_ids
    assert short.stop_reason is None and full.stop_reason is None  # the end of the turn is no stop asked for


def test_stop_string_cuts_the_text(engine: Engine, chat_ids) -> None:
    ids = chat_ids(QUESTIONS[1])
    free = engine.generate_sync(ids, GREEDY)
    word = free.text.split()[1]
    cut = engine.generate_sync(ids, SamplingParams(max_tokens=24, temperature=0, stop=("zzzq", word)))
    assert cut.finish_reason == "stop" and cut.stop_reason == word  # vLLM's: which stop string it was
    assert cut.text == free.text[: free.text.index(word)]


def test_stop_token_ids(engine: Engine, chat_ids) -> None:
    ids = chat_ids(QUESTIONS[1])
    free = engine.generate_sync(ids, GREEDY)
    stop_at = free.token_ids[2]
    cut = engine.generate_sync(ids, SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(stop_at,)))
    assert cut.finish_reason == "stop" and cut.token_ids == free.token_ids[:3] and cut.stop_reason == stop_at


def test_seed_reproduces_and_sampling_varies(engine: Engine, chat_ids) -> None:
    ids = chat_ids(QUESTIONS[2])
    hot = dict(max_tokens=16, temperature=1.0, top_p=0.95)
    a = engine.generate_sync(ids, SamplingParams(seed=1, **hot))
    assert engine.generate_sync(ids, SamplingParams(seed=1, **hot)).token_ids == a.token_ids
    others = {tuple(engine.generate_sync(ids, SamplingParams(seed=s, **hot)).token_ids) for s in range(2, 6)}
    assert len(others | {tuple(a.token_ids)}) > 1


def test_top_k_one_is_greedy(engine: Engine, chat_ids) -> None:
    ids = chat_ids(QUESTIONS[5])
    sampled = engine.generate_sync(ids, SamplingParams(max_tokens=16, temperature=1.5, top_k=1, seed=3))
    assert sampled.token_ids == engine.generate_sync(ids, SamplingParams(max_tokens=16, temperature=0)).token_ids


def test_logprobs_of_greedy_tokens_are_the_top(engine: Engine, chat_ids) -> None:
    r = engine.generate_sync(chat_ids(QUESTIONS[4]), SamplingParams(max_tokens=8, temperature=0, logprobs=3))
    assert [lp.token_id for lp in r.logprobs] == r.token_ids
    for lp in r.logprobs:
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id and lp.top[0][1] == pytest.approx(lp.logprob)
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1] and lp.logprob <= 0


def test_context_window_is_enforced(engine: Engine) -> None:
    with pytest.raises(PromptTooLong):
        engine.check(engine.max_model_len, None)
    with pytest.raises(PromptTooLong):
        engine.check(100, engine.max_model_len)
    engine.check(100, engine.max_model_len - 100)


def test_generate_sync_gathers_every_output_and_raises_engine_errors(engine: Engine, chat_ids) -> None:
    ids = chat_ids(QUESTIONS[0])
    r = engine.generate_sync(ids, SamplingParams(max_tokens=5, temperature=0, logprobs=0))
    assert r.prompt_tokens == len(ids) and r.completion_tokens == len(r.token_ids) == len(r.logprobs) == 5
    assert r.text == engine.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    with pytest.raises(ValueError, match="empty"):
        engine.generate_sync([], GREEDY)
    with pytest.raises(PromptTooLong):
        engine.generate_sync(ids, SamplingParams(max_tokens=engine.max_model_len))


def test_abandoned_stream_frees_its_slot(engine: Engine, chat_ids) -> None:
    async def read_two() -> None:
        params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
        stream = engine.generate(Request(chat_ids(QUESTIONS[3]), params))
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(read_two())
    wait_until(lambda: not any(engine.load_stats.values()), 10, "aborted sequence still scheduled")


def test_a_client_that_cannot_take_output_only_loses_its_own_request(engine: Engine, chat_ids) -> None:
    # A real failure a real part cannot stage on demand: a callback raising as a closed event loop does.
    def closed_loop(_: object) -> None:
        raise RuntimeError("Event loop is closed")

    engine.submit(
        Request(chat_ids(QUESTIONS[0]), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)), closed_loop
    )
    survivor = engine.generate_sync(chat_ids(QUESTIONS[1]), GREEDY)
    assert survivor.token_ids == engine.generate_sync(chat_ids(QUESTIONS[1]), GREEDY).token_ids
    wait_until(lambda: not any(engine.load_stats.values()), 10, "the failed request still scheduled")
