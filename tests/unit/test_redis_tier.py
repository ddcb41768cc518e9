"""kvgate.chunk_cache.redis_tier against a real redis-server, single and one-node cluster: exact round trips,
damage as a miss that deletes, layer-by-layer loading, one LRU byte budget shared by every process, outages."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvgate.chunk_cache import (
    ChunkCacheConfig,
    ChunkKV,
    ChunkStore,
    Header,
    LoadFailed,
    Loading,
    MemoryTier,
    make_tier,
)
from kvgate.chunk_cache.redis_tier import RedisTier
from tests.helpers.entries import chunk, same
from tests.helpers.redis_server import RedisServer
from tests.helpers.servers import free_port


def size_of(entry: ChunkKV) -> int:
    return len(entry.to_bytes())


@pytest.fixture
def tier(redis_url: str) -> Iterator[RedisTier]:
    tier = RedisTier(redis_url, budget_bytes=1 << 20)
    yield tier
    tier.close()


# --- entries ------------------------------------------------------------------------------------


def test_round_trip_is_exact_and_an_absent_key_is_a_miss(tier: RedisTier) -> None:
    entry = chunk()
    assert tier.get("doc") is None
    assert tier.put(entry)
    assert same(tier.get("doc"), entry)
    assert "doc" in tier and tier.keys() == ["doc"] and tier.nbytes == size_of(entry)
    assert tier.delete("doc") and not tier.delete("doc")
    assert "doc" not in tier and tier.keys() == [] and tier.nbytes == 0
    stats = tier.stats()
    assert (stats["hits"], stats["misses"], stats["puts"], stats["corrupt"]) == (1, 1, 1, 0)
    assert (stats["entries"], stats["available"], stats["cluster"]) == (0, 1, 0)


def test_the_tier_is_built_by_name_from_the_config(redis_url: str) -> None:
    config = ChunkCacheConfig(tiers=("memory", "redis"), redis_url=redis_url, redis_bytes=12345)
    tier = make_tier("redis", **config.tier_options("redis"))
    assert isinstance(tier, RedisTier) and tier.budget == 12345


def test_a_multi_megabyte_entry_round_trips(redis_url: str) -> None:
    # Each 1.5 MiB layer is more than one GETRANGE piece; the token ids lie past the first read.
    entry = chunk(tokens=12288, layers=2)
    tier = RedisTier(redis_url, budget_bytes=8 << 20)
    assert tier.put(entry)
    assert same(tier.get("doc"), entry)


def test_a_prefix_must_not_hold_hash_tag_braces(redis_url: str) -> None:
    with pytest.raises(ValueError, match="prefix"):
        RedisTier(redis_url, budget_bytes=1 << 20, prefix="kvgate:{chunk}:")


# --- damage: a miss, and the value is deleted ----------------------------------------------------


@pytest.mark.parametrize("where", ["header", "token ids", "last layer"])
def test_a_flipped_byte_is_a_miss_and_the_value_is_deleted(
    tier: RedisTier, redis_server: RedisServer, where: str
) -> None:
    entry = chunk()
    data = entry.to_bytes()
    header = Header.parse(data[: Header.size_of(data)])
    offset = {"header": 20, "token ids": header.ids_start, "last layer": header.layer_range(3)[1] - 1}[where]
    assert tier.put(entry)
    with redis_server.client() as raw:
        raw.setrange(tier.value_key("doc"), offset, bytes([data[offset] ^ 0xFF]))
        assert tier.get("doc") is None
        assert not raw.exists(tier.value_key("doc"))
    assert tier.keys() == [] and tier.nbytes == 0 and tier.stats()["corrupt"] == 1


@pytest.mark.parametrize("keep", [0, 7, 100, 0.5, -1])
def test_a_truncated_or_empty_value_is_a_miss_and_is_deleted(
    tier: RedisTier, redis_server: RedisServer, keep: float
) -> None:
    entry = chunk(tokens=512)  # 256 KiB: longer than the first read
    data = entry.to_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else keep % len(data)
    assert tier.put(entry)
    with redis_server.client() as raw:
        raw.set(tier.value_key("doc"), data[:cut])
        assert tier.get("doc") is None
        assert not raw.exists(tier.value_key("doc"))
    assert tier.stats()["corrupt"] == 1 and tier.nbytes == 0


def test_a_value_computed_by_another_model_is_a_miss_and_is_deleted(tier: RedisTier) -> None:
    assert tier.put(chunk(model="model-a"))
    store = ChunkStore([tier])
    assert store.fetch("doc", model="model-b") is None
    store.close()
    assert "doc" not in tier and tier.stats()["corrupt"] == 1


def test_a_value_stored_under_another_key_is_a_miss_and_is_deleted(tier: RedisTier, redis_server: RedisServer) -> None:
    entry = chunk("a")
    assert tier.put(entry)
    with redis_server.client() as raw:
        raw.copy(tier.value_key("a"), tier.value_key("b"))
    assert tier.get("b") is None and "b" not in tier
    assert same(tier.get("a"), entry)


# --- in a store ---------------------------------------------------------------------------------


def test_a_hit_below_memory_is_read_layer_by_layer_then_promoted(redis_url: str) -> None:
    memory, remote = MemoryTier(budget_bytes=1 << 20), RedisTier(redis_url, budget_bytes=4 << 20)
    entry = chunk(tokens=512)
    assert remote.put(entry)
    store = ChunkStore([memory, remote])

    loading = store.fetch("doc")
    assert isinstance(loading, Loading) and loading.tokens == 512
    keys, values = loading.layer(0)
    assert torch.equal(keys, entry.keys[0]) and torch.equal(values, entry.values[0])
    assert same(loading.result(), entry)

    store.close()  # waits for the load, whose end promotes the entry
    assert same(memory.get("doc"), entry)
    assert store.stats()["promotions"] == 1 and remote.stats()["hits"] == 1


# --- one Redis, many processes: shared entries, one budget --------------------------------------


def test_two_tiers_on_one_server_share_entries_as_two_processes_would(redis_url: str) -> None:
    one, two = RedisTier(redis_url, budget_bytes=1 << 20), RedisTier(redis_url, budget_bytes=1 << 20)
    entry = chunk()
    assert one.put(entry)
    assert same(two.get("doc"), entry)
    assert "doc" in two and two.keys() == ["doc"] and two.nbytes == one.nbytes == size_of(entry)
    assert two.delete("doc")
    assert one.get("doc") is None and one.nbytes == 0


def test_least_recently_used_entries_go_first_to_keep_the_shared_total_within_budget(redis_url: str) -> None:
    size = size_of(chunk())
    one, two = RedisTier(redis_url, budget_bytes=3 * size), RedisTier(redis_url, budget_bytes=3 * size)
    for key in "abc":
        assert one.put(chunk(key))
    assert one.get("a") is not None  # now b is the least recently used

    assert two.put(chunk("d"))
    assert sorted(one.keys()) == ["a", "c", "d"] and "b" not in one
    assert one.nbytes == two.nbytes == 3 * size
    assert two.stats()["evictions"] == 1

    for key in "efgh":
        assert two.put(chunk(key))
    assert sorted(one.keys()) == ["f", "g", "h"] and one.nbytes == 3 * size


def test_an_entry_larger_than_the_whole_budget_is_refused_and_evicts_nothing(redis_url: str) -> None:
    tier = RedisTier(redis_url, budget_bytes=2 * size_of(chunk()))
    assert tier.put(chunk("small"))
    assert not tier.put(chunk("big", tokens=64))
    assert tier.keys() == ["small"] and tier.stats()["refused"] == 1


def test_bookkeeping_left_wrong_by_a_dead_writer_is_repaired(tier: RedisTier, redis_server: RedisServer) -> None:
    kept, orphan = chunk("kept"), chunk("orphan")
    assert tier.put(kept) and tier.put(chunk("gone"))
    nested = RedisTier(tier.url, budget_bytes=1 << 20, prefix=tier.prefix + "v2:")  # another deployment's
    assert nested.put(chunk("doc"))
    with redis_server.client() as raw:
        raw.delete(tier.value_key("gone"))  # counted, but the value is gone
        raw.set(tier.value_key("orphan"), orphan.to_bytes())  # stored, never counted: its writer died in between

    tier.reconcile()
    assert sorted(tier.keys()) == ["gone", "kept", "orphan"]  # "gone" was used just now: maybe being written
    tier.reconcile(grace_s=0.0)
    assert sorted(tier.keys()) == ["kept", "orphan"] and tier.nbytes == size_of(kept) + size_of(orphan)
    assert nested.keys() == ["doc"]  # under the longer prefix: not ours to count

    assert RedisTier(tier.url, budget_bytes=5 * size_of(chunk()) // 2).put(chunk("new"))
    assert sorted(tier.keys()) == ["kept", "new"]  # the adopted value went first
    assert "doc" in nested


# --- outages ------------------------------------------------------------------------------------


def test_a_dead_server_is_a_quick_miss_and_is_used_again_once_back() -> None:
    with RedisServer() as redis_server:
        tier = RedisTier(redis_server.url, budget_bytes=1 << 20, retry_s=0.5)
        entry = chunk()
        assert tier.put(entry) and tier.nbytes == size_of(entry)

        redis_server.kill()
        start = time.monotonic()
        assert tier.get("doc") is None  # finds the server gone
        assert time.monotonic() - start < 1.0
        start = time.monotonic()
        for _ in range(10):  # skip the server for retry_s: no waiting on it
            assert tier.get("doc") is None and not tier.put(entry)
            assert "doc" not in tier and tier.keys() == []
        assert time.monotonic() - start < 0.1
        stats = tier.stats()  # the byte count last read from the server
        assert (stats["available"], stats["errors"], stats["bytes"]) == (0, 21, size_of(entry))

        redis_server.start()  # on the same port, empty
        time.sleep(0.5)
        assert tier.get("doc") is None and tier.put(entry)
        assert same(tier.get("doc"), entry) and tier.stats()["available"] == 1


def test_a_server_dying_mid_load_fails_the_load_not_the_caller() -> None:
    with RedisServer() as redis_server:
        tier = RedisTier(redis_server.url, budget_bytes=4 << 20)
        assert tier.put(chunk(tokens=512))
        header, read = tier.open("doc")
        redis_server.kill()
        with ThreadPoolExecutor(1) as pool:
            loading = Loading(tier, header, read, pool)
            with pytest.raises(LoadFailed):
                loading.result()
        assert tier.stats()["errors"] == 1


def test_a_server_down_from_the_start_is_a_miss_not_an_error() -> None:
    tier = RedisTier(f"redis://127.0.0.1:{free_port()}", budget_bytes=1 << 20, timeout_s=0.5)
    assert tier.get("doc") is None and not tier.put(chunk())
    assert "doc" not in tier and tier.keys() == [] and tier.nbytes == 0
    assert tier.stats()["available"] == 0


# --- Redis Cluster ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisServer]:
    with RedisServer(cluster=True) as redis_server:
        yield redis_server


def test_on_a_cluster_entries_round_trip_share_a_budget_and_damage_is_a_miss(cluster: RedisServer) -> None:
    size = size_of(chunk())
    tier = RedisTier(cluster.url, budget_bytes=3 * size)
    entries = {key: chunk(key) for key in ("doc-1", "doc-2", "doc-3", "doc-4")}  # in different slots
    for entry in entries.values():
        assert tier.put(entry)
    assert tier.stats()["cluster"] == 1
    assert sorted(tier.keys()) == ["doc-2", "doc-3", "doc-4"] and tier.stats()["evictions"] == 1
    assert same(tier.get("doc-4"), entries["doc-4"])

    with cluster.client() as raw:  # one node holds every slot
        name = tier.value_key("doc-3")
        raw.setrange(name, size - 1, bytes([raw.getrange(name, size - 1, size - 1)[0] ^ 0xFF]))
        assert tier.get("doc-3") is None
        assert not raw.exists(name)
    assert sorted(tier.keys()) == ["doc-2", "doc-4"] and tier.nbytes == 2 * size


def test_a_cluster_node_that_comes_back_is_used_again() -> None:
    with RedisServer(cluster=True) as redis_server:
        tier = RedisTier(redis_server.url, budget_bytes=1 << 20, retry_s=0.2)
        entry = chunk()
        assert tier.put(entry)
        redis_server.kill()
        assert tier.get("doc") is None and not tier.put(entry)
        redis_server.start()  # keeps its slots (the cluster config file), loses its data
        time.sleep(0.2)
        assert tier.put(entry) and same(tier.get("doc"), entry)
        assert tier.stats()["cluster"] == 1
