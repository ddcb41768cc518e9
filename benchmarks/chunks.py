"""`kvgate bench chunks`: documents a RAG framework pastes into the prompt, found by their content.

Two servers over one loaded model, on loopback: kvgate's default (prefix blocks and content-defined
chunks) and the same without chunks. Per MuSiQue item (6 documents of ~300 words), in one run:
- cold: the pasted prompt (LangChain's "stuff" layout: a system message, then `Context:`, the documents
  separated by blank lines, the question) sent new to each server, alternating which goes first: what
  finding and keeping chunks adds to a cold request's TTFT;
- reordered: the same documents in another order with another question, on the default server, as full
  prefill (`reuse: full`, the truth) and as the server chooses (chunks found); then the same two prompts
  through the `documents` field (read once in the first order, then asked in the other), the reuse kvgate
  offers when a client marks its documents. The 16-token greedy answers are compared with full prefill's.
Tokens found: reused + recomputed (blend recomputes some of what it found) over the documents' tokens.
Fidelity against full prefill, per path: the first token's KL over full prefill's top 20 (a token missing from
the path's top 20 is given the path's 20th logprob), how many leading answer tokens agree, and whole answers.
"""

from __future__ import annotations

import math
import random
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate.bench.engines_rows import Rag, Reply, load_rag, stream
from kvgate.bench.server import gateway
from kvgate.gateway.settings import Settings
from kvgate.runtime.loader import load
from kvgate.runtime.progress import progress
from kvgate.runtime.report import table, write_section

SYSTEM = "Answer the question from the context. Be brief."
TARGET_SPEEDUP = 3.0  # reordered pasted documents against full prefill (the target)
TARGET_FOUND = 0.8  # of the tokens the request repeats
TARGET_COLD = 1.05  # a cold request's TTFT with chunks over without, at most


def pasted(model: str, passages: list[str], question: str, **more: Any) -> dict[str, Any]:
    context = "\n\n".join(passages)
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Context:\n{context}\n\nQuestion: {question}"},
    ]
    return {"model": model, "messages": messages, "temperature": 0, "max_tokens": 16, **more}


def marked(model: str, passages: list[str], question: str, **more: Any) -> dict[str, Any]:
    body = pasted(model, [], question, **more)
    body["messages"][1]["content"] = f"Question: {question}"
    return {**body, "documents": [{"text": p} for p in passages]}


@dataclass
class Results:
    cold_on: list[float] = field(default_factory=list)
    cold_off: list[float] = field(default_factory=list)
    full: list[float] = field(default_factory=list)
    chunks: list[float] = field(default_factory=list)
    documents_full: list[float] = field(default_factory=list)
    documents: list[float] = field(default_factory=list)
    found: list[float] = field(default_factory=list)  # (reused + recomputed) / the documents' tokens
    reused: list[float] = field(default_factory=list)  # reused / the documents' tokens
    chunks_equal: int = 0
    documents_equal: int = 0
    chunks_kl: list[float] = field(default_factory=list)
    documents_kl: list[float] = field(default_factory=list)
    chunks_lead: list[int] = field(default_factory=list)
    documents_lead: list[int] = field(default_factory=list)
    how: list[str] = field(default_factory=list)


def recomputed(reply: Reply) -> int:
    return int(reply.headers.get("x-kvgate-recomputed-tokens", 0))


def first_kl(truth: Reply, served: Reply) -> float:
    """KL(full prefill || served) of the first token, over full prefill's top 20."""
    p = {e["token"]: e["logprob"] for e in truth.logprobs[0]["top_logprobs"]}
    q = {e["token"]: e["logprob"] for e in served.logprobs[0]["top_logprobs"]}
    floor = min(q.values())
    return sum(math.exp(lp) * (lp - q.get(token, floor)) for token, lp in p.items())


def leading(truth: Reply, served: Reply) -> int:
    """How many of the answer's first tokens are full prefill's."""
    n = 0
    for a, b in zip(truth.logprobs, served.logprobs):
        if a["token"] != b["token"]:
            break
        n += 1
    return n


SCORED = {"logprobs": True, "top_logprobs": 20}


