"""Load: concurrent clients for a while against kvgate running as its own process, started as in production
(`python -m gateway.cli --config kvgate.yaml serve`): no request fails, requests keep flowing, and the server's
memory stays flat. Against the model, two tenants: one flooding past its share of the queue (its extra
requests get 429 with Retry-After, and are sent again at once), one asking as usual (never refused).

Memory is the server's resident set (VmRSS in /proc/<pid>/status), read once a warm-up at full concurrency has
grown its pools, buffers and allocator arenas to their working size, and again after the main run. CPython
seldom gives freed memory back, so the second reading is close to the main run's high-water mark: what a leak
would leave behind shows as growth.

Measured on the 2-core CPU machine (eleven or twelve runs each, warm-up 5 s, main run 15 s):
  proxy mode, 8 clients: 338-505 requests/s (5,084-7,575 requests), latency median 12-18 ms; RSS 460 MiB,
  growth +0.5 to +0.6 MiB (and once, in a first run whose slowness was not found again: 195/s, +0.4 MiB).
  the model, 4 clients, 8 new tokens: 48-56 requests (about 3.4/s, latency median 1.1-1.3 s); RSS 1,065 MiB,
  growth +0.3 to +2.4 MiB (in that first run: 8 requests in 32 s, each waiting up to 17 s, RSS +2.0 MiB).
  the model, two tenants (one run): calm, 2 clients of 1 sequence: 39 answered, latency median 0.77 s; flood,
  4 clients of 4 sequences over a share of 8: 25 answered, 32 refused; RSS 1,133 MiB, growth +1.8 MiB."""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgate.bench.upstream import serve_upstream
from kvgate.gateway.workers import serving
from kvgate.runtime.loader import ONEDNN_CACHES
from tests.conftest import QUESTIONS
from tests.helpers import dashboards, loopback

Body = Callable[[int], dict[str, Any]]
Check = Callable[[str], None]


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def rss_mib(self) -> float:
        """The server's resident memory now."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError(f"no VmRSS for process {self.process.pid}")


@contextmanager
def kvgate(tmp_path: Path, ready_within_s: float, **settings: Any) -> Iterator[Server]:
    """`python -m gateway.cli serve` with these settings in its YAML file, on a free loopback port, once /ready."""
    log = tmp_path / "kvgate.log"
    with log.open("wb") as out, ExitStack() as stack:
        try:
            worker = stack.enter_context(
                serving({"operations": {"log_level": "warning"}, **settings}, out, ready_within_s)
            )
        except RuntimeError as exc:
            raise AssertionError(f"{exc}:\n{log.read_text()}") from None
        yield Server(worker.url, worker.process, log)


# --- clients ---------------------------------------------------------------------------------------------


@dataclass
class Tally:
    answered: int = 0
    streamed: int = 0
    refused: int = 0  # 429 with a Retry-After of at least a second: over the tenant's share
    errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def per_second(self) -> float:
        return self.answered / self.seconds


class Refused(Exception):
    """A 429 over the tenant's share of the queue, with its Retry-After."""


def refused(response: httpx.Response, text: str) -> None:
    if response.status_code == 429 and response.json()["error"]["code"] == "tenant_queue_full":
        assert int(response.headers["retry-after"]) >= 1, response.headers
        raise Refused(text)


async def ask(http: httpx.AsyncClient, body: dict[str, Any]) -> str:
    """A whole chat completion; its answer."""
    response = await http.post("/v1/chat/completions", json=body)
    refused(response, response.text)
    assert response.status_code == 200, f"{response.status_code}: {response.text}"
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length"), choice
    return choice["message"]["content"]


