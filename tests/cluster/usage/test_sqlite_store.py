"""The SQLite usage store: records round-trip, survive a restart, are stored once per request id (the
first wins), and ``record()`` only queues: a locked database delays durability, never the caller."""

from __future__ import annotations

import dataclasses
import logging
import sqlite3
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from baton_serve.cluster.usage import (
    COLUMNS,
    SQLiteUsageStore,
    UsageRecord,
    UsageStoreClosed,
    make_usage_store,
    register_usage_store,
    usage_store_names,
)
from hypothesis import given, settings
from hypothesis import strategies as st


def _rec(request_id: str = "chatcmpl-1", **kw) -> UsageRecord:
    fields = dict(
        request_id=request_id,
        tenant="acme",
        key_id="k_3f9a",
        model="qwen3-0.6b",
        weights_fingerprint="sha256:ab12",
        endpoint="chat",
        prompt_tokens=120,
        cached_tokens=64,
        completion_tokens=17,
        finish_reason="stop",
        status=200,
        created=1767225600.125,
        queue_time_s=0.004,
        ttft_s=0.031,
        e2e_s=0.412,
        idempotency_key=None,
    )
    fields.update(kw)
    return UsageRecord(**fields)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteUsageStore]:
    s = SQLiteUsageStore(tmp_path / "usage.db")
    yield s
    s.close()


