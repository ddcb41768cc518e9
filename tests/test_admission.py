"""gateway/admission.py: program FCFS in front of an upstream."""

from __future__ import annotations

import asyncio

from kvgate.gateway.admission import Gate, ProgramClock


def test_waiters_are_let_through_by_rank_not_arrival():
    async def scenario() -> list[str]:
        gate, order = Gate(1), []
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
        gate = Gate(1)
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
