"""Runtime workers: N `kvgate serve` processes on loopback, each with its own engine, behind one front
that routes by cache affinity. A worker gets the front's settings, less what the front does for it
(keys, limits, the semantic cache) and with a disk tier of its own.

A worker answers its front only: the front makes a secret at each start, hands it to its workers with
their settings on their stdin (never argv, never a file), and sends it with every request
(SECRET_HEADER); a worker refuses any other request but /health. The tenant the front names in a
request's bearer token is believed only with it. Each worker runs in a process group of its own, is
stopped (SIGTERM, then SIGKILL) once the front has drained, and stops itself when the front is gone."""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

import httpx
import yaml
from starlette.types import ASGIApp, Receive, Scope, Send

from kvgate.gateway import readiness
from kvgate.gateway.errors import APIError
from kvgate.gateway.settings import Settings, laid_over
from kvgate.gateway.upstreams import SECRET_HEADER, Upstream

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("kvgate.workers")
READY_S = 600.0  # a worker loads the model (converted once by the front beforehand)
STOP_S = 15.0  # a worker told to stop (it has drained with its front) has this long before SIGKILL
PARENT_POLL_S = 0.5  # how often a worker looks whether its front is still there


@dataclass
class Worker:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    secret: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        """What a request to this process carries to be answered."""
        return {SECRET_HEADER: self.secret} if self.secret else {}


def worker_settings(settings: Settings, index: int, port: int, secret: str) -> dict[str, object]:
    values = settings.model_dump(mode="json", exclude_none=True)
    for name in ("rate_limit_rpm", "rate_limit_tpm", "admin_key", "tenant_secret"):  # the front's to use
        values["security"].pop(name, None)
    mine = {
        "operations": {"host": "127.0.0.1", "port": port, "log_level": "warning"},
        "proxy": {"workers": 0, "upstreams": []},
        # metrics public: the front scrapes them (with the secret) and decides who sees them
        "security": {"api_keys": {}, "require_api_key": False, "metrics_access": "public", "worker_secret": secret},
        "semantic_cache": {"enabled": False},
        "caches": {"dir": str(settings.chunk_dir / f"worker-{index}")},
    }
    return laid_over(values, mine)


def launch(name: str, values: dict[str, object], output: IO[bytes] | None = None) -> Worker:
    """`kvgate serve` as its own process group, its settings `values` (grouped; with a port) written to
    its stdin: they may hold secrets (the worker's, a Redis password), so no file and no argv ever has
    them; the environment's KVGATE_* are left out. It stops itself once this process is gone."""
    operations = {**values.get("operations", {}), "exit_with_pid": os.getpid()}  # type: ignore[dict-item]
    values = {**values, "operations": operations}
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    command = [sys.executable, "-m", "kvgate.gateway.cli", "--config", "/dev/stdin", "serve"]
    process = subprocess.Popen(
        command,
        env=env,
        stdin=subprocess.PIPE,
        stdout=output,
        stderr=subprocess.STDOUT if output else None,
        start_new_session=True,  # a terminal's Ctrl-C reaches the front only; the front stops its workers
    )
    assert process.stdin is not None
    try:
        with process.stdin:
            process.stdin.write(yaml.safe_dump(values).encode())
    except BrokenPipeError:
        pass  # it exited before reading them: wait_ready says how
    secret = values.get("security", {}).get("worker_secret")  # type: ignore[attr-defined]
    url = f"http://{operations.get('host', '127.0.0.1')}:{operations['port']}"
    return Worker(name, url, process, secret if isinstance(secret, str) else None)


@contextmanager
def serving(values: dict[str, object], output: IO[bytes] | None = None, within_s: float = READY_S) -> Iterator[Worker]:
    """One `kvgate serve` process on a free loopback port, once it is ready; stopped at exit."""
    operations = {"host": "127.0.0.1", "port": readiness.free_port(), **values.get("operations", {})}  # type: ignore[dict-item]
    worker = launch("kvgate", {**values, "operations": operations}, output)
    try:
        wait_ready(worker, within_s)
        yield worker
    finally:
        stop([worker])


@contextmanager
def running(settings: Settings, n: int) -> Iterator[tuple[Upstream, ...]]:
    """Start `n` workers, wait until each is ready, yield them as upstreams; stop them at exit."""
    secret = secrets.token_urlsafe(32)
    workers: list[Worker] = []
    try:
        for i in range(n):  # all start at once; then each is waited for
            workers.append(launch(f"worker-{i}", worker_settings(settings, i, readiness.free_port(), secret)))
        for w in workers:
            wait_ready(w)
            log.info("%s ready at %s (pid %d)", w.name, w.url, w.process.pid)
        names = [httpx.get(w.url + "/v1/models", headers=w.headers, timeout=5).json()["data"][0]["id"] for w in workers]
        yield tuple(
            Upstream(
                w.name, w.url, {name: name}, max_in_flight=2 * settings.engine.max_num_seqs, worker=True, secret=secret
            )
            for w, name in zip(workers, names)
        )
    finally:
        stop(workers)


def wait_ready(worker: Worker, within_s: float = READY_S) -> None:
    readiness.wait_ready(worker.url + "/ready", worker.process, within_s, name=worker.name, headers=worker.headers)


def stop(workers: list[Worker], within_s: float = STOP_S) -> None:
    """SIGTERM to each worker's process group (it drains and exits), SIGKILL to what is left after
    `within_s`."""
    for w in workers:
        signal_group(w, signal.SIGTERM)
    deadline = time.monotonic() + within_s
    for w in workers:
        try:
            w.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0f s: killed", w.name, within_s)
            signal_group(w, signal.SIGKILL)
            w.process.wait()


def signal_group(worker: Worker, sig: signal.Signals) -> None:
    """Only while the worker is not reaped: its pid, which names its group, is still its own."""
    if worker.process.poll() is None:
        try:
            os.killpg(worker.process.pid, sig)
        except ProcessLookupError:
            pass


def exit_with(pid: int, every_s: float = PARENT_POLL_S) -> None:
    """SIGTERM to this process once `pid` is no longer its parent: a front killed outright (SIGKILL, a
    crash) leaves no worker behind, even one gone before the watch began. A poll, not
    PR_SET_PDEATHSIG: that one fires when the thread that started the worker ends, not its process."""

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(every_s)
        log.warning("process %d, which started this one, is gone: stopping", pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="kvgate-exit-with", daemon=True).start()


class FrontOnly:
    """A runtime worker's requests must carry its front's secret (compared in constant time); /health
    stays open, any other request without it is a 403."""

    def __init__(self, app: ASGIApp, secret: str) -> None:
        self.app, self.secret = app, secret.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(SECRET_HEADER.encode(), b"")
        if hmac.compare_digest(given, self.secret):
            return await self.app(scope, receive, send)
        said = "this is a kvgate runtime worker: it answers the front that started it only"
        await APIError(403, said, code="front_only").response()(scope, receive, send)


def front_only(app: FastAPI, settings: Settings) -> None:
    """Where `settings` are a worker's (they hold its front's secret): only the front is answered."""
    if settings.security.worker_secret is not None:
        app.add_middleware(FrontOnly, secret=settings.security.worker_secret.get_secret_value())
