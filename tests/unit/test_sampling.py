"""runtime/sampling.py: the filters behave as OpenAI and vLLM define them."""

from __future__ import annotations

import pytest
import torch

from kvgate.runtime.engine import Engine
from kvgate.runtime.request import Result
from kvgate.runtime.sampling import SamplingParams, choose, draw, logprob_of, penalise, preselect, probabilities

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


def test_rows_filtered_together_are_each_filtered_as_alone() -> None:
    """A step's sampled rows are filtered in one set of ops, each by its own temperature, top_k and top_p."""
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    rows = [SamplingParams(), SamplingParams(temperature=0.5, top_k=3), SamplingParams(top_p=0.3),
            SamplingParams(temperature=2.0, top_k=10, top_p=0.9), SamplingParams(top_p=5e-324)]  # fmt: skip
    together = probabilities(logits, rows)
    for row, params, probs in zip(logits, rows, together):
        alone = probabilities(row[None], [params])[0]
        torch.testing.assert_close(probs, alone, rtol=0, atol=1e-7)
    assert (together[1] > 0).sum() == 3 and (together[4] > 0).sum() == 1 and (together[0] > 0).all()
    kept = together[2] > 0  # the smallest set of the best whose mass reaches 0.3
    mass = logits[2].softmax(-1)
    assert mass[kept].sum() >= 0.3 and mass[kept].sum() - mass[kept].min() < 0.3


def sorted_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """top_p by a sort of the whole row: the definition."""
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = sorted_logits.softmax(-1)
    drop = probs.cumsum(-1) - probs >= top_p
    drop[0] = False
    return logits.masked_fill(drop.scatter(0, order, drop), float("-inf")).softmax(-1)


@pytest.mark.parametrize("scale", [8.0, 0.05])  # peaked: the cut among the first candidates; flat: past them
def test_top_p_among_the_best_candidates_is_top_p_over_the_whole_row(scale: float) -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 5000) * scale
    got = probabilities(logits, [SamplingParams(top_p=0.9), SamplingParams(top_p=0.5), SamplingParams()])
    for row, top_p, probs in zip(logits, (0.9, 0.5, 1.0), got):
        want = sorted_top_p(row, top_p) if top_p < 1 else row.softmax(-1)
        assert torch.equal(probs > 0, want > 0)
        torch.testing.assert_close(probs, want, rtol=0, atol=1e-6)


def test_a_draw_follows_the_distribution_and_never_takes_an_excluded_token() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]])
    g = torch.Generator().manual_seed(0)
    tokens = torch.cat([draw(probs.expand(1000, -1), g) for _ in range(4)])
    counts = torch.bincount(tokens, minlength=6).float() / len(tokens)
    assert counts[[0, 2, 5]].sum() == 0
    torch.testing.assert_close(counts, probs[0], rtol=0, atol=0.03)
    again = torch.Generator().manual_seed(0)
    assert torch.equal(draw(probs.expand(1000, -1), again), tokens[:1000])  # a seed draws the same again


def test_preselect_chooses_greedy_rows_and_unseeded_draws_and_leaves_the_rest() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.2, 0.7, 0.1], [0.3, 0.3, 0.4]]))
    rows = [(SamplingParams(temperature=0), True), (SamplingParams(top_k=1), True),
            (SamplingParams(seed=3), False), (SamplingParams(presence_penalty=1.0), True)]  # fmt: skip
    assert preselect(logits, rows) == [0, 2, None, None]
    drawn = {preselect(logits[3:], [(SamplingParams(), True)])[0] for _ in range(300)}
    assert drawn == {0, 1, 2}  # a draw, not the argmax


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
