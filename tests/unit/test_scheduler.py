"""The admission queue: plain FCFS, or program FCFS (pinned programs, then by program arrival); fair
between tenants (the fewest running first), a reserve of slots for a tenant with nothing running."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from kvgate.agents.flight import Flight
from kvgate.agents.programs import Turn
from kvgate.agents.queue import FairQueue
from kvgate.bench.agents_sim import SimSeq
from kvgate.runtime.kv import KVCache
from kvgate.runtime.sampling import SamplingParams
from kvgate.runtime.scheduler import Scheduler
from kvgate.runtime.sequence import Sequence, Status


def request(name: str, arrival: float, turn: Turn | None = None, prompt: int = 3) -> Sequence:
    kv = KVCache(1, 1, 4, torch.float32, "cpu")
    ids = list(range(1, prompt + 1))
    seq = Sequence(ids, SamplingParams(max_tokens=4), kv, frozenset(), 64, turn=turn, arrival=arrival)
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


# --- fairness between tenants ---------------------------------------------------------------------


def tenants_request(tenant: str, name: str, arrival: float, turn: Turn | None = None) -> Sequence:
    seq = request(name, arrival, turn)
    seq.tenant = tenant
    return seq


def step_names(scheduler: Scheduler) -> list[str]:
    """The sequences one step admits, by name."""
    before = set(map(id, scheduler.running))
    scheduler.schedule()
    return [s.text for s in scheduler.running if id(s) not in before]


def test_a_free_slot_goes_to_the_tenant_with_the_fewest_running() -> None:
    """A flood queued first does not keep a later tenant waiting: slots alternate, ties by arrival."""
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, order="fcfs", reserve=0)
    for i in range(6):
        scheduler.add(tenants_request("flood", f"f{i}", float(i)))
    scheduler.add(tenants_request("calm", "c0", 10.0))
    scheduler.add(tenants_request("calm", "c1", 11.0))
    assert step_names(scheduler) == ["f0", "c0", "f1", "c1"]
    scheduler.remove(scheduler.running[1])  # c0 ends; calm has nothing left waiting
    assert step_names(scheduler) == ["f2"]


def test_program_order_holds_within_a_tenant() -> None:
    scheduler = Scheduler(max_num_seqs=1, max_num_batched_tokens=64, order="program", reserve=0)
    for seq in queue():
        seq.tenant = "a"
        scheduler.add(seq)
    scheduler.add(tenants_request("b", "b plain", 14.0))
    names = []
    while scheduler:
        names += step_names(scheduler)
        scheduler.remove(scheduler.running[0])
    # Each admission finds both tenants with nothing running: the heads' program order decides.
    assert names == ["pinned", "older program", "new program", "plain", "b plain"]


def test_once_tenants_share_the_server_the_last_slot_waits_for_a_tenant_with_nothing_running() -> None:
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, order="fcfs", reserve=1)
    for i in range(8):
        scheduler.add(tenants_request("flood", f"f{i}", float(i)))
    assert len(step_names(scheduler)) == 4  # one tenant so far: every slot is its
    for seq in list(scheduler.running):
        scheduler.remove(seq)
    scheduler.add(tenants_request("calm", "c0", 20.0))  # a second tenant: the reserve applies from now on
    assert step_names(scheduler) == ["f4", "c0", "f5"]  # the fourth slot: not for flood, which has two
    calm = next(s for s in scheduler.running if s.tenant == "calm")
    scheduler.remove(calm)
    assert step_names(scheduler) == ["f6"]  # three running at most while flood is alone
    scheduler.add(tenants_request("calm", "c1", 30.0))
    assert step_names(scheduler) == ["c1"]  # and a newcomer starts at once, in the reserved slot


def test_the_default_reserve_is_an_eighth_of_the_batch() -> None:
    assert [Scheduler(n, 64).reserve for n in (1, 2, 8, 12, 16, 64)] == [0, 1, 1, 1, 2, 8]


def test_an_aborted_waiting_sequence_leaves_the_queue() -> None:
    scheduler = Scheduler(max_num_seqs=1, max_num_batched_tokens=64)
    seqs = [tenants_request("a", f"a{i}", float(i)) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.remove(seqs[0])
    assert len(scheduler.waiting) == 2 and seqs[0] not in scheduler.waiting
    assert scheduler.waiting_tokens == 6
    assert step_names(scheduler) == ["a1"]


class Reference:
    """FairQueue's order spelt out: the fewest running, then the queue key; O(n) a pop."""

    def __init__(self) -> None:
        self.waiting: list[tuple[tuple[bool, float, float, int], str, int]] = []
        self.running: dict[str, int] = {}

    def best(self) -> tuple[tuple[bool, float, float, int], str, int]:
        return min(self.waiting, key=lambda w: (self.running.get(w[1], 0), w[0]))

    def peek(self) -> tuple[str, int]:
        tenant = self.best()[1]
        return tenant, self.running.get(tenant, 0)

    def pop(self) -> tuple[str, int]:
        best = self.best()
        self.waiting.remove(best)
        self.running[best[1]] = self.running.get(best[1], 0) + 1
        return best[1], best[2]


