"""Starting a server on loopback: a free port, and waiting until the server answers.

Used by the front for its workers, by the benchmarks for the servers they start, and by the tests."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Mapping
from multiprocessing.process import BaseProcess

import httpx


class NotReady(RuntimeError):
    """A server that exited, or did not answer 200, before its deadline."""


def free_port() -> int:
    """A port on 127.0.0.1 that no one holds now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exit_status(process: subprocess.Popen | BaseProcess) -> int | None:
    """The process's exit status, None while it runs."""
    if isinstance(process, BaseProcess):
        return None if process.is_alive() else process.exitcode
    return process.poll()


def wait_ready(
    url: str,
    process: subprocess.Popen | BaseProcess,
    within_s: float,
    *,
    name: str = "the server",
    headers: Mapping[str, str] | None = None,
    every_s: float = 0.2,
) -> None:
    """Polls GET `url` until it answers 200. Raises NotReady when `process` exits first or `within_s` passes.
    One client for every poll: each `httpx.get()` loads the CA bundle (~50 ms of CPU), which polling would take
    from the process starting."""
    began = time.monotonic()
    with httpx.Client(headers=headers) as client:
        while True:
            status = exit_status(process)
            if status is not None:
                raise NotReady(f"{name} exited with status {status}")
            with contextlib.suppress(httpx.HTTPError):  # not listening yet: asked again at the next poll
                if client.get(url, timeout=2).status_code == 200:
                    return
            if time.monotonic() - began > within_s:
                raise NotReady(f"{name} did not answer {url} within {within_s:g} s")
            time.sleep(every_s)
