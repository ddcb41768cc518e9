"""Sampling parameters and the choice of the next token from logits."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Dividing logits by a tinier temperature overflows them to inf (and the distribution to NaN).
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # below GREEDY_BELOW (0 included): greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # None: no logprobs; k: the chosen token's plus the top k
    grammar: str | None = None  # compiled (runtime/grammar.py): what the output must match
    # A tool format's open and close tags: a call written again word for word ends the answer before it.
    calls: tuple[str, str] | None = None


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), best first


def penalise(logits: torch.Tensor, params: SamplingParams, output_ids: list[int]) -> torch.Tensor:
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=logits.device)
        bias = torch.tensor(list(params.logit_bias.values()), device=logits.device, dtype=logits.dtype)
        logits = logits.index_add(0, ids, bias)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output_ids, device=logits.device), minlength=logits.shape[0])
        counts = counts[: logits.shape[0]].to(logits.dtype)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    return logits


def choose(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, best: int | None = None
) -> int:
    """Pick a token from one row of (penalised) logits; `best`: their argmax, where known."""
    if params.temperature < GREEDY_BELOW:  # max's index is argmax's (the first of equals), at a third of its time
        return int(logits.max(-1).indices) if best is None else best
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[0]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token once the mass before it already reaches top_p; the best token always stays.
        drop = cumulative - sorted_logits.softmax(-1) >= params.top_p
        drop[0] = False  # a top_p below float32's smallest value (5e-324) would compare as 0 and drop it too
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def logprob_of(logits: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    """Log-probabilities of the model's own distribution (before temperature and penalties)."""
    logprobs = logits.log_softmax(-1)
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        values, ids = torch.topk(logprobs, k)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token_id, float(logprobs[token_id]), top)
