"""Admission under abuse, on a real server over loopback with the shared engine (8 sequences decoded
together): one request's fan-out is bounded (400, nothing queued, nothing tokenized), a tenant that
floods gets 429s with Retry-After once over its share while another tenant's 2-token chat answers
promptly, the server's total gets 503s with Retry-After, and no request ever gets any other 5xx. A
request's sequences are released however it ends: finished, its client gone, its stream closed. In
proxy mode the same bounds hold at the gateway, in front of an upstream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import pytest

from kvgate.bench.upstream import serve_upstream
from kvgate.gateway.backend import make_backend
from kvgate.gateway.local import Local
from kvgate.gateway.proxy import Upstreams
from kvgate.gateway.settings import Settings
from kvgate.runtime.engine import Engine
from tests.helpers import loopback, servers

KEYS = {"sk-flood": "flood", "sk-calm": "calm", "sk-third": "third"}
SHARE, TOTAL = 32, 40  # sequences in flight: per tenant, in all
HELLO = [{"role": "user", "content": "Say hi."}]


@dataclass
class Server:
    url: str
    backend: Local | Upstreams

    def idle(self, engine: Engine | None, within_s: float = 60.0) -> None:
        """Wait until nothing is counted or queued (an abort reaches the engine thread a step later)."""
        deadline = time.monotonic() + within_s
        while self.backend.admission.total or (engine is not None and any(engine.load_stats.values())):
            assert time.monotonic() < deadline, (self.backend.admission.tenants, engine.load_stats)
            time.sleep(0.05)


@contextmanager
def serving(settings: Settings, engine: Engine | None) -> Iterator[Server]:
    """The gateway over the shared engine (None: over upstreams) on loopback, its backend at hand."""
    backend = make_backend(settings, engine)
    assert isinstance(backend, Local | Upstreams)
    with servers.serving(settings, engine, backend=backend) as url:
        yield Server(url, backend)


@pytest.fixture(scope="module")
def server(settings: Settings, engine: Engine) -> Iterator[Server]:
    bounds = {"max_request_seqs": 16, "max_waiting_seqs_per_tenant": SHARE, "max_waiting_seqs": TOTAL}
    with serving(settings.model_copy(update={"security": {"api_keys": KEYS, **bounds}}), engine) as found:
        yield found


def chat(model: str, n: int = 1, max_tokens: int = 2, **more) -> dict:
    return {"model": model, "messages": HELLO, "n": n, "max_tokens": max_tokens, **more}


def long_chat(model: str, n: int, max_tokens: int = 8) -> dict:
    return chat(model, n, max_tokens, ignore_eos=True, temperature=1.0)


@dataclass
class Seen:
    """Every answer of a scenario: (who, status, seconds from the start to its end, response)."""

    started: float = field(default_factory=time.monotonic)
    answers: list[tuple[str, int, float, httpx.Response]] = field(default_factory=list)

    async def send(self, http: httpx.AsyncClient, who: str, body: dict, path: str = "/v1/chat/completions") -> None:
        r = await http.post(path, json=body, headers={"authorization": f"Bearer sk-{who}"})
        self.answers.append((who, r.status_code, time.monotonic() - self.started, r))

    def of(self, who: str, status: int | None = None) -> list[tuple[str, int, float, httpx.Response]]:
        return [a for a in self.answers if a[0] == who and (status is None or a[1] == status)]

    def no_server_errors(self, but: int | None = None) -> None:
        wrong = [(w, s, r.text) for w, s, _, r in self.answers if s >= 500 and s != but]
        assert not wrong, wrong


def retry_after(r: httpx.Response) -> int:
    wait = int(r.headers["retry-after"])
    assert wait >= 1
    return wait


async def flood(server: Server, model: str, also: list[tuple[str, dict]]) -> Seen:
    """Tenant flood fires 12 requests of 4 sequences (8 tokens each, 5 rounds of the 7 slots it may
    hold) at once: 48 > its share of 32. Once they are in, each of `also` is sent in turn."""
    seen = Seen()
    async with httpx.AsyncClient(base_url=server.url, timeout=600) as http:
        flooding = [asyncio.create_task(seen.send(http, "flood", long_chat(model, 4))) for _ in range(12)]
        deadline = time.monotonic() + 60
        while server.backend.admission.tenants.get("flood", 0) < SHARE:
            assert time.monotonic() < deadline, server.backend.admission.tenants
            await asyncio.sleep(0.02)
        for who, body in also:
            await seen.send(http, who, body)
        await asyncio.gather(*flooding)
    return seen


def test_a_request_asking_for_16000_sequences_is_a_400_and_queues_nothing(server, engine, model_name, monkeypatch):
    """The issue's request: 1,000 one-token prompts, n=16. Counted from the list's length: not one
    prompt is tokenized."""
    server.idle(engine)
    tokenized = []
    monkeypatch.setattr("kvgate.gateway.local.token_ids", lambda *a: tokenized.append(a))
    body = {"model": model_name, "prompt": ["hi"] * 1000, "n": 16, "max_tokens": 1}
    r = loopback.post(
        server.url + "/v1/completions", json=body, headers={"authorization": "Bearer sk-flood"}, timeout=30
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("too_many_sequences", "prompt", "invalid_request_error")
    assert "16000" in error["message"] and "retry-after" not in r.headers  # retrying never helps
    assert tokenized == [] and server.backend.admission.total == 0
    assert engine.load_stats == {"waiting": 0, "running": 0}
    # n alone over the bound names n; a list of prompts within it is served.
    r = loopback.post(
        server.url + "/v1/completions",
        json={**body, "prompt": ["hi"] * 2, "n": 9},
        headers={"authorization": "Bearer sk-flood"},
        timeout=30,
    )
    assert (r.status_code, r.json()["error"]["param"]) == (400, "n")
    monkeypatch.undo()
    r = loopback.post(
        server.url + "/v1/completions",
        json={**body, "prompt": ["hi"] * 4, "n": 4},
        headers={"authorization": "Bearer sk-flood"},
        timeout=60,
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == 16
    server.idle(engine)


def test_a_flooding_tenant_gets_429_while_another_tenants_short_chat_answers_promptly(server, engine, model_name):
    server.idle(engine)
    calm_alone = time.monotonic()
    r = loopback.post(
        server.url + "/v1/chat/completions",
        json=chat(model_name),
        headers={"authorization": "Bearer sk-calm"},
        timeout=60,
    )
    assert r.status_code == 200
    calm_alone = time.monotonic() - calm_alone

    seen = asyncio.run(flood(server, model_name, [("calm", chat(model_name))]))

    seen.no_server_errors()
    assert len(seen.of("flood", 200)) == 8  # 32 sequences: its share
    refused = seen.of("flood", 429)
    assert len(refused) == 4
    for _, _, _, r in refused:
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert r.json()["error"]["code"] == "tenant_queue_full"
        retry_after(r)
    [(_, status, calm_done, _)] = seen.of("calm")
    assert status == 200
    flood_done = max(t for _, _, t, _ in seen.of("flood", 200))
    # The calm chat was sent once the flood was in: it ends well before the flood does.
    assert calm_done < flood_done / 2, (calm_done, flood_done, calm_alone)
    server.idle(engine)


def test_the_servers_total_gets_503_with_retry_after(server, engine, model_name):
    """Flood holds its share (32); a third tenant's 16 would make 48 of 40: 503. The calm tenant's
    one sequence still fits (33)."""
    server.idle(engine)
    seen = asyncio.run(flood(server, model_name, [("third", chat(model_name, n=16)), ("calm", chat(model_name))]))
    seen.no_server_errors(but=503)
    [(_, status, _, r)] = seen.of("third")
    assert status == 503, r.text
    assert r.json()["error"]["type"] == "server_error" and r.json()["error"]["code"] == "server_queue_full"
    retry_after(r)
    assert [a[1] for a in seen.of("calm")] == [200]
    assert len(seen.of("flood", 200)) == 8
    server.idle(engine)


def test_sequences_are_released_when_the_client_hangs_up_or_closes_its_stream(server, engine, model_name):
    server.idle(engine)
    admission = server.backend.admission

    async def scenario() -> None:
        headers = {"authorization": "Bearer sk-flood"}
        async with httpx.AsyncClient(base_url=server.url, timeout=60, headers=headers) as http:
            # A whole answer whose client goes away while it is generated.
            gone = asyncio.create_task(http.post("/v1/chat/completions", json=long_chat(model_name, 4, 400)))
            while admission.tenants.get("flood", 0) < 4:
                await asyncio.sleep(0.02)
            gone.cancel()
            # A stream closed after its first event.
            body = {**long_chat(model_name, 3, 400), "stream": True}
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break
            # A completions stream of several prompts, closed too.
            body = {"model": model_name, "prompt": ["a", "b"], "n": 2, "max_tokens": 400, "ignore_eos": True}
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break

    asyncio.run(scenario())
    server.idle(engine)  # every sequence released and aborted, well before 400 tokens each
    assert admission.tenants == {}


def test_proxy_mode_holds_the_same_bounds_at_the_gateway(tmp_path):
    """Tenants' requests wait at the gateway (or are in flight upstream) within the same bounds: the
    stub upstream holds each answer 3 s; share 8, total 12, a request at most 8."""
    with serve_upstream(models=("stub-a",), words=4) as upstream:
        settings = Settings(
            proxy={"upstreams": [{"base_url": upstream, "models": ["stub-a"]}]},
            security={
                "api_keys": KEYS,
                "max_request_seqs": 8,
                "max_waiting_seqs_per_tenant": 8,
                "max_waiting_seqs": 12,
            },
            semantic_cache={"enabled": False},
            cache_dir=tmp_path,
        )
        loopback.post(upstream + "/_script", json={"actions": [{"delay_s": 3}] * 3}).raise_for_status()
        with serving(settings, None) as server:
            admission = server.backend.admission

            async def scenario() -> Seen:
                seen = Seen()
                async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                    held = [asyncio.create_task(seen.send(http, "flood", chat("stub-a", n=4))) for _ in range(2)]
                    held.append(asyncio.create_task(seen.send(http, "calm", chat("stub-a", n=4))))
                    while admission.total < 12:
                        await asyncio.sleep(0.02)
                    await seen.send(http, "flood", chat("stub-a"))  # flood: 9 of 8
                    await seen.send(http, "third", chat("stub-a"))  # the server: 13 of 12
                    await seen.send(http, "third", chat("stub-a", n=9))  # never: 9 of 8 a request
                    await asyncio.gather(*held)
                    # A stream whose client leaves after its first event releases its sequences.
                    loopback.post(upstream + "/_script", json={"actions": [{"chunk_delay_s": 1}]}).raise_for_status()
                    body = {**chat("stub-a", n=2), "stream": True}
                    headers = {"authorization": "Bearer sk-calm"}
                    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
                        assert response.status_code == 200
                        async for line in response.aiter_lines():
                            if line.startswith("data: "):
                                break
                        assert admission.tenants == {"calm": 2}
                return seen

            seen = asyncio.run(scenario())
            server.idle(None, within_s=10)
    assert [a[1] for a in seen.of("flood")].count(200) == 2
    [(_, status, _, refused)] = seen.of("flood", 429)
    assert refused.json()["error"]["code"] == "tenant_queue_full" and retry_after(refused) >= 1
    assert [a[1] for a in seen.of("calm")] == [200]
    statuses = [(a[1], a[3].json()["error"]["code"]) for a in seen.of("third")]
    assert statuses == [(503, "server_queue_full"), (400, "too_many_sequences")]
    assert retry_after(seen.of("third", 503)[0][3]) >= 1
    seen.no_server_errors(but=503)
