"""Two processes share semantic cache entries through a real redis-server started by the test."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvgate.semantic_cache import MiniLM, SemanticCache, SemanticCacheConfig
from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def embedder() -> MiniLM:
    return MiniLM()


def in_another_process(url: str, code: str) -> str:
    """Run `code` with `cache`, a SemanticCache on `url`, in a fresh Python process; its stdout."""
    script = textwrap.dedent(
        f"""
        from kvgate.semantic_cache import SemanticCache, SemanticCacheConfig
        cache = SemanticCache(SemanticCacheConfig(redis_url={url!r}))
        """
    ) + textwrap.dedent(code)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


@pytest.mark.parametrize("cluster", [False, True], ids=["single", "cluster"])
def test_an_answer_stored_by_one_process_is_a_hit_in_another(embedder: MiniLM, cluster: bool) -> None:
    with RedisServer(cluster=cluster) as server:
        here = SemanticCache(SemanticCacheConfig(redis_url=server.url), embedder=embedder)
        assert not here.lookup("s", QUESTION).hit
        entry_id = in_another_process(
            server.url, f"print(cache.put('t', 's', {QUESTION!r}, {{'content': 'Paris'}}).id)"
        )
        found = here.lookup("s", "what is the capital of france")  # no restart: the change log tells
        assert found.hit and found.entry is not None
        assert found.entry.id == entry_id and found.entry.response == {"content": "Paris"}
        # A deletion by the other process reaches this one's index too.
        assert in_another_process(server.url, "print(cache.invalidate(tenant='t'))") == "1"
        assert not here.lookup("s", QUESTION).hit and len(here.index) == 0


def test_a_new_process_reads_a_scope_from_redis_when_first_looked_up(embedder: MiniLM) -> None:
    with RedisServer() as server:
        first = SemanticCache(SemanticCacheConfig(redis_url=server.url), embedder=embedder)
        for i in range(3):
            first.put("t", "s", f"How do I cook recipe number {i}?", {"content": str(i)})
        out = in_another_process(
            server.url,
            "print(len(cache.index), cache.lookup('s', 'How do I cook recipe number 1?').hit, len(cache.index))",
        )
        assert out == "0 True 3"


def test_a_damaged_value_in_redis_is_a_miss_and_is_deleted(embedder: MiniLM) -> None:
    with RedisServer() as server:
        cache = SemanticCache(SemanticCacheConfig(redis_url=server.url), embedder=embedder)
        entry = cache.put("t", "s", QUESTION, {"content": "Paris"})
        assert entry is not None
        with server.client() as client:
            client.hset(f"{{kvgate:sem}}:e:{entry.id}", "response", b'{"content":"Lyon"}')
        assert not cache.lookup("s", QUESTION).hit
        assert cache.store.ids() == []


def test_redis_going_away_is_a_miss_not_an_error(embedder: MiniLM) -> None:
    with RedisServer() as server:
        cache = SemanticCache(SemanticCacheConfig(redis_url=server.url), embedder=embedder)
        cache.put("t", "s", QUESTION, {"content": "Paris"})
        server.kill()
        assert not cache.lookup("s", QUESTION).hit
        assert cache.put("t", "s", "Why is the sky blue?", {"content": "Rayleigh"}) is None
        assert cache.stats()["errors"] == 2


def test_a_server_down_at_start_up_means_misses_until_it_is_up(embedder: MiniLM) -> None:
    with RedisServer() as server:
        server.kill()
        cache = SemanticCache(SemanticCacheConfig(redis_url=server.url), embedder=embedder)
        assert not cache.lookup("s", QUESTION).hit
        server.start()
        assert cache.put("t", "s", QUESTION, {"content": "Paris"}) is not None
        assert cache.lookup("s", QUESTION).hit
