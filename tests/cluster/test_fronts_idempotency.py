"""Two HTTP fronts on one port: a retry with the same Idempotency-Key on either front is one run."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
from baton_serve.cluster.config import ClusterConfig
from baton_serve.cluster.usage.sqlite_store import SQLiteUsageStore


def test_retries_landing_on_either_front_share_one_generation(ray_session, tiny_model_dir, tmp_path):
    from baton_serve.cluster.http_actor import start_fronts, stop_fronts
    from baton_serve.cluster.launcher import Cluster
    from baton_serve.router.server import bind_socket

    usage = tmp_path / "usage.sqlite3"
    config = ClusterConfig.model_validate({
        "engine": {"model": str(tiny_model_dir), "dtype": "float32", "block_size": 8, "num_kv_blocks": 64},
        "pools": {"colocated": 1}, "server": {"model_name": "tiny"}, "usage": {"path": str(usage)}})
    probe = bind_socket("127.0.0.1", 0)
    port = probe.getsockname()[1]
    probe.close()
    cluster = Cluster(config)
    cluster.start()
    fronts = []
    try:
        fronts = start_fronts(cluster, 2, "127.0.0.1", port, "tiny", 64)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 40,
                "temperature": 0, "ignore_eos": True}

        def post(key: str, stream: bool = False) -> httpx.Response:
            with httpx.Client(timeout=60) as client:  # a connection of its own: the kernel picks a front
                return client.post(url, json={**body, "stream": stream}, headers={"Idempotency-Key": key})

        with ThreadPoolExecutor(12) as pool:
            replies = list(pool.map(lambda _: post("k-whole"), range(12)))
            streams = list(pool.map(lambda _: post("k-stream", stream=True), range(12)))
        assert {r.status_code for r in replies + streams} == {200}
        assert len({r.text for r in replies}) == 1 and replies[0].json()["usage"]["completion_tokens"] == 40
        events = [[ln for ln in r.text.splitlines() if ln.startswith("data: ")] for r in streams]
        assert all(e == events[0] for e in events) and events[0][-1] == "data: [DONE]"
        text = "".join(json.loads(e[6:])["choices"][0]["delta"].get("content") or ""
                       for e in events[0][:-1] if json.loads(e[6:])["choices"])
        assert text == replies[0].json()["choices"][0]["message"]["content"]  # greedy: the same tokens

        # The kernel's choice of front is a hash: retry on fresh connections until both took some.
        sent = {"k-whole": 12, "k-stream": 12}
        for _ in range(64):
            stats = ray_session.get([f.stats.remote() for f in fronts])
            if all(s["arrivals"]["anonymous"] > 0 for s in stats):
                break
            extra = post("k-whole")
            sent["k-whole"] += 1
            assert extra.text == replies[0].text
        assert all(s["arrivals"]["anonymous"] > 0 for s in stats), stats  # both fronts took requests
        assert sum(s["arrivals"]["anonymous"] for s in stats) == sum(sent.values())
    finally:
        stop_fronts(fronts)
        cluster.stop()
    store = SQLiteUsageStore(usage)
    try:
        records = store.records()
    finally:
        store.close()
    for key in ("k-whole", "k-stream"):
        mine = [r for r in records if r.idempotency_key == key]
        generated = [r for r in mine if r.finish_reason != "replayed"]
        assert len(mine) == sent[key] and len(generated) == 1 and generated[0].completion_tokens == 40, key
