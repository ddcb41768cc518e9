"""The admission queue: plain FCFS, or program FCFS (pinned programs, then by program arrival)."""

from __future__ import annotations

import pytest
import torch

from kvgate.agents.programs import Turn
from kvgate.runtime.kv import KVCache
from kvgate.runtime.sampling import SamplingParams
from kvgate.runtime.scheduler import Scheduler
from kvgate.runtime.sequence import Sequence


def request(name: str, arrival: float, turn: Turn | None = None) -> Sequence:
    kv = KVCache(1, 1, 4, torch.float32, "cpu")
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=4), kv, frozenset(), 64, turn=turn, arrival=arrival)
    seq.text = name  # to read the order back
    return seq


def queue() -> list[Sequence]:
    """In arrival order: a new program; a plain request; a later turn of an older program;
    a turn whose program's KV is pinned."""
    return [
        request("new program", 10.0, Turn("p1", arrival=10.0)),
        request("plain", 11.0),
        request("older program", 12.0, Turn("p0", arrival=2.0)),
        request("pinned", 13.0, Turn("p2", arrival=9.0, pinned=True)),
    ]


def admitted(order: str) -> list[str]:
    scheduler = Scheduler(max_num_seqs=1, max_num_batched_tokens=64, order=order)
    for seq in queue():
        scheduler.add(seq)
    names = []
    while scheduler:
        (seq, _), *_ = scheduler.schedule()
        names.append(seq.text)
        scheduler.remove(seq)
    return names


def test_fcfs_admits_in_arrival_order() -> None:
    assert admitted("fcfs") == ["new program", "plain", "older program", "pinned"]


def test_program_fcfs_admits_pinned_programs_then_by_program_arrival() -> None:
    assert admitted("program") == ["pinned", "older program", "new program", "plain"]


def test_waiting_tokens_follow_the_queue() -> None:
    scheduler = Scheduler(max_num_seqs=1, max_num_batched_tokens=64, order="program")
    for seq in queue():
        scheduler.add(seq)
    assert scheduler.waiting_tokens == 12
    scheduler.schedule()
    assert scheduler.waiting_tokens == 9


def test_an_unknown_order_is_refused() -> None:
    with pytest.raises(ValueError, match="queue order"):
        Scheduler(1, 64, order="lifo")
