"""The program registry: turns of one program, durations observed, contexts kept, pins expiring."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgate.agents import AgentConfig, PinPolicy, Programs, tool_return
from kvgate.agents.flight import Flight
from kvgate.agents.programs import Turn
from kvgate.chunk_cache import ChunkKV, ChunkStore, MemoryTier
from tests.unit.test_chunk_cache import Clock

CALL = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "search", "arguments": {}}}]}
RESULT = {"role": "tool", "content": "found it"}


@dataclass
class FixedCosts:
    """Costs as numbers (the engine measures them in the gateway)."""

    bytes_per_token: int = 100
    memory_bytes: int = 100_000
    prefill_per_token_s: float = 0.01
    waiting_s: float = 0.0

    def prefill_s(self, tokens: int) -> float:
        return tokens * self.prefill_per_token_s

    def queue_s(self) -> float:
        return self.waiting_s

    def reload_s(self, nbytes: int) -> float | None:
        return None


def keep(store: ChunkStore, turn: Turn, tokens: int, now: float) -> None:
    """What the engine does when a turn ends: store its context under turn.keep, pinned."""
    kv = torch.zeros(1, 1, tokens, 1)
    store.put(ChunkKV(turn.keep, list(range(tokens)), kv, kv), now + turn.pin_s if turn.pin_s else None)


FIXED = PinPolicy("fixed", fixed_ttl_s=10.0)


def make(pins: PinPolicy = FIXED) -> tuple[Programs, ChunkStore, Clock]:
    clock = Clock()
    store = ChunkStore([MemoryTier(budget_bytes=1 << 20, clock=clock)])
    return Programs(AgentConfig(pins=pins), store, FixedCosts(), clock=clock), store, clock


def test_tool_results_are_read_from_openai_messages() -> None:
    assert tool_return([{"role": "user", "content": "hi"}]) is None
    assert tool_return([CALL, RESULT]) == ("search",)
    assert tool_return([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]) == ()


def test_a_tool_return_tells_how_long_the_tool_took() -> None:
    programs, store, clock = make()
    first = programs.begin("p", "tenant", [{"role": "user", "content": "go"}], 100)
    clock.now += 2.0
    programs.end("tenant", first)
    clock.now += 3.5  # the tool runs
    programs.begin("p", "tenant", [CALL, RESULT], 150)
    waits, p = programs.predictor("tenant").distribution(["search"])
    assert programs.predictor("tenant").observed("search") == 1
    assert 3.5 in waits
    assert programs.predictor("other").observed("search") == 0  # one tenant's tools never move another's pins


def test_turns_of_a_program_continue_its_latest_context_and_keep_the_first_arrival() -> None:
    programs, store, clock = make()
    first = programs.begin("p", "tenant", [{"role": "user", "content": "go"}], 100)
    assert first.resume == "" and first.keep and first.pin_s == 10.0
    keep(store, first, 100, clock.now)
    programs.end("tenant", first)
    clock.now += 1.0
    second = programs.begin("p", "tenant", [CALL, RESULT], 150)
    assert second.resume == first.keep and second.keep != first.keep
    assert second.arrival == first.arrival and second.pinned
    keep(store, second, 150, clock.now)
    programs.end("tenant", second)
    assert first.keep not in store and second.keep in store  # the older context is superseded


def test_a_request_without_a_program_id_is_a_program_of_its_own() -> None:
    programs, _, _ = make()
    a = programs.begin(None, "tenant", [], 10)
    b = programs.begin(None, "tenant", [], 10)
    assert a.program != b.program and not a.keep and not a.resume


def test_the_same_program_id_of_two_tenants_is_two_programs() -> None:
    programs, store, clock = make()
    mine = programs.begin("p", "alice", [], 10)
    keep(store, mine, 10, clock.now)
    programs.end("alice", mine)
    theirs = programs.begin("p", "bob", [CALL, RESULT], 20)
    assert theirs.resume == "" and theirs.keep != mine.keep


def test_a_pin_holds_until_its_ttl_and_is_then_demoted() -> None:
    programs, store, clock = make()
    turn = programs.begin("p", "tenant", [], 100)
    keep(store, turn, 100, clock.now)
    programs.end("tenant", turn)
    memory = store.tiers[0]
    clock.now += 9.9
    assert programs.expire() is not None and memory.stats()["pinned"] == 1
    clock.now += 0.2
    assert programs.expire() is None
    assert memory.stats()["pinned"] == 0 and programs.stats()["pinned"] == 0
    assert turn.keep in store  # no tier below memory: demoted means unpinned, not dropped
    nxt = programs.begin("p", "tenant", [CALL, RESULT], 150)
    assert not nxt.pinned and nxt.resume == turn.keep


def test_no_pin_when_it_is_not_worth_its_memory() -> None:
    programs, _, _ = make(PinPolicy("decide", memory_weight=1000.0))
    assert programs.begin("p", "tenant", [], 900).pin_s == 0.0


def test_no_decided_pin_while_memory_keeps_every_context() -> None:
    programs, store, clock = make(PinPolicy("decide"))
    first = programs.begin("p", "t", [], 100)
    programs.end("t", first)
    clock.now += 4.0
    assert programs.begin("p", "t", [CALL, RESULT], 100).pin_s == 0.0  # 10 kB of 100 kB, seconds apart


def test_idle_programs_are_forgotten() -> None:
    programs, _, clock = make()
    programs.begin("p", "tenant", [], 10)
    clock.now += programs.config.idle_s + 1
    programs.expire()
    assert programs.stats()["programs"] == 0


def in_flight(per_context: float = 1.0, max_programs: int = 65536) -> tuple[Programs, Clock]:
    clock = Clock()
    store = ChunkStore([MemoryTier(budget_bytes=1 << 20, clock=clock)])
    config = AgentConfig(pins=FIXED, in_flight=per_context, max_programs=max_programs)
    return Programs(config, store, FixedCosts(), clock=clock), clock


def test_only_a_programs_first_turn_is_first_and_each_turn_measures_its_context() -> None:
    programs, _ = in_flight()
    one = programs.begin("p", "t", [], 250)
    assert one.first and one.tenant == "t"
    programs.end("t", one)
    assert not programs.begin("p", "t", [CALL, RESULT], 500).first
    assert programs.flight.context_bytes == 25_000 + (50_000 - 25_000) / 16  # 100 bytes a token, a running mean
    assert programs.flight.limit() == 3  # 100 kB of memory over ~26.6 kB


def test_the_flight_passed_in_is_the_one_counted_even_while_empty() -> None:
    """The engine's own door (an empty Flight is falsy: it has a length) is what the programs count in."""
    clock = Clock()
    store = ChunkStore([MemoryTier(budget_bytes=1 << 20, clock=clock)])
    door = Flight(1 << 20, per_context=1.0, clock=clock)
    programs = Programs(AgentConfig(pins=FIXED), store, FixedCosts(), clock=clock, flight=door)
    assert programs.flight is door
    programs.end("t", programs.begin("p", "t", [], 250))
    assert door.context_bytes == 25_000  # measured on the door the scheduler holds