@given(st.lists(st.tuples(st.sampled_from("push pop done remove".split()), st.integers(0, 3), st.integers(0, 5))))
@hyp_settings(max_examples=300, deadline=None)
def test_the_fair_queue_matches_its_definition(ops: list[tuple[str, int, int]]) -> None:
    """Random pushes (tenant, program arrival), pops, ends and withdrawals: the same order as the
    definition, in the program order."""
    fair: FairQueue[int] = FairQueue("program")
    ref = Reference()
    items: dict[int, str] = {}  # waiting item -> tenant
    running: list[tuple[str, int]] = []
    for n, (op, t, p) in enumerate(ops):
        tenant = "t" + str(t)
        if op == "push":
            fair.push(n, tenant, program_arrival=float(p), pinned=p == 0, arrival=float(n))
            ref.waiting.append(((p != 0, float(p), float(n), n), tenant, n))
            items[n] = tenant
        elif op == "pop" and items:
            assert fair.peek() == ref.peek()
            got, want = fair.pop(), ref.pop()
            assert got == want[1]
            running.append((items.pop(got), got))
        elif op == "done" and running:
            tenant, _ = running.pop(t % len(running))
            fair.done(tenant)
            ref.running[tenant] -= 1
        elif op == "remove" and items:
            item = sorted(items)[p % len(items)]
            assert fair.remove(item)
            del items[item]
            ref.waiting = [w for w in ref.waiting if w[2] != item]
        assert len(fair) == len(items) and set(fair) == set(items)
        assert len(fair.heap) <= max(64, 4 * len(fair.version)) + 1


def test_a_thousand_waiting_sequences_of_many_tenants_do_not_scan_the_queue() -> None:
    """Each admission costs heap operations: the tenant heap stays within a few entries per tenant."""
    fair: FairQueue[int] = FairQueue("fcfs")
    for i in range(5000):
        fair.push(i, f"t{i % 50}")
    taken = [fair.pop() for _ in range(100)]
    assert taken == list(range(100))  # 50 tenants with nothing running, then one each: arrival order
    assert len(fair.heap) <= 4 * 50 + 64


# --- the step's token budget ------------------------------------------------------------------------


def prompt(name: str, n: int, arrival: float = 0.0) -> Sequence:
    return request(name, arrival, prompt=n)


def run_step(scheduler: Scheduler) -> list[tuple[str, int]]:
    """One step as the engine runs it: each sequence's tokens enter its KV; a done prompt samples a token."""
    batch = scheduler.schedule()
    for seq, tokens in batch:
        seq.kv.lengths = [len(seq.kv) + len(tokens)]
        if not seq.prefilling:
            seq.output_ids.append(7)
    return [(seq.text, len(tokens)) for seq, tokens in batch]


