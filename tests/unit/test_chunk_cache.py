"""chunk_cache: content keys, self-checking entries, the tier registry and the store."""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import numpy as np
import pytest
import torch

from kvgate.chunk_cache import (
    ChunkCacheConfig,
    ChunkKV,
    ChunkStore,
    CorruptEntry,
    DiskTier,
    Header,
    MemoryTier,
    Tier,
    chunk_key,
    make_tier,
    register_tier,
    tier_names,
)
from tests.helpers.entries import Clock, reheadered, rewritten
from tests.helpers.entries import priced as chunk

# --- keys ---------------------------------------------------------------------------------------


def test_key_is_a_stable_sha256_of_the_tokens_whatever_their_container() -> None:
    key = chunk_key("model", "tok", [1, 2, 3], scope="tenant-a")
    assert len(key) == 64 and int(key, 16) >= 0
    assert chunk_key("model", "tok", (1, 2, 3), scope="tenant-a") == key
    assert chunk_key("model", "tok", torch.tensor([1, 2, 3]), scope="tenant-a") == key


def test_key_changes_with_model_tokenizer_tokens_and_scope() -> None:
    keys = {
        chunk_key("model", "tok", [1, 2, 3]),
        chunk_key("model-2", "tok", [1, 2, 3]),
        chunk_key("model", "tok-2", [1, 2, 3]),
        chunk_key("model", "tok", [1, 2, 4]),
        chunk_key("model", "tok", [3, 2, 1]),
        chunk_key("model", "tok", [1, 2, 3, 0]),
        chunk_key("model", "tok", [1, 2, 3], scope="tenant-a"),
        chunk_key("model", "tok", [1, 2, 3], scope="tenant-b"),
    }
    assert len(keys) == 8


def test_key_parts_cannot_run_into_each_other() -> None:
    # Plain concatenation would give the same bytes for each pair.
    assert chunk_key("ab", "c", [1]) != chunk_key("a", "bc", [1])
    assert chunk_key("m", "", [1], scope="x") != chunk_key("m", "x", [1], scope="")
    assert chunk_key("m", "t", [], scope="") != chunk_key("m", "t", [0], scope="")
    assert chunk_key("m", "t", [1 << 32]) != chunk_key("m", "t", [0, 1])


# --- entries ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bytes_round_trip_is_exact(dtype: torch.dtype) -> None:
    entry = chunk("doc", tokens=5, cost=0.25, dtype=dtype)
    back = ChunkKV.from_bytes(entry.to_bytes(), key="doc")
    assert (back.key, back.token_ids, back.cost) == ("doc", entry.token_ids, 0.25)
    assert back.keys.dtype == dtype and back.keys.shape == (2, 2, 5, 8)
    assert torch.equal(back.keys, entry.keys) and torch.equal(back.values, entry.values)
    assert (back.tokens, back.nbytes) == (5, entry.nbytes)


def test_every_flipped_byte_is_a_corrupt_entry() -> None:
    data = chunk().to_bytes()
    for i in range(len(data)):
        damaged = bytearray(data)
        damaged[i] ^= 0xFF
        with pytest.raises(CorruptEntry):
            ChunkKV.from_bytes(bytes(damaged))


def test_flipped_bit_in_the_tensors_fails_the_checksum() -> None:
    data = bytearray(chunk().to_bytes())
    data[-3] ^= 0x01
    with pytest.raises(CorruptEntry, match="checksum"):
        ChunkKV.from_bytes(bytes(data))


