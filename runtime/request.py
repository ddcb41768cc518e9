"""What a caller hands the engine and gets back: a prompt's plan of pieces, a request, its outputs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvgate.agents.programs import Turn
from kvgate.runtime.errors import InvalidPrompt, PromptTooLong
from kvgate.runtime.reuse import ReuseMode
from kvgate.runtime.reuse_report import NOTHING, ReuseReport
from kvgate.runtime.sampling import SamplingParams, TokenLogprob
from kvgate.runtime.stages import Stages


@dataclass(frozen=True)
class Plan:
    """A prompt made of pieces, some of them documents whose KV may be reused."""

    pieces: list[list[int]]
    documents: list[bool]
    reuse: ReuseMode = ReuseMode()
    scope: str = ""
    # Which pieces are message contents agents share (runtime/spans.py), and who reads them: the
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
    report: ReuseReport = NOTHING  # what reuse made of the prompt's KV
    stages: Stages | None = None  # the last output's: when the request passed each stage


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
    report: ReuseReport = NOTHING
    stages: Stages | None = None

    def add(self, out: Output) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        self.prompt_tokens, self.completion_tokens, self.report = out.prompt_tokens, out.completion_tokens, out.report
        self.stages = out.stages or self.stages


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
