"""Tiers that hold entries as bytes outside the process (disk, Redis, LMCache): the shared part.

A subclass says how to read a byte range of a stored entry, how to write and remove one. This
class checks everything it reads (header, token ids, each layer: see entry.py), turns damage
into a miss that also deletes the entry, turns a failing backend into a miss, and counts.
"""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod
from collections.abc import Callable, Iterator

import torch

from kvgate.chunk_cache.codec import codec_named
from kvgate.chunk_cache.entry import ChunkKV, CorruptEntry, Header
from kvgate.chunk_cache.tier import Tier

log = logging.getLogger(__name__)

# Bytes [start, stop) of one stored entry; shorter when the entry is shorter (truncated).
Read = Callable[[int, int], bytes | memoryview]


class TierUnavailable(RuntimeError):
    """The backend cannot be reached (a server down): a miss now, maybe a hit later."""


class ByteTier(Tier):
    def __init__(self, budget_bytes: int, codec: str | None = None) -> None:
        """codec: how `put` stores entries (codec.py's names: "int8", "int4"); None: raw. Any entry is read."""
        super().__init__()
        if budget_bytes < 0:
            raise ValueError(f"need budget_bytes >= 0, got {budget_bytes}")
        codec_named(codec)  # a name not known here: ValueError now, not at the first put
        self.budget_bytes, self.codec = budget_bytes, codec
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("hits", "misses", "corrupt", "errors", "puts", "refused", "evictions", "bytes_read", "bytes_written"), 0
        )

    # ---- what a backend implements ------------------------------------------------------

    @abstractmethod
    def reader(self, key: str) -> Read | None:
        """A reader of the stored entry, None when there is none; raises when the backend fails."""

    @abstractmethod
    def write(self, key: str, data: bytes) -> bool:
        """Store the bytes under key (whole, or not at all); False when they cannot be held."""

    @abstractmethod
    def remove(self, key: str) -> bool: ...

    # ---- the Tier interface ---------------------------------------------------------------

    @property
    def budget(self) -> int:
        return self.budget_bytes

    def open(self, key: str, model: str | None = None) -> tuple[Header, Read] | None:
        """The entry's checked header and a reader for its layers; None on a miss (damage, a
        value written by another model, an unreachable backend: all misses)."""
        try:
            read = self.reader(key)
            if read is None:
                self.count("misses")
                return None
            size = Header.size_of(read(0, 8))
            header = Header.parse(read(0, size), key, model)
            header.check_tokens(read(header.ids_start, header.ids_stop))
            return header, read
        except CorruptEntry as e:
            self.discard(key, e)
        except Exception as e:
            self.failed("reading", key, e)
        return None

    def get(self, key: str, model: str | None = None) -> ChunkKV | None:
        opened = self.open(key, model)
        if opened is None:
            return None
        header, read = opened
        kv = torch.empty(header.kv_shape, dtype=header.dtype)
        try:
            for _ in self.layers(header, read, kv):
                pass
        except CorruptEntry as e:
            self.discard(key, e)
            return None
        except Exception as e:
            self.failed("reading", key, e)
            return None
        self.loaded(header)
        return header.entry(kv)

    def layers(self, header: Header, read: Read, kv: torch.Tensor) -> Iterator[int]:
        """Read each layer of the entry into kv[i] and check it, in order: yields i once layer i is
        usable. A reader that can (`read.into(start, buffer) -> bytes read`: a file's) reads straight
        into the layer's tensor, checked in place: no second copy. A compressed entry's layers are
        read, checked, then decoded into the tensor."""
        into = getattr(read, "into", None)
        for i in range(header.layers):
            start, stop = header.layer_range(i)
            if into is None or header.codec is not None:
                header.layer(i, read(start, stop), out=kv[i])
            else:
                raw = memoryview(kv[i].view(torch.uint8).reshape(-1).numpy())
                header.check(i, raw[: into(start, raw)])
            yield i

    def put(self, entry: ChunkKV) -> bool:
        data = entry.to_bytes(self.codec)
        try:
            stored = self.write(entry.key, data)
        except Exception as e:
            self.failed("writing", entry.key, e)
            return False
        self.count("puts" if stored else "refused")
        if stored:
            self.count("bytes_written", len(data))
        return stored

    def delete(self, key: str) -> bool:
        try:
            return self.remove(key)
        except Exception as e:
            self.failed("deleting", key, e)
            return False

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            counts = dict(self._counts)
        return {**counts, "bytes": self.nbytes, "budget_bytes": self.budget_bytes}

    # ---- bookkeeping, also for loaders ------------------------------------------------------

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] += n

    def loaded(self, header: Header) -> None:
        with self._lock:
            self._counts["hits"] += 1
            self._counts["bytes_read"] += header.total

    def discard(self, key: str, why: Exception) -> None:
        """A damaged entry: never used, and deleted so it is not read again."""
        log.warning("chunk cache tier %s: dropping damaged entry %s: %s", self.name, key, why)
        self.count("corrupt")
        self.count("misses")
        self.delete(key)

    def failed(self, doing: str, key: str, why: Exception) -> None:
        # While a backend is known to be down every call fails at once: say so once, not per request.
        level = logging.DEBUG if isinstance(why, TierUnavailable) else logging.WARNING
        log.log(level, "chunk cache tier %s: %s %s failed: %r", self.name, doing, key, why)
        self.count("errors")
        if doing != "deleting":
            self.count("misses" if doing == "reading" else "refused")
