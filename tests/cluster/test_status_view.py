"""``GET /status``, the workers summary in ``/ready`` and ``baton status`` against a real server."""

from __future__ import annotations

import httpx
import pytest
from baton_serve.cluster.cli import main
from baton_serve.cluster.status_view import fetch_status, format_status
from baton_serve.router.api import build_app
from baton_serve.router.server import ServerThread
from baton_serve.workers.engine.async_engine import AsyncEngine
from baton_serve.workers.engine.config import EngineConfig
from baton_serve.workers.llm import build_engine

ADMIN = "sk-admin"


def _worker(wid: str, role: str, **kw) -> dict:
    row = {"worker_id": wid, "role": role, "alive": True, "incarnation": 0, "restarts": 0, "restarting": False,
           "quarantined": False, "num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
    row.update(kw)
    return row


class _View:
    """A deployment's status that the test changes between calls, as a front's pool would."""

    def __init__(self) -> None:
        self.workers = [_worker("prefill-0", "prefill"), _worker("decode-0", "decode", num_running=3,
                                                                  kv_cache_usage=0.25)]

    def ready(self) -> bool:
        roles = {w["role"] for w in self.workers if w["alive"]}
        return {"prefill", "decode"} <= roles

    def status(self) -> dict:
        return {"ready": self.ready(), "front_id": "front-test", "workers": [dict(w) for w in self.workers],
                "migrations_total": 2, "open_streams": 1, "controller": {"view_age_s": 0.4}}


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    engine, tokenizer, _ = build_engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", block_size=8,
                                                     num_kv_blocks=16))
    client = AsyncEngine(engine)
    view = _View()
    app = build_app(client, tokenizer, "tiny", engine.max_model_len, ready=view.ready, status=view.status,
                    admin=lambda header: header == f"Bearer {ADMIN}")
    server = ServerThread(app).start()
    try:
        yield server.url, view
    finally:
        server.stop()
        client.shutdown()


def test_status_needs_an_admin_key_and_reports_every_worker(served):
    url, view = served
    denied = httpx.get(url + "/status", timeout=5)
    assert denied.status_code == 401 and denied.json()["error"]["message"]
    with pytest.raises(RuntimeError, match="401"):
        fetch_status(url)
    status = fetch_status(url, ADMIN)
    assert [w["worker_id"] for w in status["workers"]] == ["prefill-0", "decode-0"]
    assert status["workers"][1]["num_running"] == 3 and status["migrations_total"] == 2


def test_ready_carries_restarts_and_quarantine(served):
    url, view = served
    view.workers[0].update(restarts=2, incarnation=2)
    body = httpx.get(url + "/ready", timeout=5).json()
    assert body == {"status": "ready", "workers": {"alive": 2, "total": 2, "restarts": 2, "quarantined": []}}
    view.workers[0].update(alive=False, quarantined=True, restarts=6)
    try:
        resp = httpx.get(url + "/ready", timeout=5)
        assert resp.status_code == 503 and "1 of 2 workers alive" in resp.json()["error"]["message"]
    finally:
        view.workers[0].update(alive=True, quarantined=False, restarts=0, incarnation=0)


def test_baton_status_prints_the_table_and_exits_nonzero_when_not_ready(served, capsys):
    url, view = served
    assert main(["status", "--url", url, "--api-key", ADMIN]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["worker", "role", "tp", "state", "incarnation", "restarts", "running", "waiting", "kv",
                             "used"]
    assert out[2].split() == ["decode-0", "decode", "1", "alive", "0", "0", "3", "0", "25%"]
    assert out[-1].startswith("front-test: ready, 1 open streams, 2 migrations")
    view.workers[1].update(alive=False, restarting=True, restarts=1)
    try:
        assert main(["status", "--url", url, "--api-key", ADMIN]) == 1
        assert capsys.readouterr().out.splitlines()[2].split()[:6] == ["decode-0", "decode", "1", "restarting", "0", "1"]
    finally:
        view.workers[1].update(alive=True, restarting=False, restarts=0)
    assert main(["status", "--url", url]) == 2  # no key: one clear line on stderr
    assert "401" in capsys.readouterr().err


def test_format_states():
    rows = [_worker("a", "colocated", quarantined=True, alive=False), _worker("b", "colocated", alive=False)]
    text = format_status({"ready": False, "front_id": "f", "workers": rows, "migrations_total": 0,
                          "open_streams": 0, "controller": None})
    assert "quarantined" in text.splitlines()[1] and text.splitlines()[2].split()[3] == "dead"
    assert text.splitlines()[-1] == "f: NOT READY, 0 open streams, 0 migrations, no controller"


def test_a_draining_worker_and_the_controllers_flips_are_shown():
    rows = [_worker("prefill-1", "prefill"), _worker("decode-0", "decode")]
    rows[0].update(draining=True, to_role="decode")
    flips = [{"worker_id": "decode-1", "from_role": "decode", "to_role": "prefill", "drained_s": 2.5},
             {"worker_id": "prefill-2", "from_role": "prefill", "to_role": "decode", "given_up": "died"}]
    text = format_status({"ready": True, "front_id": "f", "workers": rows, "migrations_total": 0,
                          "open_streams": 3, "controller": {"view_age_s": 0.4, "flips": flips, "rebalance": {
                              "enabled": True, "dry_run": True,
                              "last": {"reason": "within_band", "pressures": {"prefill": 0.5, "decode": 0.25}}}}})
    lines = text.splitlines()
    assert "draining -> decode" in lines[1] and lines[2].split()[3] == "alive"
    assert lines[-3] == "rebalancer (dry run): last decision within_band, pressure prefill 0.50, decode 0.25"
    assert lines[-2:] == ["flip: decode-1 decode -> prefill, drained in 2.5 s",
                          "flip: prefill-2 prefill -> decode, given up (died)"]
