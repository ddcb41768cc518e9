"""Document KV on disk and in Redis, through the gateway: damage is a miss, an outage is survived,
a restart and another process find what was stored. Real redis-server, real HTTP, the real model."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
import torch

from kvgate.chunk_cache import ChunkKV, DiskTier
from kvgate.gateway.settings import Settings
from kvgate.runtime.engine import Engine
from kvgate.runtime.loader import LoadedModel
from tests.helpers import loopback
from tests.helpers.redis_server import RedisServer
from tests.helpers.servers import free_port, serving
from tests.helpers.waiting import wait_healthy

DOCS = [
    "The Harbor Line opened in 1911 and runs from Pier Street to the Old Mill, stopping at Elm Square.",
    "Tickets for the Harbor Line cost three coins; children under ten ride for free on weekends.",
]
QUESTION = "How much does a ticket for the Harbor Line cost?"


@contextmanager
def gateway(loaded: LoadedModel, **options) -> Iterator[tuple[str, Engine]]:
    settings = Settings(engine={"max_num_seqs": 4}).model_copy(update=options)
    engine = Engine(settings.engine_config(), loaded)
    try:
        with serving(settings, engine) as url:
            yield url, engine
    finally:
        engine.shutdown()


def ask(url: str, reuse: str = "blend", ratio: float | None = 0.15, token: str = "") -> tuple[str, list[float], int]:
    """The greedy answer, its logprobs, and how many tokens' KV came from the cache."""
    body = {
        "model": loopback.get(f"{url}/v1/models").json()["data"][0]["id"],
        "messages": [{"role": "user", "content": QUESTION}],
        "documents": [{"text": d} for d in DOCS],
        "kvgate": {"reuse": reuse, **({"recompute_ratio": ratio} if ratio is not None else {})},
        "temperature": 0,
        "max_tokens": 4,  # the answer and its logprobs compared: 4 tokens of them suffice
        "logprobs": True,
    }
    headers = {"authorization": f"Bearer {token}"} if token else {}
    r = loopback.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    logprobs = [t["logprob"] for t in choice["logprobs"]["content"]]
    return choice["message"]["content"], logprobs, int(r.headers["x-kvgate-reused-tokens"])


def store_documents(url: str) -> list[str]:
    return [loopback.post(f"{url}/v1/documents", json={"text": d}, timeout=60).json()["id"] for d in DOCS]


def tier_stats(engine: Engine, name: str) -> dict:
    return next(t for t in engine.reuser.store.stats()["tiers"] if t["tier"] == name)


# ---- faults -------------------------------------------------------------------------------------


def damage_disk(engine: Engine, key: str, fault: str) -> None:
    disk = next(t for t in engine.reuser.store.tiers if isinstance(t, DiskTier))
    path = disk.path(key)
    data = bytearray(path.read_bytes())
    if fault == "flipped byte":
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    elif fault == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:  # the same key, KV computed by another model
        entry = ChunkKV.from_bytes(bytes(data))
        other = ChunkKV(key, entry.token_ids, entry.keys + 1, entry.values, entry.cost, model="another-model")
        path.write_bytes(other.to_bytes())