def test_truncated_bytes_are_a_corrupt_entry() -> None:
    data = chunk().to_bytes()
    for cut in [0, 4, 8, 50, len(data) // 2, len(data) - 1]:
        with pytest.raises(CorruptEntry):
            ChunkKV.from_bytes(data[:cut])


def test_an_entry_stored_under_another_key_is_a_corrupt_entry() -> None:
    data = chunk("doc-a").to_bytes()
    assert ChunkKV.from_bytes(data, key="doc-a").key == "doc-a"
    with pytest.raises(CorruptEntry, match="key"):
        ChunkKV.from_bytes(data, key="doc-b")


def test_an_entry_computed_by_another_model_is_a_corrupt_entry() -> None:
    entry = chunk("doc-a")
    data = entry.to_bytes()
    assert ChunkKV.from_bytes(data, model=entry.model).model == entry.model
    with pytest.raises(CorruptEntry, match="computed by model"):
        ChunkKV.from_bytes(data, "doc-a", "another model")


def test_trailing_bytes_are_a_corrupt_entry() -> None:
    data = chunk().to_bytes()
    with pytest.raises(CorruptEntry, match=f"^{len(data) + 1} bytes, expected {len(data)}$"):
        ChunkKV.from_bytes(data + b"\0")


def test_an_entry_moves_to_a_device_whole() -> None:
    entry = chunk(model="model-fp")  # moved, still that model's
    assert entry.to("cpu") is entry  # already there: not copied
    moved = entry.to("meta")  # a device every torch build has: the copy path a GPU takes
    fields = ("key", "token_ids", "cost", "model")
    assert [getattr(moved, f) for f in fields] == [getattr(entry, f) for f in fields]
    assert moved.keys.device.type == moved.values.device.type == "meta"
    assert moved.keys.shape == entry.keys.shape and moved.values.shape == entry.values.shape


def test_an_entry_whose_tensors_lie_in_the_other_order_reads_the_same() -> None:
    """The reader goes by each tensor's byte offsets, not by the order safetensors happens to write."""
    entry = chunk(tokens=5)
    data = entry.to_bytes()
    size = Header.size_of(data)
    header = json.loads(data[8:size])
    (k0, k1), (i0, i1) = header["kv"]["data_offsets"], header["token_ids"]["data_offsets"]
    kv, ids = data[size + k0 : size + k1], data[size + i0 : size + i1]

    def swap(h: dict[str, Any]) -> None:
        h["kv"]["data_offsets"], h["token_ids"]["data_offsets"] = [0, len(kv)], [len(kv), len(kv) + len(ids)]

    back = ChunkKV.from_bytes(reheadered(data, swap, body=kv + ids))
    assert back.token_ids == entry.token_ids
    assert torch.equal(back.keys, entry.keys) and torch.equal(back.values, entry.values)


def test_a_cost_of_any_number_type_is_stored_as_a_float() -> None:
    entry = chunk(cost=np.float64(0.25))  # as a numpy sum gives it
    assert type(entry.cost) is float
    assert ChunkKV.from_bytes(entry.to_bytes()).cost == 0.25  # its repr() is read back as a float


def test_a_tensor_whose_byte_range_does_not_match_its_shape_is_refused() -> None:
    data = chunk(tokens=5).to_bytes()
    for tensor in ("kv", "token_ids"):

        def shorten(h: dict[str, Any], tensor: str = tensor) -> None:
            start, stop = h[tensor]["data_offsets"]
            h[tensor]["data_offsets"] = [start, stop - 8]

        with pytest.raises(CorruptEntry, match="^tensor byte ranges do not match their shapes$"):
            ChunkKV.from_bytes(reheadered(data, shorten))


def test_a_header_declares_at_most_16_mib() -> None:
    limit = 1 << 24
    assert Header.size_of(limit.to_bytes(8, "little")) == 8 + limit
    with pytest.raises(CorruptEntry, match=f"^a header of {limit + 1} bytes$"):
        Header.size_of((limit + 1).to_bytes(8, "little"))


def test_each_kind_of_damage_is_named() -> None:
    """What a miss logs says why the entry was refused."""
    data = chunk(model="model-a").to_bytes()
    size = Header.size_of(data)
    header = Header.parse(data[:size])
    damaged = {
        "^entry holds key 'doc', expected 'other'$": lambda: ChunkKV.from_bytes(data, key="other"),
        "^entry computed by model 'model-a', not 'model-b'$": lambda: ChunkKV.from_bytes(data, model="model-b"),
        r"^shape \(2, 2, 4\)$": lambda: ChunkKV.from_bytes(rewritten(data, shape="[2, 2, 4]")),
        r"^shape \(2, 2, -4, 8\)$": lambda: ChunkKV.from_bytes(rewritten(data, shape="[2, 2, -4, 8]")),
        r"^shape \(2, 2, 4.0, 8\)$": lambda: ChunkKV.from_bytes(rewritten(data, shape="[2, 2, 4.0, 8]")),
        "^tensors do not match the metadata$": lambda: ChunkKV.from_bytes(rewritten(data, dtype="F16")),
        "^token ids or layer checksums do not match the shape$": lambda: ChunkKV.from_bytes(
            rewritten(data, layers=json.dumps(list(header.digests[:1])))
        ),
        "^7 bytes is shorter than a header$": lambda: Header.size_of(data[:7]),
        f"^header of {size} bytes in 20 bytes$": lambda: Header.parse(data[:20]),
        "^format 'kvgate.chunk-entry.v1', expected 'kvgate.chunk-entry.v2'$": lambda: ChunkKV.from_bytes(
            rewritten(data, format="kvgate.chunk-entry.v1")
        ),
        "^token ids truncated$": lambda: header.check_tokens(b""),
        "^header checksum mismatch$": lambda: ChunkKV.from_bytes(rewritten(data, cost="2.0")),
        f"^layer 1: 3 bytes, expected {header.layer_bytes}$": lambda: header.check(1, b"abc"),
    }
    for message, read in damaged.items():
        with pytest.raises(CorruptEntry, match=message):
            read()


def test_entry_checks_its_own_shapes() -> None:
    k = torch.randn(2, 2, 4, 8)
    with pytest.raises(ValueError, match="differ"):
        ChunkKV("doc", [1, 2, 3, 4], k, torch.randn(2, 2, 5, 8))
    with pytest.raises(ValueError, match="^3 token ids for 4 cached tokens$"):
        ChunkKV("doc", [1, 2, 3], k, k.clone())
    with pytest.raises(ValueError, match="layers"):
        ChunkKV("doc", [1, 2, 3, 4], k[0], k[0].clone())


# --- registry and store -------------------------------------------------------------------------


def test_tiers_are_built_by_registered_name() -> None:
    assert "memory" in tier_names()
    tier = make_tier("memory", budget_bytes=1024, half_life_s=5)
    assert isinstance(tier, MemoryTier) and tier.budget == 1024 and tier.name == "memory"
    with pytest.raises(ValueError, match="known: .*memory"):
        make_tier("floppy")
    with pytest.raises(ValueError, match="already registered"):
        register_tier("memory")(type("Other", (MemoryTier,), {}))
    assert issubclass(MemoryTier, Tier)


def test_store_from_config_uses_the_configured_tiers() -> None:
    store = ChunkStore.from_config(ChunkCacheConfig(memory_bytes=4096, half_life_s=30))
    (tier,) = store.tiers
    assert isinstance(tier, MemoryTier) and (tier.budget, tier.half_life_s) == (4096, 30)


def test_store_promotes_a_hit_in_a_lower_tier_to_the_first() -> None:
    fast, slow = MemoryTier(budget_bytes=1 << 20), MemoryTier(budget_bytes=1 << 20)
    store = ChunkStore([fast, slow])
    slow.put(chunk("doc"))

    assert store.get("doc") is not None
    assert "doc" in fast
    assert store.get("missing") is None
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["promotions"]) == (1, 1, 1)
    assert [t["tier"] for t in stats["tiers"]] == ["memory", "memory"]


