"""Runtime workers: N `kvgate serve` processes on loopback, each with its own engine, behind one front
that routes by cache affinity. A worker gets the front's settings, less what the front does for it
(keys, limits, the semantic cache) and with a disk tier of its own."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
import yaml

from kvgate.gateway.settings import Settings
from kvgate.gateway.upstreams import Upstream

READY_S = 600.0  # a worker loads the model (converted once by the front beforehand)


@dataclass
class Worker:
    name: str
    url: str
    process: subprocess.Popen[bytes]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_settings(settings: Settings, index: int, port: int) -> dict[str, object]:
    values = settings.model_dump(mode="json", exclude_none=True)
    values.update(
        host="127.0.0.1",
        port=port,
        workers=0,
        upstreams=[],
        api_keys={},
        require_api_key=False,
        semantic_cache=False,
        chunk_cache_dir=str((settings.chunk_cache_dir or settings.cache_dir / "chunks") / f"worker-{index}"),
        log_level="warning",
    )
    for name in ("rate_limit_rpm", "rate_limit_tpm", "admin_key"):
        values.pop(name, None)
    return values


def launch(name: str, values: dict[str, object], folder: Path, output: IO[bytes] | None = None) -> Worker:
    """`kvgate serve` as its own process, with `values` as its settings file (the environment's KVGATE_*
    left out: the file says it all). `values` must hold a port."""
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(values))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    command = [sys.executable, "-m", "kvgate.gateway.cli", "--config", str(path), "serve"]
    process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT if output else None)
    return Worker(name, f"http://{values.get('host', '127.0.0.1')}:{values['port']}", process)


@contextmanager
def serving(
    values: dict[str, object], folder: Path, output: IO[bytes] | None = None, within_s: float = READY_S
) -> Iterator[Worker]:
    """One `kvgate serve` process on a free loopback port, once it is ready; stopped at exit."""
    worker = launch("kvgate", {"host": "127.0.0.1", "port": free_port(), **values}, folder, output)
    try:
        wait_ready(worker, within_s)
        yield worker
    finally:
        stop([worker])


@contextmanager
def running(settings: Settings, n: int) -> Iterator[tuple[Upstream, ...]]:
    """Start `n` workers, wait until each is ready, yield them as upstreams; stop them at exit."""
    workers: list[Worker] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-workers-") as folder:
        try:
            for i in range(n):  # all start at once; then each is waited for
                workers.append(launch(f"worker-{i}", worker_settings(settings, i, free_port()), Path(folder)))
            for w in workers:
                wait_ready(w)
            names = [httpx.get(w.url + "/v1/models", timeout=5).json()["data"][0]["id"] for w in workers]
            yield tuple(
                Upstream(w.name, w.url, {name: name}, max_in_flight=2 * settings.max_num_seqs, worker=True)
                for w, name in zip(workers, names)
            )
        finally:
            stop(workers)


def wait_ready(worker: Worker, within_s: float = READY_S) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if worker.process.poll() is not None:
            raise RuntimeError(f"{worker.name} exited with status {worker.process.returncode}")
        try:
            if httpx.get(worker.url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{worker.name} was not ready within {within_s:.0f} s")


def stop(workers: list[Worker]) -> None:
    for w in workers:
        if w.process.poll() is None:
            w.process.terminate()
    for w in workers:
        try:
            w.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            w.process.kill()
            w.process.wait()
