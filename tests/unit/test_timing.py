"""runtime/timing.py: the prefill rate from prefill-sized steps, and what rows added to a step cost."""

from __future__ import annotations

import pytest

from kvgate.runtime.timing import DEFAULT_S_PER_TOKEN, StepTimes


def test_the_prefill_rate_comes_from_prefill_sized_steps_only() -> None:
    times = StepTimes()
    assert times.prefill_s(300) == pytest.approx(300 * DEFAULT_S_PER_TOKEN)  # nothing measured yet
    times.measured(4, 0.12)  # a decode step: its rate (30 ms a token) is no prefill rate
    assert times.prefill_s(300) == pytest.approx(300 * DEFAULT_S_PER_TOKEN)
    times.measured(200, 0.5)
    assert times.prefill_s(100) == pytest.approx(0.25)


def test_rows_added_to_a_step_cost_the_slope_of_step_time_not_its_average() -> None:
    times = StepTimes()
    for tokens in (4, 68, 4, 132, 4, 300) * 5:  # steps cost 0.11 s of weights read, plus 2 ms a row
        times.measured(tokens, 0.11 + 0.002 * tokens)
    assert times.added_s(64) == pytest.approx(64 * 0.002, rel=1e-6)
    assert times.prefill_s(64) > 1.2 * times.added_s(64)  # alone, rows pay a share of the step's fixed cost


def test_with_steps_all_alike_there_is_no_slope_and_rows_cost_the_prefill_rate() -> None:
    times = StepTimes()
    for _ in range(20):
        times.measured(100, 0.3)
    assert times.added_s(64) == pytest.approx(times.prefill_s(64))


def test_a_slope_is_never_above_the_prefill_rate_nor_below_nothing() -> None:
    times = StepTimes()
    for tokens in (64, 300) * 5:  # bigger steps cheaper: noise, or another load on the machine
        times.measured(tokens, 0.5 if tokens == 64 else 0.3)
    assert times.added_s(10) == 0.0
    rising = StepTimes()
    for tokens in (64, 300) * 5:  # a steep slope (a long context's attention): capped at the prefill rate
        rising.measured(tokens, 0.01 if tokens == 64 else 3.0)
    assert rising.added_s(10) == pytest.approx(rising.prefill_s(10))