def test_a_program_stays_in_flight_through_its_tool_calls_and_lands_with_its_last_turn() -> None:
    programs, clock = in_flight()
    one = programs.begin("p", "t", [], 500)  # 50 of 100 kB: room for two
    programs.flight.start("t", "p")  # the scheduler let its first turn through
    programs.end("t", one, more=True)  # it called a tool
    assert programs.stats()["in_flight"] == 1
    clock.now += 1.0
    two = programs.begin("p", "t", [CALL, RESULT], 500)
    clock.now += programs.config.in_flight_linger_s + 1  # a long turn: it counts until it ends
    assert programs.stats()["in_flight"] == 1
    programs.flight.start("t", "q")
    assert not programs.flight.room()
    programs.end("t", two, more=False)  # it answered: the program is over
    assert programs.stats()["in_flight"] == 1 and programs.flight.room()


def test_a_program_whose_tools_are_late_leaves_the_flight() -> None:
    """Its client may have ended it after a tool call (an Agents SDK run does): counted out once 95%
    of the predicted returns would have come, long before the linger."""
    programs, clock = in_flight()
    one = programs.begin("p", "t", [], 1000)  # all of memory: room for one
    programs.flight.start("t", "p")
    programs.end("t", one, more=True)
    late = programs.programs[("t", "p")].late_s
    assert 0 < late < programs.config.in_flight_linger_s
    clock.now += late - 0.01
    assert not programs.flight.room()
    clock.now += 0.02
    assert programs.flight.room()


def test_programs_forgotten_for_room_or_idleness_leave_the_flight() -> None:
    programs, clock = in_flight(max_programs=1)
    programs.begin("a", "t", [], 100)
    programs.flight.start("t", "a")
    programs.begin("b", "t", [], 100)  # past max_programs: a is forgotten
    assert len(programs.flight) == 0
    programs.flight.start("t", "b")
    clock.now += programs.config.idle_s + 1
    programs.expire()
    assert len(programs.flight) == 0
