"""The embedded default usage store: one SQLite file in WAL mode, written by one thread in batches."""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
import time
from contextlib import closing
from pathlib import Path
from typing import cast

from baton_serve.cluster.usage.record import COLUMNS, UsageRecord
from baton_serve.cluster.usage.store import UsageStore, UsageStoreClosed, register_usage_store

log = logging.getLogger(__name__)

_SCHEMA_VERSION = 1

# SQLite's AUTOINCREMENT needs an INTEGER PRIMARY KEY, so ``seq`` holds that and ``request_id`` is
# NOT NULL UNIQUE: the same guarantee as a primary key. ``seq`` is never reused, so it orders rows
# across restarts.
_DDL = """
CREATE TABLE IF NOT EXISTS usage (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    request_id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    key_id TEXT,
    model TEXT NOT NULL,
    weights_fingerprint TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    finish_reason TEXT NOT NULL,
    status INTEGER NOT NULL,
    created REAL NOT NULL,
    queue_time_s REAL,
    ttft_s REAL,
    e2e_s REAL,
    idempotency_key TEXT
)"""
# ON CONFLICT(request_id) rather than INSERT OR IGNORE: only a repeated id is skipped (and counted as a
# duplicate); any other constraint failure still raises instead of silently dropping the row.
_INSERT = (
    f"INSERT INTO usage ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))}) "
    "ON CONFLICT(request_id) DO NOTHING"
)
_SELECT = f"SELECT {', '.join(COLUMNS)} FROM usage ORDER BY seq LIMIT ?"

_STOP = object()


