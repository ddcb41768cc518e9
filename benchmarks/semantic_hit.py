"""A semantic hit end to end through the gateway against the model's own answer: the real engine
behind a real uvicorn server on loopback, the openai SDK as client, side by side in one run."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import openai

from kvgate.bench.server import gateway
from kvgate.gateway.settings import Settings
from kvgate.runtime.report import table


def timed(
    client: openai.OpenAI,
    model: str,
    question: str,
    max_tokens: int,
    stream: bool,
    lookup: bool = True,
    system: str | None = None,
) -> tuple[float, str]:
    """Seconds to the whole answer (or, streamed, to the first content), and the x-kvgate-cache header.
    Without `lookup` the request says Cache-Control: no-cache, no-store (the cache is skipped whole)."""
    messages: Any = [{"role": "user", "content": question}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    headers = None if lookup else {"cache-control": "no-cache, no-store"}
    start = time.perf_counter()
    if not stream:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, extra_headers=headers
        )
        raw.parse()
        return time.perf_counter() - start, raw.headers.get("x-kvgate-cache", "")
    with client.chat.completions.with_streaming_response.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True, extra_headers=headers
    ) as response:
        first = None
        for line in response.iter_lines():  # read to the end: a stream left early is not stored
            if first is None and line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter() - start
        return first or time.perf_counter() - start, response.headers.get("x-kvgate-cache", "")


def row(name: str, seconds: list[float], model: float) -> list[str]:
    if not seconds:
        return [name, "0", "-", "-", "-"]
    p50 = statistics.median(seconds)
    return [name, str(len(seconds)), f"{p50 * 1e3:.1f}", f"{max(seconds) * 1e3:.1f}", f"{model / p50:.1f}x"]


def bench_hit(base: Settings, pairs: list[tuple[str, str]], max_tokens: int, workdir: Path) -> str:
    """Each pair (question, paraphrase): the question is a miss (the model answers it), then the same
    question and its paraphrase are asked again; every timing is kept. Returns a markdown body."""
    settings = base.model_copy(update={"semantic_cache": {"enabled": True, "path": workdir / "hit.sqlite3"}})
    kinds: dict[str, list[float]] = {"miss": [], "hit (same question)": [], "hit (paraphrase)": []}
    skip = "cache skipped (no-cache, no-store)"
    streamed: dict[str, list[float]] = {"miss": [], "hit (same question)": [], skip: []}
    with gateway(settings) as (url, model):
        client = openai.OpenAI(base_url=url, api_key="bench", max_retries=0, timeout=300)
        timed(client, model, "Warm up: say hello.", 4, False)
        for question, paraphrase in pairs:
            seconds, status = timed(client, model, question, max_tokens, False)
            if status != "miss":
                continue  # asked before in this run
            kinds["miss"].append(seconds)
            seconds, status = timed(client, model, question, max_tokens, False)
            if status == "hit":
                kinds["hit (same question)"].append(seconds)
            seconds, status = timed(client, model, paraphrase, max_tokens, False)
            if status == "hit":
                kinds["hit (paraphrase)"].append(seconds)
        # Streamed: time to the first content. Another system prompt is another scope: a miss, then a hit;
        # a third one with the cache skipped is the model alone.
        label = {"miss": "miss", "hit": "hit (same question)", "bypass": skip}
        for question, _ in pairs:
            for system, lookup in (("Answer briefly.", True), ("Answer briefly.", True), ("Be brief.", False)):
                seconds, status = timed(client, model, question, max_tokens, True, lookup, system)
                streamed[label[status]].append(seconds)
    model_answer, model_first = statistics.median(kinds["miss"]), statistics.median(streamed[skip] or [0.0])
    rows = [row(name, seconds, model_answer) for name, seconds in kinds.items()]
    rows += [row(f"streamed, first content: {name}", seconds, model_first) for name, seconds in streamed.items()]
    speedup = model_answer / statistics.median(kinds["hit (same question)"] or [model_answer])
    verdict = "met" if speedup >= 20 else "**missed**"
    return (
        f"Through the gateway on loopback (openai SDK, temperature 0, max_tokens {max_tokens}); each question is first "
        "answered by the model (miss), then asked again and as its paraphrase. Median latency; speedup = the "
        "model's median answer time over the row's median; for the streamed rows, the model's median time to "
        "the first content with the cache skipped over the row's median.\n\n"
        + table(["request", "n", "p50 ms", "max ms", "speedup vs model"], rows)
        + f"\n\nTarget: a semantic hit >= 20x faster than the model's answer: {verdict} ({speedup:.0f}x)."
        " A hit's time is mostly the query's embedding (MiniLM on the same 2 cores as the model); every miss"
        " pays it too, which the streamed rows show: for these short prompts the first token of a miss comes"
        " about the embedding later than with the cache skipped."
    )
