"""One request's state inside the engine: tokens, KV, text so far, stop conditions."""

from __future__ import annotations

import itertools
import time
from dataclasses import InitVar, dataclass, field
from enum import Enum
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from kvgate.agents.programs import Turn
from kvgate.runtime.kv import KVCache
from kvgate.runtime.prompt_kv import PromptKV
from kvgate.runtime.request import Output, Plan, Request
from kvgate.runtime.sampling import SamplingParams, TokenLogprob
from kvgate.runtime.stages import Stages
from kvgate.runtime.tokens import Detokenizer
from kvgate.runtime.tools import partial_suffix

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


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
    detokenizer: Detokenizer | None = None  # made with the first token
    pending_ids: list[int] = field(default_factory=list)  # tokens not yet handed out
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None
    plan: InitVar[Plan | None] = None
    turn: Turn | None = None
    tenant: str = ""  # whose: the scheduler shares its queue fairly between tenants
    ingest: bool = False  # only compute and store the plan's documents: no answer
    matcher: Any = None  # the grammar's state (an llguidance LLMatcher) when params.grammar is set
    arrival: float = field(default_factory=time.monotonic)
    admitted: float | None = None  # time.monotonic() when the scheduler took it in
    first_token: float | None = None  # and when its first token was sampled
    prompt: PromptKV = field(init=False)  # what its prompt's KV reuses and leaves (the one writer of that state)

    @classmethod
    def of(cls, request: Request, kv: KVCache, eos_ids: frozenset[int], max_len: int, matcher: Any = None) -> Sequence:
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
            matcher=matcher,
        )

    def __post_init__(self, plan: Plan | None) -> None:
        self.prompt = PromptKV(self.id, self.prompt_ids, self.kv, plan, self.turn, self.tenant, self.ingest)
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
        return len(self.kv) < len(self.prompt_ids)

    def admit(self) -> None:
        """The scheduler took it into its running batch."""
        self.status = Status.RUNNING
        self.admitted = time.monotonic()

    def end(self) -> None:
        """The scheduler let it go."""
        self.status = Status.FINISHED

    def stop(self) -> None:
        """Nothing may follow (its documents stored, its grammar complete): it ends as stopped, unless it ended."""
        if self.finish_reason is None:
            self.finish_reason = "stop"

    def next_run(self, budget: int, grid: int = 1) -> list[int]:
        """The tokens to compute in the next step: a prompt chunk, or the last sampled token. A chunk that
        stops short of the prompt's end stops at a multiple of `grid` (none fits: empty), so that the prompt's
        KV is the same however it is chunked (runtime/model.py)."""
        if not self.prefilling:
            return self.output_ids[-1:]
        return self.prompt.chunk(budget, grid)

    def add(self, token_id: int, logprob: TokenLogprob | None, tokenizer: PreTrainedTokenizerBase) -> None:
        if not self.output_ids:
            self.first_token = time.monotonic()
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
        """Append the text output tokens ..end complete (`whole`: all of it, half a character too)."""
        if self.detokenizer is None:
            self.detokenizer = Detokenizer(tokenizer)
        self.text += self.detokenizer.text(self.output_ids, end, whole)

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
            report=self.prompt.report,
            stages=self.stages() if done else None,
        )
        self.sent, self.pending_ids, self.pending_logprobs = end, [], []
        return out

    def stages(self) -> Stages:
        """When it passed each stage, as of now (its last output)."""
        p = self.prompt
        return Stages(
            self.arrival,
            self.admitted,
            p.loaded_at,
            p.reused_at,
            self.first_token,
            time.monotonic(),
            p.reads.by_tier(),
            len(self.output_ids),
        )
