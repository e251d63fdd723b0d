"""Graceful drain of `baton serve` on SIGTERM: 503 at once, open streams finish or end with abort
inside the drain timeout, every usage record on disk, exit code 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
from baton_serve.cluster.usage.sqlite_store import SQLiteUsageStore

from tests.tiny_model import write_tiny_llama


def _stream(url: str, out: dict, ready: threading.Event, lock: threading.Lock, started: list) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a long story"}],
            "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
    finish, rid, done = None, None, False
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                chunk = json.loads(line[6:])
                rid = chunk["id"]
                with lock:
                    if rid not in started:
                        started.append(rid)
                        if len(started) == 8:
                            ready.set()
                if chunk["choices"] and chunk["choices"][0].get("finish_reason"):
                    finish = chunk["choices"][0]["finish_reason"]
            time.sleep(0.001)  # a slowish reader
    out[rid] = (finish, done, time.monotonic())


def test_sigterm_drains_open_streams_and_exits_zero(tmp_path):
    # long enough that no CPU finishes 8 x 4000 tokens inside the 1.5 s drain
    model_dir = write_tiny_llama(tmp_path / "model", max_positions=8192)
    port = 19000 + os.getpid() % 1000
    usage = tmp_path / "usage.sqlite3"
    config = tmp_path / "drain.toml"
    config.write_text(f"""
[engine]
model = "{model_dir}"
dtype = "float32"
max_num_seqs = 8
[pools]
colocated = 1
[server]
port = {port}
model_name = "tiny"
drain_timeout_s = 1.5
[usage]
path = "{usage}"
""")
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    proc = subprocess.Popen([sys.executable, "-m", "baton_serve.cluster.cli", "serve", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith("ready in") or (not line and proc.poll() is not None):
                break
        assert httpx.get(f"{url}/ready", timeout=10).status_code == 200
        results: dict = {}
        ready, lock, started = threading.Event(), threading.Lock(), []
        threads = [threading.Thread(target=_stream, args=(url, results, ready, lock, started)) for _ in range(8)]
        for t in threads:
            t.start()
        assert ready.wait(60), "the 8 streams did not start"
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        probes: list[tuple[float, int | None]] = []
        while proc.poll() is None and time.monotonic() < signalled + 60:
            try:
                probes.append((time.monotonic(), httpx.get(f"{url}/ready", timeout=2).status_code))
                fresh = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=5)
                if probes[-1][1] == 503:
                    assert fresh.status_code == 503 and fresh.json()["error"]["code"] == "draining"
            except httpx.HTTPError:
                probes.append((time.monotonic(), None))  # the listener has closed: the front is gone
            time.sleep(0.02)
        for t in threads:
            t.join(60)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = proc.stdout.read()
    assert proc.returncode == 0, output
    codes = [c for _, c in probes]
    first_503 = codes.index(503)
    assert all(c == 200 for c in codes[:first_503]) and all(c in (503, None) for c in codes[first_503:])
    assert probes[first_503][0] - signalled < 1.0  # /ready says so at once, not after the drain
    assert len(results) == 8
    for rid, (finish, done, ended) in results.items():
        assert done and finish in ("length", "abort"), (rid, finish)
        assert ended - signalled < 1.5 + 10  # inside the drain timeout, plus the time to flush the stream
    assert any(finish == "abort" for finish, _, _ in results.values())  # 4000 tokens outlive a 1.5 s drain
    store = SQLiteUsageStore(usage)
    try:
        recorded = {r.request_id: r for r in store.records()}
    finally:
        store.close()
    assert set(results) <= set(recorded)
    assert {recorded[rid].finish_reason for rid in results} == {f for f, _, _ in results.values()}
