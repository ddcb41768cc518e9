"""Runtime workers answer their front only, and a front stops cleanly. `kvgate serve --workers 1` runs as
production runs it (a process of its own, its worker a process group of its own) and is probed from
outside: a worker's port asked directly, a tenant forged, SIGTERM during a stream, SIGKILL.

The worker's URL and pid come from the front's log line `worker-0 ready at URL (pid N)`."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvgate.bench.upstream import serve_upstream
from kvgate.gateway.workers import Worker, serving
from tests.helpers import loopback
from tests.helpers.waiting import wait_until

FRONT = {
    "proxy": {"workers": 1},
    "engine": {"max_num_seqs": 4},
    "semantic_cache": {"enabled": False},
    "operations": {
        "log_level": "info",  # the line naming the worker
        "shutdown_grace_s": 120,  # a stream on a busy 2-core machine may take long; none here is cut
    },
}
HELLO = [{"role": "user", "content": "Tell me about rivers."}]
REFUSED = {"message", "type", "param", "code"}


@dataclass
class Front:
    front: Worker
    worker_url: str
    worker_pid: int
    tmp: Path  # its TMPDIR, and its worker's


@contextmanager
def started(folder: Path) -> Iterator[Front]:
    tmp, log = folder / "tmp", folder / "front.log"
    tmp.mkdir()
    with pytest.MonkeyPatch.context() as env, log.open("wb") as out:
        env.setenv("TMPDIR", str(tmp))
        # torch's compile cache, which a process importing transformers' model code creates under TMPDIR unless
        # this names it (torch then sets it for the processes it starts): torch's folder, not kvgate's file
        env.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder / "torchinductor"))
        with serving({**FRONT, "caches": {"disk_bytes": 0, "dir": str(folder / "chunks")}}, out) as front:
            found = re.search(r"worker-0 ready at (\S+) \(pid (\d+)\)", log.read_text())
            assert found, log.read_text()
            yield Front(front, found[1], int(found[2]), tmp)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    """One front for the module's tests; the last of them stops it."""
    with started(tmp_path_factory.mktemp("front")) as front:
        yield front


