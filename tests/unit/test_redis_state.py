"""gateway/redis_state.py: one way to connect to the Redis the fronts share, a single server or a Redis Cluster
alike. On a real (one-node) Redis Cluster, every store the fronts share passes the tests it passes on a
single server: keys, placements, responses, answered turns, tool durations."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

import tests.unit.test_conversation_index as conversations
import tests.unit.test_key_store as keys
import tests.unit.test_placement as placements
import tests.unit.test_responses_store as responses
import tests.unit.test_tool_times as tool_times
from kvgate.gateway.redis_state import clustered, connect
from tests.helpers.redis_server import RedisServer
from tests.helpers.servers import free_port


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisServer]:
    with RedisServer(cluster=True) as server:
        yield server


def test_a_cluster_node_is_told_from_a_single_server(cluster: RedisServer, redis_url: str) -> None:
    assert clustered(cluster.url) and not clustered(redis_url)
    assert not clustered(f"redis://127.0.0.1:{free_port()}")  # out of reach at start: taken for a single server
    assert isinstance(connect(cluster.url), aioredis.RedisCluster)


STORES: dict[str, Callable[[str, Path], None]] = {
    "keys": lambda url, where: asyncio.run(
        keys.test_a_key_created_in_redis_is_found_and_listed_by_every_process(where, url)
    ),
    "placements": lambda url, _: placements.test_what_one_front_placed_another_finds_and_counts(url),
    "responses": lambda url, _: responses.test_the_redis_store_is_the_same_bounded_lru_shared_by_every_front(url),
    "turns": lambda url, _: conversations.test_what_one_front_answered_another_continues(url),
    "tool durations": lambda url, _: tool_times.test_a_replica_learns_how_long_a_tool_takes_from_another(url),
}


@pytest.mark.parametrize("name", list(STORES))
def test_every_shared_store_works_on_a_cluster(cluster: RedisServer, tmp_path: Path, name: str) -> None:
    with cluster.client() as raw:
        raw.flushall()
    STORES[name](cluster.url, tmp_path)
