"""gateway.readiness: waiting for a server that another process starts on loopback (the front for its workers,
the benchmarks and the tests for theirs)."""

from __future__ import annotations

import multiprocessing
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvgate.gateway.readiness import NotReady, exit_status, free_port, wait_ready


@pytest.fixture
def file_server() -> Iterator[tuple[str, subprocess.Popen]]:
    """Python's http.server on a free port: 200 for /, 404 for /health."""
    port = free_port()
    command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}", process
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_it_returns_once_the_server_answers_200(file_server):
    url, process = file_server
    wait_ready(url + "/", process, 30, every_s=0.05)  # polled while the interpreter starts, then answered


def test_an_answer_other_than_200_is_waited_past_until_the_deadline(file_server):
    url, process = file_server
    wait_ready(url + "/", process, 30, every_s=0.05)
    began = time.monotonic()
    with pytest.raises(NotReady, match=r"did not answer .*/health within 0.5 s"):
        wait_ready(url + "/health", process, 0.5, every_s=0.05)
    assert time.monotonic() - began >= 0.5


def test_a_process_that_exits_ends_the_wait_at_once_with_its_status():
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait(timeout=30)
    began = time.monotonic()
    with pytest.raises(NotReady, match="the worker exited with status 3"):
        wait_ready(f"http://127.0.0.1:{free_port()}/ready", process, 60, name="the worker")
    assert time.monotonic() - began < 5


def test_a_multiprocessing_process_has_its_exit_code_read_too():
    process = multiprocessing.get_context("spawn").Process(target=sys.exit, args=(4,))  # fork: a thread may hold a lock
    process.start()
    process.join(timeout=30)
    assert exit_status(process) == 4
    with pytest.raises(NotReady, match="exited with status 4"):
        wait_ready(f"http://127.0.0.1:{free_port()}/ready", process, 60)


def test_a_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
