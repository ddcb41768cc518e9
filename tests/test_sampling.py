"""runtime/sampling.py: the filters behave as OpenAI and vLLM define them."""

from __future__ import annotations

import torch

from kvgate.runtime.sampling import SamplingParams, choose, logprob_of, penalise

LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))


def draws(params: SamplingParams, n: int = 400) -> set[int]:
    g = torch.Generator().manual_seed(0)
    return {choose(LOGITS, params, g) for _ in range(n)}


def test_greedy_takes_the_argmax() -> None:
    assert draws(SamplingParams(temperature=0), 5) == {0}


def test_top_k_keeps_the_k_best() -> None:
    assert draws(SamplingParams(top_k=2)) == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    assert draws(SamplingParams(top_p=0.7)) == {0, 1}
    assert draws(SamplingParams(top_p=0.5)) == {0}
    assert draws(SamplingParams(top_p=0.81)) == {0, 1, 2}


def test_a_top_p_too_small_for_float32_keeps_the_best_token() -> None:
    assert draws(SamplingParams(top_p=5e-324), 20) == {0}  # found by fuzzing: it was a 500


def test_full_distribution_reaches_every_token() -> None:
    assert draws(SamplingParams(temperature=1.0), 2000) == {0, 1, 2, 3}


def test_penalties_and_bias() -> None:
    p = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, logit_bias={3: 10.0})
    out = penalise(LOGITS, p, [0, 0, 1])
    assert torch.allclose(out[0], LOGITS[0] - 1.0 - 1.0)
    assert torch.allclose(out[1], LOGITS[1] - 1.0 - 0.5)
    assert out[2] == LOGITS[2] and torch.allclose(out[3], LOGITS[3] + 10)


def test_logprobs_are_normalised() -> None:
    lp = logprob_of(LOGITS * 3, 1, 2)
    assert [t for t, _ in lp.top] == [0, 1]
    assert torch.isclose(torch.tensor([lp.logprob]).exp(), torch.softmax(LOGITS * 3, -1)[1])


def test_a_tiny_temperature_is_greedy() -> None:
    # Dividing by it would overflow the logits to inf and the distribution to NaN.
    assert draws(SamplingParams(temperature=1e-40), 5) == {0}
