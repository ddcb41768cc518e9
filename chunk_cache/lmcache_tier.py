"""LMCache as a chunk cache tier (the optional extra `kvgate[lmcache]`).

`LMCacheEngine.store` cuts an entry's tokens into chunks and has our connector copy each chunk's KV
into one of its memory objects, kept in its CPU pool; `retrieve` has the connector copy them back.
LMCache keys a chunk by its token ids plus a tag, here the kvgate key, so equal tokens under another
model or scope never meet.

LMCache keeps no checksums, so this tier keeps each entry's checksum, model fingerprint and cost in an
index of its own and checks every byte it reads back: a damaged value is a miss and is
removed, as is an entry LMCache dropped a chunk of. The checksum is taken of each memory object just
after its copy, while the copy has brought it into the CPU's cache, not in a pass of its own that reads
the entry from memory again. The index keeps the budget (least recently used first) and lives in this
process: an entry lives no longer than the tier. LMCache allocates its whole
pool (budget_bytes) at the first put, whose layout (layers, kv heads, head dim, dtype) it keeps:
entries of another layout are refused.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import xxhash

from kvgate.chunk_cache.entry import ChunkKV
from kvgate.chunk_cache.tier import Tier, register_tier

os.environ["LMCACHE_TRACK_USAGE"] = "false"  # no usage telemetry from inside a gateway
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")  # it logs every store and retrieve at INFO

try:
    from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder  # noqa: E402
    from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface  # noqa: E402
    from lmcache.v1.memory_management import AddressManager, MemoryObj  # noqa: E402
    from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
except ImportError as e:
    raise ImportError(f"the lmcache chunk cache tier needs LMCache: pip install 'kvgate[lmcache]' ({e})") from e

log = logging.getLogger(__name__)
# It warns at each start that its chunk hashes may differ between processes: this tier's never leave its own.
logging.getLogger("lmcache.v1.token_database").setLevel(logging.ERROR)

_ALIGN = AddressManager.ALIGN_BYTES  # LMCache's CPU pool rounds every memory object up to this
T = TypeVar("T")


class ChunkConnector(GPUConnectorInterface):
    """Our side of LMCache's copies, between kvgate's KV layout and its memory objects.

    A memory object holds tokens [start, end) of one entry. LMCache sizes it as [2, layers, tokens,
    kv_heads * head_dim] (its KV_2LTD format) but never reads it; we lay it out as kvgate does,
    [layers, 2, kv_heads, tokens, head_dim], so a retrieve copies long contiguous runs (an entry of one
    chunk in one run), not element by element through a transpose. A store reads `keys` and `values`
    [layers, kv_heads, T, head_dim]; a retrieve writes `kv` [layers, 2, kv_heads, T, head_dim], one copy
    per object (a copy per layer paid 30 calls' overhead). The copies are Tensor.copy_ (any device).
    Both take `digests`: each object is hashed into it right after its copy.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int) -> None:
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.layers, num_tokens, self.kv_heads * self.head_dim])

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self.batched_from_gpu([memory_obj], [start], [end], **kwargs)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self.batched_to_gpu([memory_obj], [start], [end], **kwargs)

    def batched_from_gpu(self, memory_objs: Sequence[MemoryObj], starts: list[int], ends: list[int], **kwargs: Any):
        keys, values = kwargs["keys"], kwargs["values"]
        for obj, start, end in zip(memory_objs, starts, ends):
            held = self._view(obj, end - start)
            held[:, 0].copy_(keys[:, :, start:end])
            held[:, 1].copy_(values[:, :, start:end])
            kwargs["digests"].add(start, held)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs: Any) -> None:
        kv = kwargs["kv"]
        for obj, start, end in zip(memory_objs, starts, ends):
            held = self._view(obj, end - start)
            kv[:, :, :, start:end].copy_(held)
            kwargs["digests"].add(start, held)

    def _view(self, obj: MemoryObj, tokens: int) -> torch.Tensor:
        """The object's tensor as [layers, 2, kv_heads, tokens, head_dim]."""
        return obj.tensor.view(self.layers, 2, self.kv_heads, tokens, self.head_dim)


