"""runtime/outbox.py: a step's outputs reach each client loop in order, in one hand-over a loop per flush."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvgate.runtime.outbox import Outbox


def test_a_flush_hands_each_loop_its_outputs_in_order_at_once() -> None:
    loops = [asyncio.new_event_loop() for _ in range(2)]
    threads = [threading.Thread(target=loop.run_forever, daemon=True) for loop in loops]
    for thread in threads:
        thread.start()
    try:
        outbox, seen = Outbox(), {0: [], 1: []}  # type: ignore[var-annotated]
        for i in range(6):
            outbox.post(loops[i % 2], seen[i % 2].append, i)
        assert seen == {0: [], 1: []}  # nothing before the flush
        wakes = []
        for loop in loops:
            original = loop.call_soon_threadsafe
            loop.call_soon_threadsafe = lambda *a, o=original: (wakes.append(1), o(*a))[1]  # type: ignore[method-assign]
        outbox.flush()
        outbox.flush()  # nothing pending: no wake-up
        assert len(wakes) == 2  # one a loop, for its three outputs
        for loop in loops:
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=5)
        assert seen == {0: [0, 2, 4], 1: [1, 3, 5]}
    finally:
        for loop, thread in zip(loops, threads):
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=5)
            loop.close()


def test_a_closed_loop_is_refused_at_the_post() -> None:
    """Its client is gone: the engine hears of it at once and ends the sequence."""
    loop = asyncio.new_event_loop()
    loop.close()
    with pytest.raises(RuntimeError):
        Outbox().post(loop, print, "lost")