def test_store_writes_lower_tiers_behind_and_demotes_evictions() -> None:
    fast, slow = MemoryTier(budget_bytes=chunk().nbytes, clock=Clock()), MemoryTier(budget_bytes=1 << 20)
    store = ChunkStore([fast, slow])
    store.put(chunk("a"))
    store.put(chunk("b"))
    store.flush()
    assert fast.keys() == ["b"] and sorted(slow.keys()) == ["a", "b"]

    slow.delete("b")  # lost below (its budget, say): evicting it from the top writes it again
    store.put(chunk("c"))
    store.flush()
    assert fast.keys() == ["c"] and sorted(slow.keys()) == ["a", "b", "c"]
    assert store.get("a") is not None and "a" in fast


class NiceTier(MemoryTier):
    """A lower tier that notes the CPU priority its writes run at."""

    def __init__(self) -> None:
        super().__init__(budget_bytes=1 << 20)
        self.nice: list[int] = []

    def put(self, entry: ChunkKV) -> bool:
        self.nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return super().put(entry)


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own priority is Linux's")
def test_writes_behind_run_at_the_lowest_cpu_priority_and_the_caller_keeps_its_own() -> None:
    below = NiceTier()
    store = ChunkStore([MemoryTier(budget_bytes=1 << 20), below])
    store.put(chunk("a"))
    store.flush()
    assert below.nice == [19]  # the engine's steps take the cores first
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 19


class HeldTier(MemoryTier):
    """A lower tier whose writes wait until the test lets them land (to order a delete between a
    put and its write behind; no real tier can be made that slow on demand)."""

    def __init__(self) -> None:
        super().__init__(budget_bytes=1 << 20)
        self.open = threading.Event()

    def put(self, entry: ChunkKV) -> bool:
        self.open.wait(10)
        return super().put(entry)