class Digests:
    """An entry's checksum from its memory objects, taken one by one in whatever order LMCache copies
    them: xxh3-128 of each object's bytes, by its first token; the entry's, xxh3-128 of those in order."""

    def __init__(self) -> None:
        self.parts: dict[int, bytes] = {}

    def add(self, start: int, held: torch.Tensor) -> None:
        self.parts[start] = xxhash.xxh3_128_digest(memoryview(held.reshape(-1).view(torch.uint8).numpy()))

    def hexdigest(self) -> str:
        return xxhash.xxh3_128_hexdigest(b"".join(self.parts[start] for start in sorted(self.parts)))


@dataclass(frozen=True)
class _Held:
    """What the tier knows of an entry LMCache holds: enough to ask for it and to check it."""

    token_ids: tuple[int, ...]
    shape: tuple[int, int, int, int]  # [layers, kv_heads, T, head_dim]
    digest: str  # Digests.hexdigest() of its memory objects as stored
    cost: float
    model: str
    nbytes: int  # in LMCache's pool
    exact: int | None = None  # ChunkKV.exact


@register_tier("lmcache")
class LMCacheTier(Tier):
    def __init__(self, budget_bytes: int, chunk_size: int = 256, close_timeout_s: float = 10.0) -> None:
        """chunk_size: tokens per LMCache memory object. close_timeout_s: how long close() waits for LMCache."""
        super().__init__()
        if budget_bytes < 0 or chunk_size <= 0:
            raise ValueError(f"need budget_bytes >= 0 and chunk_size > 0, got {budget_bytes}, {chunk_size}")
        self.budget_bytes, self.chunk_size, self.close_timeout_s = budget_bytes, chunk_size, close_timeout_s
        self._instance = f"kvgate-{uuid.uuid4().hex}"
        self._engine: LMCacheEngine | None = None
        self._layout: tuple[int, int, int, torch.dtype] | None = None  # layers, kv_heads, head_dim, dtype
        self._held: OrderedDict[str, _Held] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._closed = False
        self._lock = threading.Lock()  # one LMCache call at a time, and the index with it
        self._counts = dict.fromkeys(("hits", "misses", "corrupt", "lost", "errors", "puts", "refused", "evictions"), 0)

    @property
    def engine(self) -> LMCacheEngine | None:
        """The LMCacheEngine, once the first entry has started it."""
        return self._engine

    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def budget(self) -> int:
        return self.budget_bytes

    def get(self, key: str, model: str | None = None) -> ChunkKV | None:
        with self._lock:
            held = self._held.get(key)
            if held is None or self._engine is None or (model is not None and held.model != model):
                self._counts["misses"] += 1
                return None
            layers, kv_heads, tokens, head_dim = held.shape
            kv = torch.empty(layers, 2, kv_heads, tokens, head_dim, dtype=self._layout[3])
            digests = Digests()
            try:
                found = self._engine.retrieve(list(held.token_ids), kv=kv, digests=digests, request_configs=_tag(key))
            except Exception as e:
                log.warning("chunk cache tier lmcache: reading %s failed: %r", key, e)
                self._drop(key, "errors")
                return None
            if not bool(found.all()):
                self._drop(key, "lost")  # LMCache evicted a chunk of it
                return None
            if digests.hexdigest() != held.digest:
                log.warning("chunk cache tier lmcache: dropping damaged entry %s", key)
                self._drop(key, "corrupt")
                return None
            self._held.move_to_end(key)
            self._counts["hits"] += 1
        return ChunkKV(key, held.token_ids, kv[:, 0], kv[:, 1], held.cost, held.model, held.exact)

    def put(self, entry: ChunkKV) -> bool:
        layers, kv_heads, tokens, head_dim = entry.keys.shape
        layout = (layers, kv_heads, head_dim, entry.keys.dtype)
        size = _footprint(tokens, 2 * layers * kv_heads * head_dim * entry.keys.element_size(), self.chunk_size)
        with self._lock:
            if self._closed or tokens == 0 or size > self.budget_bytes or self._layout not in (None, layout):
                self._counts["refused"] += 1
                return False
            keys, values = (t.detach().to("cpu").contiguous() for t in (entry.keys, entry.values))
            digests = Digests()
            try:
                engine = self._start(layout)
                if entry.key in self._held:
                    self._drop(entry.key, None)  # LMCache keeps the old value of a key it holds
                self._make_room(size)
                ids, tag = list(entry.token_ids), _tag(entry.key)
                engine.store(ids, keys=keys, values=values, digests=digests, request_configs=tag)
                if engine.lookup(ids, request_configs=tag) < tokens:  # its pool could not take every chunk
                    engine.clear(ids, request_configs=tag)
                    self._counts["refused"] += 1
                    return False
            except Exception as e:
                log.warning("chunk cache tier lmcache: writing %s failed: %r", entry.key, e)
                self._counts["errors"] += 1
                self._counts["refused"] += 1
                return False
            shape = (layers, kv_heads, tokens, head_dim)
            digest = digests.hexdigest()
            self._held[entry.key] = _Held(entry.token_ids, shape, digest, entry.cost, entry.model, size, entry.exact)
            self._bytes += size
            self._counts["puts"] += 1
        return True

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._drop(key, None)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._held

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            return {**self._counts, "entries": len(self._held), "bytes": self._bytes, "budget_bytes": self.budget_bytes}

    def close(self) -> None:
        """Free LMCache's pool and stop its threads. Waits at most close_timeout_s: some LMCache
        backends' close() hang (its Redis connector's does); their threads are daemons (see _start)
        and die with the process."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            engine, self._engine = self._engine, None
            self._held.clear()
            self._bytes = 0
        if engine is not None:
            try:
                _in_daemon_thread(lambda: LMCacheEngineBuilder.destroy(self._instance), self.close_timeout_s)
            except TimeoutError:
                log.warning("chunk cache tier lmcache: LMCache did not close in %.0f s", self.close_timeout_s)

    # ---- under the lock -------------------------------------------------------------------

    def _start(self, layout: tuple[int, int, int, torch.dtype]) -> LMCacheEngine:
        if self._engine is not None:
            return self._engine
        layers, kv_heads, head_dim, dtype = layout
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=self.chunk_size,
            local_cpu=True,
            max_local_cpu_size=self.budget_bytes / 2**30,  # GiB
            save_unfull_chunk=True,  # an entry's last, shorter chunk too
        )
        metadata = LMCacheMetadata(
            model_name="kvgate", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=dtype, kv_shape=(layers, 2, self.chunk_size, kv_heads, head_dim), chunk_size=self.chunk_size,
        )  # fmt: skip
        connector = ChunkConnector(layers, kv_heads, head_dim)

        def build() -> LMCacheEngine:
            engine = LMCacheEngineBuilder.get_or_create(
                self._instance, config, metadata, connector, _single_process, _single_process
            )
            engine.post_init()  # starts its storage manager, whose event loop thread is not a daemon
            return engine

        method = multiprocessing.get_start_method(allow_none=True)
        try:
            # Built in a daemon thread, so that the threads it starts are daemons too (they inherit
            # the flag) and never keep the process from exiting when nobody calls close().
            self._engine = _in_daemon_thread(build)
        finally:
            multiprocessing.set_start_method(method, force=True)  # LMCacheEngine forces "spawn" process-wide
        self._layout = layout
        return self._engine

    def _make_room(self, size: int) -> None:
        while self._held and self._bytes + size > self.budget_bytes:
            self._drop(next(iter(self._held)), "evictions")

    def _drop(self, key: str, why: str | None) -> bool:
        """Forget the entry and remove it from LMCache; `why` (a miss, an eviction) is counted."""
        held = self._held.pop(key, None)
        if held is None:
            return False
        self._bytes -= held.nbytes
        if why is not None:
            self._counts[why] += 1
            if why != "evictions":
                self._counts["misses"] += 1
        if self._engine is not None:
            try:
                self._engine.clear(list(held.token_ids), request_configs=_tag(key))
            except Exception as e:
                log.warning("chunk cache tier lmcache: removing %s failed: %r", key, e)
        return True


def _tag(key: str) -> dict[str, str]:
    """LMCache request config that adds the kvgate key to each chunk's LMCache key."""
    return {"lmcache.tag.kvgate": key}


def _footprint(tokens: int, token_bytes: int, chunk_size: int) -> int:
    """Bytes an entry takes in LMCache's pool: one object per chunk, each rounded up to _ALIGN."""
    chunks = [min(chunk_size, tokens - start) * token_bytes for start in range(0, tokens, chunk_size)]
    return sum(-(-n // _ALIGN) * _ALIGN for n in chunks)


def _single_process(*args: Any) -> Any:
    raise RuntimeError("kvgate runs LMCache in a single process: nothing to broadcast")


def _in_daemon_thread(fn: Callable[[], T], timeout: float | None = None) -> T:
    """fn() run in a daemon thread; TimeoutError when it has not returned after `timeout` seconds."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, name="kvgate-lmcache", daemon=True).start()
    return future.result(timeout)
