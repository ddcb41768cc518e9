"""One request's state inside the engine: tokens, KV, text so far, stop conditions."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from kvgate.agents.programs import Turn
from kvgate.chunk_cache import ChunkKV
from kvgate.runtime.blend import Steps
from kvgate.runtime.errors import InvalidPrompt, PromptTooLong
from kvgate.runtime.kv import KVCache
from kvgate.runtime.reuse import Reuse
from kvgate.runtime.sampling import SamplingParams, TokenLogprob
from kvgate.runtime.shared import Shared
from kvgate.runtime.tokens import decoder
from kvgate.runtime.tools import partial_suffix

_ids = itertools.count()


@dataclass(frozen=True)
class Plan:
    """A prompt made of pieces, some of them documents whose KV may be reused."""

    pieces: list[list[int]]
    documents: list[bool]
    reuse: Reuse = Reuse()
    scope: str = ""
    # Which pieces are message contents agents share (runtime/shared.py), and who reads them: the
    # agent as its prefix identifies it, the same across its tasks.
    spans: list[bool] = field(default_factory=list)
    agent: str = ""
    note: str = ""  # how the plan was found, for x-kvgate-reuse

    def after(self, done: int) -> Plan:
        """The plan of the prompt after its first `done` tokens (an exact head already in the KV); a
        document the head cuts into goes on as plain tokens."""
        pieces, documents, offset = [], [], 0
        for ids, is_document in zip(self.pieces, self.documents):
            if offset + len(ids) > done:
                cut = max(0, done - offset)
                pieces.append(ids[cut:])
                documents.append(is_document and cut == 0)
            offset += len(ids)
        return replace(self, pieces=pieces, documents=documents)


@dataclass
class Missing:
    """A document of the prompt that no tier holds: computed alone (positions 0..T-1), chunk by
    chunk in its sequence's steps like any prefill, then stored."""

    key: str
    token_ids: list[int]
    kv: KVCache  # its layers: views of keys and values
    keys: torch.Tensor  # [layers, kv_heads, T, head_dim]
    values: torch.Tensor


@dataclass(frozen=True)
class Request:
    """One generation as the engine takes it (the one message from the gateway, or any caller, to the
    engine): the prompt, how to sample it (the grammar among that), how its KV may be reused, the agent
    program turn it belongs to, and whose it is. `ingest`: only compute and keep the plan's documents."""

    prompt_ids: list[int]
    params: SamplingParams
    plan: Plan | None = None
    turn: Turn | None = None
    tenant: str = ""  # admission counts it, the scheduler shares its slots fairly by it
    ingest: bool = False


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Output:
    """What one step produced for a sequence: new text, and the finish reason when done."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    stop_reason: str | int | None = None  # what stopped it, as vLLM says: the stop string or token id matched
    cached_tokens: int = 0  # prompt tokens whose KV came from a cache and was kept
    recomputed_tokens: int = 0  # cached prompt tokens computed again (blend)
    reuse: str = ""  # how the prompt's KV was made, when documents were reused; and why if not as asked
    fidelity: str = ""  # how far that reuse moves the first token, as last measured (runtime/caching.py)


@dataclass
class Result:
    """A whole completion, gathered from its outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0
    reuse: str = ""
    fidelity: str = ""

    def add(self, out: Output) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        self.prompt_tokens, self.completion_tokens = out.prompt_tokens, out.completion_tokens
        self.cached_tokens, self.recomputed_tokens, self.reuse = out.cached_tokens, out.recomputed_tokens, out.reuse
        self.fidelity = out.fidelity


