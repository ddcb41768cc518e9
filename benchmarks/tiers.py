"""`kvgate bench tiers`: how fast each chunk cache tier hands document KV back, against the limit
of its medium measured in the same run, and the time to first token of a blend reading from it.

Limits, each the medium's own at full use: memory (and LMCache, whose pool is in memory: one limit,
timed in turn with both loads), copies of the entries' sizes by every core at once through buffers far
beyond the CPU's caches, every entry in turn as loads are (each has left the caches since its last read);
disk, a cold sequential read of the entry's file, with a second row from the page cache; Redis, the best
GET rate of values of the entry's size redis-benchmark (a C client) reaches, or the entry's own pieces
asked for at once. A load is what a blend waits for: the entry read, every checksum checked, into tensors.
"""

from __future__ import annotations

import csv
import ctypes
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path
from urllib.parse import urlparse

import redis
import torch

from kvgate.chunk_cache import ByteTier, ChunkKV, ChunkStore, DiskTier, Loading, MemoryTier, Tier, make_tier
from kvgate.chunk_cache.redis_tier import PIECE, RedisTier
from kvgate.gateway.readiness import free_port
from kvgate.runtime.blend import BlendConfig
from kvgate.runtime.calibration import model_fingerprint
from kvgate.runtime.config import EngineConfig
from kvgate.runtime.fidelity import Item, load_items, start
from kvgate.runtime.loader import load
from kvgate.runtime.progress import progress
from kvgate.runtime.report import table, write_section
from kvgate.runtime.reuse import ReuseMode, Reuser

TARGET_BANDWIDTH = 0.70  # of the medium's limit
# A load or limit in memory takes milliseconds and this machine's memory speed wanders between runs and
# within one: at least this many timings of each, the fastest kept (TTFT, seconds a try, keeps `repeats`).
BANDWIDTH_REPEATS = 10
TARGET_SPEEDUP = 3.0  # blend from disk against full prefill
PAGE_CACHE = "page cache"  # a disk row read from memory: shown, but the target is on the disk's own row


def best(f: Callable[[], object], repeats: int) -> float:
    return fastest_in_turn([f], repeats)[0]


@contextmanager
def redis_server() -> Iterator[str]:
    """A redis-server of the benchmark's own on a free loopback port."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server is not installed (make test installs it); or pass --redis-url")
    port = free_port()
    args = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield url
    finally:
        process.kill()
        process.wait()


def uncached(path: Path) -> None:
    """Drop the file's pages from the page cache (clean pages: no privilege needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cold(f: Callable[[], object], path: Path, repeats: int) -> float:
    """Seconds of `f` with `path` out of the page cache each time, the fastest of `repeats`."""
    times = []
    for _ in range(repeats):
        uncached(path)
        began = time.perf_counter()
        f()
        times.append(time.perf_counter() - began)
    return min(times)


