"""Over HTTP, a decode worker killed mid-stream: each SSE stream goes on where it stopped (its
text equals an undisturbed run's) and the usage store holds exactly one record per request,
counting every token once; ``/status`` shows the migrations."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
from baton_serve.cluster.config import ClusterConfig

from tests.faults.scenario import NUM_BLOCKS, alive_idle, free_port

MAX_TOKENS = 48
BODIES = [  # greedy, and seeded sampling that must draw the same numbers after the move
    {"prompt": "Hello world", "temperature": 0},
    {"prompt": "The sky is", "temperature": 0.9, "top_p": 0.9, "seed": 7},
    {"prompt": "One two three", "temperature": 0.7, "seed": 3, "frequency_penalty": 0.3},
]


def _sse(url: str, body: dict, got: dict, key: int, reached: threading.Semaphore, after: int) -> None:
    text, chunks, usage, told = [], 0, None, False
    try:
        with httpx.Client(timeout=120) as client, client.stream("POST", url, json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    got[key] = {"error": event["error"]}
                    return
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event["choices"]:
                    text.append(choice["text"])
                    chunks += 1
                got[key] = {"id": event["id"], "text": "".join(text), "usage": usage}
                if not told and chunks >= after:
                    told = True
                    reached.release()
    finally:
        if not told:
            reached.release()


def test_decode_killed_mid_sse_stream_usage_counted_once(ray_session, tiny_model_dir, tmp_path):
    import ray
    from baton_serve.cluster.http_actor import start_fronts, stop_fronts
    from baton_serve.cluster.launcher import Cluster
    from baton_serve.cluster.usage.sqlite_store import SQLiteUsageStore

    usage_path = tmp_path / "usage.sqlite3"
    config = ClusterConfig.model_validate({
        "engine": {"model": str(tiny_model_dir), "dtype": "float32", "block_size": 8, "num_kv_blocks": NUM_BLOCKS,
                   "threads_per_worker": 1},
        "pools": {"prefill": 1, "decode": 2}, "server": {"model_name": "tiny"}, "kv_transfer": {"timeout_s": 10},
        "usage": {"path": str(usage_path)}})
    port = free_port()
    cluster = Cluster(config)
    cluster.start()
    fronts = []
    base = f"http://127.0.0.1:{port}"
    common = {"model": "tiny", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    try:
        fronts = start_fronts(cluster, 1, "127.0.0.1", port, "tiny", 64)
        with httpx.Client(timeout=120) as client:  # the undisturbed run of every body
            want = [client.post(base + "/v1/completions", json={**common, **b}).json()["choices"][0]["text"]
                    for b in BODIES]
        got: dict[int, dict] = {}
        reached = threading.Semaphore(0)
        body = {**common, "stream": True, "stream_options": {"include_usage": True}}
        threads = [threading.Thread(target=_sse, args=(base + "/v1/completions", {**body, **b}, got, i, reached, 4))
                   for i, b in enumerate(BODIES)]
        for t in threads:
            t.start()
        for _ in threads:
            assert reached.acquire(timeout=60)
        running = {w.worker_id: ray.get(w.handle.stats.remote())["num_running"]
                   for w in cluster.workers if w.role == "decode"}
        victim = max(running, key=running.get)
        assert running[victim] > 0, running
        os.kill(next(w.info["pid"] for w in cluster.workers if w.worker_id == victim), signal.SIGKILL)
        for t in threads:
            t.join(120)
        assert [g.get("text") for _, g in sorted(got.items())] == want, got
        assert all(g["usage"]["completion_tokens"] == MAX_TOKENS for g in got.values())
        status = httpx.get(base + "/status", timeout=10).json()
        assert status["migrations_total"] >= running[victim] and status["ready"]
        ids = {g["id"] for g in got.values()}
    finally:
        stop_fronts(fronts)  # flushes the usage store
        try:
            alive_idle(cluster, {victim} if "victim" in locals() else set())
        finally:
            cluster.stop()
    store = SQLiteUsageStore(usage_path)
    try:
        records = store.records()
        assert store.duplicates == 0
    finally:
        store.close()
    streamed = [r for r in records if r.request_id in ids]
    assert sorted(r.request_id for r in streamed) == sorted(ids)  # one record each, no more
    assert all((r.completion_tokens, r.finish_reason, r.status) == (MAX_TOKENS, "length", 200) for r in streamed)
    assert len(records) == len(BODIES) * 2  # and the undisturbed run's, once each

