"""gateway/admission.py: the bounds on sequences (per request, per tenant, in all) and their
accounting through `run` (released as each sequence ends: finished, failed, aborted); program FCFS in
front of an upstream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from kvgate.gateway.admission import Admission, ConcurrencyGate, ProgramClock, fan_out
from kvgate.gateway.choices import Choice, collect, run
from kvgate.gateway.errors import APIError
from kvgate.runtime.errors import EngineError
from kvgate.runtime.request import Output, Request
from kvgate.runtime.sampling import SamplingParams


def test_waiters_are_let_through_by_rank_not_arrival():
    async def scenario() -> list[str]:
        gate, order = ConcurrencyGate(1), []
        await gate.acquire(0.0)  # the slot is taken

        async def wait(tag: str, rank: float) -> None:
            await gate.acquire(rank)
            order.append(tag)
            gate.release()

        tasks = [asyncio.create_task(wait("late program", 5.0)), asyncio.create_task(wait("early program", 1.0))]
        await asyncio.sleep(0.01)
        assert gate.load == 3
        gate.release()
        await asyncio.gather(*tasks)
        assert gate.busy == 0
        return order

    assert asyncio.run(scenario()) == ["early program", "late program"]


def test_a_waiter_that_gives_up_does_not_keep_the_slot():
    async def scenario() -> int:
        gate = ConcurrencyGate(1)
        await gate.acquire(0.0)
        quitter = asyncio.create_task(gate.acquire(1.0))
        await asyncio.sleep(0.01)
        quitter.cancel()
        await asyncio.sleep(0.01)
        gate.release()
        await asyncio.wait_for(gate.acquire(2.0), 1)  # free again
        return gate.busy

    assert asyncio.run(scenario()) == 1


def test_a_program_keeps_its_first_arrival_until_it_idles():
    clock = ProgramClock(idle_s=60.0)
    first = clock.rank("p")
    assert clock.rank("p") == first
    assert clock.rank(None) > first
    clock.idle_s = 0.0
    assert clock.rank("p") > first  # idle too long: a new program


# --- the bounds -------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def refusal(fn, *args) -> APIError:
    with pytest.raises(APIError) as caught:
        fn(*args)
    return caught.value


def test_a_request_over_the_per_request_bound_is_a_400_whatever_the_load():
    admission = Admission(max_request_seqs=128, max_waiting_seqs=1024, max_waiting_seqs_per_tenant=256)
    err = refusal(admission.admit, "a", 1000, 16)
    assert (err.status, err.code, err.param) == (400, "too_many_sequences", "prompt")
    assert "16000 sequences (1000 prompts x n=16)" in err.message
    err = refusal(admission.admit, "a", 100, 2)
    assert (err.status, err.param) == (400, "n")
    assert admission.total == 0 and admission.tenants == {}  # nothing counted
    assert admission.admit("a", 8, 16).left == 128  # exactly the bound: admitted


def test_a_bound_no_request_could_ever_pass_is_a_400_not_a_429():
    """A tenant's share smaller than the per-request bound: retrying could never help."""
    admission = Admission(max_request_seqs=128, max_waiting_seqs=1024, max_waiting_seqs_per_tenant=16)
    err = refusal(admission.admit, "a", 1, 17)
    assert err.status == 400 and "at most 16" in err.message


def test_a_tenant_over_its_share_gets_429_another_tenant_still_gets_in():
    admission = Admission(max_request_seqs=16, max_waiting_seqs=100, max_waiting_seqs_per_tenant=20)
    admission.admit("flood", 1, 16)
    err = refusal(admission.admit, "flood", 1, 8)
    assert (err.status, err.code) == (429, "tenant_queue_full")
    assert int(err.headers["retry-after"]) >= 1
    assert err.body()["error"]["type"] == "rate_limit_error"
    admission.admit("flood", 1, 4)  # what still fits is admitted
    admission.admit("calm", 1, 2)
    assert admission.tenants == {"flood": 20, "calm": 2} and admission.total == 22


def test_the_server_over_its_total_gets_503():
    admission = Admission(max_request_seqs=16, max_waiting_seqs=40, max_waiting_seqs_per_tenant=32)
    admission.admit("a", 1, 16)
    admission.admit("a", 1, 16)
    admission.admit("b", 1, 4)
    err = refusal(admission.admit, "c", 1, 8)
    assert (err.status, err.code) == (503, "server_queue_full")
    assert int(err.headers["retry-after"]) >= 1
    assert err.body()["error"]["type"] == "server_error"
    assert admission.tenants == {"a": 32, "b": 4}  # the refused request counted nothing


def test_a_tenants_refusal_is_held_back_a_second_the_servers_is_not():
    """A flood that sends again at once, whatever Retry-After says, gets one refusal a second per
    connection; a 503 (a front may try another server) and a 400 come at once."""

    async def scenario() -> None:
        clock = Clock()
        admission = Admission(16, 24, 16, clock=clock)
        admission.admit("a", 1, 16)
        clock.now += 5.0  # busy 5 s, nothing ended: Retry-After 5 at the refusal, 4 a second later
        start = time.monotonic()
        with pytest.raises(APIError) as caught:
            await admission.screen("a")
        assert time.monotonic() - start >= 0.9
        assert (caught.value.status, caught.value.headers["retry-after"]) == (429, "4")
        admission.admit("b", 1, 8)
        for tenant, n, status in (("c", 1, 503), ("c", 17, 400)):
            start = time.monotonic()
            with pytest.raises(APIError) as caught:
                await admission.screen(tenant, 1, n)
            assert caught.value.status == status and time.monotonic() - start < 0.5

    asyncio.run(scenario())


