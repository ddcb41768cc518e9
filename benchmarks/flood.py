"""One tenant floods, another asks a 2-token chat: how much slower is the second tenant's answer?

    .venv/bin/python benchmarks/flood.py [--flooders 96 --n 4 --max-tokens 128 --samples 10]

A real server (its own process, two API keys: tenant `flood` and tenant `calm`) on loopback. First the
calm tenant's 2-token chat alone, `--samples` times; then `--flooders` clients of tenant `flood` send
chats of n sequences of `--max-tokens` each, one after another without pause (a 429 is retried after
50 ms, not after its Retry-After: a flood does not wait; 96 x 4 is over the tenant's share of 256),
and once the batch is full the calm tenant asks again. Printed: both latencies, their ratio (the
target: within 3x), and what the flood got.
`--reserve 0` turns off the slots kept for a tenant with nothing running (runtime/scheduler.py), to see
what they are worth; `--switch-interval 0.0001` shortens the server's GIL switch interval (a flood of
refusals busies the event loop, and the engine thread, which gives the GIL up at every torch call,
then waits up to the 5 ms default for it each time). The semantic cache is off: every calm request is
generated."""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time
from collections import Counter
from typing import Any

import httpx

from kvgate.gateway.readiness import free_port, wait_ready

KEYS = {"sk-flood": "flood", "sk-calm": "calm"}
QUESTION = [{"role": "user", "content": "Say hi."}]


def serve(values: dict[str, Any], port: int, reserve: int | None, switch_interval: float | None) -> None:
    """The server process: the gateway over its own engine (as `kvgate serve`)."""
    import sys

    import uvicorn

    from kvgate.gateway.app import create_app
    from kvgate.gateway.backend import make_backend
    from kvgate.gateway.settings import Settings
    from kvgate.runtime.engine import Engine

    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    settings = Settings(**values)
    engine = Engine(settings.engine_config())
    if reserve is not None:
        engine.scheduler.reserve = reserve
    app = create_app(settings, make_backend(settings, engine))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


async def calm_latencies(http: httpx.AsyncClient, model: str, samples: int, gap_s: float) -> list[float]:
    body = {"model": model, "messages": QUESTION, "max_tokens": 2, "temperature": 0}
    found = []
    for _ in range(samples):
        start = time.perf_counter()
        r = await http.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-calm"})
        assert r.status_code == 200, f"calm: {r.status_code} {r.text}"
        found.append(time.perf_counter() - start)
        await asyncio.sleep(gap_s)
    return found


async def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.flooders + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        model = (await http.get("/v1/models", headers={"authorization": "Bearer sk-calm"})).json()["data"][0]["id"]
        await calm_latencies(http, model, 2, 0.0)  # warm-up
        alone = await calm_latencies(http, model, args.samples, args.gap_s)

        statuses: Counter[int] = Counter()
        sequences = 0
        stop = asyncio.Event()
        flood_body = {
            "model": model,
            "messages": QUESTION,
            "n": args.n,
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "temperature": 1.0,
        }

        async def flooder() -> None:
            nonlocal sequences
            while not stop.is_set():
                headers = {"authorization": "Bearer sk-flood"}
                r = await http.post("/v1/chat/completions", json=flood_body, headers=headers)
                statuses[r.status_code] += 1
                if r.status_code == 200:
                    sequences += args.n
                else:
                    await asyncio.sleep(0.05)

        started = time.perf_counter()
        tasks = [asyncio.create_task(flooder()) for _ in range(args.flooders)]
        while True:  # the batch full of the flood's sequences
            load = (await http.get("/ready")).json()
            if load["running"] >= args.max_num_seqs - max(1, args.max_num_seqs // 8) and load["waiting"] > 0:
                break
            await asyncio.sleep(0.1)
        flooded = await calm_latencies(http, model, args.samples, args.gap_s)
        load = (await http.get("/ready")).json()
        seconds = time.perf_counter() - started
        stop.set()
        for task in tasks:  # the flood's clients hang up: the server aborts their sequences
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "alone": alone,
        "flooded": flooded,
        "statuses": statuses,
        "sequences": sequences,
        "seconds": seconds,
        "load": load,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flooders", type=int, default=96, help="concurrent clients of the flooding tenant")
    p.add_argument("--n", type=int, default=4, help="sequences per flood request")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per flood sequence (ignore_eos)")
    p.add_argument("--samples", type=int, default=10, help="calm requests, alone and under the flood")
    p.add_argument("--gap-s", type=float, default=0.2, help="between two calm requests")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="torch threads of the server (0: torch's default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--reserve", type=int, default=None, help="slots kept for a tenant with nothing running")
    p.add_argument("--switch-interval", type=float, default=None, help="the server's sys.setswitchinterval")
    args = p.parse_args()
    if args.flooders * args.n <= args.max_num_seqs:  # the calm tenant would wait for a full batch forever
        p.error("--flooders x --n must be more than --max-num-seqs: a smaller flood never fills the batch")

    values = {
        "security": {"api_keys": KEYS},
        "semantic_cache": {"enabled": False},
        "caches": {"disk_bytes": 0},
        "engine": {"max_num_seqs": args.max_num_seqs, "threads": args.threads, "device": args.device},
        "operations": {"log_level": "warning"},
    }
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(
        target=serve, args=(values, port, args.reserve, args.switch_interval), daemon=True
    )
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url + "/ready", server, 300)
        found = asyncio.run(measure(url, args))
    finally:
        server.terminate()
        server.join(timeout=10)

    alone, flooded = found["alone"], found["flooded"]
    a, f = statistics.median(alone), statistics.median(flooded)
    statuses = dict(sorted(found["statuses"].items()))
    print(
        f"flood: {args.flooders} clients x n={args.n} x {args.max_tokens} tokens; max_num_seqs={args.max_num_seqs}, "
        f"reserve={'default' if args.reserve is None else args.reserve}, threads={args.threads or 'default'}, "
        f"switch interval={args.switch_interval or 'default'}"
    )
    print(f"calm 2-token chat alone:   median {a * 1000:.0f} ms, max {max(alone) * 1000:.0f} ms")
    print(f"calm 2-token chat flooded: median {f * 1000:.0f} ms, max {max(flooded) * 1000:.0f} ms")
    print(f"ratio (medians): {f / a:.2f}x   (max over median alone: {max(flooded) / a:.2f}x; target: within 3x)")
    print(
        f"flood: statuses {statuses}, {found['sequences']} sequences answered in {found['seconds']:.1f} s "
        "(then its clients hung up); "
        f"queue when the calm tenant was done: {found['load']}"
    )
    server_errors = sum(v for k, v in statuses.items() if k >= 500)
    print(f"5xx: {server_errors}")


if __name__ == "__main__":
    main()
