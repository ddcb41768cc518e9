"""The disk tier: one checked file per entry, atomic writes, mmap reads layer by layer, damage is a miss."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from kvgate.chunk_cache import ChunkStore, DiskTier, LoadFailed, Loading, MemoryTier
from kvgate.chunk_cache.entry import Header
from tests.helpers.entries import chunk, same


def test_round_trip_and_miss(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, budget_bytes=1 << 20)
    entry = chunk()
    assert disk.put(entry)
    assert same(disk.get("doc"), entry) and "doc" in disk and disk.keys() == ["doc"]
    assert disk.get("absent") is None
    stats = disk.stats()
    assert (stats["hits"], stats["misses"], stats["puts"], stats["entries"]) == (1, 1, 1, 1)
    assert stats["bytes"] == stats["bytes_written"] == stats["bytes_read"] > entry.nbytes
    assert not list(tmp_path.glob(".*.tmp"))  # written under a temporary name, then renamed


def test_a_restarted_process_finds_what_the_last_one_wrote(tmp_path: Path) -> None:
    entry = chunk()
    DiskTier(tmp_path, budget_bytes=1 << 20).put(entry)
    again = DiskTier(tmp_path, budget_bytes=1 << 20)
    assert again.keys() == ["doc"] and again.nbytes > 0
    assert same(again.get("doc"), entry)


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flipped byte":
        data[len(data) // 2] ^= 0x01  # inside the KV tensor
    elif how == "flipped header byte":
        data[20] ^= 0x01
    elif how == "truncated":
        data = data[: len(data) - 100]
    elif how == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flipped byte", "flipped header byte", "truncated", "empty"])
def test_a_damaged_file_is_a_miss_and_is_deleted(tmp_path: Path, how: str) -> None:
    disk = DiskTier(tmp_path, budget_bytes=1 << 20)
    disk.put(chunk())
    damage(disk.path("doc"), how)
    assert disk.get("doc") is None
    assert not disk.path("doc").exists() and "doc" not in disk
    assert disk.stats()["corrupt"] == 1


def test_a_value_from_another_model_or_under_another_key_is_a_miss(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, budget_bytes=1 << 20)
    disk.put(chunk(model="model-b"))
    assert disk.get("doc", model="model-a") is None and "doc" not in disk

    disk.put(chunk("other"))
    os.replace(disk.path("other"), disk.path("doc"))  # a file under the wrong name
    assert disk.get("doc") is None and "doc" not in disk
    assert disk.stats()["corrupt"] == 2


def test_least_recently_used_files_go_first_when_over_budget(tmp_path: Path) -> None:
    size = len(chunk().to_bytes())
    disk = DiskTier(tmp_path, budget_bytes=int(2.5 * size))
    disk.put(chunk("a"))
    disk.put(chunk("b"))
    os.utime(disk.path("b"), (1, 1))  # not touched since long ago: older than "a"
    disk = DiskTier(tmp_path, budget_bytes=int(2.5 * size))  # the order survives a restart
    disk.put(chunk("c"))
    assert sorted(disk.keys()) == ["a", "c"] and disk.nbytes <= disk.budget
    assert disk.stats()["evictions"] == 1
    assert not disk.put(chunk("huge", tokens=200))  # bigger than the whole budget: refused


def test_the_store_reads_a_lower_tier_layer_by_layer_and_promotes_it(tmp_path: Path) -> None:
    memory, disk = MemoryTier(budget_bytes=1 << 20), DiskTier(tmp_path, budget_bytes=1 << 20)
    store = ChunkStore([memory, disk])
    entry = chunk()
    disk.put(entry)
    loading = store.fetch("doc", model="model-a")
    assert isinstance(loading, Loading) and loading.token_ids == entry.token_ids
    for i in range(4):
        k, v = loading.layer(i)
        assert torch.equal(k, entry.keys[i]) and torch.equal(v, entry.values[i])
    assert same(loading.result(), entry)
    store.flush()
    assert same(memory.get("doc"), entry)  # promoted once whole
    store.close()


class SlowToFinishDisk(DiskTier):
    """A disk tier whose loads finish late after their last layer (a busy process's thread, made sure)."""

    def loaded(self, header: Header) -> None:
        time.sleep(0.3)
        super().loaded(header)


def test_flush_waits_for_the_promotion_of_a_load_already_read(tmp_path: Path) -> None:
    memory, disk = MemoryTier(budget_bytes=1 << 20), SlowToFinishDisk(tmp_path, budget_bytes=1 << 20)
    store = ChunkStore([memory, disk])
    disk.put(chunk())
    loading = store.fetch("doc")
    assert isinstance(loading, Loading)
    loading.result()  # every layer is read; the promotion comes after
    store.flush()
    assert "doc" in memory
    store.close()


def test_the_store_says_what_memory_holds_without_callers_reaching_into_its_tiers(tmp_path: Path) -> None:
    memory, disk = MemoryTier(budget_bytes=1 << 20), DiskTier(tmp_path, budget_bytes=1 << 20)
    store = ChunkStore([memory, disk])
    disk.put(chunk())
    assert "doc" in store and not store.resident("doc")  # on disk only: a load away
    memory.put(chunk())
    assert store.resident("doc") and store.memory_bytes == 1 << 20 and store.tiered
    assert not ChunkStore([MemoryTier(budget_bytes=1 << 20)]).tiered
    store.close()


class GatedDisk(DiskTier):
    """A disk tier whose layer reads wait for the test: shows layer 0 is usable before layer 1
    is read. (A gate, not a fake: the bytes still come from the real file.)"""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Semaphore(0)

    def reader(self, key: str):
        read = super().reader(key)
        header_reads = 3  # size, header, token ids

        def gated(start: int, stop: int):
            nonlocal header_reads
            if header_reads:
                header_reads -= 1
            else:
                self.gate.acquire()
            return read(start, stop)

        return gated


def test_layer_i_is_usable_while_the_next_layers_are_still_being_read(tmp_path: Path) -> None:
    disk = GatedDisk(tmp_path, budget_bytes=1 << 20)
    store = ChunkStore([MemoryTier(budget_bytes=1 << 20), disk])
    entry = chunk()
    disk.put(entry)
    loading = store.fetch("doc")
    assert isinstance(loading, Loading)
    disk.gate.release()  # let one layer through
    k, _ = loading.layer(0)
    assert torch.equal(k, entry.keys[0]) and loading._ready == 1  # layer 1 not read yet
    for _ in range(3):
        disk.gate.release()
    assert same(loading.result(), entry)
    store.close()


def test_damage_found_mid_load_fails_the_load_and_deletes_the_file(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, budget_bytes=1 << 20)
    store = ChunkStore([MemoryTier(budget_bytes=1 << 20), disk])
    entry = chunk()
    disk.put(entry)
    data = bytearray(disk.path("doc").read_bytes())
    data[-entry.nbytes // 8] ^= 0xFF  # in the last layer: the header and first layers are sound
    disk.path("doc").write_bytes(bytes(data))

    loading = store.fetch("doc")
    assert isinstance(loading, Loading)
    assert torch.equal(loading.layer(0)[0], entry.keys[0])
    with pytest.raises(LoadFailed, match="checksum"):
        loading.result()
    store.flush()
    assert "doc" not in disk and "doc" not in store and store.get("doc") is None
    store.close()


# ---- durability: settle, crashed writers, one budget per directory ---------------------------------


class HeldDisk(DiskTier):
    """A disk tier whose writes wait until the test lets them go, to watch `settle` wait for one.
    (A gate, not a fake: the bytes still go to the real file.)"""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.open, self.writing = threading.Event(), threading.Event()

    def write(self, key: str, data: bytes) -> bool:
        self.writing.set()
        self.open.wait(10)
        return super().write(key, data)


def test_settle_waits_until_the_disk_holds_the_entry_and_names_it(tmp_path: Path) -> None:
    memory, disk = MemoryTier(budget_bytes=1 << 20), HeldDisk(tmp_path, budget_bytes=1 << 20)
    store = ChunkStore([memory, disk])
    entry = chunk()
    store.put(entry)
    assert store.where("doc") is memory and not memory.durable  # in memory only, so far
    started = time.monotonic()
    assert store.settle("doc", timeout_s=0.3) is memory  # bounded: the write is still held
    assert 0.3 <= time.monotonic() - started < 5
    threading.Timer(0.2, disk.open.set).start()
    assert store.settle("doc") is disk and disk.durable
    assert same(DiskTier(tmp_path, budget_bytes=1 << 20).get("doc"), entry)  # whole, as another process sees it
    assert store.where("absent") is None and store.settle("absent") is None
    store.close()


def test_settle_does_not_wait_for_a_write_dropped_or_refused(tmp_path: Path) -> None:
    memory, disk = MemoryTier(budget_bytes=1 << 20), HeldDisk(tmp_path, budget_bytes=1 << 20)
    store = ChunkStore([memory, disk], write_queue=1)
    store.put(chunk("a"))
    assert disk.writing.wait(10)  # the writer took it, and waits
    store.put(chunk("b"))  # queued
    store.put(chunk("c"))  # the queue is full: dropped
    started = time.monotonic()
    assert store.settle("c") is memory and time.monotonic() - started < 1
    disk.open.set()
    assert store.settle("b") is disk
    store.close()

    small = ChunkStore([MemoryTier(budget_bytes=1 << 20), DiskTier(tmp_path / "small", budget_bytes=100)])
    small.put(chunk("big"))  # larger than the disk's budget: refused there
    assert small.settle("big") is small.tiers[0]
    small.close()


def test_temporary_files_of_dead_writers_go_at_open_and_a_live_writers_stay(tmp_path: Path) -> None:
    dead, live = tmp_path / ".a.kvc.dead.tmp", tmp_path / ".b.kvc.live.tmp"
    dead.write_bytes(b"half an entry")
    live.write_bytes(b"an entry being written")
    with open(live, "r+b") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as its writer holds it, until its rename
        disk = DiskTier(tmp_path, budget_bytes=1 << 20)
        assert not dead.exists() and live.exists()
        assert disk.nbytes == live.stat().st_size  # a write in flight counts against the budget
    disk.put(chunk())  # its writer gone, the next write sweeps it
    assert not live.exists() and disk.keys() == ["doc"]
    assert not list(tmp_path.glob("*.tmp"))


def test_writes_in_flight_hold_their_room_until_done(tmp_path: Path) -> None:
    size = len(chunk().to_bytes())
    disk = DiskTier(tmp_path, budget_bytes=int(1.5 * size))
    flight = tmp_path / ".x.kvc.flight.tmp"
    flight.write_bytes(b"\0" * size)
    with open(flight, "r+b") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert not disk.put(chunk("a"))  # no room beside the write in flight, whatever is evicted
    assert disk.put(chunk("a")) and disk.nbytes <= disk.budget
