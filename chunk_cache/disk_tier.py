"""Local disk: one file per entry in one directory, which any number of processes may share.

The directory is its own ledger. A write takes the directory's lock (fcntl.flock on LOCK), removes
the least recently used entries until every file there, entries and writes in flight, leaves room
within the budget, and reserves its bytes by creating its temporary file at full size, locked for
as long as it is written; then, the directory unlocked, fills it and fsyncs it; renames it to the
entry's name under the lock again (a listing that meets a rename half-way may show the file under
neither name, and an eviction counting on it would leave the budget overdrawn) and fsyncs the
directory. A crash leaves an old entry or a whole new one, never part of
one, and an unlocked temporary file (its lock died with its writer) that the next writer or opener
removes. A read goes from the open file straight into the layer's tensor (preadv); a file's mtime
is its last use, so the order survives a restart and is the same for every process. A damaged file
is a miss (checksums: see entry.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from kvgate.chunk_cache.byte_tier import ByteTier, Read
from kvgate.chunk_cache.entry import CorruptEntry, Header
from kvgate.chunk_cache.tier import register_tier

SUFFIX = ".kvc"
TMP = ".tmp"
LOCK = ".lock"


class Opened:
    """An entry's file, open for as long as a reader holds it: byte ranges as bytes, or read
    straight into the caller's buffer (a layer's tensor: no mapping's page faults, no second copy)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __call__(self, start: int, stop: int) -> bytes:
        return os.pread(self.fd, stop - start, start)

    def into(self, start: int, buffer: memoryview) -> int:
        done = 0
        while done < len(buffer):
            n = os.preadv(self.fd, [buffer[done:]], start + done)
            if n == 0:  # the file ends early: truncated
                break
            done += n
        return done

    def __del__(self) -> None:
        os.close(self.fd)


@register_tier("disk")
class DiskTier(ByteTier):
    durable = True

    def __init__(self, root: str | Path, budget_bytes: int, codec: str | None = None) -> None:
        super().__init__(budget_bytes, codec)
        self.dir = Path(root).expanduser()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._keys: dict[str, str] = {}  # file name -> key, read from its header once
        self._keys_lock = threading.Lock()
        with self._locked():
            self._sweep()
            for name, _, _ in self._files(SUFFIX):
                if self._key_of(name) is None:
                    (self.dir / name).unlink(missing_ok=True)  # unreadable: it could never be a hit

    def path(self, key: str) -> Path:
        # Keys are arbitrary strings; file names are not.
        return self.dir / (hashlib.sha256(key.encode()).hexdigest() + SUFFIX)

    def reader(self, key: str) -> Read | None:
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        opened = Opened(fd)
        if os.fstat(fd).st_size == 0:
            raise CorruptEntry("an empty file")
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        with contextlib.suppress(FileNotFoundError):  # evicted since: the open file still reads
            os.utime(path)  # a use: last in line for eviction
        return opened

    def write(self, key: str, data: bytes) -> bool:
        if len(data) > self.budget_bytes:
            return False
        path = self.path(key)
        reserved = self._reserve(path.name, len(data))
        if reserved is None:
            return False
        fd, tmp = reserved
        try:
            with os.fdopen(fd, "r+b") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
                with self._locked():
                    os.replace(tmp, path)  # before close: the file is never an unlocked temporary one
            self._sync_dir()
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        with self._keys_lock:
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
        found = (self._key_of(name) for name, _, _ in self._files(SUFFIX))
        return [key for key in found if key is not None]

    @property
    def nbytes(self) -> int:
        """Bytes held in the directory by every process sharing it, writes in flight included."""
        return sum(size for _, size, _ in self._files())

    def stats(self) -> dict[str, int | float]:
        return {**super().stats(), "entries": len(self._files(SUFFIX))}

    # ---- the shared directory ---------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The directory's lock, between processes and between threads (each takes its own descriptor)."""
        fd = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _reserve(self, name: str, size: int) -> tuple[int, str] | None:
        """A locked temporary file of `size` bytes (descriptor, path), once the budget has room for it;
        None when it cannot have room (writes in flight hold it)."""
        with self._locked():
            files = self._files()  # one scan for both (it stats every file there: milliseconds for a thousand)
            gone = self._sweep([name for name, _, _ in files if name.endswith(TMP)])
            if not self._make_room(size, [f for f in files if f[0] not in gone]):
                return None
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{name}.", suffix=TMP)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.posix_fallocate(fd, 0, size)  # the reservation: a scan counts it at full size
            except BaseException:
                os.unlink(tmp)
                os.close(fd)
                raise
            return fd, tmp

    def _make_room(self, size: int, files: list[tuple[str, int, int]]) -> bool:
        held = sum(s for _, s, _ in files)
        in_flight = sum(s for name, s, _ in files if name.endswith(TMP))
        if in_flight + size > self.budget_bytes:
            return False
        for name, s, _ in sorted((f for f in files if f[0].endswith(SUFFIX)), key=lambda f: f[2]):
            if held + size <= self.budget_bytes:
                break
            self._forget(name)
            (self.dir / name).unlink(missing_ok=True)
            self.count("evictions")
            held -= s
        return True

    def _sweep(self, names: list[str] | None = None) -> set[str]:
        """Remove the temporary files (`names`, else those there now) of writers that died (under the directory's
        lock: a live writer locked its file when it made it, and holds that lock until the file has its entry's
        name); the names removed."""
        gone: set[str] = set()
        for name in names if names is not None else [name for name, _, _ in self._files(TMP)]:
            try:
                fd = os.open(self.dir / name, os.O_RDWR)
            except FileNotFoundError:
                gone.add(name)  # renamed or removed meanwhile
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.unlink(self.dir / name)
                gone.add(name)
            except BlockingIOError:
                pass  # a live writer's
            finally:
                os.close(fd)
        return gone

    def _files(self, *ends: str) -> list[tuple[str, int, int]]:
        """(name, bytes, last use in ns) of the files there now: entries and temporary files, or those
        ending with `ends`."""
        ends = ends or (SUFFIX, TMP)
        found = []
        with os.scandir(self.dir) as it:
            for e in it:
                if e.name.endswith(ends):
                    with contextlib.suppress(FileNotFoundError):  # removed by another process meanwhile
                        st = e.stat()
                        found.append((e.name, st.st_size, st.st_mtime_ns))
        return found

    def _key_of(self, name: str) -> str | None:
        with self._keys_lock:
            if name in self._keys:
                return self._keys[name]
        try:
            with open(self.dir / name, "rb") as f:
                head = f.read(8)
                key = Header.parse(head + f.read(Header.size_of(head) - 8)).key
        except (OSError, CorruptEntry):
            return None
        with self._keys_lock:
            self._keys[name] = key
        return key

    def _forget(self, name: str) -> None:
        with self._keys_lock:
            self._keys.pop(name, None)

    def _sync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
