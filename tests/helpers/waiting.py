"""Waiting in tests for what another thread or process does: a condition polled up to a deadline."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

from kvgate.gateway import readiness


def wait_until(condition: Callable[[], object], timeout_s: float, what: str, every_s: float = 0.02) -> None:
    """Returns once condition() is true; fails the test with `what` when it is still false after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s: {what}"
        time.sleep(every_s)


def wait_healthy(process: subprocess.Popen, url: str, timeout_s: float) -> None:
    """Returns once `url`/health answers 200; fails with the process's output if it exits first."""
    try:
        readiness.wait_ready(f"{url}/health", process, timeout_s, name=str(process.args))
    except readiness.NotReady as exc:
        output = (process.stdout or process.stderr) if process.poll() is not None else None
        text = output.read() if output else ""  # read only once it exited: a running process's pipe blocks
        text = text.decode(errors="replace") if isinstance(text, bytes) else text
        raise AssertionError(f"{exc}: {text[-2000:]}") from None
