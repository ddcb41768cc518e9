"""Two real runtime worker processes behind a front: a request goes to the worker most likely to hold
its documents or program (consistent hashing), spills over when that worker is busy, and a client
that leaves mid-stream frees the worker's slot."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.gateway.routing import Ring
from kvgate.gateway.settings import Settings
from kvgate.gateway.upstreams import Upstream
from kvgate.gateway.workers import running
from tests.helpers import loopback
from tests.helpers.dashboards import FLEET, load, samples, unmatched
from tests.helpers.servers import serving
from tests.helpers.waiting import wait_until

AUTH = {"authorization": "Bearer sk-anyone"}
QUESTION = [{"role": "user", "content": "What does the passage say?"}]


def passage(n: int) -> str:
    return f"Passage {n}: the river town of Aldmere {n} holds a market on the {n % 28 + 1}th of each month."


def owner(text: str) -> str:
    return Ring(["worker-0", "worker-1"]).owner("text:" + hashlib.sha256(text.encode()).hexdigest())


@pytest.fixture(scope="module")
def front(loaded, tmp_path_factory) -> Iterator[tuple[str, dict[str, Upstream]]]:
    """The front's URL, and each worker by name. `loaded` has converted the model already."""
    settings = Settings(
        proxy={"workers": 2, "spill_at": 1},
        engine={"max_num_seqs": 4},
        semantic_cache={"enabled": False},
        caches={"dir": tmp_path_factory.mktemp("worker-chunks"), "disk_bytes": 0},
    )
    with running(settings, 2) as workers:
        with serving(settings, None, workers) as url:
            yield url, {w.name: w for w in workers}


def chat(url: str, model: str, documents: list[dict], auth: dict[str, str] = AUTH, **body) -> httpx.Response:
    payload = {"model": model, "messages": QUESTION, "documents": documents, "max_tokens": 4, "temperature": 0}
    r = loopback.post(url + "/v1/chat/completions", json={**payload, **body}, headers=auth, timeout=120)
    assert r.status_code == 200, r.text
    return r


def test_the_same_documents_go_to_the_same_worker_and_are_reused(front, model_name):
    url, _ = front
    docs = [{"text": passage(1)}, {"text": passage(2)}]
    first, again = chat(url, model_name, docs), chat(url, model_name, docs)
    assert first.headers["x-kvgate-upstream"] == again.headers["x-kvgate-upstream"]
    assert int(again.headers["x-kvgate-reused-tokens"]) > 0  # the worker's own report, passed on


def test_a_tenants_document_kv_is_reused_on_its_worker_by_that_tenant_only(front, model_name):
    """The front names each tenant to the worker (a token per tenant, hashed): B citing A's text reuses
    none of A's KV, while A's next request does."""
    url, _ = front
    docs = [{"text": passage(300)}]
    a, b = {"authorization": "Bearer sk-tenant-a"}, {"authorization": "Bearer sk-tenant-b"}
    chat(url, model_name, docs, a)
    assert int(chat(url, model_name, docs, b).headers["x-kvgate-reused-tokens"]) == 0
    assert int(chat(url, model_name, docs, a).headers["x-kvgate-reused-tokens"]) > 0


def test_each_document_goes_to_the_worker_its_hash_names(front, model_name):
    url, _ = front
    texts = {}
    for n in range(100, 140):
        texts.setdefault(owner(passage(n)), passage(n))
    assert set(texts) == {"worker-0", "worker-1"}
    for worker, text in texts.items():
        assert chat(url, model_name, [{"text": text}]).headers["x-kvgate-upstream"] == worker


def test_a_program_stays_on_one_worker_and_programs_spread_over_both(front, model_name):
    url, _ = front
    used: set[str] = set()
    for n in range(8):
        program = {"program_id": f"agent-{n}"}
        seen = {chat(url, model_name, [], kvgate=program).headers["x-kvgate-upstream"] for _ in range(2)}
        assert len(seen) == 1
        used |= seen
    assert used == {"worker-0", "worker-1"}  # by the program's hash, not by load alone


