"""`kvgate bench gateway`: the latency proxy mode adds. One client calls a small OpenAI-compatible
upstream (benchmarks/upstream.py) directly and through a kvgate front, request by request in turn, in
one run; both servers are processes of their own on loopback."""

from __future__ import annotations

import logging
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from kvgate.bench.report import table, write_section
from kvgate.bench.upstream import serve_upstream
from kvgate.gateway.workers import serving

MODEL = "stub-a"


@contextmanager
def front(upstream: str, semantic: bool, cache_dir: Path) -> Iterator[str]:
    """A kvgate front over `upstream`, as `kvgate serve` runs it."""
    config = {
        "upstreams": [{"base_url": upstream, "models": [MODEL]}],
        "semantic_cache": semantic,
        "cache_dir": str(cache_dir),
        "log_level": "warning",
    }
    with serving(config) as process:
        yield process.url


def timer(http: httpx.Client, url: str, stream: bool, temperature: float | None) -> Callable[[int], float]:
    """One request's latency in seconds: the whole answer, or a stream's first event."""

    def once(i: int) -> float:
        content = f"Question {i}: what is {random.randint(0, 10**9)}?" if temperature == 0 else "hello"
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": stream}
        if temperature is not None:
            body["temperature"] = temperature
        started = time.perf_counter()
        if not stream:
            r = http.post(url + "/v1/chat/completions", json=body)
            elapsed = time.perf_counter() - started
            assert r.status_code == 200, r.text
            return elapsed
        with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            elapsed = time.perf_counter() - started
            for _ in lines:
                pass
        return elapsed

    return once


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_gateway(requests: int, output: Path, command: str) -> dict[str, dict[str, float]]:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    with (
        tempfile.TemporaryDirectory() as folder,
        serve_upstream(models=(MODEL,)) as upstream,
        front(upstream, semantic=True, cache_dir=Path(folder)) as proxy,
        httpx.Client(timeout=30) as http,
    ):
        variants = {
            "direct": timer(http, upstream, False, None),
            "proxy": timer(http, proxy, False, None),
            "direct, stream": timer(http, upstream, True, None),
            "proxy, stream": timer(http, proxy, True, None),
            "direct, temperature 0": timer(http, upstream, False, 0),
            "proxy, temperature 0 (semantic miss)": timer(http, proxy, False, 0),
        }
        for i in range(max(50, requests // 10)):  # warm-up: connections, caches, the embedder
            for once in variants.values():
                once(i)
        seen: dict[str, list[float]] = {name: [] for name in variants}
        for i in range(requests):
            names = list(variants)
            random.shuffle(names)  # in turn, in a new order each round: both see the same noise
            for name in names:
                seen[name].append(variants[name](i))
    results = {name: {"p50": statistics.median(v) * 1e3, "p99": percentile(v, 0.99) * 1e3} for name, v in seen.items()}
    report(results, requests, output, command)
    return results


def report(results: dict[str, dict[str, float]], requests: int, output: Path, command: str) -> None:
    rows = []
    pairs = [
        ("proxy", "direct"),
        ("proxy, stream", "direct, stream"),
        ("proxy, temperature 0 (semantic miss)", "direct, temperature 0"),
    ]
    for proxied, direct in pairs:
        p, d = results[proxied], results[direct]
        rows.append(
            [
                proxied,
                f"{d['p50']:.2f}",
                f"{p['p50']:.2f}",
                f"{p['p50'] - d['p50']:+.2f}",
                f"{d['p99']:.2f}",
                f"{p['p99']:.2f}",
                f"{p['p99'] - d['p99']:+.2f}",
            ]
        )
    added = results["proxy"]["p50"] - results["direct"]["p50"]
    verdict = "met" if added <= 1.0 else "missed"
    header = ["path", "direct p50 ms", "proxy p50 ms", "added p50", "direct p99 ms", "proxy p99 ms", "added p99"]
    body = f"""{requests} requests per path, the paths in turn in a shuffled order each round, one keep-alive
httpx client; upstream and front are separate processes on loopback. Non-streamed rows time the whole
answer (8 words); stream rows the first SSE event. "temperature 0" requests are new questions each time:
the front's semantic cache looks each one up (an embedding, a miss) and stores the answer.

{table(header, rows)}

Target: p50 added latency <= 1 ms on the proxy path (cache miss): **{verdict}** ({added:+.2f} ms, semantic
cache bypassed as for any request that is not temperature 0). A semantic-cache miss adds the embedding of
the question on top, as the last row shows.

Where the added time goes: the front is a second Python HTTP server and an HTTP client on the path. The
request is parsed and answered once more by uvicorn and Starlette, and sent again through httpx and httpcore,
whose pure-Python HTTP/1.1 (h11) costs more than the upstream's whole handling; three processes (client,
front, upstream) share two cores. kvgate's own work in between (keys, limits, metrics, admission, the relay)
is the smaller part. uvloop (installed with kvgate) took about a third off; a client with a C parser
(aiohttp) would take off more, but the issue asked for httpx.
"""
    write_section(output, "gateway", "Gateway: latency added by proxy mode", command, body)