def sequential_read(path: Path) -> Callable[[], None]:
    """A plain sequential read of the file in 1 MiB blocks into one reused buffer (what `dd` does)."""
    buffer = memoryview(bytearray(1 << 20))

    def read() -> None:
        with open(path, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while f.readinto(buffer):
                continue

    return read


RING_BYTES = 512 << 20  # far beyond any CPU's last-level cache: a copy through it reads and writes memory


@contextmanager
def memory_copies(sizes: list[int]) -> Iterator[list[Callable[[], None]]]:
    """Passes that copy blocks of `sizes` bytes one after another, each from and to the next place in a
    ring of RING_BYTES, by every core at once (the machine's memory bandwidth at these sizes, not one
    memmove's, nor the caches'), with two copy engines: memmove, each core its share of every block
    with no wait between blocks; and torch's own parallel copy of float32."""
    threads = os.cpu_count() or 1
    elements = max(RING_BYTES // 4, *(-(-size // 4) for size in sizes))  # a block larger than the ring: a ring of it
    src, dst = torch.ones(elements), torch.ones(elements)  # touched: no shared zero pages
    blocks, at = [], 0
    for size in sizes:
        n = -(-size // 4)
        at = 0 if at + n > src.numel() else at
        blocks.append((at, n))
        at += n
    shares: list[list[tuple[int, int, int]]] = [[] for _ in range(threads)]
    for at, n in blocks:
        step = -(-4 * n // threads)
        for core, i in enumerate(range(0, 4 * n, step)):
            shares[core].append((dst.data_ptr() + 4 * at + i, src.data_ptr() + 4 * at + i, min(step, 4 * n - i)))

    def copy(mine: list[tuple[int, int, int]]) -> None:  # ctypes calls release the GIL
        for share in mine:
            ctypes.memmove(*share)

    def torch_copy() -> None:
        for at, n in blocks:
            dst[at : at + n].copy_(src[at : at + n])

    with ThreadPoolExecutor(threads) as pool:
        yield [lambda: list(pool.map(copy, shares)), torch_copy]


def fastest_in_turn(passes: list[Callable[[], object]], repeats: int) -> list[float]:
    """Seconds of each pass, the fastest of `repeats`, the passes run in turn so that a machine whose
    memory speed wanders gives each the same conditions."""
    times = [float("inf")] * len(passes)
    for _ in range(repeats):
        for i, f in enumerate(passes):
            began = time.perf_counter()
            f()
            times[i] = min(times[i], time.perf_counter() - began)
    return times


def redis_limit(tier: RedisTier, key: str, size: int, repeats: int) -> float:
    """Seconds per value of `size` bytes that Redis and loopback hand over at best: the faster of
    redis-benchmark (a C client, so no Python parsing bounds it) GETting such values over 1 or 2
    connections, pipelined or not, and the entry itself asked for in the pieces the tier reads, all at
    once over one connection, the replies read straight into a reused buffer (redis-benchmark's own
    reading is slower than that at tens of MB)."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        raise FileNotFoundError("redis-benchmark is not installed (it comes with redis-server)")
    address = urlparse(tier.url)
    host, port = address.hostname or "127.0.0.1", address.port or 6379
    gets = str(max(20, min(200, (1 << 30) // size)))  # about 1 GB a run, however large the value
    rates = []
    for clients, pipeline in ((1, 1), (2, 1), (1, 4)):
        args = [binary, "-h", host, "-p", str(port), "-t", "set,get", "-d", str(size), "-n", gets]
        args += ["-c", str(clients), "-P", str(pipeline), "--csv"]
        run = subprocess.run(args, capture_output=True, text=True)
        if run.returncode:  # one way failing leaves the others (and the pieces below) to set the limit
            print(f"kvgate bench tiers: redis-benchmark {clients} client(s), pipeline {pipeline}: {run.stderr.strip()}")
        rates += [float(row[1]) for row in csv.reader(run.stdout.splitlines()) if row and row[0] == "GET"]
    name = tier.value_key(key).encode()
    stored = redis.Redis.from_url(tier.url).strlen(name)
    assert stored == size, f"Redis holds {stored} bytes under {name!r}, not the entry's {size}"  # else a read hangs
    pieces = [(lo, min(lo + PIECE, size)) for lo in range(0, size, PIECE)]
    commands = b"".join(resp(b"GETRANGE", name, b"%d" % lo, b"%d" % (hi - 1)) for lo, hi in pieces)
    replies = memoryview(bytearray(sum(len(b"$%d\r\n" % (hi - lo)) + hi - lo + 2 for lo, hi in pieces)))
    with socket.create_connection((host, port)) as connection:

        def get() -> None:  # every piece asked at once, every reply read straight into one buffer
            connection.sendall(commands)
            got = 0
            while got < len(replies):
                got += connection.recv_into(replies[got:])

        return min([1.0 / rate for rate in rates] + [best(get, repeats)])


def resp(*words: bytes) -> bytes:
    """A Redis command as it goes on the wire."""
    return b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%s\r\n" % (len(w), w) for w in words)


def limit_of(tier: ByteTier, key: str, size: int, repeats: int) -> float:
    """Seconds a byte tier's medium itself needs to hand over `size` bytes (for disk, from the page cache)."""
    if isinstance(tier, DiskTier):
        buf = bytearray(size)

        def read() -> None:
            with open(tier.path(key), "rb", buffering=0) as f:
                f.readinto(buf)

        return best(read, repeats)
    assert isinstance(tier, RedisTier)
    return redis_limit(tier, key, size, repeats)


def loader(store: ChunkStore, key: str, kv: list[torch.Tensor]) -> Callable[[], None]:
    """A load: the entry whole, checked, in tensors of this process. From the memory tier, where it
    already is, a load is the copy into the request's KV (what a blend does with any entry)."""
    in_memory = isinstance(store.tiers[-1], MemoryTier)

    def once() -> None:
        found = store.fetch(key)
        if isinstance(found, Loading):
            found.result()
        elif in_memory:
            kv[0].copy_(found.keys)
            kv[1].copy_(found.values)

    return once


def whole(store: ChunkStore, key: str) -> None:
    """The entry read whole from the store's lower tier."""
    found = store.fetch(key)
    assert isinstance(found, Loading), "the store's memory tier holds nothing"
    found.result()


LMCACHE_BYTES_PER_DOCUMENT = 64 << 20  # a MuSiQue passage's KV is about 28 MB


def tier_stores(tmp: Path, redis_url: str | None, documents: int) -> dict[str, ChunkStore]:
    """One store per tier; below memory, a memory tier that holds nothing, so every read is the tier's.
    LMCache's pool is sized for the run's `documents`: it takes all its memory at once, and a pool of
    most of the machine's would leave the other tiers' timings to a kernel reclaiming pages."""
    stores = {"memory": ChunkStore([MemoryTier(64 << 30)])}
    lower: dict[str, Tier] = {"disk": DiskTier(tmp / "chunks", 64 << 30)}
    if redis_url:
        lower["redis"] = make_tier("redis", url=redis_url, budget_bytes=64 << 30)
    try:
        lower["lmcache"] = make_tier("lmcache", budget_bytes=max(1 << 30, documents * LMCACHE_BYTES_PER_DOCUMENT))
    except ImportError as e:
        print(f"kvgate bench tiers: no LMCache tier ({e})")
    for name, tier in lower.items():
        stores[name] = ChunkStore([MemoryTier(0), tier])
    return stores


def bench_tiers(
    config: EngineConfig,
    data: Path,
    docs: int,
    limit: int,
    ratio: float,
    repeats: int,
    redis_url: str | None,
    output: Path,
    command: str,
) -> None:
    loaded = load(config)
    data_items = load_items(loaded, data, docs, limit, True, 0, 0)
    with tempfile.TemporaryDirectory() as tmp, redis_server() if redis_url is None else nullcontext(redis_url) as url:
        stores = tier_stores(Path(tmp), url, docs * limit)
        model, tokenizer, fp = loaded.model, loaded.tokenizer, model_fingerprint(loaded)
        reusers = {name: Reuser(model, tokenizer, store, fp, BlendConfig()) for name, store in stores.items()}
        entries: list[ChunkKV] = []
        for item in data_items:
            for ids, is_doc in zip(item.pieces, item.documents):
                if is_doc:
                    entries.append(reusers["memory"].document(ids)[0])
        for store in stores.values():
            for entry in entries:
                store.tiers[-1].put(entry)
        bandwidth = measure_bandwidth(stores, entries, repeats)
        ttft = measure_ttft(reusers, data_items, ratio, repeats)
        for store in stores.values():
            store.close()
    write(bandwidth, ttft, ratio, len(data_items), docs, output, command)


def measure_bandwidth(
    stores: dict[str, ChunkStore], entries: list[ChunkKV], repeats: int
) -> dict[str, tuple[float, float]]:
    """Per tier: GB/s of a load and GB/s of the medium's limit, summed over the entries."""
    out = {}
    repeats = max(repeats, BANDWIDTH_REPEATS)
    in_memory = {}  # memory, or LMCache's pool in memory: one limit, timed in turn with both
    for name, store in stores.items():
        tier = store.tiers[-1] if name != "memory" else None
        loads = [loader(store, e.key, [torch.empty_like(e.keys), torch.empty_like(e.values)]) for e in entries]
        if not isinstance(tier, ByteTier):
            in_memory[name] = lambda loads=loads: [once() for once in loads]
            out[name] = (0.0, 0.0)  # its row's place; timed below
            continue
        sizes = [len(e.to_bytes()) for e in entries]
        seconds = sum(best(once, repeats) for once in loads)
        limit = sum(limit_of(tier, e.key, size, repeats) for e, size in zip(entries, sizes, strict=True))
        nbytes = sum(sizes)
        if isinstance(tier, DiskTier):  # the medium itself: every read from the disk, not the page cache
            paths = [tier.path(e.key) for e in entries]
            read = sum(cold(partial(whole, store, e.key), p, repeats) for e, p in zip(entries, paths, strict=True))
            sequential = sum(cold(sequential_read(p), p, repeats) for p in paths)
            out[name] = (nbytes / read / 1e9, nbytes / sequential / 1e9)
            name = f"{name}, {PAGE_CACHE}"
        out[name] = (nbytes / seconds / 1e9, nbytes / limit / 1e9)
    if in_memory:  # every entry in turn, so each has left the caches since its last read
        with memory_copies([e.nbytes for e in entries]) as copies:
            times = fastest_in_turn([*in_memory.values(), *copies], repeats)
        nbytes, limit = sum(e.nbytes for e in entries), min(times[len(in_memory) :])
        out |= {name: (nbytes / t / 1e9, nbytes / limit / 1e9) for name, t in zip(in_memory, times, strict=False)}
    for name, (load_gbs, limit_gbs) in out.items():
        print(f"{name}: load {load_gbs:.2f} GB/s, limit {limit_gbs:.2f} GB/s", flush=True)
    return out


def measure_ttft(
    reusers: dict[str, Reuser], data_items: list[Item], ratio: float, repeats: int
) -> dict[str, tuple[float, bool]]:
    """Per mode: mean time to first token, and whether every logit equals the in-memory blend's."""
    seconds: dict[str, list[float]] = {"full": []}
    exact = {name: True for name in reusers}
    memory = reusers["memory"]
    for n, item in enumerate(progress(data_items, "items timed")):
        seconds["full"].append(best(lambda item=item: start(memory, item, ReuseMode("full")), repeats))
        reference = start(memory, item, ReuseMode("blend", ratio))[1]
        for name, reuser in reusers.items():
            runs = []
            for _ in range(repeats):
                began = time.perf_counter()
                _, logits, done = start(reuser, item, ReuseMode("blend", ratio))
                runs.append(time.perf_counter() - began)
                exact[name] &= torch.equal(logits, reference) and done.reused > 0
            seconds.setdefault(name, []).append(min(runs))
        line = ", ".join(f"{k} {v[-1]:.2f} s" for k, v in seconds.items())
        print(f"item {n + 1}/{len(data_items)}: {len(item.ids)} tokens; {line}", flush=True)
    full = statistics.fmean(seconds["full"])
    return {"full": (full, True), **{k: (statistics.fmean(seconds[k]), exact[k]) for k in reusers}}


def write(
    bandwidth: dict[str, tuple[float, float]],
    ttft: dict[str, tuple[float, bool]],
    ratio: float,
    items: int,
    docs: int,
    output: Path,
    command: str,
) -> None:
    full = ttft["full"][0]
    rows = []
    for name, (load_gbs, limit_gbs) in bandwidth.items():
        share = load_gbs / limit_gbs
        seconds, exact = ttft[name.split(",")[0]]
        met = "met" if share >= TARGET_BANDWIDTH else "MISSED"
        if name.endswith(PAGE_CACHE):
            met = "(not the medium)"
        rows.append([
            name, f"{load_gbs:.2f}", f"{limit_gbs:.2f}", f"{share:.0%}", met,
            f"{seconds:.2f}", f"{full / seconds:.1f}x", "yes" if exact else "NO",
        ])  # fmt: skip
    header = ["tier", "load GB/s", "limit GB/s", "load / limit", f">= {TARGET_BANDWIDTH:.0%}", "blend TTFT s",
              "vs full prefill", "same logits as memory"]  # fmt: skip
    disk = full / ttft["disk"][0]
    body = (
        f"{items} MuSiQue items, {docs} passages each as documents (shuffled), blend at {ratio:.0%}; full prefill "
        f"mean {full:.2f} s. A load from memory is the copy into the request's KV; from any other tier, the "
        "entry read whole, every checksum checked, into freshly allocated tensors (from disk: "
        "read straight into them). Limits, each the medium's own at full use: memory and LMCache (its pool is "
        f"in memory), copies of the entries' sizes by all {os.cpu_count()} cores at once (the faster of memmove "
        f"and torch's copy), back to back through {RING_BYTES >> 20} MiB, far beyond the CPU's caches, as loads "
        "from these two are timed, one limit for both: every entry in turn "
        "(so that each has left the caches since its last read, as in a pool of many documents), the fastest "
        "pass, the two loads and the limit passes taken in turn; disk, a cold sequential read "
        "of the entry's file in 1 MiB blocks, its pages dropped from the page cache first (before each load "
        f"too); disk, {PAGE_CACHE}: the same file read whole from the page cache into a reused buffer, load "
        "and limit alike (shown, not the target: the medium there is memory); Redis, the faster of the best GET "
        "rate of values of the entry's size redis-benchmark (a C client) reaches, over 1 or 2 connections, "
        "pipelined or not, and the entry itself asked for in the tier's 1 MiB pieces all at once over one "
        "connection, read straight into a reused buffer. The blend's TTFT includes its loads, "
        "pipelined with the recompute (layer i+1 loads while layer i runs). "
        "Every store below memory has a memory tier of 0 bytes, so every read comes from the tier itself.\n\n"
        + table(header, rows)
        + f"\n\nTarget: blend with KV from disk >= {TARGET_SPEEDUP:.0f}x faster than full prefill: "
        + ("met" if disk >= TARGET_SPEEDUP else "MISSED")
        + f" ({disk:.1f}x)."
    )
    write_section(output, "tiers", "Chunk cache tiers: load bandwidth and TTFT", command, body)
    print(body)
