"""The workloads of `kvgate bench engines`: one streamed request, and every row's requests to both engines.

RAG prompts reach vLLM as kvgate's own token ids (`rag_body`). Each row keeps, per engine and in the order
sent, what it times, every measured request's prompt tokens (as the engine's own usage reports them; a row
whose two engines' counts differ at the same request stops the run: the engines would not be computing the
same prompt), and, for a reuse row, whether the greedy answer equals that engine's own full prefill of the
same prompt (kvgate: `kvgate: {"reuse": "full"}`; vLLM: the same request under a fresh `cache_salt`, which
its prefix cache shares with nothing), with the `x-kvgate-reuse` and `x-kvgate-fidelity` kvgate reported.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
from transformers import PreTrainedTokenizerBase

from kvgate.runtime.documents import chat_pieces, document_ids
from kvgate.runtime.progress import progress

ENGINES = ("kvgate", "vllm")
ANSWER = 16  # greedy answer tokens compared with the engine's own full prefill
AGENT_SAYS = "I will look that up with the search tool."  # the agent's turn, the same text to both engines


class PromptMismatch(RuntimeError):
    """The two engines were sent prompts of different token counts: their rows would not compare."""


class Pair(Protocol):
    """The two engines served (engines.py `Engines`)."""

    def order(self, rep: int) -> list[tuple[str, str]]: ...

    def alone(self, engine: str) -> AbstractContextManager[None]: ...


# ---- one request ----------------------------------------------------------------------------------


@dataclass
class Reply:
    began: float  # time.perf_counter() when sent
    first: float  # ... when the first content came
    end: float  # ... when the last chunk came
    text: str
    tokens: int
    cached: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # per token, when asked: token, logprob, top_logprobs
    prompt: int = 0  # prompt tokens

    @property
    def ttft(self) -> float:
        return self.first - self.began


def stream(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Reply:
    """A streamed chat completion: when its first content came, its text, its usage."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    began, first, text, usage, logprobs = time.perf_counter(), None, "", {}, []
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"  # token ids: a completion
    with httpx.stream("POST", f"{url}{path}", json=body, headers=headers, timeout=900) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.read().decode()[:400]}")
        answered = dict(r.headers)
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                if first is None and (content or choice.get("finish_reason")):
                    first = time.perf_counter()
                text += content
                logprobs += (choice.get("logprobs") or {}).get("content") or ()
    end = time.perf_counter()
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    tokens, prompt = usage.get("completion_tokens", 0), usage.get("prompt_tokens", 0)
    return Reply(began, first or end, end, text, tokens, cached, answered, logprobs, prompt)


def full_prefill(engine: str, body: dict[str, Any]) -> dict[str, Any]:
    """The same request computed in full by that engine: the truth its reuse is held to."""
    if engine == "kvgate":
        return {**body, "kvgate": {"reuse": "full"}}
    return {**body, "cache_salt": uuid.uuid4().hex}  # vLLM: a prefix cache of its own, empty


# ---- the workloads --------------------------------------------------------------------------------


@dataclass
class Rag:
    question: str
    passages: list[str]


