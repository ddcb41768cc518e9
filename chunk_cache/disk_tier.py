"""Local disk: one file per entry in one directory, written to a temporary name and
renamed (a reader sees an old file or a whole new one), read through mmap. Least recently used
files go first when over budget; the file's mtime is its last use, so the order survives a restart.

No fsync: a file cut short by a crash fails its checksums and is a miss.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import tempfile
import threading
import time
from pathlib import Path

from kvgate.chunk_cache.byte_tier import ByteTier, Read
from kvgate.chunk_cache.entry import CorruptEntry, Header
from kvgate.chunk_cache.tier import register_tier

SUFFIX = ".kvc"


@register_tier("disk")
class DiskTier(ByteTier):
    def __init__(self, root: str | Path, budget_bytes: int) -> None:
        super().__init__(budget_bytes)
        self.dir = Path(root).expanduser()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, tuple[int, float]] = {}  # file name -> (bytes, last use)
        self._keys: dict[str, str] = {}  # file name -> key
        self._index_lock = threading.Lock()
        self._scan()

    def path(self, key: str) -> Path:
        # Keys are arbitrary strings; file names are not.
        return self.dir / (hashlib.sha256(key.encode()).hexdigest() + SUFFIX)

    def reader(self, key: str) -> Read | None:
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    raise CorruptEntry("an empty file")
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            self._forget(path.name)
            return None
        now = time.time()
        os.utime(path, (now, now))
        with self._index_lock:
            if path.name in self._files:
                self._files[path.name] = (size, now)
        view = memoryview(mapped)  # keeps the mapping alive as long as a reader holds it
        return lambda start, stop: view[start:stop]

    def write(self, key: str, data: bytes) -> bool:
        if len(data) > self.budget_bytes:
            return False
        path = self.path(key)
        self._make_room(len(data), path.name)
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        with self._index_lock:
            self._files[path.name] = (len(data), time.time())
            self._keys[path.name] = key
        return True

    def remove(self, key: str) -> bool:
        path = self.path(key)
        self._forget(path.name)
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.path(key).is_file()

    def keys(self) -> list[str]:
        with self._index_lock:
            return [self._keys[name] for name in self._files if name in self._keys]

    @property
    def nbytes(self) -> int:
        with self._index_lock:
            return sum(size for size, _ in self._files.values())

    def stats(self) -> dict[str, int | float]:
        with self._index_lock:
            entries = len(self._files)
        return {**super().stats(), "entries": entries}

    def _forget(self, name: str) -> None:
        with self._index_lock:
            self._files.pop(name, None)
            self._keys.pop(name, None)

    def _make_room(self, size: int, replacing: str) -> None:
        with self._index_lock:
            held = sum(s for name, (s, _) in self._files.items() if name != replacing)
            victims = []
            for name, (s, _) in sorted(self._files.items(), key=lambda kv: kv[1][1]):
                if held + size <= self.budget_bytes:
                    break
                if name != replacing:
                    victims.append(name)
                    held -= s
        for name in victims:
            self._forget(name)
            (self.dir / name).unlink(missing_ok=True)
            self.count("evictions")

    def _scan(self) -> None:
        """Index the files already there (another run's): sizes, last use, keys from their headers."""
        for path in self.dir.glob("*" + SUFFIX):
            try:
                stat = path.stat()
                with open(path, "rb") as f:
                    head = f.read(8)
                    key = Header.parse(head + f.read(Header.size_of(head) - 8)).key
            except (OSError, CorruptEntry):
                path.unlink(missing_ok=True)  # unreadable: it could never be a hit
                continue
            self._files[path.name] = (stat.st_size, stat.st_mtime)
            self._keys[path.name] = key
        for stale in self.dir.glob(".*.tmp"):  # a writer that died before its rename
            if time.time() - stale.stat().st_mtime > 600:
                stale.unlink(missing_ok=True)
