"""Outputs on their way to the clients' event loops, handed over once a step.

A client's output is put on its event loop's queue by a thread-safe call, which wakes the loop through its
self-pipe (a system call): one a token of every sequence of a step, a few microseconds each. The engine posts a
step's outputs here and flushes once: one wake-up of each loop a step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvgate.engine")


def _run(items: list[tuple[Callable[[Any], None], Any]]) -> None:
    for fn, item in items:
        fn(item)


class Outbox:
    """One owner: the engine's thread (posts and flushes)."""

    def __init__(self) -> None:
        self.pending: dict[asyncio.AbstractEventLoop, list[tuple[Callable[[Any], None], Any]]] = {}

    def post(self, loop: asyncio.AbstractEventLoop, fn: Callable[[Any], None], item: Any) -> None:
        """fn(item) on `loop`, at the next flush. Raises at once where the loop is closed (its client is gone)."""
        if loop.is_closed():
            raise RuntimeError("the client's event loop is closed")
        self.pending.setdefault(loop, []).append((fn, item))

    def flush(self) -> None:
        pending, self.pending = self.pending, {}
        for loop, items in pending.items():
            try:
                loop.call_soon_threadsafe(_run, items)
            except RuntimeError:
                # Closed since the post: its clients are gone. Their sequences end when the loop's async generators
                # are shut down (asyncio.run does, and each generate() aborts its sequence); a loop closed without
                # that leaves them to run to max_tokens, as a client that stops reading does.
                log.debug("an event loop closed with %d outputs for it", len(items))
