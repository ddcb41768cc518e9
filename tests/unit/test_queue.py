"""The admission queues of agents/queue.py on their own, as documentation of what they promise.

ProgramQueue: "fcfs" is insertion order; "program" is pinned programs first, then by program arrival, then by
the item's own arrival (an item pushed without one arrives now). An item waiting can be withdrawn (`remove`
says whether it was waiting) and tested with `in`; a pop from an empty queue raises IndexError.

FairQueue: the next item comes from the tenant with the fewest running (popped, not yet `done`), ties by the
queue's order; an item without a tenant is the anonymous tenant "". `done` counts down one at a time, never
below zero, and a tenant with nothing waiting or running leaves every map.

Bounds: withdrawals and churn leave stale heap entries behind, but a heap holds at most 64 entries or twice the
items waiting (ProgramQueue, after a withdrawal), or four times the tenants waiting (FairQueue); and one
operation never rebuilds a large heap (each is O(log n)).
"""

from __future__ import annotations

import time
from typing import TypeVar

import pytest

from kvgate.agents.queue import FairQueue, ProgramQueue

T = TypeVar("T")


def drain(queue: ProgramQueue[T] | FairQueue[T]) -> list[T]:
    return [queue.pop() for _ in range(len(queue))]


# --- order -------------------------------------------------------------------------------------------------


def test_the_default_order_is_program_order() -> None:
    assert ProgramQueue().order == "program" and FairQueue().order == "program"


def test_an_unknown_order_is_refused_naming_the_known_ones() -> None:
    for make in (ProgramQueue, FairQueue):
        with pytest.raises(ValueError, match="one of fcfs, program"):
            make("lifo")


def test_fcfs_is_insertion_order_whatever_the_arrivals_and_pins() -> None:
    queue: ProgramQueue[str] = ProgramQueue("fcfs")
    queue.push("first", program_arrival=9.0, arrival=9.0)
    queue.push("second", program_arrival=1.0, pinned=True, arrival=1.0)
    queue.push("third", arrival=0.0)
    assert drain(queue) == ["first", "second", "third"]


def test_program_order_is_pinned_then_program_arrival_then_arrival() -> None:
    queue: ProgramQueue[str] = ProgramQueue("program")
    queue.push("plain", arrival=3.0)
    queue.push("later turn of an old program", program_arrival=1.0, arrival=5.0)
    queue.push("earlier turn of an old program", program_arrival=1.0, arrival=4.0)
    queue.push("pinned", program_arrival=8.0, pinned=True, arrival=8.0)
    assert drain(queue) == ["pinned", "earlier turn of an old program", "later turn of an old program", "plain"]


def test_an_item_pushed_without_an_arrival_arrives_now() -> None:
    """The gateway's gate pushes a plain request with no times at all: it queues behind an older program."""
    queue: ProgramQueue[str] = ProgramQueue("program")
    queue.push("plain")
    queue.push("turn of a program a minute old", program_arrival=time.monotonic() - 60)
    assert drain(queue) == ["turn of a program a minute old", "plain"]


def test_an_item_is_not_pinned_unless_told() -> None:
    queue: ProgramQueue[str] = ProgramQueue("program")
    fair: FairQueue[str] = FairQueue("program")
    queue.push("plain", arrival=1.0)
    fair.push("plain", arrival=1.0)
    queue.push("pinned", pinned=True, arrival=2.0)
    fair.push("pinned", pinned=True, arrival=2.0)
    assert drain(queue) == drain(fair) == ["pinned", "plain"]


# --- withdrawal, membership, an empty pop ---------------------------------------------------------------------


def test_a_withdrawn_item_leaves_the_queue_and_only_a_waiting_one_can_be_withdrawn() -> None:
    for queue in (ProgramQueue[str]("fcfs"), FairQueue[str]("fcfs")):
        for item in ("a", "b", "c"):
            queue.push(item)
        assert "b" in queue and "z" not in queue
        assert queue.remove("b") is True
        assert "b" not in queue and len(queue) == 2 and set(queue) == {"a", "c"}
        assert queue.remove("b") is False and queue.remove("z") is False
        assert drain(queue) == ["a", "c"]
        assert queue.remove("a") is False  # popped: no longer waiting


def test_items_are_told_apart_by_identity_not_equality() -> None:
    """An item is the object pushed: an equal object that was not pushed is not in the queue."""
    queue: ProgramQueue[list[int]] = ProgramQueue("fcfs")
    item = [1]
    queue.push(item)
    assert item in queue and [1] not in queue and queue.remove([1]) is False


def test_a_pop_from_an_empty_queue_raises_index_error() -> None:
    for queue in (ProgramQueue[str](), FairQueue[str]()):
        with pytest.raises(IndexError):
            queue.pop()
        queue.push("withdrawn")
        queue.remove("withdrawn")
        with pytest.raises(IndexError):
            queue.pop()


# --- fairness and `done` ----------------------------------------------------------------------------------


def test_an_item_without_a_tenant_is_the_anonymous_tenant() -> None:
    fair: FairQueue[str] = FairQueue("fcfs")
    fair.push("keyless")
    assert fair.peek() == ("", 0)
    fair.pop()
    fair.done("")
    assert fair.running == {}


def test_the_tenant_with_the_fewest_running_goes_next_ties_by_order() -> None:
    fair: FairQueue[str] = FairQueue("fcfs")
    for item, tenant in (("a0", "a"), ("a1", "a"), ("b0", "b")):
        fair.push(item, tenant)
    assert fair.pop() == "a0"  # none running anywhere: arrival decides
    assert fair.peek() == ("b", 0)
    assert fair.pop() == "b0" and fair.pop() == "a1"


