"""Two processes share semantic cache entries, and the error bound's evidence, through a real redis-server
started by the test."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvgate.semantic_cache import MiniLM, SemanticCache, SemanticCacheConfig
from kvgate.semantic_cache.bound import NEVER, SYNC_S, Bound
from kvgate.semantic_cache.redis_store import RedisStore
from tests.helpers.redis_server import RedisServer
from tests.helpers.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def embedder() -> MiniLM:
    return MiniLM()


@contextmanager
def another_process(url: str) -> Iterator[Callable[[str], str]]:
    """A SemanticCache on `url` in a fresh Python process, kept while the block runs (one start: an import of
    torch and the embedder's load, seconds): each call runs `code` there, with `cache`, and returns its stdout."""
    script = textwrap.dedent(
        f"""
        import contextlib, io, json, sys
        from kvgate.semantic_cache import SemanticCache, SemanticCacheConfig
        cache = SemanticCache(SemanticCacheConfig(redis_url={url!r}))
        for line in sys.stdin:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(json.loads(line), {{"cache": cache}})
            print(json.dumps(out.getvalue()), flush=True)
        """
    )
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, text=True, **pipes)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None

    def run(code: str) -> str:
        proc.stdin.write(json.dumps(code) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-3000:]  # it died: why
        return json.loads(line).strip()

    try:
        yield run
    finally:
        proc.stdin.close()
        proc.wait(30)


@pytest.mark.parametrize("cluster", [False, True], ids=["single", "cluster"])
def test_an_answer_stored_by_one_process_is_a_hit_in_another(embedder: MiniLM, cluster: bool) -> None:
    with RedisServer(cluster=cluster) as server:
        here = SemanticCache(SemanticCacheConfig(redis_url=server.url), embedder=embedder)
        assert not here.lookup("s", QUESTION).hit
        with another_process(server.url) as there:
            entry_id = there(f"print(cache.put('t', 's', {QUESTION!r}, {{'content': 'Paris'}}).id)")
            found = here.lookup("s", "what is the capital of france")  # no restart: the change log tells
            assert found.hit and found.entry is not None
            assert found.entry.id == entry_id and found.entry.response == {"content": "Paris"}
            # A deletion by the other process reaches this one's index too.
            assert there("print(cache.invalidate(tenant='t'))") == "1"
        assert not here.lookup("s", QUESTION).hit and len(here.index) == 0


def test_a_new_process_reads_a_scope_from_redis_when_first_looked_up(embedder: MiniLM) -> None:
    with RedisServer() as server:
        first = SemanticCache(SemanticCacheConfig(redis_url=server.url), embedder=embedder)
        for i in range(3):
            first.put("t", "s", f"How do I cook recipe number {i}?", {"content": str(i)})
        with another_process(server.url) as there:
            lookup = "cache.lookup('s', 'How do I cook recipe number 1?').hit"
            out = there(f"print(len(cache.index), {lookup}, len(cache.index))")
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


@pytest.mark.parametrize("cluster", [False, True], ids=["single", "cluster"])
def test_verdicts_one_process_learnt_open_the_bound_in_every_process_on_the_store(cluster: bool) -> None:
    """Each front would otherwise wait for its own warm-up's verdicts: pooled, the fleet learns as one."""
    now = [0.0]
    with RedisServer(cluster=cluster) as server:
        one, two = (
            Bound({"c": 0.1}, shared=RedisStore(server.url, dim=4).evidence, clock=lambda: now[0]) for _ in "12"
        )
        assert two.threshold("c") == NEVER
        for i in range(90):
            one.asked("c", 0.95)
            one.learn("c", f"e{i}", 0.95, True)
        assert one.threshold("c") <= 0.95 and two.threshold("c") == NEVER  # not before the next sync
        now[0] += SYNC_S
        one.threshold("c")  # adds its evidence
        assert two.threshold("c") <= 0.95
        for i in range(45):
            two.learn("c", f"f{i}", 0.95, False)  # a third of all verdicts wrong: 0.95 shut again, everywhere
        now[0] += SYNC_S
        assert two.threshold("c") > 0.95 and one.threshold("c") > 0.95
        counted = one.stats()["categories"]["c"]
        assert (counted["asked"], counted["right"], counted["wrong"]) == (90, 90, 45)


def test_a_store_out_of_reach_keeps_the_evidence_here_until_it_answers(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    with RedisServer() as server:
        store = RedisStore(f"redis://127.0.0.1:{free_port()}", dim=4)  # nothing listens there
        bound = Bound({"c": 0.1}, shared=store.evidence, clock=lambda: now[0])
        for i in range(90):
            bound.asked("c", 0.95)
            bound.learn("c", f"e{i}", 0.95, True)
        with caplog.at_level(logging.WARNING, logger="kvgate.semantic"):
            assert bound.threshold("c") <= 0.95  # what this process saw counts here meanwhile
            now[0] += SYNC_S
            bound.threshold("c")
        assert caplog.messages == ["semantic cache: the bound's shared evidence is out of reach (ConnectionError)"]
        bound.shared = RedisStore(server.url, dim=4).evidence  # the store is back (here: another address)
        now[0] += SYNC_S
        bound.threshold("c")
        other = Bound({"c": 0.1}, shared=RedisStore(server.url, dim=4).evidence, clock=lambda: now[0])
        assert other.stats()["categories"]["c"]["right"] == 90  # nothing lost, nothing counted twice
