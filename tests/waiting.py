"""Waiting in tests for what another thread or process does: a condition polled up to a deadline."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import httpx

from tests import loopback


def wait_until(condition: Callable[[], object], timeout_s: float, what: str, every_s: float = 0.02) -> None:
    """Returns once condition() is true; fails the test with `what` when it is still false after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s: {what}"
        time.sleep(every_s)


def wait_healthy(process: subprocess.Popen, url: str, timeout_s: float) -> None:
    """Returns once `url`/health answers 200; fails with the process's output if it exits first."""

    def healthy() -> bool:
        if process.poll() is not None:
            output = process.stdout or process.stderr
            text = output.read() if output else ""
            text = text.decode(errors="replace") if isinstance(text, bytes) else text
            raise AssertionError(f"{process.args} exited: {text[-2000:]}")
        try:
            return loopback.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(healthy, timeout_s, f"{url} did not come up", every_s=0.2)
