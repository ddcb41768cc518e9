"""runtime/sampling.py: the filters behave as OpenAI and vLLM define them."""

from __future__ import annotations

import pytest
import torch

from kvgate.runtime.engine import Engine
from kvgate.runtime.sampling import SamplingParams, choose, logprob_of, penalise
from kvgate.runtime.sequence import Result

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


def test_logprobs_are_the_models_own_distribution_before_temperature_and_penalties(engine: Engine, chat_ids) -> None:
    """The same context gives the same logprobs, whatever temperature and penalties then make of them."""
    ids = chat_ids("Repeat the word hello five times.")  # a repetitive answer: the penalties bite

    def run(**sampling) -> Result:
        return engine.generate_sync(ids, SamplingParams(**{"max_tokens": 8, "logprobs": 5, **sampling}))

    plain, hot = run(temperature=0), run(temperature=1.5, seed=0, max_tokens=1)
    penalised = run(temperature=0, presence_penalty=2.0, frequency_penalty=2.0)
    # Up to the first token the penalties changed, both read the same context.
    same = next(i for i, (a, b) in enumerate(zip(plain.token_ids, penalised.token_ids)) if a != b)
    assert same > 0 and [lp.logprob for lp in penalised.logprobs[:same]] == pytest.approx(
        [lp.logprob for lp in plain.logprobs[:same]], abs=1e-4
    )
    for other, steps in ((hot, 1), (penalised, same + 1)):
        for a, b in zip(plain.logprobs[:steps], other.logprobs[:steps], strict=True):
            assert [t for t, _ in b.top] == [t for t, _ in a.top]
            assert [lp for _, lp in b.top] == pytest.approx([lp for _, lp in a.top], abs=1e-4)
