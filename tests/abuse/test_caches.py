"""Caches tied to content, and document KV that is durable when the card says so, replayed against
real servers, real processes, a real redis-server and the real model:
- the same model at two paths (two machines, two cache dirs) shares document KV through Redis;
- new weights at an old path (same size, same mtime) never meet the old answers or the old KV;
- a server SIGKILLed right after answering `durable: true` left that document whole on disk;
- a writer SIGKILLed mid-write leaves no entry that answers, and its temporary file goes at the next open;
- two processes writing one disk directory keep its one budget."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file

from kvgate.chunk_cache import DiskTier
from kvgate.chunk_cache.disk_tier import LOCK
from kvgate.gateway.settings import Settings
from kvgate.runtime.engine import Engine
from kvgate.runtime.loader import LoadedModel, load
from tests.helpers import loopback
from tests.helpers.entries import chunk
from tests.helpers.servers import free_port, serving
from tests.helpers.waiting import wait_healthy
from tests.unit.test_families import FAMILIES, saved

ROOT = Path(__file__).resolve().parents[2]
DOC = (
    "The Harbor Line opened in 1911 and runs from Pier Street to the Old Mill, stopping at Elm Square. "
    "Tickets cost three coins; children under ten ride for free on weekends."
)
QUESTION = "How much does a ticket for the Harbor Line cost?"


@contextmanager
def gateway(loaded: LoadedModel | None = None, **options) -> Iterator[tuple[str, Engine]]:
    """A real server over its own Engine (its own model load unless `loaded` is given)."""
    # documents' KV is the subject
    settings = Settings(engine={"max_num_seqs": 4}, caches={"prefix_caching": False}).model_copy(update=options)
    engine = Engine(settings.engine_config(), loaded or load(settings.engine_config()))
    try:
        with serving(settings, engine) as url:
            yield url, engine
    finally:
        engine.shutdown()


def chat(url: str, documents: list[dict] | None = None, question: str = QUESTION, reuse: str = "") -> httpx.Response:
    body = {
        **({"kvgate": {"reuse": reuse}} if reuse else {}),
        "model": loopback.get(f"{url}/v1/models").json()["data"][0]["id"],
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": 6,
        **({"documents": documents} if documents else {}),
    }
    r = loopback.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def reused(r: httpx.Response) -> int:
    """Tokens whose KV came from the cache, as the headers and the usage both say."""
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == int(r.headers["x-kvgate-reused-tokens"])
    return int(r.headers["x-kvgate-reused-tokens"])


def copy_model(source: Path, to: Path) -> Path:
    """The same model files at another path (the weights hard-linked where the disk allows)."""

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, to, copy_function=link)
    return to


# ---- the model fingerprint is content, not a path ----------------------------------------------------


def test_the_same_model_at_two_paths_shares_document_kv_through_redis(
    loaded: LoadedModel, redis_url: str, tmp_path: Path
) -> None:
    dirs = {name: copy_model(loaded.path, tmp_path / name / "model") for name in "ab"}
    common = {"redis_url": redis_url, "semantic_cache": {"enabled": False}}
    with gateway(engine={"model": str(dirs["a"])}, cache_dir=tmp_path / "a" / "cache", **common) as (url_a, engine_a):
        card = loopback.post(f"{url_a}/v1/documents", json={"text": DOC}, timeout=120).json()
        engine_a.reuser.store.flush()
    with gateway(engine={"model": str(dirs["b"])}, cache_dir=tmp_path / "b" / "cache", **common) as (url_b, engine_b):
        assert engine_b.model_fp == engine_a.model_fp  # other path, other cache dir: the same model
        assert loopback.get(f"{url_b}/v1/documents/{card['id']}").json()["tokens"] == card["tokens"]
        assert reused(chat(url_b, [{"text": DOC}])) >= card["tokens"] // 2


def perturb(weights: Path) -> None:
    """Change one weight in place, keeping the file's size and mtime (as `cp -p` or rsync would)."""
    st = weights.stat()
    tensors = load_file(weights)
    name = next(n for n in sorted(tensors) if tensors[n].dtype == torch.float32)
    tensors[name].view(-1)[0] += 1.0
    save_file(tensors, weights, metadata={"format": "pt"})
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_new_weights_at_the_same_path_miss_old_answers_and_old_document_kv(tmp_path: Path) -> None:
    model = tmp_path / "model"
    saved(FAMILIES["llama"], model)
    options = {
        "engine": {"model": str(model)},
        "cache_dir": tmp_path / "cache",
        "semantic_cache": {"path": tmp_path / "semantic.sqlite3"},
    }
    docs = [{"text": DOC}]
    # This two-layer model computes every token in a blend's first two layers: its cost model never
    # picks a blend (slower than full prefill), so the documents' KV is read by naive reuse.
    with gateway(**options) as (url, old):
        assert chat(url).headers["x-kvgate-cache"] == "miss"
        assert chat(url).headers["x-kvgate-cache"] == "hit"
        assert reused(chat(url, docs, "Who rides free?", "naive")) == 0
    with gateway(**options) as (url, same):  # restarted, weights untouched: both caches answer
        assert same.model_fp == old.model_fp
        assert chat(url).headers["x-kvgate-cache"] == "hit"
        assert reused(chat(url, docs, "When did it open?", "naive")) > 0
    perturb(model / "model.safetensors")
    with gateway(**options) as (url, new):
        assert new.model_fp != old.model_fp
        assert chat(url).headers["x-kvgate-cache"] == "miss"
        assert (
            reused(chat(url, docs, "Where does it stop?", "naive")) == 0
        )  # recomputed: the old KV is not this model's
        assert reused(chat(url, docs, "Where does it end?", "naive")) > 0