def damage_redis(engine: Engine, key: str, fault: str) -> None:
    tier = next(t for t in engine.reuser.store.tiers if t.name == "redis")
    client, name = redis.Redis.from_url(tier.url), tier.prefix + key
    data = client.get(name)
    assert data is not None
    if fault == "flipped byte":
        client.setrange(name, len(data) // 2, bytes([data[len(data) // 2] ^ 0x01]))
    elif fault == "truncated":
        client.set(name, data[: len(data) // 2])
    else:
        entry = ChunkKV.from_bytes(data)
        client.set(name, ChunkKV(key, entry.token_ids, entry.keys + 1, entry.values, entry.cost, "x").to_bytes())


@pytest.mark.parametrize("fault", ["flipped byte", "truncated", "another model"])
@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_damaged_entry_is_a_miss_and_never_changes_the_answer(
    loaded: LoadedModel, tmp_path: Path, tier: str, fault: str
) -> None:
    with RedisServer() as server:
        # Nothing fits in memory: every document and prefix is read from the tier under test.
        caches = {"memory_bytes": 0, "dir": tmp_path} | ({"disk_bytes": 0} if tier == "redis" else {})
        options = {"caches": caches} | ({"redis_url": server.url} if tier == "redis" else {})
        damage = damage_disk if tier == "disk" else damage_redis
        alone = {**options, "caches": {**caches, "prefix_caching": False}}
        with gateway(loaded, **alone) as (url, engine):  # documents alone
            ids = store_documents(url)
            clean = ask(url)
            assert clean[2] > 0  # the documents came from the tier
            for doc_id in ids:
                damage(engine, doc_id.removeprefix("doc-"), fault)
            text, logprobs, reused = ask(url)
            assert reused == 0  # a miss, recomputed...
            assert text == clean[0] and logprobs == pytest.approx(clean[1], abs=1e-5)  # ...same answer
            assert tier_stats(engine, tier)["corrupt"] >= len(ids)
            assert ask(url)[2] > 0  # stored again, sound this time

        with gateway(loaded, **options) as (url, engine):  # prefix blocks
            full = ask(url, "full")  # full prefill, the truth: it touches no cache
            assert ask(url, "prefix")[2] == 0  # computes and stores the prompt's blocks
            found = ask(url, "prefix")
            assert found[2] > 0 and found[0] == full[0]
            blocks = engine.caches.blocks
            assert blocks is not None
            keys = [key for children in blocks.children.values() for key in children]
            for key in keys:
                damage(engine, key, fault)
            prefix = ask(url, "prefix")
            assert prefix[2] == 0 and prefix[0] == full[0]
            assert tier_stats(engine, tier)["corrupt"] >= 1
            assert ask(url, "prefix")[2] > 0  # stored again, sound this time


# ---- outage, restart, another process -------------------------------------------------------------


def test_requests_survive_a_redis_outage_and_use_it_again_when_it_is_back(loaded: LoadedModel, tmp_path: Path) -> None:
    with RedisServer() as server:
        options = {"caches": {"dir": tmp_path, "disk_bytes": 0}, "redis_url": server.url}
        with gateway(loaded, **options) as (url, engine):
            store_documents(url)
            engine.reuser.store.flush()
            answer = ask(url)
            server.kill()

            started = time.monotonic()
            during = ask(url)  # from memory, Redis unreachable
            assert during[0] == answer[0] and during[2] > 0
            loopback.post(f"{url}/v1/documents", json={"text": "Written while Redis is down."}, timeout=60)
            engine.reuser.store.flush()
            assert time.monotonic() - started < 20
            assert tier_stats(engine, "redis")["errors"] > 0

            server.start()  # empty again: it saves nothing
            time.sleep(1.5)  # the tier's retry interval
            key = loopback.post(f"{url}/v1/documents", json={"text": "Written once Redis is back."}, timeout=60)
            engine.reuser.store.flush()
            assert key.json()["id"].removeprefix("doc-") in engine.reuser.store.tiers[-1]


def test_after_a_restart_documents_are_found_on_disk(loaded: LoadedModel, tmp_path: Path) -> None:
    with gateway(loaded, caches={"dir": tmp_path}) as (url, _):
        ids = store_documents(url)
        before = ask(url)
    with gateway(loaded, caches={"dir": tmp_path}) as (url, engine):  # shutdown flushed the writes
        # Cited by id: the restarted process learns the tokens from the entry on disk.
        shown = loopback.get(f"{url}/v1/documents/{ids[0]}")
        assert shown.status_code == 200 and shown.json()["tokens"] > 0
        after = ask(url)
        assert after[2] > 0 and after[0] == before[0]
        assert tier_stats(engine, "disk")["hits"] >= len(DOCS)


def test_a_document_stored_through_one_process_is_a_hit_in_another_through_redis(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    with RedisServer() as server:
        with gateway(loaded, caches={"dir": tmp_path / "a"}, redis_url=server.url) as (url_a, engine_a):
            ids = store_documents(url_a)
            engine_a.reuser.store.flush()

        port = free_port()
        env = {
            **os.environ,
            "KVGATE_REDIS_URL": server.url,
            "KVGATE_CACHES__DIR": str(tmp_path / "b"),
            "KVGATE_CACHES__DISK_BYTES": "0",
        }
        process = subprocess.Popen(
            [sys.executable, "-m", "kvgate.gateway.cli", "serve", "--port", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            url_b = f"http://127.0.0.1:{port}"
            wait_healthy(process, url_b, 120)
            assert loopback.get(f"{url_b}/v1/documents/{ids[0]}").status_code == 200
            assert ask(url_b)[2] > 0
        finally:
            process.terminate()
            process.wait(timeout=30)


def test_a_token_callers_documents_stored_on_one_machine_are_hits_on_another_through_redis(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    """Two machines, each its own cache_dir, one Redis; callers send a bearer token that is no key (no
    keys configured). The token is the same tenant on both, so its documents are found on the second."""
    with RedisServer() as server:

        def machine(name: str) -> dict:
            where = tmp_path / name
            return {"cache_dir": where, "caches": {"dir": where / "chunks"}, "redis_url": server.url}

        with gateway(loaded, **machine("a")) as (url_a, engine_a):
            assert ask(url_a, token="EMPTY")[2] == 0
            engine_a.reuser.store.flush()
        with gateway(loaded, **machine("b")) as (url_b, _):
            assert ask(url_b, token="another")[2] == 0  # another token: another tenant's documents
            assert ask(url_b, token="EMPTY")[2] > 0


def test_tier_reads_are_bit_exact(loaded: LoadedModel, tmp_path: Path) -> None:
    """What a tier hands back is exactly what was computed (the fault tests compare answers)."""
    with gateway(loaded, caches={"dir": tmp_path}) as (url, engine):
        (doc_id, _) = store_documents(url)
        key = doc_id.removeprefix("doc-")
        engine.reuser.store.flush()
        memory, disk = engine.reuser.store.tiers[:2]
        a, b = memory.get(key), disk.get(key, engine.reuser.model_fp)
        assert b is not None and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