@dataclass
class CacheState:
    """What reuse did and has yet to do for one sequence. Written by caching (runtime/caching.py) and by the
    engine's prefill steps that run it; the rest of the engine only reads it (for the answer's usage)."""

    planned: bool = False  # the plan's (or the turn's) reuse has run
    exact: int = 0  # leading prompt tokens whose KV is full prefill's own (what prefix blocks may keep)
    # Where the rows that are full prefill's own bit for bit end: rows read decoded (or lossy) and every row
    # computed over them are not (runtime/caching.py `read`).
    bitwise: int = 1 << 62
    matched: int = 0  # where the prompt's tokens found in prefix blocks end (the read itself ends on the grid)
    blended: int = 0  # prompt tokens read from the blocks an earlier blend of the same tokens left
    kept: int = 0  # where storing its prefix blocks goes on (the blocks before are stored)
    chunked: int = 0  # where keeping its content-defined chunks goes on
    missing: list[Missing] | None = None  # the plan's documents no tier holds (None: not looked yet)
    fresh: dict[str, ChunkKV] = field(default_factory=dict)  # documents computed for this prompt
    in_context: set[str] = field(default_factory=set)  # new documents whose KV this prompt's full prefill leaves
    reusing: Steps[torch.Tensor | None] | None = None  # the reuse underway, spread over steps
    gated: tuple[str, float] | None = None  # the gate's key served (a mode or KVCOMM shape) and its ratio (FULL: none)
    shared: Shared | None = None  # a span prefill whose lessons wait for the prompt's KV to complete
    cached_tokens: int = 0  # prompt tokens whose KV came from a cache and was kept
    recomputed_tokens: int = 0  # cached prompt tokens computed again (blend)
    reuse: str = ""  # how the prompt's KV was made (x-kvgate-reuse)
    fidelity: str = ""  # how far that moves the first token, as last measured (x-kvgate-fidelity)


def check_fits(prompt_tokens: int, max_tokens: int | None, window: int) -> None:
    """Raise InvalidPrompt for a prompt no sequence can take (PromptTooLong: past the context `window`)."""
    if prompt_tokens == 0:
        raise InvalidPrompt("the prompt is empty")
    if prompt_tokens >= window:
        raise PromptTooLong(
            f"the prompt has {prompt_tokens} tokens; this model's context window is {window} tokens, "
            "including the completion"
        )
    if max_tokens is not None and prompt_tokens + max_tokens > window:
        raise PromptTooLong(
            f"max_tokens={max_tokens} plus the prompt's {prompt_tokens} tokens exceed this model's context "
            f"window of {window} tokens"
        )


