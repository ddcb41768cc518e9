"""The tool-duration predictor: a prior until observations come, then their distribution."""

from __future__ import annotations

import math
import random

from kvgate.agents import ANY, PinPolicy, Predictor, Prior, benefit, decide


def lognormal_cdf(t: float, median: float, sigma: float) -> float:
    return 0.5 * (1 + math.erf(math.log(t / median) / (sigma * math.sqrt(2)))) if t > 0 else 0.0


def distance(predictor: Predictor, tool: str, median: float, sigma: float) -> float:
    """The largest gap between the predicted and the true P(duration <= t) (Kolmogorov-Smirnov)."""
    waits, p = predictor.distribution([tool])
    return max(abs(q - lognormal_cdf(t, median, sigma)) for t, q in zip(waits, p))


def test_a_tool_not_seen_yet_follows_the_prior() -> None:
    prior = Prior(median_s=2.0, sigma=1.0)
    predictor = Predictor(prior)
    waits, p = predictor.distribution(["never-called"])
    assert all(abs(q - prior.cdf(t)) < 1e-9 for t, q in zip(waits, p))
    assert abs(prior.cdf(prior.quantile(0.9)) - 0.9) < 1e-6


def test_the_predictor_converges_on_a_known_distribution() -> None:
    rng = random.Random(7)
    median, sigma = 6.0, 0.5  # far from the prior (2 s, sigma 1)
    predictor = Predictor(Prior(), window=4096)
    gaps = []
    for n in (10, 100, 3000):
        while predictor.observed("run_tests") < n:
            predictor.observe(["run_tests"], rng.lognormvariate(math.log(median), sigma))
        gaps.append(distance(predictor, "run_tests", median, sigma))
    assert gaps[0] > gaps[1] > gaps[2]
    assert gaps[2] < 0.03


def test_the_ttl_converges_on_the_best_ttl_of_the_true_distribution() -> None:
    rng = random.Random(3)
    median, sigma, saved, held = 3.0, 0.4, 4.0, 0.05
    predictor = Predictor(Prior(), window=4096)
    for _ in range(3000):
        predictor.observe(["search"], rng.lognormvariate(math.log(median), sigma))
    waits, p = predictor.distribution(["search"])
    ttl = decide(PinPolicy(), waits, p, saved, held)

    def true_gain(t: float) -> float:
        return benefit(lognormal_cdf(t, median, sigma), saved, held, 1.0, t)

    best = max(true_gain(t / 100) for t in range(1, 3000))
    assert true_gain(ttl) > 0.98 * best


def test_tools_called_together_come_back_when_the_slowest_does() -> None:
    predictor = Predictor(Prior(weight=0.0))
    for _ in range(50):
        predictor.observe(["fast"], 1.0)
        predictor.observe(["slow"], 5.0)
    waits, p = predictor.distribution(["fast", "slow"])
    assert dict(zip(waits, p))[1.0] == 0.0 and dict(zip(waits, p))[5.0] == 1.0


def test_every_observation_also_counts_for_any_tool() -> None:
    predictor = Predictor()
    predictor.observe(["a"], 1.0)
    predictor.observe(["b"], 2.0)
    assert predictor.observed(ANY) == 2 and predictor.observed("a") == 1


def test_the_window_keeps_the_latest_observations() -> None:
    predictor = Predictor(Prior(weight=0.0), window=10)
    for _ in range(10):
        predictor.observe(["tool"], 1.0)
    for _ in range(10):
        predictor.observe(["tool"], 9.0)  # the tool got slower: the old durations are forgotten
    waits, p = predictor.distribution(["tool"])
    assert dict(zip(waits, p))[9.0] == 1.0
    assert max(q for t, q in zip(waits, p) if t < 9.0) == 0.0


def test_the_next_call_is_predicted_from_the_calls_seen_to_follow_the_last_one() -> None:
    predictor = Predictor(Prior(weight=0.0))
    for _ in range(30):  # programs that search, then run the tests
        predictor.called((), ("search",))
        predictor.observe(["search"], 1.0)
        predictor.called(("search",), ("run_tests",))
        predictor.observe(["run_tests"], 8.0)
    waits, p = predictor.after(("search",))
    back = dict(zip(waits, p))
    assert back[1.0] < 0.05 and back[8.0] == 1.0  # after a search comes a slow test run
    waits, p = predictor.after(())
    assert dict(zip(waits, p))[1.0] > 0.9  # a program's first call is a quick search