def test_held_sequences_end_once_and_the_tenant_is_forgotten():
    admission = Admission(16, 100, 50)
    held = admission.admit("a", 1, 3)
    held.end()
    assert admission.tenants == {"a": 2}
    held.close()
    held.close()
    held.end()
    assert admission.total == 0 and admission.tenants == {} and admission.drains == {}


def test_retry_after_is_the_excess_over_the_rate_sequences_have_been_ending():
    clock = Clock()
    admission = Admission(16, 1000, 20, clock=clock)
    held = [admission.admit("a") for _ in range(20)]
    for i in range(10):  # two sequences end a second, over five seconds
        clock.now += 0.5
        held[i].close()
        admission.admit("a")
    # 20 in flight; 6 more need 6 to end: 3 s at 2 a second.
    assert refusal(admission.admit, "a", 1, 6).headers["retry-after"] == "3"
    clock.now += 60  # nothing ended for a minute: as long again as the window it was measured over
    assert refusal(admission.admit, "a", 1, 6).headers["retry-after"] == "30"


def test_retry_after_before_anything_ended_is_at_least_a_second():
    clock = Clock()
    admission = Admission(16, 16, 16, clock=clock)
    admission.admit("a", 1, 16)
    assert refusal(admission.admit, "b").headers["retry-after"] == "1"
    clock.now += 5.0
    assert refusal(admission.admit, "b").headers["retry-after"] == "5"  # busy 5 s and nothing ended


def test_a_body_is_counted_loosely_as_a_proxy_forwards_it():
    assert fan_out({"messages": []}) == (1, 1)
    assert fan_out({"prompt": ["a", "b", "c"], "n": 4}) == (3, 4)
    assert fan_out({"prompt": [1, 2, 3], "n": 2}) == (1, 2)  # one prompt of token ids
    assert fan_out({"prompt": [[1], [2]], "best_of": 5, "n": 2}) == (2, 5)
    assert fan_out({"prompt": "x", "n": "many", "best_of": True}) == (1, 1)  # not numbers: the upstream judges


# --- the accounting through run(): every way a request's sequences end --------------------------------


class FakeEngine:
    """engine.generate as run() uses it: each sequence's outputs from a script, or held open."""

    def __init__(self, tokens: int = 2, fail: bool = False, hang: bool = False) -> None:
        self.tokens, self.fail, self.hang = tokens, fail, hang
        self.submitted: list[str] = []
        self.aborted = 0

    async def generate(self, request: Request) -> AsyncIterator[Output]:
        self.submitted.append(request.tenant)
        done = False
        try:
            for i in range(self.tokens):
                await asyncio.sleep(0.001)
                if self.fail:
                    raise EngineError("a step failed")
                last = i == self.tokens - 1 and not self.hang
                done = last
                yield Output("x", [1], [], "length" if last else None, 1, i + 1)
            while self.hang:
                await asyncio.sleep(1)
        finally:
            if not done:
                self.aborted += 1


def work(n: int, tenant: str = "t") -> list[Choice]:
    return [Choice(i, Request([1, 2], SamplingParams(max_tokens=2), tenant=tenant)) for i in range(n)]


def test_finished_sequences_are_released_and_the_tenant_reaches_the_engine():
    async def scenario() -> None:
        admission, engine = Admission(16, 100, 50), FakeEngine()
        done = await collect(engine, work(3), admission)
        assert len(done) == 3 and engine.submitted == ["t"] * 3
        assert admission.total == 0

    asyncio.run(scenario())


def test_each_choice_is_released_as_it_finishes():
    async def scenario() -> None:
        admission, engine = Admission(16, 100, 50), FakeEngine(tokens=1)
        outputs = run(engine, work(3), admission)
        await anext(outputs)
        assert admission.total == 2  # one finished, two still running
        await outputs.aclose()
        assert admission.total == 0

    asyncio.run(scenario())


def test_a_failed_request_releases_its_sequences():
    async def scenario() -> None:
        admission = Admission(16, 100, 50)
        with pytest.raises(EngineError) as caught:
            await collect(FakeEngine(fail=True), work(4), admission)
        assert caught.value.status == 500  # as the gateway renders it
        assert admission.total == 0

    asyncio.run(scenario())


def test_a_client_that_hangs_up_releases_its_sequences_and_aborts_them():
    """The route cancels the backend's task (non-streamed), or closes the stream's outputs."""

    async def scenario() -> None:
        admission, engine = Admission(16, 100, 50), FakeEngine(hang=True)
        task = asyncio.create_task(collect(engine, work(4), admission))
        await asyncio.sleep(0.05)
        assert admission.total == 4
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert admission.total == 0
        await asyncio.sleep(0.01)
        assert engine.aborted == 4

        outputs = run(engine, work(2), admission)  # a stream: the first output out, then closed
        await anext(outputs)
        assert admission.total == 2
        await outputs.aclose()
        assert admission.total == 0

    asyncio.run(scenario())


def test_a_refused_request_queues_nothing():
    """Admitted whole or refused whole: never some of its choices in the engine."""

    async def scenario() -> None:
        admission, engine = Admission(16, 100, 10), FakeEngine(hang=True)
        first = run(engine, work(8), admission)
        task = asyncio.create_task(anext(first))
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as caught:
            await anext(run(engine, work(4), admission))
        assert caught.value.status == 429
        assert len(engine.submitted) == 8  # the first request's only
        task.cancel()
        await first.aclose()
        assert admission.total == 0

    asyncio.run(scenario())