def run_item(results: Results, item: Rag, i: int, on: str, off: str, model: str, tokens: int) -> None:
    first = [(on, results.cold_on), (off, results.cold_off)]
    for url, into in first if i % 2 == 0 else first[::-1]:
        into.append(stream(url, pasted(model, item.passages, item.question)).ttft)
    order = random.Random(i).sample(item.passages, len(item.passages))
    other = f"In one sentence: {item.question}"
    truth = stream(on, pasted(model, order, other, kvgate={"reuse": "full"}, **SCORED))
    served = stream(on, pasted(model, order, other, **SCORED))
    results.full.append(truth.ttft)
    results.chunks.append(served.ttft)
    results.found.append((served.cached + recomputed(served)) / tokens)
    results.reused.append(served.cached / tokens)
    results.chunks_equal += served.text == truth.text
    results.chunks_kl.append(first_kl(truth, served))
    results.chunks_lead.append(leading(truth, served))
    results.how.append(served.headers.get("x-kvgate-reuse", ""))
    stream(on, marked(model, item.passages, item.question))  # the documents read once, in the first order
    documents_truth = stream(on, marked(model, order, other, kvgate={"reuse": "full"}, **SCORED))
    documents = stream(on, marked(model, order, other, **SCORED))
    results.documents_full.append(documents_truth.ttft)
    results.documents.append(documents.ttft)
    results.documents_equal += documents.text == documents_truth.text
    results.documents_kl.append(first_kl(documents_truth, documents))
    results.documents_lead.append(leading(documents_truth, documents))


def report(r: Results, items: int) -> str:
    mean = statistics.mean
    cold = mean(r.cold_on) / mean(r.cold_off)
    speed, documents_speed = mean(r.full) / mean(r.chunks), mean(r.documents_full) / mean(r.documents)
    rows = [
        [
            "cold pasted prompt, TTFT: chunks on / off",
            f"{mean(r.cold_on):.2f} s / {mean(r.cold_off):.2f} s",
            f"{cold:.3f}x",
            f"<= {TARGET_COLD}x",
        ],
        [
            "reordered pasted documents, TTFT: full prefill / chunks",
            f"{mean(r.full):.2f} s / {mean(r.chunks):.2f} s",
            f"{speed:.2f}x",
            f">= {TARGET_SPEEDUP}x",
        ],
        [
            "the same through `documents`, TTFT: full prefill / reuse",
            f"{mean(r.documents_full):.2f} s / {mean(r.documents):.2f} s",
            f"{documents_speed:.2f}x",
            "",
        ],
        ["documents' tokens found (reused + recomputed)", "", f"{mean(r.found):.1%}", f">= {TARGET_FOUND:.0%}"],
        ["documents' tokens reused (`cached_tokens`)", "", f"{mean(r.reused):.1%}", ""],
        ["16-token greedy answers equal to full prefill's: chunks", "", f"{r.chunks_equal} of {items}", ""],
        ["... through `documents`", "", f"{r.documents_equal} of {items}", ""],
        ["first-token KL from full prefill (top 20), mean: chunks", "", f"{mean(r.chunks_kl):.4f}", ""],
        ["... through `documents`", "", f"{mean(r.documents_kl):.4f}", ""],
        ["leading answer tokens equal to full prefill's, mean of 16: chunks", "", f"{mean(r.chunks_lead):.1f}", ""],
        ["... through `documents`", "", f"{mean(r.documents_lead):.1f}", ""],
    ]
    how = "\n".join(f"- item {i}: `x-kvgate-reuse: {h}`" for i, h in enumerate(r.how))
    return f"{table(['row', 'seconds', 'ratio', 'target'], rows)}\n\n{how}\n"


def bench_chunks(settings: Settings, data: Path, count: int, output: Path, command: str) -> str:
    items = load_rag(data, count, docs=6, words=300)
    base = settings.model_copy(update={"semantic_cache": {"enabled": False}})
    loaded = load(base.engine_config())
    results = Results()
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:  # nothing cached from before
        with_chunks = base.model_copy(update={"caches": {"dir": Path(a)}})
        without = base.model_copy(update={"caches": {"dir": Path(b), "content_chunks": False}})
        with gateway(with_chunks, loaded) as (on, model), gateway(without, loaded) as (off, _):
            on, off = on.removesuffix("/v1"), off.removesuffix("/v1")
            for i, item in enumerate(progress(items, "items")):
                tokens = sum(len(loaded.tokenizer.encode(p, add_special_tokens=False)) for p in item.passages)
                run_item(results, item, i, on, off, model, tokens)
    body = report(results, len(items))
    write_section(output, "chunks", "Pasted documents found by their content", command, body)
    return body