def test_a_push_that_becomes_its_tenants_new_head_moves_the_tenant_up() -> None:
    fair: FairQueue[str] = FairQueue("program")
    fair.push("a's new program", "a", program_arrival=5.0)
    fair.push("b's program", "b", program_arrival=3.0)
    assert fair.peek() == ("b", 0)
    fair.push("a's oldest program", "a", program_arrival=1.0)
    assert fair.peek() == ("a", 0) and fair.pop() == "a's oldest program"


def test_done_counts_a_tenant_down_one_item_at_a_time() -> None:
    fair: FairQueue[str] = FairQueue("fcfs")
    for i in range(3):
        fair.push(f"a{i}", "a")
    fair.pop()
    fair.pop()
    assert fair.peek() == ("a", 2)
    fair.done("a")
    assert fair.peek() == ("a", 1)
    fair.done("a")
    assert fair.peek() == ("a", 0) and "a" not in fair.running


def test_done_for_a_tenant_with_nothing_running_never_counts_below_zero() -> None:
    fair: FairQueue[str] = FairQueue("fcfs")
    fair.done("ghost")
    fair.push("g0", "ghost")
    fair.done("ghost")
    assert fair.running == {} and fair.peek() == ("ghost", 0)


def test_a_tenant_with_nothing_waiting_or_running_leaves_every_map() -> None:
    fair: FairQueue[str] = FairQueue("program")
    fair.push("popped", "a")
    fair.push("withdrawn", "b")
    fair.pop()
    fair.remove("withdrawn")
    assert fair.queues == {} and fair.version == {} and fair.tenant_of == {} and fair.running == {"a": 1}
    fair.done("a")
    assert fair.running == {} and not fair and fair.peek() is None


# --- bounds ------------------------------------------------------------------------------------------------


def test_a_withdrawal_marks_its_entry_and_does_not_rebuild_the_heap() -> None:
    """O(log n): withdrawing one of many waiting items leaves the heap list as it was."""
    queue: ProgramQueue[object] = ProgramQueue("fcfs")
    items = [object() for _ in range(1000)]
    for item in items:
        queue.push(item)
    heap = queue.heap
    assert queue.remove(items[500])
    assert queue.heap is heap and len(heap) == 1000


def test_withdrawn_entries_are_compacted_away() -> None:
    """However many are withdrawn, at most 64 stale entries, or as many as are waiting, stay in the heap."""
    for n in (65, 200):
        queue: ProgramQueue[object] = ProgramQueue("program")
        items = [object() for _ in range(n)]
        for i, item in enumerate(items):
            queue.push(item, arrival=float(i))
        for item in items:
            queue.remove(item)
            assert len(queue.heap) <= max(64, 2 * len(queue))
    queue = ProgramQueue("fcfs")
    items = [object() for _ in range(65)]
    for item in items[:64]:
        queue.push(item)
    for item in items[:64]:
        queue.remove(item)  # 64 stale entries: within the slack
    queue.push(items[64])
    queue.remove(items[64])
    assert len(queue) == 0 and queue.heap == []


def test_queuing_behind_a_tenants_head_adds_no_tenant_heap_entry() -> None:
    fair: FairQueue[int] = FairQueue("fcfs")
    for i in range(10):
        fair.push(i, "a")
    assert len(fair.heap) == 1


def test_the_tenant_heap_stays_bounded_when_every_push_is_a_new_head() -> None:
    """Each push of an older program's turn moves its tenant up: the tenant's old entry goes stale."""
    for tenants in (1, 20):
        fair: FairQueue[int] = FairQueue("program")
        for i in range(300):
            fair.push(i, f"t{i % tenants}", program_arrival=float(-i))
            assert len(fair.heap) <= max(64, 4 * len(fair.version))
        assert sorted(drain(fair)) == list(range(300))


def test_a_rebuilt_tenant_heap_keeps_each_tenants_running_count() -> None:
    """Churn (pop, done) on one tenant rebuilds the tenant heap many times; a rebuild must not lose who runs."""
    fair: FairQueue[str] = FairQueue("fcfs")
    for i in range(300):
        fair.push(f"busy{i}", "busy")
    fair.push("idle", "idle")
    for i in range(200):
        assert fair.peek() == ("busy", 0)  # a tie at nothing running: busy's head arrived first
        assert fair.pop() == f"busy{i}"
        assert fair.peek() == ("idle", 0)  # busy runs one now
        fair.done("busy")
        assert len(fair.heap) <= max(64, 4 * len(fair.version))


def test_a_pop_among_many_tenants_does_not_rebuild_the_tenant_heap() -> None:
    """O(log n): with 100 tenants waiting, a pop adds an entry to the tenant heap, it does not rebuild it."""
    fair: FairQueue[int] = FairQueue("fcfs")
    for i in range(200):
        fair.push(i, f"t{i % 100}")
    heap = fair.heap
    assert fair.pop() == 0
    assert fair.heap is heap and len(heap) == 101


def test_an_item_already_waiting_is_refused_not_held_twice() -> None:
    queue: ProgramQueue[object] = ProgramQueue("fcfs")
    item = object()
    queue.push(item)
    with pytest.raises(ValueError, match="^the item is already waiting$"):
        queue.push(item)
    assert queue.pop() is item and len(queue) == 0 and queue.head() is None
