"""How light a proxy-mode front is: `kvgate serve` over one upstream, from start to a 200 on /ready,
its RSS once ready, and whether torch is in the process; side by side with the same front at an
earlier commit (`--before`, a checkout of it whose top-level packages were gateway/, runtime/, ...).

    kvgate bench front [--before DIR] [--runs 5]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from kvgate.bench.upstream import serve_upstream
from kvgate.gateway.readiness import free_port, wait_ready
from kvgate.runtime.report import table, write_section


def start(command: list[str], cwd: Path, port: int) -> tuple[float, int, bool]:
    """Seconds from the process's start to /ready answering 200, its RSS (KiB) then, torch loaded."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    began = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}/ready", process, 120, name=str(command), every_s=0.01)
        ready = time.perf_counter() - began
        status = Path(f"/proc/{process.pid}/status").read_text()
        rss = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
        torch = "libtorch" in Path(f"/proc/{process.pid}/maps").read_text()
        return ready, rss, torch
    finally:
        process.terminate()
        process.wait(timeout=15)


def measure(label: str, command: list[str], cwd: Path, settings: dict, runs: int, folder: Path) -> list[str]:
    results = []
    for i in range(runs):
        port = free_port()
        config = folder / f"{label.replace(' ', '-')}-{i}.yaml"
        config.write_text(yaml.safe_dump({**settings, "port": port}))
        results.append(start([arg.replace("CONFIG", str(config)) for arg in command], cwd, port))
    ready = statistics.median(r[0] for r in results)
    rss = statistics.median(r[1] for r in results) / 1024
    return [label, f"{ready:.2f}", f"{rss:.0f}", "yes" if any(r[2] for r in results) else "no"]


def bench_front(before: Path | None, runs: int, output: Path, command: str) -> str:
    rows = []
    with serve_upstream(("stub-a",)) as upstream, tempfile.TemporaryDirectory() as tmp:
        base = {
            "host": "127.0.0.1",
            "upstreams": [{"base_url": upstream, "models": ["stub-a"]}],
            "log_level": "warning",
        }
        light = {**base, "semantic_cache": False, "cache_dir": tmp}
        if before is not None:
            old = [sys.executable, "-m", "gateway.cli", "--config", "CONFIG", "serve"]
            rows.append(measure("before, semantic cache off", old, before, light, runs, Path(tmp)))
        new = [sys.executable, "-m", "kvgate.gateway.cli", "serve", "--config", "CONFIG"]
        rows.append(measure("now, semantic cache off", new, Path(tmp), light, runs, Path(tmp)))
        rows.append(measure("now, semantic cache on", new, Path(tmp), {**base, "cache_dir": tmp}, runs, Path(tmp)))
    body = table(["front", "start to ready, s (median)", "RSS, MiB (median)", "torch loaded"], rows)
    body += (
        f"\n\nMedians of {runs} starts each, one run, on {os.cpu_count()} CPUs. Targets: ready in <= 1.5 s, "
        "RSS <= 150 MiB, no torch, for a front that owns no model and no semantic cache (the semantic cache's "
        "embedder is a transformers model: a front with it on loads torch, by design).\n"
    )
    write_section(output, "front", "Proxy-mode front: start-up and memory", command, body)
    return body