def load_rag(data: Path, count: int, docs: int, words: int) -> list[Rag]:
    """Items of MuSiQue, each with `docs` documents of about `words` words (passages joined in turn)."""
    items = []
    with open(data) as f:
        for line in f:
            row = json.loads(line)
            text = " ".join(p.get("text", p) if isinstance(p, dict) else p for p in row["passages"]).split()
            per = max(1, min(words, len(text) // docs))
            items.append(Rag(row["question"], [" ".join(text[i * per : (i + 1) * per]) for i in range(docs)]))
            if len(items) == count:
                break
    return items


def rag_body(
    engine: str, model: str, passages: list[str], question: str, tokenizer: PreTrainedTokenizerBase, **more: Any
) -> dict[str, Any]:
    """kvgate: the documents in its `documents` field. vLLM: the very token ids kvgate computes for them (the
    chat template's head, each document in DOCUMENT_TEMPLATE tokenized alone, the question and the generation
    prompt) as a completion's prompt. Pasted as text into a chat message instead, the same characters
    tokenize otherwise at each document's boundary ("\n\n" before `<document>` is two tokens there, one
    alone): 6 tokens more for 6 documents, and not the same prompt."""
    if engine == "kvgate":
        body = {"messages": [{"role": "user", "content": question}], "documents": [{"text": p} for p in passages]}
    else:
        head, tail = chat_pieces(tokenizer, [{"role": "user", "content": question}])
        body = {"prompt": [*head, *(t for p in passages for t in document_ids(tokenizer, p)), *tail]}
    return {"model": model, "temperature": 0, "max_tokens": ANSWER, **body, **more}


@dataclass
class Row:
    name: str
    unit: str  # "s" (TTFT, lower is better) or "tok/s"
    reuse: bool = False  # a row whose requests reuse KV: each is checked against the engine's own full prefill
    values: dict[str, list[float]] = field(default_factory=lambda: {e: [] for e in ENGINES})
    prompts: dict[str, list[int]] = field(default_factory=lambda: {e: [] for e in ENGINES})
    equal: dict[str, list[bool]] = field(default_factory=lambda: {e: [] for e in ENGINES})
    served: list[str] = field(default_factory=list)  # kvgate's x-kvgate-reuse of each measured request
    fidelity: list[str] = field(default_factory=list)  # kvgate's x-kvgate-fidelity of each measured request
    streams: int = 0  # a decode row's concurrent streams (0: not a decode row)

    def prompt(self, engine: str, tokens: int) -> None:
        """One measured request's prompt tokens; a PromptMismatch when the other engine's same request differed."""
        mine, other = self.prompts[engine], self.prompts[ENGINES[1 - ENGINES.index(engine)]]
        mine.append(tokens)
        i = len(mine) - 1
        if i < len(other) and other[i] != tokens:
            raise PromptMismatch(
                f"{self.name!r}, request {i}: {engine} counted {tokens} prompt tokens, the other engine {other[i]}"
            )

    def took(self, engine: str, reply: Reply, truth: Reply | None = None) -> None:
        """A measured TTFT; with `truth`, the engine's own full prefill of the very prompt."""
        self.values[engine].append(reply.ttft)
        self.prompt(engine, reply.prompt)
        if truth is not None:
            if truth.prompt != reply.prompt:
                raise PromptMismatch(f"{self.name!r}: {engine}'s full prefill counted {truth.prompt} prompt tokens, "
                                     f"its reuse {reply.prompt}")  # fmt: skip
            self.equal[engine].append(truth.text == reply.text)
        if engine == "kvgate":
            self.served.append(reply.headers.get("x-kvgate-reuse", ""))
            self.fidelity.append(reply.headers.get("x-kvgate-fidelity", ""))


def checked(url: str, engine: str, body: dict[str, Any], row: Row) -> None:
    """Send `body` (timed), then its full prefill (not timed), and keep both in `row`."""
    served = stream(url, body)
    row.took(engine, served, stream(url, full_prefill(engine, body)))


def rag_rows(
    engines: Pair, model: str, items: list[Rag], repeats: int, tokenizer: PreTrainedTokenizerBase
) -> list[Row]:
    cold = Row("cold: 6 new documents and a question, TTFT", "s")
    again = Row("the very same request again, TTFT", "s", reuse=True)
    moved = Row("the same documents in another order, another question, TTFT", "s", reuse=True)
    for rep, item in enumerate(progress(items[:repeats], "RAG repeats")):
        order = random.Random(rep).sample(item.passages, len(item.passages))
        other = f"In one sentence: {item.question}"
        for engine, url in engines.order(rep):
            with engines.alone(engine):
                body = rag_body(engine, model, item.passages, item.question, tokenizer)
                cold.took(engine, stream(url, body))
                checked(url, engine, body, again)
                checked(url, engine, rag_body(engine, model, order, other, tokenizer), moved)
    return [cold, again, moved]


def turns(system: str, question: str, results: Iterator[str]) -> Iterator[list[dict[str, str]]]:
    """An agent's prompts: the question, then each turn the agent's (fixed) call and a tool's result appended."""
    history = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    for result in results:
        yield history
        history = [*history, {"role": "assistant", "content": AGENT_SAYS}, {"role": "user", "content": result}]


def chat_rows(engines: Pair, model: str, items: list[Rag], system: str, repeats: int) -> list[Row]:
    shared = Row("one long system prompt, a new question each time, TTFT", "s", reuse=True)
    agent = Row("an agent's next turn (history resent, a tool result appended), TTFT", "s", reuse=True)
    asked = {"model": model, "temperature": 0, "max_tokens": ANSWER}
    for engine, url in engines.order(0):
        with engines.alone(engine):
            hello = [{"role": "system", "content": system}, {"role": "user", "content": "Hi."}]
            stream(url, {**asked, "max_tokens": 4, "messages": hello})
            for rep in range(repeats):
                question = f"Question {rep}: {items[rep % len(items)].question}"
                messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
                checked(url, engine, {**asked, "messages": messages}, shared)
    for rep in progress(range(repeats), "agent repeats"):
        results = (" ".join(items[(rep + s) % len(items)].passages[s].split()[:120]) for s in range(3))
        prompts = list(turns(f"Agent {rep}. {system[:1500]}", items[rep % len(items)].question, results))
        for engine, url in engines.order(rep):
            with engines.alone(engine):
                for step, messages in enumerate(prompts):
                    if step == 0:  # the first turn is cold: it leaves what the next ones reuse
                        stream(url, {**asked, "messages": messages})
                    else:
                        checked(url, engine, {**asked, "messages": messages}, agent)
    return [shared, agent]


def decode_row(streams: int) -> Row:
    if streams == 1:
        return Row("decode, 1 stream, 128 tokens", "tok/s", streams=1)
    return Row(f"decode, {streams} streams, 64 tokens each", "tok/s", streams=streams)


def decode_rows(engines: Pair, model: str, repeats: int, streams: tuple[int, ...] = (1, 8)) -> list[Row]:
    """Tokens/s after the first token: one stream's (128 tokens), and N concurrent streams' together (64 tokens
    each, from the first first token to the last end), for each N of `streams`."""
    rows = [decode_row(n) for n in streams]
    body = {"model": model, "temperature": 0, "ignore_eos": True}
    for rep in progress(range(repeats), "decode repeats"):
        for engine, url in engines.order(rep):
            for row in rows:
                if row.streams == 1:
                    messages = [{"role": "user", "content": f"Tell a long story about ship number {rep}."}]
                    with engines.alone(engine):
                        r = stream(url, {**body, "max_tokens": 128, "messages": messages})
                    row.values[engine].append((r.tokens - 1) / (r.end - r.first))
                    row.prompt(engine, r.prompt)
                    continue
                asks = [
                    {**body, "max_tokens": 64, "messages": [{"role": "user", "content": f"Story {rep}-{i}."}]}
                    for i in range(row.streams)
                ]
                with engines.alone(engine), ThreadPoolExecutor(row.streams) as pool:
                    replies = list(pool.map(stream, [url] * row.streams, asks))
                span = max(r.end for r in replies) - min(r.first for r in replies)
                row.values[engine].append(sum(r.tokens - 1 for r in replies) / span)
                row.prompt(engine, sum(r.prompt for r in replies))
    return rows