@contextmanager
def _write_locked(path: Path) -> Iterator[None]:
    """Hold the database's write lock from another connection, as a second writer process would."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        db.execute("ROLLBACK")
        db.close()


def test_records_round_trip_field_by_field(tmp_path: Path) -> None:
    a = _rec("chatcmpl-a")
    b = _rec(
        "cmpl-b",
        key_id=None,
        endpoint="completion",
        cached_tokens=0,
        finish_reason="length",
        status=429,
        queue_time_s=None,
        ttft_s=None,
        e2e_s=None,
        idempotency_key="idem-7",
        created=1767225601.5,
    )
    with SQLiteUsageStore(tmp_path / "deep" / "er" / "usage.db") as s:  # parent folders created
        s.record(a)
        s.record(b)
        s.flush()
        got = s.records()
    assert len(got) == 2
    for want, have in zip([a, b], got):
        for name in COLUMNS:
            assert getattr(have, name) == getattr(want, name), name
            assert type(getattr(have, name)) is type(getattr(want, name)), name
    assert UsageRecord.from_row(a.to_row()) == a


def test_a_restart_sees_every_record_in_order(tmp_path: Path) -> None:
    path = tmp_path / "usage.db"
    sent = [_rec(f"chatcmpl-{i}", prompt_tokens=i) for i in range(50)]
    s = SQLiteUsageStore(path)
    for r in sent[:30]:
        s.record(r)
    s.flush()
    # a second store on the same file sees what the first flushed, while the first is still open
    assert SQLiteUsageStore(path).records() == sent[:30]
    for r in sent[30:]:
        s.record(r)
    s.close()

    reopened = SQLiteUsageStore(path)
    assert reopened.count() == 50
    assert reopened.records() == sent
    assert reopened.records(limit=3) == sent[:3]
    reopened.record(_rec("chatcmpl-new"))
    reopened.close()
    assert [r.request_id for r in SQLiteUsageStore(path).records()][-2:] == ["chatcmpl-49", "chatcmpl-new"]


def test_a_repeated_request_id_keeps_the_first_and_counts_a_duplicate(
    store: SQLiteUsageStore, caplog
) -> None:
    first = _rec("chatcmpl-x", completion_tokens=10)
    with caplog.at_level(logging.WARNING, logger="baton_serve.cluster.usage.sqlite_store"):
        store.record(first)
        store.flush()
        store.record(_rec("chatcmpl-x", completion_tokens=99, finish_reason="abort"))
        store.flush()
    assert store.records() == [first]
    assert store.duplicates == 1
    assert any("chatcmpl-x" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_a_repeated_request_id_within_one_batch_keeps_the_first(tmp_path: Path) -> None:
    path = tmp_path / "usage.db"
    with SQLiteUsageStore(path) as s:
        with _write_locked(path):
            s.record(_rec("chatcmpl-0"))
            time.sleep(0.1)  # the writer takes chatcmpl-0 alone and waits on the lock ...
            s.record(_rec("chatcmpl-y", prompt_tokens=1))  # ... so these two share its next transaction
            s.record(_rec("chatcmpl-y", prompt_tokens=2))
        s.flush()
        assert [(r.request_id, r.prompt_tokens) for r in s.records()][1:] == [("chatcmpl-y", 1)]
        assert s.duplicates == 1


def test_the_database_is_in_wal_mode(store: SQLiteUsageStore) -> None:
    with sqlite3.connect(store.path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_concurrent_records_from_8_threads_are_all_stored(store: SQLiteUsageStore) -> None:
    start = threading.Barrier(8)

    def send(t: int) -> None:
        start.wait()
        for i in range(200):
            store.record(_rec(f"chatcmpl-{t}-{i}"))

    threads = [threading.Thread(target=send, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    store.flush()
    assert store.count() == 1600
    assert {r.request_id for r in store.records()} == {
        f"chatcmpl-{t}-{i}" for t in range(8) for i in range(200)
    }
    assert store.duplicates == 0


def test_record_returns_while_the_database_is_locked_and_flush_times_out(store: SQLiteUsageStore) -> None:
    # A store that wrote in record() would wait out the 5 s busy timeout on every call here.
    with _write_locked(store.path):
        t0 = time.monotonic()
        for i in range(100):
            store.record(_rec(f"chatcmpl-{i}"))
        assert time.monotonic() - t0 < 1.0
        assert store.count() == 0  # queued, not yet written
        with pytest.raises(TimeoutError, match="100 of 100 records"):
            store.flush(timeout_s=0.2)
    store.flush()
    assert store.count() == 100


def test_a_batch_that_outlasts_the_busy_timeout_is_retried_not_lost(tmp_path: Path, caplog) -> None:
    path = tmp_path / "usage.db"
    with SQLiteUsageStore(path, busy_timeout_s=0.02) as s, caplog.at_level(logging.WARNING):
        with _write_locked(path):
            s.record(_rec("chatcmpl-1"))
            time.sleep(0.3)  # several busy failures and retries
        s.flush()
        assert s.records() == [_rec("chatcmpl-1")]
    assert any("retrying" in r.getMessage() for r in caplog.records)


def test_close_is_idempotent_and_record_after_close_raises(tmp_path: Path) -> None:
    s = SQLiteUsageStore(tmp_path / "usage.db")
    s.record(_rec())
    s.close()
    s.close()
    with pytest.raises(UsageStoreClosed):
        s.record(_rec("chatcmpl-2"))
    assert isinstance(UsageStoreClosed(), RuntimeError)
    assert s.count() == 1


def test_close_raises_when_records_cannot_be_made_durable(tmp_path: Path) -> None:
    path = tmp_path / "usage.db"
    s = SQLiteUsageStore(path, busy_timeout_s=0.02)
    with _write_locked(path):
        s.record(_rec())
        with pytest.raises(TimeoutError):
            s.close(timeout_s=0.1)
    s.close()  # already closed: nothing more to report


def test_a_bad_record_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="endpoint"):
        _rec(endpoint="embeddings")
    with pytest.raises(ValueError, match="prompt_tokens"):
        _rec(prompt_tokens=-1)
    with pytest.raises(ValueError, match="request_id"):
        _rec(request_id="")
    with pytest.raises(ValueError, match="tenant"):
        _rec(tenant=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        _rec().status = 500  # type: ignore[misc]


def test_registry_builds_sqlite_and_lists_known_names_for_an_unknown_one(tmp_path: Path) -> None:
    assert "sqlite" in usage_store_names()
    s = make_usage_store("sqlite", path=tmp_path / "usage.db")
    assert isinstance(s, SQLiteUsageStore)
    s.close()
    with pytest.raises(ValueError, match=r"unknown usage store 'kafka'; known: .*sqlite"):
        make_usage_store("kafka")


def test_a_new_writer_is_one_registration(tmp_path: Path) -> None:
    name = f"test-{uuid.uuid4().hex[:8]}"
    register_usage_store(name, lambda root: SQLiteUsageStore(Path(root) / "x.db"))
    assert name in usage_store_names()
    with make_usage_store(name, root=tmp_path) as s:
        assert s.count() == 0
    with pytest.raises(ValueError, match="taken"):
        register_usage_store(name, SQLiteUsageStore)


_records = st.builds(
    _rec,
    request_id=st.sampled_from(["chatcmpl-a", "chatcmpl-b", "cmpl-c", "cmpl-d", "chatcmpl-e"]),
    prompt_tokens=st.integers(0, 1 << 20),
    completion_tokens=st.integers(0, 4096),
    finish_reason=st.sampled_from(["stop", "length", "abort", "error"]),
    ttft_s=st.none() | st.floats(0, 60, allow_nan=False),
)


@settings(max_examples=40, deadline=None)
@given(st.lists(_records, max_size=20))
def test_any_sequence_stores_each_distinct_id_once_with_its_first_record(sent: list[UsageRecord]) -> None:
    first: dict[str, UsageRecord] = {}
    for r in sent:
        first.setdefault(r.request_id, r)
    with tempfile.TemporaryDirectory() as d, SQLiteUsageStore(Path(d) / "usage.db") as s:
        for r in sent:
            s.record(r)
        s.flush()
        assert s.records() == list(first.values())  # dicts keep first-insertion order
        assert s.duplicates == len(sent) - len(first)