def test_a_step_computes_at_most_its_budget_and_no_empty_chunk() -> None:
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=8)
    for name, n in (("a", 5), ("b", 6), ("c", 2)):
        scheduler.add(prompt(name, n))
    assert run_step(scheduler) == [("a", 5), ("b", 3)]  # the budget spent exactly: c is not admitted yet
    assert scheduler.waiting_tokens == 2 and [s.text for s in scheduler.running] == ["a", "b"]


def test_the_last_token_of_the_budget_is_used_and_none_past_it() -> None:
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=3)
    scheduler.add(prompt("a", 2))
    scheduler.add(prompt("b", 5))
    assert run_step(scheduler) == [("a", 2), ("b", 1)]  # one token left: b's first chunk is one token
    scheduler.add(prompt("c", 1))
    scheduler.add(prompt("d", 1))
    assert run_step(scheduler) == [("a", 1), ("b", 2)]  # a decodes, b fills the rest: c waits
    assert run_step(scheduler) == [("a", 1), ("b", 2)]  # b's prompt ends here
    assert run_step(scheduler) == [("a", 1), ("b", 1), ("c", 1)]
    assert run_step(scheduler) == [("a", 1), ("b", 1), ("c", 1)]  # three decodes spend it all: d waits


def test_decodes_go_first_so_a_long_prompt_never_starves_them() -> None:
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=8)
    scheduler.add(prompt("short", 3))
    assert run_step(scheduler) == [("short", 3)]
    scheduler.add(prompt("long", 40))
    # Admitted after the decode, and every later step: the decode's token, then the long prompt's chunk.
    assert run_step(scheduler) == [("short", 1), ("long", 7)]
    assert run_step(scheduler) == [("short", 1), ("long", 7)]


def test_a_given_reserve_keeps_one_slot_for_the_rest() -> None:
    assert Scheduler(4, 64, reserve=4).reserve == 3
    assert Scheduler(4, 64, reserve=2).reserve == 2


def test_a_sequence_that_ends_frees_its_slot_and_its_tenant_count() -> None:
    scheduler = Scheduler(max_num_seqs=1, max_num_batched_tokens=64)
    first, second = tenants_request("a", "a0", 0.0), tenants_request("a", "a1", 1.0)
    scheduler.add(first)
    scheduler.add(second)
    assert step_names(scheduler) == ["a0"] and step_names(scheduler) == []
    scheduler.remove(first)
    assert first.status.name == "FINISHED" and step_names(scheduler) == ["a1"]
    assert scheduler.waiting_tokens == 0 and len(scheduler.waiting) == 0


def test_program_order_reads_arrival_not_the_order_requests_were_added() -> None:
    scheduler = Scheduler(max_num_seqs=1, max_num_batched_tokens=64, order="program")
    for name, arrival in (("late", 5.0), ("early", 1.0)):
        scheduler.add(request(name, arrival))
    assert step_names(scheduler) == ["early"]


def test_only_program_order_lets_a_pinned_turn_pass_the_waiting_tokens() -> None:
    for order, passable in (("program", 12), ("fcfs", 0)):
        scheduler = Scheduler(max_num_seqs=1, max_num_batched_tokens=64, order=order)
        for seq in queue():
            scheduler.add(seq)
        assert scheduler.passable_tokens == passable


def test_the_simulators_sequences_are_the_anonymous_tenant() -> None:
    scheduler = Scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    scheduler.add(tenants_request("", "keyless", 0.0))
    scheduler.add(SimSeq(range(1), Turn("p", 1.0), 1.0, program=0, index=0))  # benchmarks/agents_sim.py's
    assert not scheduler.shared  # one tenant: no slot is held back


# ---- the gate: a new program's first turn waits for room among the programs in flight


def gated(limit: int) -> tuple[Scheduler, Flight]:
    flight = Flight(limit << 20, per_context=1.0)
    flight.measure(1 << 20, recent=1.0)  # memory holds `limit` contexts
    return Scheduler(max_num_seqs=8, max_num_batched_tokens=64, order="program", gate=flight), flight


def first(name: str, arrival: float, tenant: str = "") -> Sequence:
    seq = request(name, arrival, Turn(name, arrival=arrival, tenant=tenant, first=True))
    seq.tenant = tenant
    return seq