# ---- durable documents ---------------------------------------------------------------------------


@contextmanager
def served_process(env: dict[str, str]) -> Iterator[tuple[str, subprocess.Popen]]:
    """`kvgate serve` in a process of its own, on a free port."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvgate.gateway.cli", "serve", "--port", str(port)],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, 120)
        yield url, process
    finally:
        process.kill()
        process.wait(timeout=30)


def test_a_document_answered_durable_survives_a_sigkill(loaded: LoadedModel, tmp_path: Path) -> None:
    chunks = tmp_path / "chunks"
    env = {"KVGATE_CACHES__DIR": str(chunks), "KVGATE_SEMANTIC_CACHE__ENABLED": "false"}
    with served_process(env) as (url, process):
        card = loopback.post(f"{url}/v1/documents", json={"text": DOC}, timeout=120).json()
        process.send_signal(signal.SIGKILL)  # at once: no shutdown, no flush of writes queued
        process.wait(timeout=30)
    assert card["cached"] and card["durable"] and card["tier"] == "disk"
    disk = DiskTier(chunks, 1 << 30)  # as the next process opens it
    key = card["id"].removeprefix("doc-")
    assert disk.get(key) is not None and not list(chunks.glob("*.tmp"))
    with gateway(loaded, caches={"dir": chunks}, semantic_cache={"enabled": False}) as (url, _):
        shown = loopback.get(f"{url}/v1/documents/{card['id']}")
        assert shown.status_code == 200 and shown.json() == card
        assert reused(chat(url, [{"id": card["id"]}])) >= card["tokens"] // 2  # blend recomputes a few


def test_a_memory_only_document_says_it_is_not_durable(loaded: LoadedModel, tmp_path: Path) -> None:
    with gateway(loaded, caches={"disk_bytes": 0}, semantic_cache={"enabled": False}) as (url, _):
        card = loopback.post(f"{url}/v1/documents", json={"text": DOC}, timeout=120).json()
        assert card["cached"] and card["tier"] == "memory" and card["durable"] is False


# ---- the disk tier under crashes and sharing -------------------------------------------------------

WRITER = """
import sys
from kvgate.chunk_cache import DiskTier
from tests.helpers.entries import chunk
root, budget, name, count, tokens = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
disk = DiskTier(root, budget)
print("open", flush=True)
for i in range(count):
    assert disk.put(chunk(f"{name}-{i}", tokens=tokens))
print(disk.stats()["evictions"], flush=True)
"""


def writer(root: Path, budget: int, name: str, count: int, tokens: int) -> subprocess.Popen:
    args = [sys.executable, "-c", WRITER, str(root), str(budget), name, str(count), str(tokens)]
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def on_disk(root: Path) -> int:
    """Bytes of every file in the directory now (each file once, however often a rename shows it),
    read under the directory's lock: writers make room and reserve under it, so the listing is one
    moment's (unlocked, a slow scan could count a file evicted after it was seen and the file reserved
    in its place)."""
    fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        sizes = {}
        for path in root.iterdir():
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            sizes[st.st_ino] = st.st_size
        return sum(sizes.values())
    finally:
        os.close(fd)


def test_two_processes_sharing_a_disk_directory_keep_one_budget(tmp_path: Path) -> None:
    size = len(chunk(tokens=64).to_bytes())
    budget = int(3.5 * size)
    procs = [writer(tmp_path, budget, name, 120, 64) for name in "ab"]
    peak = 0
    while any(p.poll() is None for p in procs):
        peak = max(peak, on_disk(tmp_path))
    outs = [p.communicate() for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    evictions = sum(int(out.split()[-1]) for out, _ in outs)
    assert peak <= budget and on_disk(tmp_path) <= budget, (peak, budget)
    assert evictions >= 2 * 120 - 4  # each process evicted the other's files too, not only its own
    assert len(DiskTier(tmp_path, budget).keys()) == 3


def test_a_writer_killed_mid_write_leaves_no_entry_that_answers(tmp_path: Path) -> None:
    process = writer(tmp_path, 16 << 20, "w", 200, 8192)  # 2 MiB entries
    assert process.stdout.readline().strip() == "open"
    while True:  # until it is stopped while writing a file, with entries written before it
        assert process.poll() is None, "never caught mid-write"
        if len(list(tmp_path.glob("*.kvc"))) >= 2 and list(tmp_path.glob("*.tmp")):
            process.send_signal(signal.SIGSTOP)
            if list(tmp_path.glob("*.tmp")):
                break
            process.send_signal(signal.SIGCONT)
        time.sleep(0.001)
    process.kill()
    process.wait()
    disk = DiskTier(tmp_path, 16 << 20)
    assert not list(tmp_path.glob("*.tmp"))  # the dead writer's file went at open
    keys = disk.keys()
    assert len(keys) >= 2 and all(disk.get(key) is not None for key in keys) and disk.stats()["corrupt"] == 0
