"""Programs in flight (agents/flight.py): how many memory has room for, and when each stops counting."""

from __future__ import annotations

from kvgate.agents.flight import Flight

MIB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_limit_is_the_contexts_memory_holds_times_per_context() -> None:
    flight = Flight(100 * MIB, per_context=2.0)
    assert flight.limit() is None  # nothing measured: no limit
    flight.measure(25 * MIB, recent=1 / 16)
    assert flight.limit() == 8  # memory holds 4 such contexts
    flight.measure(41 * MIB, recent=1 / 16)  # the mean moves a sixteenth of the way: 26 MiB
    assert flight.limit() == 7
    flight.measure(400 * MIB, recent=1.0)
    assert flight.limit() == 1  # never below one: some program must run


def test_off_means_no_limit() -> None:
    flight = Flight(100 * MIB, per_context=0.0)
    flight.measure(50 * MIB, recent=1.0)
    assert flight.limit() is None and flight.room()


def test_a_new_program_waits_until_one_ends() -> None:
    flight = Flight(100 * MIB, per_context=1.0)
    flight.measure(50 * MIB, recent=1.0)  # room for two
    flight.start("t", "a")
    flight.start("t", "b")
    assert not flight.room()
    flight.wait("t", "a")  # a calls a tool: still in flight
    assert not flight.room()
    flight.land("t", "a")
    assert flight.room() and len(flight) == 1
    flight.land("t", "a")  # twice: nothing more lands
    assert len(flight) == 1


def test_a_tool_that_never_returns_stops_counting_after_the_linger() -> None:
    clock = Clock()
    flight = Flight(100 * MIB, per_context=1.0, linger_s=30.0, clock=clock)
    flight.measure(100 * MIB, recent=1.0)  # room for one
    flight.start("t", "a")
    flight.wait("t", "a")
    clock.now = 29.0
    assert not flight.room()
    clock.now = 31.0
    assert flight.room() and len(flight) == 0


def test_a_turn_that_comes_back_counts_until_it_ends_however_long_it_runs() -> None:
    clock = Clock()
    flight = Flight(100 * MIB, per_context=1.0, linger_s=30.0, clock=clock)
    flight.measure(100 * MIB, recent=1.0)
    flight.start("t", "a")
    flight.wait("t", "a")
    clock.now = 20.0
    flight.back("t", "a")  # its tool returned: the turn queues and runs, past the linger
    clock.now = 100.0
    assert not flight.room()


def test_programs_of_two_tenants_with_one_name_are_two_programs() -> None:
    flight = Flight(100 * MIB, per_context=1.0)
    flight.measure(50 * MIB, recent=1.0)
    flight.start("tenant-a", "p")
    flight.start("tenant-b", "p")
    flight.land("tenant-a", "p")
    assert len(flight) == 1 and flight.room()


def test_turns_of_programs_never_started_change_nothing() -> None:
    """Programs begun before the gate was on, or not gated: back and wait do not add them."""
    flight = Flight(100 * MIB, per_context=1.0)
    flight.measure(100 * MIB, recent=1.0)
    flight.back("t", "x")
    flight.wait("t", "x")
    assert len(flight) == 0 and flight.room()