class SQLiteUsageStore(UsageStore):
    """Usage records in the SQLite file at ``path`` (parent folders created). ``record()`` queues; one
    writer thread owns the write connection and commits what is queued as one transaction."""

    def __init__(
        self,
        path: str | Path,
        *,
        synchronous: str = "NORMAL",
        busy_timeout_s: float = 5.0,
        max_batch: int = 512,
    ) -> None:
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be 'NORMAL' or 'FULL', got {synchronous!r}")
        if busy_timeout_s < 0:
            raise ValueError(f"busy_timeout_s must be >= 0, got {busy_timeout_s}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.path = Path(path)
        self._synchronous = synchronous
        self._busy_timeout_s = busy_timeout_s
        self._max_batch = max_batch
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._create_schema()  # here, not in the writer: a bad path or foreign file fails the constructor

        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)  # notified when records become durable
        self._submitted = 0
        self._durable = 0
        self._duplicates = 0
        self._closed = False
        self._error: BaseException | None = None
        self._stop = threading.Event()
        # daemon: an unclosed store must not hang interpreter exit; close() is what makes records durable.
        self._writer = threading.Thread(target=self._run, name=f"usage-writer:{self.path.name}", daemon=True)
        self._writer.start()

    # -- the contract --------------------------------------------------------------------------

    def record(self, rec: UsageRecord) -> None:
        with self._lock:
            if self._closed:
                raise UsageStoreClosed(
                    f"usage store {self.path} is closed; record {rec.request_id!r} refused"
                )
            # put under the lock: flush() reads _submitted under it, so every counted record is queued
            self._queue.put(rec)
            self._submitted += 1

    def flush(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        with self._progress:
            target = self._submitted
            while self._durable < target:
                if self._error is not None:
                    raise RuntimeError(f"usage store {self.path}: writer failed") from self._error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"usage store {self.path}: {target - self._durable} of {target} records "
                        f"not durable after {timeout_s}s"
                    )
                self._progress.wait(left)

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush (``TimeoutError`` if that fails: the records still queued are lost), then stop the writer."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.flush(timeout_s)
        finally:
            self._stop.set()
            self._queue.put(_STOP)
            # a writer inside SQLite's busy wait returns within busy_timeout_s
            self._writer.join(timeout=self._busy_timeout_s + 1.0)

    def count(self) -> int:
        """Stored records; reads with its own connection (disk I/O: not for the event loop)."""
        with closing(self._connect()) as db:
            return int(db.execute("SELECT COUNT(*) FROM usage").fetchone()[0])

    def records(self, limit: int | None = None) -> list[UsageRecord]:
        """Stored records, oldest first; reads with its own connection (disk I/O: not for the event loop)."""
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0 or None, got {limit}")
        with closing(self._connect()) as db:
            rows = db.execute(_SELECT, (-1 if limit is None else limit,)).fetchall()
        return [UsageRecord.from_row(row) for row in rows]

    @property
    def duplicates(self) -> int:
        return self._duplicates

    # -- the writer thread ---------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: no implicit transactions; the writer opens its own with BEGIN IMMEDIATE.
        return sqlite3.connect(self.path, timeout=self._busy_timeout_s, isolation_level=None)

    def _create_schema(self) -> None:
        with closing(self._connect()) as db:
            # WAL: readers (count, records, an admin view) never block the writer, nor it them.
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise RuntimeError(f"usage store {self.path}: journal_mode is {mode!r}, WAL is required")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, _SCHEMA_VERSION):
                raise RuntimeError(
                    f"usage store {self.path}: schema version {version}, this code reads {_SCHEMA_VERSION}"
                )
            db.execute(_DDL)
            db.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")

    def _run(self) -> None:
        try:
            with closing(self._connect()) as db:
                # NORMAL is safe with WAL: a commit is in the WAL before it returns, so it survives a crash
                # of this process; only an OS crash or power loss may drop the last commits, and never
                # corrupts the file. FULL adds an fsync per commit for those too.
                db.execute(f"PRAGMA synchronous={self._synchronous}")
                while True:
                    batch, stop = self._next_batch()
                    if batch and not self._write(db, batch):
                        return
                    if stop:
                        return
        except BaseException as e:
            log.exception("usage store %s: writer failed", self.path)
            with self._progress:
                self._error = e
                self._progress.notify_all()

    def _next_batch(self) -> tuple[list[UsageRecord], bool]:
        """Wait for one record, then take what else is queued, up to ``max_batch``; True once stopped."""
        batch: list[UsageRecord] = []
        item = self._queue.get()
        while item is not _STOP:
            batch.append(cast(UsageRecord, item))
            if len(batch) >= self._max_batch:
                return batch, False
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return batch, False
        return batch, True

    def _write(self, db: sqlite3.Connection, batch: list[UsageRecord]) -> bool:
        """Commit ``batch``, retrying while the database is busy or failing; False if stopped first."""
        delay = 0.05
        while True:
            try:
                duplicates = self._insert(db, batch)
                break
            # busy, locked, disk full, I/O error: the batch is kept here and retried, never dropped
            except sqlite3.OperationalError as e:
                log.warning(
                    "usage store %s: writing %d records failed (%s); retrying in %.2fs",
                    self.path,
                    len(batch),
                    e,
                    delay,
                )
                if self._stop.wait(delay):
                    return False
                delay = min(2 * delay, 1.0)
        for request_id in duplicates:
            log.warning(
                "usage store %s: a second record for %r arrived; the first is kept", self.path, request_id
            )
        with self._progress:
            self._durable += len(batch)
            self._duplicates += len(duplicates)
            self._progress.notify_all()
        return True

    @staticmethod
    def _insert(db: sqlite3.Connection, batch: list[UsageRecord]) -> list[str]:
        """Insert ``batch`` in one transaction; the request ids that were already stored."""
        duplicates = []
        # IMMEDIATE takes the write lock up front, so a busy database is waited for here and not met
        # half-way through the batch.
        db.execute("BEGIN IMMEDIATE")
        try:
            for rec in batch:
                if db.execute(_INSERT, rec.to_row()).rowcount == 0:
                    duplicates.append(rec.request_id)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        return duplicates


register_usage_store("sqlite", SQLiteUsageStore)
