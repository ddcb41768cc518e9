"""The LMCache tier (kvgate[lmcache]): exact round trips through LMCacheEngine and our connector,
damage in what LMCache holds is a miss, the budget, and a close that cannot hang."""

from __future__ import annotations

import importlib
import multiprocessing
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import entries
from tests.helpers.entries import same

pytest.importorskip("lmcache", reason="LMCache is not installed: pip install 'kvgate[lmcache]'")

from kvgate.chunk_cache import ChunkKV, ChunkStore, MemoryTier, make_tier  # noqa: E402
from kvgate.chunk_cache.lmcache_tier import Digests, LMCacheTier  # noqa: E402

CHUNK = 16  # tokens per LMCache memory object: small, so entries span several, the last one short


def chunk(key: str = "doc", tokens: int = 40, dtype: torch.dtype = torch.float32, layers: int = 4) -> ChunkKV:
    """40 tokens: an entry spanning several LMCache chunks."""
    return entries.chunk(key, tokens, layers, "model-fp", dtype)


@pytest.fixture
def tier() -> Iterator[LMCacheTier]:
    tier = LMCacheTier(budget_bytes=1 << 20, chunk_size=CHUNK)
    yield tier
    tier.close()


def lmcache_objects(tier: LMCacheTier) -> dict:
    """LMCache's own map of what its CPU pool holds: CacheEngineKey -> MemoryObj, one per chunk."""
    assert tier.engine is not None
    return tier.engine.storage_manager.storage_backends["LocalCPUBackend"].hot_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_exact(dtype: torch.dtype) -> None:
    tier = LMCacheTier(budget_bytes=1 << 20, chunk_size=CHUNK)
    try:
        method = multiprocessing.get_start_method(allow_none=True)
        entry = chunk(dtype=dtype)
        assert tier.put(entry)
        assert multiprocessing.get_start_method(allow_none=True) == method  # LMCache's "spawn" is undone
        assert len(lmcache_objects(tier)) == 3  # 16 + 16 + 8 tokens
        assert same(tier.get("doc"), entry)
        assert same(tier.get("doc", model="model-fp"), entry)
        assert tier.get("doc", model="another-model") is None
        assert "doc" in tier and tier.keys() == ["doc"] and tier.nbytes > 0
    finally:
        tier.close()


def test_miss(tier: LMCacheTier) -> None:
    assert tier.get("absent") is None
    assert tier.put(chunk("doc"))
    assert tier.get("absent") is None
    assert "absent" not in tier
    assert tier.stats()["misses"] == 2


def test_equal_tokens_under_different_keys_stay_apart(tier: LMCacheTier) -> None:
    a = chunk("tenant-a")
    b = ChunkKV("tenant-b", a.token_ids, torch.randn_like(a.keys), torch.randn_like(a.values), 1.0, "model-fp")
    assert tier.put(a) and tier.put(b)
    assert same(tier.get("tenant-a"), a) and same(tier.get("tenant-b"), b)


def test_replacing_and_deleting(tier: LMCacheTier) -> None:
    old, new = chunk("doc"), chunk("doc")
    assert tier.put(old) and tier.put(new)
    assert same(tier.get("doc"), new)
    assert tier.delete("doc") and not tier.delete("doc")
    assert tier.get("doc") is None and tier.nbytes == 0
    assert lmcache_objects(tier) == {}


def test_a_hit_through_the_store_is_promoted_to_memory() -> None:
    memory, lmcache = MemoryTier(1 << 20), LMCacheTier(budget_bytes=1 << 20, chunk_size=CHUNK)
    store = ChunkStore([memory, lmcache])
    try:
        entry = chunk("doc")
        assert store.put(entry)
        store.flush()  # written behind into LMCache
        assert "doc" in lmcache
        memory.delete("doc")
        assert same(store.get("doc", model="model-fp"), entry)
        assert "doc" in memory and store.stats()["promotions"] == 1
    finally:
        store.close()
        lmcache.close()


def test_a_flipped_byte_in_what_lmcache_holds_is_a_miss_and_is_removed(tier: LMCacheTier) -> None:
    entry = chunk("doc")
    assert tier.put(entry)
    # LMCache keeps each chunk in a MemoryObj whose tensor is a view of its CPU pool; flipping a bit
    # through that view damages the very bytes its next retrieve copies out.
    objects = lmcache_objects(tier)
    damaged = list(objects.values())[1]  # the second chunk: tokens 16-31, every layer
    damaged.tensor.reshape(-1).view(torch.uint8)[100] ^= 0x10
    assert tier.get("doc") is None
    assert "doc" not in tier and tier.nbytes == 0
    assert objects == {}  # removed from LMCache too
    assert tier.stats()["corrupt"] == 1
    assert tier.put(entry) and same(tier.get("doc"), entry)  # and it can be stored again


def test_an_entrys_checksum_is_its_objects_by_first_token_whatever_order_they_are_copied_in() -> None:
    # A retrieve may copy an entry's memory objects in another order than its store did.
    objects = {start: torch.full((2, 3), float(start)) for start in (0, 16, 32)}
    stored, read, swapped = Digests(), Digests(), Digests()
    for start in (0, 16, 32):
        stored.add(start, objects[start])
    for start in (32, 0, 16):
        read.add(start, objects[start])
    for start, held in zip((0, 16, 32), (objects[0], objects[32], objects[16])):
        swapped.add(start, held)  # the right bytes under the wrong tokens
    assert read.hexdigest() == stored.hexdigest() != swapped.hexdigest()


