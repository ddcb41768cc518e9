"""Entries in one SQLite file: the default, embedded store. Processes on one machine may share the
file (WAL mode); the change log table tells each the others' writes."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

from kvgate.semantic_cache.entry import CHECKED, Entry, pack, unpack
from kvgate.semantic_cache.store import Change, Store, register_store

COLUMNS = (*CHECKED, "sum", "last_used", "hits")
TEXT = ("vector", "response", "query")  # kept as bytes; the other checked fields as text
LOG_KEEP = 100_000  # change-log rows kept; a reader further behind rebuilds its index

# expires_at: the checked `expires` as a number, for the expiry index. counts: entries per category;
# held: entries per tenant and category (rows at 0 go). Triggers keep both, so that a write checks
# its quotas without counting.
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS entries (
  {", ".join(f"{c} {'REAL' if c == 'last_used' else 'INTEGER' if c == 'hits' else 'BLOB'}" for c in COLUMNS)},
  expires_at REAL NOT NULL, PRIMARY KEY (id));
DROP INDEX IF EXISTS entries_tenant;
CREATE INDEX IF NOT EXISTS entries_lru ON entries (category, last_used);
CREATE INDEX IF NOT EXISTS entries_quota ON entries (tenant, category, last_used);
CREATE INDEX IF NOT EXISTS entries_scope ON entries (scope);
CREATE INDEX IF NOT EXISTS entries_expires ON entries (expires_at);
CREATE TABLE IF NOT EXISTS counts (category TEXT PRIMARY KEY, n INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS held (tenant TEXT, category TEXT, n INTEGER NOT NULL, PRIMARY KEY (tenant, category));
CREATE INDEX IF NOT EXISTS held_most ON held (category, n);
CREATE TRIGGER IF NOT EXISTS entries_in AFTER INSERT ON entries BEGIN
  INSERT INTO counts VALUES (new.category, 1) ON CONFLICT (category) DO UPDATE SET n = n + 1; END;
CREATE TRIGGER IF NOT EXISTS entries_out AFTER DELETE ON entries BEGIN
  UPDATE counts SET n = n - 1 WHERE category = old.category; END;
CREATE TRIGGER IF NOT EXISTS held_in AFTER INSERT ON entries BEGIN
  INSERT INTO held VALUES (new.tenant, new.category, 1) ON CONFLICT (tenant, category) DO UPDATE SET n = n + 1; END;
CREATE TRIGGER IF NOT EXISTS held_out AFTER DELETE ON entries BEGIN
  UPDATE held SET n = n - 1 WHERE tenant = old.tenant AND category = old.category;
  DELETE FROM held WHERE tenant = old.tenant AND category = old.category AND n <= 0; END;
CREATE TABLE IF NOT EXISTS log (seq INTEGER PRIMARY KEY AUTOINCREMENT, op TEXT NOT NULL, id TEXT NOT NULL);
"""
# Counted afresh on opening: a file written before `held` existed has entries it never counted.
RECOUNT = (
    "DELETE FROM counts",
    "INSERT INTO counts SELECT category, count(*) FROM entries GROUP BY category",
    "DELETE FROM held",
    "INSERT INTO held SELECT tenant, category, count(*) FROM entries GROUP BY tenant, category",
)
# A write's scope, read from its entry (an entry gone since: "", and nothing to index).
CHANGES = """SELECT seq, op, log.id, coalesce(entries.scope, '') FROM log
  LEFT JOIN entries ON op = 'put' AND entries.id = log.id WHERE seq > ? ORDER BY seq"""
INSERT = f"INSERT INTO entries VALUES ({','.join('?' * (len(COLUMNS) + 1))})"


def row(entry: Entry) -> list[bytes | str | float | int]:
    packed = pack(entry)
    values: list[bytes | str | float | int] = [packed[c] if c in TEXT else packed[c].decode() for c in CHECKED]
    return [*values, packed["sum"].decode(), entry.last_used or entry.created, entry.hits, entry.expires]