def run_end(computed: int, budget: int, length: int, grid: int = 1) -> int:
    """Where a prompt chunk starting at `computed` ends within `budget`: the prompt's end, or else the last
    multiple of `grid` (`computed` itself when none fits: an empty chunk)."""
    stop = min(computed + budget, length)
    return stop if stop == length else max(computed, stop - stop % grid)


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    kv: KVCache
    eos_ids: frozenset[int]
    max_len: int  # context window: prompt + output never exceed it
    id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of text already handed out
    decoded_from: int = 0  # the output tokens `detokenize` decodes beside the new ones: decoded_from..decoded_to
    decoded_to: int = 0
    pending_ids: list[int] = field(default_factory=list)  # tokens not yet handed out
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None
    plan: Plan | None = None
    turn: Turn | None = None
    tenant: str = ""  # whose: the scheduler shares its queue fairly between tenants
    ingest: bool = False  # only compute and store the plan's documents: no answer
    cache: CacheState = field(default_factory=CacheState)  # what reuse did for it (runtime/caching.py)
    matcher: Any = None  # the grammar's state (an llguidance LLMatcher) when params.grammar is set
    arrival: float = field(default_factory=time.monotonic)

    @classmethod
    def of(cls, request: Request, kv: KVCache, eos_ids: frozenset[int], max_len: int) -> Sequence:
        r = request
        return cls(
            list(r.prompt_ids),
            r.params,
            kv,
            eos_ids,
            max_len,
            plan=r.plan,
            turn=r.turn,
            tenant=r.tenant,
            ingest=r.ingest,
        )

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator(device=self.kv.device).manual_seed(self.params.seed)

    @property
    def computed(self) -> int:
        """Tokens whose KV is in the cache."""
        return len(self.kv)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt_ids)

    def next_run(self, budget: int, grid: int = 1) -> list[int]:
        """The tokens to compute in the next step: a prompt chunk, or the last sampled token. A chunk that
        stops short of the prompt's end stops at a multiple of `grid` (none fits: empty), so that the prompt's
        KV is the same however it is chunked (runtime/model.py)."""
        if not self.prefilling:
            return self.output_ids[-1:]
        return self.prompt_ids[self.computed : run_end(self.computed, budget, len(self.prompt_ids), grid)]

    def add(self, token_id: int, logprob: TokenLogprob | None, tokenizer: PreTrainedTokenizerBase) -> None:
        self.output_ids.append(token_id)
        self.pending_ids.append(token_id)
        if logprob is not None:
            self.pending_logprobs.append(logprob)
        p = self.params
        if token_id in p.stop_token_ids or (token_id in self.eos_ids and not p.ignore_eos):
            self.finish_reason = "stop"
            self.stop_reason = token_id if token_id in p.stop_token_ids else None
            self.detokenize(tokenizer, len(self.output_ids) - 1, whole=True)  # the text before the stop token
            return
        full = len(self.output_ids) >= p.max_tokens or len(self.prompt_ids) + len(self.output_ids) >= self.max_len
        self.detokenize(tokenizer, len(self.output_ids), whole=full)
        self.check_stop_strings()
        self.check_repeated_call()
        if self.finish_reason is None and full:
            self.finish_reason = "length"

    def detokenize(self, tokenizer: PreTrainedTokenizerBase, end: int, whole: bool) -> None:
        """Append the text output tokens ..end complete (`whole`: all of it, half a character too), decoding the
        new ones beside those of the text before (as vLLM does): a token's text can depend on the one before it
        (a leading space, a character split over byte tokens). Each token costs the same however long the
        output is."""
        if end <= self.decoded_to:
            return
        ids, decode = self.output_ids[self.decoded_from : end], decoder(tokenizer)
        before, now = decode(ids[: self.decoded_to - self.decoded_from]), decode(ids)
        if len(now) > len(before) and (whole or not now.endswith("\ufffd")):  # else wait for the character's rest
            self.text += now[len(before) :]
            self.decoded_from, self.decoded_to = self.decoded_to, end

    def check_stop_strings(self) -> None:
        if not self.params.stop:
            return
        # Only the tail can hold a new match: the last token's text plus a stop string's length.
        window = max(self.sent - max(map(len, self.params.stop)), 0)
        hits = [(i, s) for s in self.params.stop if (i := self.text.find(s, window)) >= 0]
        if hits:
            at, self.stop_reason = min(hits)
            self.text = self.text[:at]
            self.finish_reason = "stop"

    def check_repeated_call(self) -> None:
        """A tool call written again word for word is a loop, not a second call (a small model that repeats
        one, greedy, repeats it until max_tokens): the answer ends before it, its calls made."""
        if self.params.calls is None or self.finish_reason is not None:
            return
        opening, closing = self.params.calls
        at = self.text.rfind(opening)
        end = self.text.find(closing, at) if at >= 0 else -1
        if end >= 0 and self.text[at : end + len(closing)] in self.text[:at]:
            self.text, self.finish_reason = self.text[:at], "stop"

    def repeating(self) -> int:
        """Where a tool call that so far repeats an earlier one word for word begins (held back: it may be a
        loop, which check_repeated_call cuts), else the text's length."""
        opening, closing = self.params.calls or ("", "")
        if not opening:
            return len(self.text)
        part = partial_suffix(self.text, opening)
        start = len(self.text) - part if part else self.text.rfind(opening)
        if start < 0 or closing in self.text[start:] or self.text[start:] not in self.text[:start]:
            return len(self.text)
        return start

    def take_output(self) -> Output | None:
        """New text since the last call; None when nothing can be handed out yet."""
        done = self.finish_reason is not None
        end = len(self.text)
        if not done:
            # Hold back text that may be the start of a stop string, or half a UTF-8 character.
            if self.params.stop:
                end -= max(map(len, self.params.stop)) - 1
            if self.text.endswith("\ufffd"):
                end = min(end, len(self.text) - 1)
            end = min(end, self.repeating())
        end = max(end, self.sent)
        if not done and end == self.sent and not self.pending_logprobs:
            return None
        out = Output(
            text=self.text[self.sent : end],
            token_ids=self.pending_ids,
            logprobs=self.pending_logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
            cached_tokens=self.cache.cached_tokens,
            recomputed_tokens=self.cache.recomputed_tokens,
            reuse=self.cache.reuse,
            fidelity=self.cache.fidelity,
        )
        self.sent, self.pending_ids, self.pending_logprobs = end, [], []
        return out
