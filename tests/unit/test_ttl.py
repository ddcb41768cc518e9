"""The TTL decision: pin for the time that maximises the expected saving net of memory held."""

from __future__ import annotations

import pytest

from kvgate.agents import PinPolicy, decide

WAITS = [1.0, 2.0, 3.0, 30.0]
BACK = [0.25, 0.5, 0.9, 1.0]  # P(the next turn has come within each wait)


def test_off_never_pins_and_fixed_always_pins_for_its_ttl() -> None:
    assert decide(PinPolicy("off"), WAITS, BACK, saved_s=100.0, held=0.01) == 0.0
    assert decide(PinPolicy("fixed", fixed_ttl_s=7.0), WAITS, BACK, saved_s=0.0, held=0.9) == 7.0


def test_cheap_memory_pins_until_the_tool_has_most_likely_returned() -> None:
    # gains: 1 s -> 1.0, 2 s -> 2.0, 3 s -> 3.6, 30 s -> 4.0 - 3.0 = 1.0
    assert decide(PinPolicy(), WAITS, BACK, saved_s=4.0, held=0.1) == 3.0


def test_no_pin_when_holding_the_memory_costs_more_than_it_saves() -> None:
    assert decide(PinPolicy(), WAITS, BACK, saved_s=0.5, held=0.9) == 0.0


def test_the_ttl_never_passes_the_cap() -> None:
    assert decide(PinPolicy(max_ttl_s=2.5), WAITS, BACK, saved_s=1000.0, held=0.0) == 2.0


def test_context_larger_than_the_memory_is_never_pinned() -> None:
    assert decide(PinPolicy(), WAITS, BACK, saved_s=1000.0, held=1.5) == 0.0


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="pin mode"):
        PinPolicy("always")  # type: ignore[arg-type]