@register_store("sqlite")
class SQLiteStore(Store):
    def __init__(self, path: Path, dim: int) -> None:
        self.path, self.dim = Path(path), dim
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            for statement in RECOUNT:
                self.db.execute(statement)
        self.lock = threading.Lock()

    def put(self, entry: Entry, quota: int, now: float, capacity: int | None = None) -> list[str]:
        with self.lock, self.db:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.execute("DELETE FROM entries WHERE id = ?", (entry.id,))
            self.db.execute(INSERT, row(entry))
            self._log([("put", entry.id)])
            dropped = [r[0] for r in self.db.execute("SELECT id FROM entries WHERE expires_at <= ?", (now,))]
            self._delete(dropped)
            dropped += self._evict(entry.tenant, entry.category, self._held(entry.tenant, entry.category) - quota)
            if capacity is not None:
                dropped += self._share(entry.category, capacity)
            self.db.execute("DELETE FROM log WHERE seq <= (SELECT max(seq) FROM log) - ?", (LOG_KEEP,))
        return dropped

    def _share(self, category: str, capacity: int) -> list[str]:
        """Bring the category down to `capacity`, taking from whichever tenant holds the most."""
        dropped: list[str] = []
        count = "SELECT coalesce(max(n), 0) FROM counts WHERE category = ?"
        while self.db.execute(count, (category,)).fetchone()[0] > capacity:
            most = self.db.execute("SELECT tenant FROM held WHERE category = ? ORDER BY n DESC LIMIT 1", (category,))
            tenant = (most.fetchone() or [None])[0]
            evicted = self._evict(tenant, category, 1) if tenant is not None else []
            if not evicted:  # the counts disagree with the rows: never loop on them
                return dropped
            dropped += evicted
        return dropped

    def _held(self, tenant: str, category: str) -> int:
        held = "SELECT coalesce(max(n), 0) FROM held WHERE tenant = ? AND category = ?"
        return int(self.db.execute(held, (tenant, category)).fetchone()[0])

    def _evict(self, tenant: str, category: str, over: int) -> list[str]:
        """Delete the tenant's `over` least recently used entries of the category."""
        if over <= 0:
            return []
        lru = "SELECT id FROM entries WHERE tenant = ? AND category = ? ORDER BY last_used LIMIT ?"
        evicted = [r[0] for r in self.db.execute(lru, (tenant, category, over))]
        self._delete(evicted)
        return evicted

    def load(self, entries: list[Entry]) -> None:
        """Write many entries in one transaction, without expiry or quotas (an import, or a benchmark's fill)."""
        with self.lock, self.db:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.executemany(INSERT, [row(e) for e in entries])
            self._log([("put", e.id) for e in entries])

    def get(self, entry_id: str) -> Entry | None:
        with self.lock:
            cur = self.db.execute(f"SELECT {','.join(COLUMNS)} FROM entries WHERE id = ?", (entry_id,))
            row = cur.fetchone()
        if row is None:
            return None
        entry = unpack(dict(zip(COLUMNS, row, strict=True)), self.dim)
        if entry is None:
            self.delete([entry_id])
        return entry

    def touch(self, entry_id: str, now: float) -> None:
        with self.lock:
            self.db.execute("UPDATE entries SET last_used = ?, hits = hits + 1 WHERE id = ?", (now, entry_id))

    def delete(self, entry_ids: list[str]) -> int:
        with self.lock, self.db:
            self.db.execute("BEGIN IMMEDIATE")
            return self._delete(entry_ids)

    def _delete(self, entry_ids: list[str]) -> int:
        gone = 0
        for entry_id in entry_ids:
            gone += self.db.execute("DELETE FROM entries WHERE id = ?", (entry_id,)).rowcount
        self._log([("del", i) for i in entry_ids])
        return gone

    def _log(self, changes: list[tuple[str, str]]) -> None:
        self.db.executemany("INSERT INTO log (op, id) VALUES (?, ?)", changes)

    def ids(self, tenant: str | None = None, category: str | None = None) -> list[str]:
        query, args = "SELECT id FROM entries WHERE 1", []
        if tenant is not None:
            query, args = query + " AND tenant = ?", [*args, tenant]
        if category is not None:
            query, args = query + " AND category = ?", [*args, category]
        with self.lock:
            return [r[0] for r in self.db.execute(query, args)]

    def entries(self, scope: str) -> Iterator[Entry]:
        with self.lock:
            rows = self.db.execute(f"SELECT {','.join(COLUMNS)} FROM entries WHERE scope = ?", (scope,)).fetchall()
        found = [unpack(dict(zip(COLUMNS, row, strict=True)), self.dim) for row in rows]
        if damaged := [row[0] for row, entry in zip(rows, found, strict=True) if entry is None]:
            self.delete(damaged)
        return iter([entry for entry in found if entry is not None])

    def cursor(self) -> str:
        with self.lock:
            return str(self.db.execute("SELECT coalesce(max(seq), 0) FROM log").fetchone()[0])

    def changes(self, since: str) -> tuple[str, list[Change]] | None:
        with self.lock:
            first = self.db.execute("SELECT min(seq) FROM log").fetchone()[0]
            rows = self.db.execute(CHANGES, (int(since),)).fetchall()
        if first is not None and first > int(since) + 1 and int(since) > 0:
            return None
        return (str(rows[-1][0]) if rows else since), [(op, i, scope) for _, op, i, scope in rows]

    def close(self) -> None:
        with self.lock:
            self.db.close()