def model(url: str) -> str:
    return loopback.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def gone(pid: int) -> bool:
    """The process has exited (a zombie nobody reaps has too)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def assert_refused(r: httpx.Response) -> None:
    assert r.status_code == 403, (r.request.url, r.status_code, r.text)
    assert set(r.json()["error"]) == REFUSED and r.json()["error"]["code"] == "front_only"


def test_via_the_front_the_worker_answers(shared: Front) -> None:
    url = shared.front.url
    body = {"model": model(url), "messages": HELLO, "max_tokens": 4}
    r = loopback.post(url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-a"}, timeout=120)
    assert r.status_code == 200 and r.headers["x-kvgate-upstream"] == "worker-0", r.text
    assert 'kvgate_requests_running{worker="worker-0"}' in loopback.get(url + "/metrics").text  # scraped with it


def test_a_worker_refuses_whoever_is_not_its_front(shared: Front) -> None:
    url = shared.worker_url
    body = {"model": model(shared.front.url), "messages": HELLO, "max_tokens": 4}
    for path in ("/v1/models", "/ready", "/metrics", "/openapi.json", "/docs", "/admin/keys", "/nowhere"):
        assert_refused(loopback.get(url + path))
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/documents", "/v1/embeddings", "/v1/responses"):
        assert_refused(loopback.post(url + path, json=body))
    assert loopback.get(url + "/health").json() == {"status": "ok"}  # liveness only: says nothing else


def test_a_forged_tenant_or_secret_is_refused(shared: Front) -> None:
    """What a caller could compute (the tenant's token as the front once sent it, a tenant header) or
    guess (a secret's shape) does not open a worker."""
    body = {"model": model(shared.front.url), "messages": HELLO, "max_tokens": 4}
    victim = {
        "authorization": "Bearer tenant-" + hashlib.sha256(b"team-a").hexdigest(),
        "x-kvgate-tenant": "team-a",
    }
    for secret in (None, "", "x", "A" * 43, "Bearer"):
        forged = victim | ({"x-kvgate-worker-secret": secret} if secret is not None else {})
        assert_refused(loopback.post(shared.worker_url + "/v1/chat/completions", json=body, headers=forged))
    # The secret reached the worker neither in its command line nor in its environment.
    argv = Path(f"/proc/{shared.worker_pid}/cmdline").read_bytes().split(b"\0")
    assert b"/dev/stdin" in argv and b"secret" not in b" ".join(argv).lower()
    names = {entry.partition(b"=")[0] for entry in Path(f"/proc/{shared.worker_pid}/environ").read_bytes().split(b"\0")}
    assert not {n for n in names if b"SECRET" in n.upper()} - {k.encode() for k in os.environ}  # none added


def stream(url: str, body: dict, opened: threading.Event, lines: list[str]) -> None:
    """Its lines into `lines` until it ends (cut short: as far as it came)."""
    with loopback.stream("POST", url + "/v1/chat/completions", json=body, timeout=180) as r:
        try:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    opened.set()
        except httpx.RemoteProtocolError:
            pass


def refuses_connections(url: str, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            loopback.get(url + "/health", timeout=1)
        except httpx.TransportError:
            return True
        time.sleep(0.05)
    return False


def test_sigterm_drains_the_front_then_stops_its_workers(shared: Front) -> None:
    """The last test of the shared front: it stops it. A stream in flight at SIGTERM completes, new
    connections are refused, the front exits 0, its worker is gone, no temporary file is left."""
    url, process = shared.front.url, shared.front.process
    body = {"model": model(url), "messages": HELLO, "max_tokens": 48, "ignore_eos": True, "stream": True}
    opened, lines = threading.Event(), []
    streamer = threading.Thread(target=stream, args=(url, body, opened, lines))
    streamer.start()
    assert opened.wait(120)
    at_signal = len(lines)
    process.send_signal(signal.SIGTERM)
    assert refuses_connections(url, 5)
    streamer.join(180)
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert lines[-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length", lines[-3:]
    print(f"{at_signal} of {len(lines)} lines had come when the front got SIGTERM")
    assert at_signal < len(lines) // 2  # most of it was answered while the front drained
    assert process.wait(60) == 0
    assert gone(shared.worker_pid)
    assert not list(shared.tmp.iterdir())  # nothing written to TMPDIR, nothing left in it


def test_sigterm_cuts_what_outlasts_the_grace(tmp_path: Path) -> None:
    """A proxy front (no model: light) over a stream of 200 words 0.05 s apart, shutdown_grace_s 1: the
    stream goes on for the grace, is then cut, and the front exits 0."""
    with serve_upstream(models=("stub-a",), words=200) as up:
        loopback.post(up + "/_script", json={"actions": [{"chunk_delay_s": 0.05}]}).raise_for_status()
        upstream = {"name": "stub", "base_url": up, "models": ["stub-a"]}
        values = {
            "proxy": {"upstreams": [upstream]},
            "semantic_cache": {"enabled": False},
            "cache_dir": str(tmp_path),
            "operations": {"shutdown_grace_s": 1},
        }
        with serving(values) as front:
            body = {"model": "stub-a", "messages": HELLO, "stream": True}
            opened, lines = threading.Event(), []
            streamer = threading.Thread(target=stream, args=(front.url, body, opened, lines))
            streamer.start()
            assert opened.wait(30)
            front.process.send_signal(signal.SIGTERM)
            began, at_signal = time.monotonic(), len(lines)
            streamer.join(30)
            took = time.monotonic() - began
            assert front.process.wait(10) == 0
    print(f"cut {took:.2f} s after SIGTERM, {len(lines) - at_signal} events later")
    assert 0.9 < took < 3 and lines[-1] != "data: [DONE]" and len(lines) - at_signal > 5


def test_a_worker_outlives_no_front_killed_outright(tmp_path: Path) -> None:
    with started(tmp_path) as front:
        os.kill(front.front.process.pid, signal.SIGKILL)
        front.front.process.wait(10)
        began = time.monotonic()
        wait_until(lambda: gone(front.worker_pid), 15, "the worker outlived its front", every_s=0.1)
        took = time.monotonic() - began
        print(f"the worker stopped {took:.1f} s after its front was killed")
        assert took < 10