def test_a_first_turn_waits_while_the_programs_in_flight_fill_memory() -> None:
    scheduler, flight = gated(1)
    scheduler.add(first("a", 1.0))
    scheduler.add(first("b", 2.0))
    assert [s.text for s, _ in scheduler.schedule()] == ["a"]
    assert [s.text for s in scheduler.held] == ["b"]
    scheduler.remove(scheduler.running[0])  # a's turn ends calling a tool: a is still in flight
    flight.wait("", "a")
    scheduler.add(request("a, after its tool", 3.0, Turn("a", arrival=1.0)))  # a later turn: never held
    scheduler.add(request("plain", 4.0))  # a request of no program: never held
    assert [s.text for s, _ in scheduler.schedule()] == ["a, after its tool", "plain"]
    assert [s.text for s in scheduler.held] == ["b"]  # the engine is busy: b still waits
    for seq in list(scheduler.running):
        scheduler.remove(seq)
    flight.land("", "a")  # a's last turn ended
    scheduler.add(request("plain 2", 5.0))
    assert [s.text for s, _ in scheduler.schedule()] == ["b", "plain 2"]  # room: b goes first, as it came first
    assert len(flight) == 1  # b's program now counts


def test_an_idle_engine_lets_one_held_first_turn_through_over_the_limit() -> None:
    scheduler, flight = gated(1)
    scheduler.add(first("a", 1.0))
    scheduler.schedule()
    scheduler.remove(scheduler.running[0])
    flight.wait("", "a")  # a waits on its tool (or its client ended it after one: unseen until late)
    scheduler.add(first("b", 2.0))
    scheduler.add(first("c", 3.0))
    assert scheduler  # work for a step: nothing else would run
    assert [s.text for s, _ in scheduler.schedule()] == ["b"]  # one, not every held turn
    assert [s.text for s in scheduler.held] == ["c"] and len(flight) == 2


def test_a_held_first_turn_can_be_withdrawn() -> None:
    scheduler, flight = gated(1)
    scheduler.add(first("a", 1.0))
    scheduler.schedule()
    gone = first("b", 2.0)
    scheduler.add(gone)
    scheduler.remove(gone)  # its client went away while it waited
    flight.land("", "a")
    assert not scheduler.held and gone.status is Status.FINISHED
    assert len(flight) == 0  # b never started


def test_held_first_turns_go_to_the_tenant_with_fewest_let_through_still_running() -> None:
    scheduler, flight = gated(1)
    for i in range(3):
        scheduler.add(first(f"flood-{i}", float(i), tenant="flood"))
    scheduler.add(first("quiet-0", 10.0, tenant="quiet"))
    order = []
    for _ in range(3):
        *_, (seq, _) = scheduler.schedule()  # the one let through joins the batch last
        order.append(seq.text)
        flight.land(seq.turn.tenant, seq.turn.program)  # its program ends; the sequence still runs
    assert order == ["flood-0", "quiet-0", "flood-1"]


def test_a_let_through_first_turn_that_finished_no_longer_counts_for_its_tenant() -> None:
    scheduler, flight = gated(1)
    scheduler.add(first("flood-0", 0.0, tenant="flood"))
    (seq, _), *_ = scheduler.schedule()
    scheduler.remove(seq)  # it finished
    flight.land("flood", "flood-0")
    scheduler.add(first("flood-1", 1.0, tenant="flood"))
    scheduler.add(first("quiet-0", 2.0, tenant="quiet"))
    assert [s.text for s, _ in scheduler.schedule()] == ["flood-1"]  # none of either still running: the earlier


def test_the_scheduler_yields_every_sequence_it_holds() -> None:
    """Running, waiting and held alike: where the engine finds a sequence to abort."""
    scheduler, _ = gated(1)
    scheduler.add(first("running", 0.0))
    scheduler.schedule()
    scheduler.add(first("held", 1.0))
    scheduler.add(request("waiting", 2.0))
    assert sorted(seq.text for seq in scheduler) == ["held", "running", "waiting"]