async def ask_streamed(http: httpx.AsyncClient, body: dict[str, Any]) -> str:
    """A streamed chat completion, to its [DONE]; its answer, joined from the chunks."""
    async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode()
            refused(response, text)
            raise AssertionError(f"{response.status_code}: {text}")
        events = [line.removeprefix("data: ") async for line in response.aiter_lines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", f"the stream ended without [DONE]: {events[-3:]}"
    chunks = [json.loads(event) for event in events[:-1]]
    assert not [c for c in chunks if "error" in c], f"an error event: {chunks}"
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    finishes = sorted((c["index"], c["finish_reason"]) for c in choices if c["finish_reason"])
    n = body.get("n", 1)
    assert [i for i, _ in finishes] == list(range(n)), finishes  # each choice ends once
    assert all(reason in ("stop", "length") for _, reason in finishes), finishes
    return "".join(c["delta"].get("content") or "" for c in choices if c["index"] == 0)


async def drive(url: str, clients: int, seconds: float, body: Body, check: Check, key: str | None = None) -> Tally:
    """`clients` clients, each with its own connection, sending one request after another for `seconds`,
    every other one streamed; what came back. Each client is its own (anonymous) tenant, or all are the
    tenant of `key`. A refused request (429) is sent again 50 ms later."""
    tally = Tally()
    started = time.monotonic()

    async def client(i: int) -> None:
        headers = {"authorization": f"Bearer {key or f'sk-load-{i}'}"}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
            n = 0
            while time.monotonic() - started < seconds:
                streamed = (i + n) % 2 == 1
                sent = time.monotonic()
                try:
                    check(await (ask_streamed if streamed else ask)(http, body(i + n)))
                except Refused:
                    tally.refused += 1
                    await asyncio.sleep(0.05)
                except Exception as exc:
                    tally.errors.append(f"client {i}, request {n}: {type(exc).__name__}: {exc}")
                else:
                    tally.latencies.append(time.monotonic() - sent)
                    tally.answered += 1
                    tally.streamed += streamed
                n += 1

    await asyncio.gather(*(client(i) for i in range(clients)))
    tally.seconds = time.monotonic() - started
    return tally


def chat(model: str, max_tokens: int, n: int = 1) -> Body:
    def body(i: int) -> dict[str, Any]:
        question = QUESTIONS[i % len(QUESTIONS)]
        return {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "n": n}

    return body


@dataclass
class Tenant:
    """Clients that send `body` one request after another: each its own tenant, or all `key`'s."""

    clients: int
    body: Body
    key: str | None = None


@dataclass
class Run:
    loads: list[Tally]  # one per tenant, in the order given
    rss_before_mib: float  # after the warm-up
    rss_after_mib: float  # after the main run

    @property
    def load(self) -> Tally:
        return self.loads[0]

    @property
    def growth_mib(self) -> float:
        return self.rss_after_mib - self.rss_before_mib


async def drive_all(url: str, tenants: list[Tenant], seconds: float, check: Check) -> list[Tally]:
    return list(await asyncio.gather(*(drive(url, t.clients, seconds, t.body, check, t.key) for t in tenants)))


def warm_up_then_load(server: Server, tenants: list[Tenant], warmup_s: float, load_s: float, check: Check) -> Run:
    warmup = asyncio.run(drive_all(server.url, tenants, warmup_s, check))
    errors = [e for tally in warmup for e in tally.errors]
    assert not errors, "\n".join(errors[:10])
    before = server.rss_mib()
    loads = asyncio.run(drive_all(server.url, tenants, load_s, check))
    run = Run(loads, before, server.rss_mib())
    for tenant, load in zip(tenants, loads):
        print(
            f"\n{tenant.key or 'a tenant each'}: {load.answered} answered in {load.seconds:.1f} s "
            f"({load.per_second:.1f}/s, {load.streamed} streamed), {load.refused} refused (429), "
            f"{len(load.errors)} errors; latency median {statistics.median(load.latencies or [0]):.3f} s, "
            f"max {max(load.latencies or [0]):.2f} s"
        )
    print(f"RSS {before:.1f} -> {run.rss_after_mib:.1f} MiB ({run.growth_mib:+.1f})")
    return run


# --- proxy mode ------------------------------------------------------------------------------------------

STUB_ANSWER = "w0 w1 w2 w3 w4 w5 w6 w7 "


def the_stub_answer(text: str) -> None:
    assert text == STUB_ANSWER, repr(text)


def test_proxy_mode_under_load_fails_nothing_and_keeps_its_memory(tmp_path: Path) -> None:
    with serve_upstream(models=("stub-a",), words=8) as upstream:
        upstreams = [{"base_url": upstream, "models": ["stub-a"]}]
        with kvgate(
            tmp_path, 60, proxy={"upstreams": upstreams}, semantic_cache={"enabled": False}, cache_dir=str(tmp_path)
        ) as server:
            clients = [Tenant(8, chat("stub-a", 8))]
            run = warm_up_then_load(server, clients, warmup_s=5, load_s=15, check=the_stub_answer)
    assert not run.load.errors, "\n".join(run.load.errors[:10])
    # A quarter of the slowest rate measured: a gateway that stalls or serialises its clients falls far below.
    assert run.load.per_second > 50
    # Over ten times the growth measured. Over the ~5,000 requests of a main run, a leak of 2 KiB a request (a kept
    # request body, response or SSE buffer each) crosses it; at the slowest rate measured (~2,900), one of 3 KiB.
    assert run.growth_mib < 8, f"RSS grew {run.growth_mib:.1f} MiB over {run.load.answered} requests"


# --- the real model --------------------------------------------------------------------------------------


def some_answer(text: str) -> None:
    assert isinstance(text, str)


def test_the_model_under_load_fails_nothing_and_keeps_its_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two tenants: `calm` (2 clients, one sequence a request) and `flood` (4 clients, 4 sequences a request:
    16 wanted, twice its share of 8, so about half its requests are refused and sent again at once).

    The server runs in the dtype `auto` picks, as `kvgate serve` does: bf16 on a CPU with AVX512-BF16 or AMX,
    float32 on an AVX2 one. In bf16, oneDNN keeps a compiled matmul for each row count a step has run and weight
    shape (~0.6 MiB each, runtime/loader.py), in caches the loader bounds at 32 entries (test_loader.py); at their
    default of 1024 this test saw +42 MiB (5 s warm-up, 15 s run), and at 32 entries RSS still rose 11 MiB over
    the 15 s after a 5 s warm-up, and +3.6 to +10.5 MiB over a 10 s run after a 10 s warm-up (seven runs: the
    slower the shared machine, the fewer steps the warm-up ran). Held at 8 entries here, they fill within the
    warm-up (measured: +1.1 MiB in the 5 s after it, +3.2 over 30 s, the machine busy), and what the main run
    measures is the rest: kvgate's own memory."""
    # The model and its converted weights from the user cache, as `kvgate serve` runs them; no disk tier. The semantic
    # cache is on, for the dashboard's panels: the load's requests (no temperature given) bypass it.
    # No prefix blocks, no content-defined chunks: they fill the memory tier up to its budget by design (each
    # sampled answer's last chunk, ~1 MiB, is kept: an answer's end is a cut); what is checked is the rest.
    off = {"prefix_caching": False, "content_chunks": False}
    semantic = {"path": str(tmp_path / "semantic.sqlite3"), "verify_rate": 0.0}  # a repeated question: a hit
    settings = {"semantic_cache": semantic, "caches": {"disk_bytes": 0, **off}, "engine": {"max_num_seqs": 8}}
    security = {"max_waiting_seqs_per_tenant": 8, "admin_key": ADMIN_KEY, "metrics_access": "admin"}
    for name in ONEDNN_CACHES:  # the server's environment: its loader keeps an operator's value
        monkeypatch.setenv(name, "8")
    with kvgate(tmp_path, 180, security=security, **settings) as server:
        model = loopback.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        tenants = [Tenant(2, chat(model, 8), "sk-calm"), Tenant(4, chat(model, 8, n=4), "sk-flood")]
        run = warm_up_then_load(server, tenants, warmup_s=5, load_s=15, check=some_answer)
        scraped = what_the_load_left_out(server.url, model)
    calm, flood = run.loads
    errors = calm.errors + flood.errors  # anything but a 429 with Retry-After to the flood: no 5xx, no other 4xx
    assert not errors, "\n".join(errors[:10])
    assert calm.refused == 0  # within its share, whatever the other tenant does
    assert flood.refused > 0 and flood.answered > 0
    # Requests keep flowing for the calm tenant, by an order and not a rate (on shared cores both tenants
    # slow alike): measured 39 calm to 25 flood and 20 to 13 (1.5x); 0.75x is half that. (Tenants served
    # FCFS gave 21 to 20: the fair share is test_queue's and abuse/test_flood's to check.)
    assert calm.answered >= 2 and calm.answered >= 0.75 * flood.answered, (calm.answered, flood.answered)
    # Over three times the largest growth measured (bf16: +3.0 to +5.0 MiB, three runs; float32, the dtype forced:
    # +1.0 and +3.4; oneDNN's caches at 1024 entries: +45). One sequence's KV cache (45 tokens x 45 KiB in
    # float32, half that in bf16: about 3 and 1.5 MiB as allocated) kept by each of the main run's ~50 sequences
    # (calm's ~15 requests, flood's ~9 of 4) would add some 150 MiB (75 in bf16); kept by six of them (eleven), 16.
    assert run.growth_mib < 16, f"RSS grew {run.growth_mib:.1f} MiB over {run.load.answered} requests"
    # Every panel of the server dashboard has data: each of its selectors matches a sample of the scrape.
    missing = dashboards.unmatched(dashboards.load(dashboards.SERVER), dashboards.samples(scraped))
    assert not missing, "no sample for:\n" + "\n".join(missing)
    # The flood's 429s under their reason (the warm-up's too); its generated answers' time per output token.
    refusals = dashboards.value(dashboards.samples(scraped), "kvgate_refused_total", reason="tenant_queue_full")
    assert refusals is not None and refusals >= flood.refused, (refusals, flood.refused)
    route = {"route": "/v1/chat/completions"}
    paced = dashboards.value(dashboards.samples(scraped), "kvgate_time_per_output_token_seconds_count", **route)
    # (an answer whose first token ends it, sampled, has no pace: half of them is far below what comes)
    assert paced is not None and paced >= (calm.answered + flood.answered) / 2, (paced, calm.answered, flood.answered)


ADMIN_KEY = "sk-admin-load"
LIGHTHOUSE = [{"text": "The lighthouse at Varn was built in 1821."}, {"text": "Its keeper was Ada Moll."}]


def what_the_load_left_out(url: str, model: str) -> str:
    """What the load does not send, for the server dashboard's panels: documents twice (stored, then reused: blend,
    the memory tier's hits), a temperature-0 question twice (the semantic cache's miss, then its hit). Then
    `/metrics` as deploy/prometheus/prometheus.yml scrapes it: with `metrics_access: admin`, the admin key.
    The documents name their ratio: for two documents the shipped calibration meets the target at none."""
    ask = {"model": model, "messages": [{"role": "user", "content": "Who kept the lighthouse?"}], "max_tokens": 2}
    blend = {"documents": LIGHTHOUSE, "kvgate": {"recompute_ratio": 0.3}}
    for extra in (blend, blend, {"temperature": 0}, {"temperature": 0}):
        r = loopback.post(url + "/v1/chat/completions", json={**ask, **extra}, timeout=60)
        assert r.status_code == 200, r.text
    assert loopback.get(url + "/metrics").status_code == 401
    scraped = loopback.get(url + "/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert scraped.status_code == 200, scraped.text
    return scraped.text