def test_stored_documents_are_found_where_they_were_stored(front, model_name):
    """A document's id does not hash to the worker its text does: the front remembers where it went."""
    url, _ = front
    for n in range(7, 60):  # one whose id alone would name the other worker
        stored = loopback.post(url + "/v1/documents", json={"text": passage(n)}, headers=AUTH, timeout=60)
        assert stored.status_code == 200 and stored.headers["x-kvgate-upstream"] == owner(passage(n))
        document_id = stored.json()["id"]
        if Ring(["worker-0", "worker-1"]).owner(document_id) != owner(passage(n)):
            break
    else:
        pytest.fail("every document id hashed to its text's worker")
    cited = chat(url, model_name, [{"id": document_id}])
    assert cited.headers["x-kvgate-upstream"] == owner(passage(n))
    assert int(cited.headers["x-kvgate-reused-tokens"]) > 0
    shown = loopback.get(url + f"/v1/documents/{document_id}", headers=AUTH)
    assert shown.status_code == 200 and shown.json()["id"] == document_id
    assert shown.headers["x-kvgate-upstream"] == owner(passage(n))
    assert loopback.delete(url + f"/v1/documents/{document_id}", headers=AUTH).status_code == 200
    assert loopback.get(url + f"/v1/documents/{document_id}", headers=AUTH).status_code == 404


def long_stream(url: str, model: str, text: str, opened: threading.Event, stop: threading.Event) -> None:
    body = {
        "model": model,
        "messages": QUESTION,
        "documents": [{"text": text}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with loopback.stream("POST", url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
        for _ in r.iter_lines():
            opened.set()
            if stop.is_set():
                return  # leaves mid-stream: the connection closes


def asked(worker: Upstream, path: str) -> httpx.Response:
    """A worker's answer to a GET as its front asks it (with the secret it holds)."""
    return loopback.get(worker.base_url + path, headers=worker.credentials())


def running_at(worker: Upstream) -> int:
    return asked(worker, "/ready").json()["running"]


def test_a_busy_worker_spills_over_and_a_client_leaving_frees_its_slot(front, model_name):
    url, workers = front
    text = passage(11)
    busy = owner(text)
    opened, stop = threading.Event(), threading.Event()
    streamer = threading.Thread(target=long_stream, args=(url, model_name, text, opened, stop))
    streamer.start()
    try:
        assert opened.wait(60)
        assert running_at(workers[busy]) == 1
        spilled = chat(url, model_name, [{"text": text}])
        assert spilled.headers["x-kvgate-upstream"] != busy  # spill_at=1: the preferred worker is busy
    finally:
        stop.set()
        streamer.join(60)
    # the worker stops generating for the client that left
    wait_until(lambda: running_at(workers[busy]) == 0, 15, "the worker kept generating", every_s=0.1)


def ready_model(workers: dict[str, Upstream]) -> str:
    return asked(next(iter(workers.values())), "/v1/models").json()["data"][0]["id"]


def test_the_front_reports_its_workers(front):
    url, workers = front
    ready = loopback.get(url + "/ready").json()
    assert ready == {"status": "ready", "upstreams": dict.fromkeys(workers, True)}
    text = loopback.get(url + "/metrics").text
    assert 'kvgate_upstream_in_flight{upstream="worker-0"}' in text
    assert 'kvgate_upstream_waiting{upstream="worker-1"} 0.0' in text
    # The workers' own metrics, labelled: document KV found in each worker's memory tier.
    assert 'kvgate_document_kv_hits_total{tier="memory",worker="worker-0"}' in text
    assert 'kvgate_requests_running{worker="worker-1"}' in text
    assert list(text_string_to_metric_families(text))  # still valid Prometheus text
    models = loopback.get(url + "/v1/models", headers=AUTH).json()["data"]
    assert [m["id"] for m in models] == [ready_model(workers)]


def test_every_panel_of_the_fleet_dashboard_has_data_from_a_front_of_workers(front, model_name):
    """kvgate-fleet.json over one front of --workers: its own samples (worker="") for the fronts' rows, its
    workers' (labelled) for the replicas' row; after documents asked twice (the second streamed: reused on
    their worker) and a request for a model no worker serves."""
    url, _ = front
    docs = [{"text": passage(500)}]
    chat(url, model_name, docs)
    body = {"model": model_name, "messages": QUESTION, "documents": docs, "max_tokens": 4, "stream": True}
    with loopback.stream("POST", url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200 and b"[DONE]" in r.read()
    nobody = {"model": "nobody", "messages": QUESTION}
    assert loopback.post(url + "/v1/chat/completions", json=nobody, headers=AUTH).status_code == 404
    missing = unmatched(load(FLEET), samples(loopback.get(url + "/metrics").text))
    assert not missing, "no sample for:\n" + "\n".join(missing)
