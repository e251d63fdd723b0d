"""The ingress gate: refusals before any tokenizer time, tickets that end exactly once in one record."""

from __future__ import annotations

import threading

import pytest
from baton_serve.cluster.admission.gate import AdmissionError, IngressGate
from baton_serve.cluster.admission.tenants import TenantDirectory, hash_key
from baton_serve.cluster.usage.sqlite_store import SQLiteUsageStore


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def store(tmp_path):
    s = SQLiteUsageStore(tmp_path / "usage.sqlite3")
    yield s
    s.close()


def _directory(tmp_path, extra: str = "") -> TenantDirectory:
    p = tmp_path / "tenants.toml"
    p.write_text(f'[tenants.a]\napi_keys = ["{hash_key("ka")}"]\n{extra}\n'
                 f'[tenants.b]\napi_keys = ["{hash_key("kb")}"]\n')
    return TenantDirectory.from_file(p)


def test_401_without_or_with_a_wrong_key_and_no_record(tmp_path, store):
    rejected = []
    gate = IngressGate(_directory(tmp_path), usage=store, on_reject=lambda r, t: rejected.append((r, t)))
    for header in (None, "Bearer nope"):
        with pytest.raises(AdmissionError) as err:
            gate.admit(header)
        assert err.value.status_code == 401 and err.value.headers["WWW-Authenticate"] == "Bearer"
        assert err.value.body()["error"]["type"] == "authentication_error"
    store.flush()
    assert store.count() == 0 and rejected == [("unauthenticated", ""), ("unauthenticated", "")]
    assert gate.in_flight == 0


def test_request_rate_429_with_retry_after_from_the_bucket(tmp_path, store):
    clock = Clock()
    gate = IngressGate(_directory(tmp_path, "requests_per_second = 2\nrequest_burst = 2"), usage=store, clock=clock)
    tickets = [gate.admit("Bearer ka"), gate.admit("Bearer ka")]
    with pytest.raises(AdmissionError) as err:
        gate.admit("Bearer ka")
    assert err.value.status_code == 429 and err.value.reason == "tenant_request_rate"
    assert err.value.headers["Retry-After"] == "1"
    gate.admit("Bearer kb").finish(200, "stop")  # another tenant is not limited by a's bucket
    clock.t = 0.5
    tickets.append(gate.admit("Bearer ka"))
    for t in tickets:
        t.finish(200, "stop", 10, 0, 5)
    store.flush()
    records = store.records()
    # Every authenticated request has its record, the refused one included.
    assert [r.status for r in records].count(429) == 1 and len(records) == 5
    assert {r.tenant for r in records} == {"a", "b"}


def test_token_rate_debt_refuses_until_paid_back_and_refunds_unused(tmp_path):
    clock = Clock()
    gate = IngressGate(_directory(tmp_path, "tokens_per_second = 100\ntoken_burst = 100"), clock=clock)
    t = gate.admit("Bearer ka")
    t.charge_tokens(300)  # stage 2: prompt + max_tokens, more than the burst: allowed, into debt
    with pytest.raises(AdmissionError) as err:
        gate.admit("Bearer ka")
    assert err.value.reason == "tenant_token_rate" and err.value.headers["Retry-After"] == "2"
    t.finish(200, "stop", prompt_tokens=50, completion_tokens=50)  # 200 unused tokens come back
    gate.admit("Bearer ka").finish(200, "stop")


def test_global_cap_draining_and_body_size(tmp_path, store):
    clock = Clock()
    gate = IngressGate(_directory(tmp_path), max_queued=2, max_body_bytes=1000, usage=store, clock=clock)
    for _ in range(4):  # a history: a request finishes every 2 s
        gate.admit("Bearer ka").finish(200, "stop")
        clock.t += 2.0
    a, b = gate.admit("Bearer ka"), gate.admit("Bearer kb")
    with pytest.raises(AdmissionError) as err:
        gate.admit("Bearer ka")
    assert err.value.reason == "queue_full" and err.value.status_code == 429
    assert err.value.headers["Retry-After"] == "2"  # one place, at the 0.5/s the requests finish at
    a.finish(200, "stop")
    with pytest.raises(AdmissionError) as err:
        gate.admit("Bearer ka", content_length=5000)
    assert err.value.status_code == 413
    c = gate.admit("Bearer ka")
    with pytest.raises(AdmissionError):
        gate.check_body_size(c, 1001)
    assert c.finished
    gate.start_draining()
    with pytest.raises(AdmissionError) as err:
        gate.admit("Bearer ka")
    assert err.value.status_code == 503
    assert not gate.wait_idle(0.05)
    b.finish(200, "length")
    assert gate.wait_idle(1.0) and gate.in_flight == 0


def test_finish_races_record_once(tmp_path, store):
    gate = IngressGate(_directory(tmp_path), usage=store)
    tickets = [gate.admit("Bearer ka") for _ in range(200)]
    for i, t in enumerate(tickets):
        t.request_id = f"r{i}"
    wins = []
    barrier = threading.Barrier(4)

    def racer(reason: str) -> None:  # finish, cancel, timeout and disconnect all at once
        barrier.wait()
        wins.extend(t.finish(200, reason) for t in tickets)

    threads = [threading.Thread(target=racer, args=(r,)) for r in ("stop", "abort", "timeout", "error")]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    store.flush()
    assert sum(wins) == 200 and store.count() == 200 and store.duplicates == 0
    assert gate.in_flight == 0 and gate.tenant_in_flight("a") == 0