def test_a_deleted_entry_does_not_come_back_with_its_write_behind() -> None:
    below = HeldTier()
    store = ChunkStore([MemoryTier(budget_bytes=1 << 20), below])
    store.put(chunk("a"))  # the writer holds a's write until the tier opens
    store.put(chunk("b"))  # queued behind it
    threading.Timer(0.2, below.open.set).start()
    assert store.delete("b") and store.delete("a")  # each waits for a write under way, drops a queued one
    store.flush()
    assert "a" not in store and "b" not in store and below.keys() == []


def test_store_puts_into_the_first_tier_that_accepts() -> None:
    fast, slow = MemoryTier(budget_bytes=chunk(tokens=2).nbytes), MemoryTier(budget_bytes=1 << 20)
    store = ChunkStore([fast, slow])
    assert store.put(chunk("big", tokens=4))
    store.flush()
    assert "big" not in fast and "big" in slow and "big" in store
    assert store.delete("big") and "big" not in store


def test_store_pins_where_the_entry_is() -> None:
    clock = Clock()
    store = ChunkStore([MemoryTier(budget_bytes=1 << 20, clock=clock)])
    store.put(chunk("doc"))
    assert store.pin("doc", until=clock.now + 5) and not store.pin("absent", until=clock.now + 5)
    assert store.stats()["tiers"][0]["pinned"] == 1
    assert store.unpin("doc") and store.stats()["tiers"][0]["pinned"] == 0


def test_no_entry_evicts_a_pin_before_it_ends() -> None:
    clock = Clock()
    tier = MemoryTier(budget_bytes=3 * chunk().nbytes, clock=clock)
    for key, ttl in (("soon", 5), ("late", 50), ("middle", 20)):
        assert tier.put_pinned(chunk(key), until=clock.now + ttl)
    assert not tier.put(chunk("unpinned"))
    assert not tier.put_pinned(chunk("sooner"), until=clock.now + 1)  # a pin ending first evicts none either
    assert not tier.put_pinned(chunk("later"), until=clock.now + 90)
    assert set(tier.keys()) == {"soon", "late", "middle"} and tier.stats()["refused"] == 3
    clock.now += 5  # "soon" has ended: its room is any entry's
    assert tier.put_pinned(chunk("new"), until=clock.now + 10)
    assert set(tier.keys()) == {"late", "middle", "new"} and tier.stats()["pinned"] == 3


def test_demote_moves_an_entry_from_memory_to_the_tier_below(tmp_path) -> None:
    clock = Clock()
    memory = MemoryTier(budget_bytes=1 << 20, clock=clock)
    disk = DiskTier(tmp_path, budget_bytes=1 << 20)
    store = ChunkStore([memory, disk])
    try:
        entry = chunk("agent-context")
        assert store.put(entry, until=clock.now + 5)
        assert memory.stats()["pinned"] == 1
        assert store.demote("agent-context")
        store.flush()
        assert "agent-context" not in memory and "agent-context" in disk
        assert torch.equal(store.get("agent-context").keys, entry.keys)  # and a hit promotes it again
    finally:
        store.close()


class SlowDisk(DiskTier):
    """A disk whose background writes wait for `go` (a real disk may be this slow; a test cannot wait
    for one to be): the one fake here, to hold the write-behind queue still."""

    go = threading.Event()

    def put(self, entry: ChunkKV) -> bool:
        if threading.current_thread().name == "kvgate-chunk-write":
            self.go.wait(10)
        return super().put(entry)


def test_demote_leaves_memory_only_once_the_tier_below_holds_the_entry(tmp_path) -> None:
    """Its pin over before the write-behind reached disk: a reader in between still finds it."""
    clock = Clock()
    memory, disk = MemoryTier(budget_bytes=1 << 20, clock=clock), SlowDisk(tmp_path, budget_bytes=1 << 20)
    store = ChunkStore([memory, disk])
    try:
        assert store.put(chunk("agent-context"), until=clock.now + 5)
        assert store.demote("agent-context")  # the queued write has not landed
        assert "agent-context" not in memory and "agent-context" in disk
        assert store.get("agent-context") is not None
    finally:
        SlowDisk.go.set()
        store.close()


def test_demote_with_no_tier_below_only_unpins() -> None:
    clock = Clock()
    store = ChunkStore([MemoryTier(budget_bytes=1 << 20, clock=clock)])
    store.put(chunk("doc"), until=clock.now + 5)
    assert store.demote("doc")
    assert "doc" in store and store.stats()["tiers"][0]["pinned"] == 0
