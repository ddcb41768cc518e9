"""Sampling parameters and the choice of the next token from logits."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Dividing logits by a tinier temperature overflows them to inf (and the distribution to NaN).
GREEDY_BELOW = 1e-5
# Tokens top_p looks among first, in order (more where they hold less than top_p of the mass).
CANDIDATES = 1024


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
    """Pick a token from one row of (penalised) logits; `best`: the row's token where it was chosen already, with
    the step's other rows (`preselect`)."""
    if best is not None:
        return best
    if params.temperature < GREEDY_BELOW:  # max's index is argmax's (the first of equals), at a third of its time
        return int(logits.max(-1).indices)
    return int(draw(probabilities(logits[None], [params]), generator)[0])


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token from each row of probs [rows, vocab], by its cumulative sum: a uniform draw and a binary search a
    row (torch.multinomial, by one exponential draw a token, took 1 ms a row over 49k tokens on 2 CPU cores)."""
    cdf = probs.cumsum(-1)
    u = torch.rand(len(probs), 1, generator=generator, device=probs.device, dtype=cdf.dtype)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=probs.shape[-1] - 1)[:, 0]


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[rows, vocab] logits -> the distribution each row samples from: its temperature, then its top_k, then its
    top_p (the best token always stays), in ops over all the rows at once."""
    device, width = logits.device, logits.shape[-1]
    logits = logits / torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)[:, None]
    ks = [p.top_k if 0 < p.top_k < width else 0 for p in params]
    if any(ks):
        top = torch.topk(logits, max(ks), dim=-1).values
        kth = top.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=device)[:, None])
        kth = kth.masked_fill(torch.tensor(ks, device=device)[:, None] == 0, float("-inf"))  # no top_k: nothing out
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        probs = logits.softmax(-1)
        tops = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], device=device, dtype=probs.dtype)
        # The best tokens in order, only as many as hold each row's top_p (a sort of all 49k took 3.4 ms a row).
        k = min(width, CANDIDATES)
        while True:
            best, order = torch.topk(probs, k, dim=-1)
            if k == width or bool(((best.sum(-1) >= tops) | (tops > 1)).all()):
                break
            k = min(width, 8 * k)
        # Keep a token while the mass before it is under top_p; the best always (a top_p of 5e-324 is 0 in float32).
        keep = (best.cumsum(-1) - best) < tops[:, None]
        keep[:, 0] = True
        kept = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, order, keep) | (tops > 1)[:, None]
        logits = logits.masked_fill(~kept, float("-inf"))
    return logits.softmax(-1)


def preselect(logits: torch.Tensor, rows: list[tuple[SamplingParams, bool]]) -> list[int | None]:
    """The tokens of a step's rows that can be chosen together, with one copy to the host: each greedy row's argmax,
    and a draw for each sampled row that needs no penalties and may share a generator (`rows`: each row's params
    and whether it may: not with a seed of its own, nor a grammar). None where a row is chosen alone (`choose`)."""
    out: list[int | None] = list(logits.max(-1).indices.tolist())
    drawn = []
    for i, (params, free) in enumerate(rows):
        if params.temperature < GREEDY_BELOW:
            continue
        out[i] = None
        if free and not (params.logit_bias or params.presence_penalty or params.frequency_penalty):
            drawn.append(i)
    if drawn:
        probs = probabilities(logits[drawn], [rows[i][0] for i in drawn])
        for i, token in zip(drawn, draw(probs).tolist()):
            out[i] = token
    return out


def logprob_of(logits: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    """Log-probabilities of the model's own distribution (before temperature and penalties)."""
    logprobs = logits.log_softmax(-1)
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        values, ids = torch.topk(logprobs, k)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token_id, float(logprobs[token_id]), top)