def test_a_chunk_lmcache_dropped_on_its_own_is_a_miss(tier: LMCacheTier) -> None:
    assert tier.put(chunk("doc"))
    backend = tier.engine.storage_manager.storage_backends["LocalCPUBackend"]
    backend.remove(list(backend.hot_cache)[-1])  # what its own eviction does to one chunk
    assert tier.get("doc") is None
    assert "doc" not in tier and tier.stats()["lost"] == 1


def test_budget_is_honoured_least_recently_used_first() -> None:
    # 40 float32 tokens of [4, 2, _, 8]: 512 bytes a token, so LMCache objects of 8, 8 and 4 KiB.
    size = 20 << 10
    tier = LMCacheTier(budget_bytes=3 * size, chunk_size=CHUNK)
    try:
        entries = [chunk(f"doc{i}") for i in range(5)]
        for entry in entries[:3]:
            assert tier.put(entry)
        assert tier.nbytes == 3 * size
        assert same(tier.get("doc0"), entries[0])  # now doc1 is the least recently used
        assert tier.put(entries[3]) and tier.put(entries[4])
        assert tier.nbytes == 3 * size <= tier.budget
        assert sorted(tier.keys()) == ["doc0", "doc3", "doc4"]
        for i in (0, 3, 4):
            assert same(tier.get(f"doc{i}"), entries[i])
        assert tier.get("doc1") is None and tier.get("doc2") is None
        assert len(lmcache_objects(tier)) == 9
        assert not tier.put(chunk("big", tokens=200))  # more than the whole budget: refused, nothing evicted
        assert sorted(tier.keys()) == ["doc0", "doc3", "doc4"]
        assert tier.stats()["evictions"] == 2
    finally:
        tier.close()


def test_another_layout_is_refused(tier: LMCacheTier) -> None:
    assert tier.put(chunk("doc"))
    assert not tier.put(chunk("other", layers=2))
    assert not tier.put(chunk("empty", tokens=0))
    assert tier.stats()["refused"] == 2


def test_concurrent_puts_and_gets_stay_exact_and_within_budget() -> None:
    tier = LMCacheTier(budget_bytes=3 * (20 << 10), chunk_size=CHUNK)
    entries = {f"doc{i}": chunk(f"doc{i}") for i in range(6)}
    wrong: list[str] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(30):
            key = rng.choice(list(entries))
            if rng.random() < 0.5:
                tier.put(entries[key])
            elif (got := tier.get(key)) is not None and not same(got, entries[key]):
                wrong.append(key)

    try:
        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not wrong
        assert tier.nbytes == len(tier.keys()) * (20 << 10) <= tier.budget
        assert len(lmcache_objects(tier)) == 3 * len(tier.keys())
    finally:
        tier.close()


def test_without_lmcache_the_import_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lmcache.v1.cache_engine", None)  # an import of it now fails
    monkeypatch.delitem(sys.modules, "kvgate.chunk_cache.lmcache_tier")
    with pytest.raises(ImportError, match=r"pip install 'kvgate\[lmcache\]'"):
        importlib.import_module("kvgate.chunk_cache.lmcache_tier")


def test_built_by_name() -> None:
    tier = make_tier("lmcache", budget_bytes=1 << 20)
    assert isinstance(tier, LMCacheTier) and tier.name == "lmcache"
    tier.close()


def test_close_is_bounded_even_when_lmcache_hangs(monkeypatch: pytest.MonkeyPatch) -> None:
    tier = LMCacheTier(budget_bytes=1 << 20, chunk_size=CHUNK, close_timeout_s=1.0)
    assert tier.put(chunk("doc"))
    started = time.monotonic()
    tier.close()
    assert time.monotonic() - started < 5
    assert tier.get("doc") is None and not tier.put(chunk("doc"))
    tier.close()  # twice is fine

    # A fake, to inject a failure the local CPU backend cannot produce: a close() that never
    # returns, as LMCache's Redis connector's does.
    hanging = LMCacheTier(budget_bytes=1 << 20, chunk_size=CHUNK, close_timeout_s=0.5)
    assert hanging.put(chunk("doc"))
    monkeypatch.setattr("kvgate.chunk_cache.lmcache_tier.LMCacheEngineBuilder.destroy", lambda _: time.sleep(3600))
    started = time.monotonic()
    hanging.close()
    assert time.monotonic() - started < 3


def test_a_process_that_never_closes_the_tier_still_exits() -> None:
    # LMCache's storage manager runs a non-daemon event loop thread; the tier starts it as a daemon.
    code = (
        "import torch\n"
        "from chunk_cache.entry import ChunkKV\n"
        "from chunk_cache.lmcache_tier import LMCacheTier\n"
        "tier = LMCacheTier(budget_bytes=1 << 20, chunk_size=16)\n"
        "x = torch.randn(2, 2, 20, 8)\n"
        "assert tier.put(ChunkKV('doc', list(range(20)), x, x))\n"
        "print('stored')\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "stored" in done.stdout
