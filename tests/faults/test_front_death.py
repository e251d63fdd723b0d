"""An HTTP front dies with streams open: the other front on the port keeps serving, the workers
abort the dead front's requests (its output socket closed) and hold nothing for it afterwards."""

from __future__ import annotations

import json
import threading
import time

import httpx
from baton_serve.cluster.config import ClusterConfig

from tests.faults.scenario import NUM_BLOCKS, alive_idle, free_port


def test_killed_front_other_front_keeps_serving(ray_session, tiny_model_dir, tmp_path):
    import ray
    from baton_serve.cluster.http_actor import start_fronts, stop_fronts
    from baton_serve.cluster.launcher import Cluster

    config = ClusterConfig.model_validate({
        "engine": {"model": str(tiny_model_dir), "dtype": "float32", "block_size": 8, "num_kv_blocks": NUM_BLOCKS,
                   "threads_per_worker": 1},
        "pools": {"colocated": 1}, "server": {"model_name": "tiny"},
        "usage": {"path": str(tmp_path / "usage.sqlite3")}})
    port = free_port()
    cluster = Cluster(config)
    cluster.start()
    fronts = []
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    try:
        fronts = start_fronts(cluster, 2, "127.0.0.1", port, "tiny", 64)
        ends: list[str] = []
        started = threading.Semaphore(0)

        def stream() -> None:
            try:
                with httpx.Client(timeout=60) as client, client.stream("POST", url, json=body) as r:
                    first = True
                    for line in r.iter_lines():
                        if first and line.startswith("data: "):
                            first = False
                            started.release()
                        if line == "data: [DONE]":
                            ends.append("done")
                            return
                ends.append("closed")
            except httpx.HTTPError:
                ends.append("cut")  # the front it was on died

        # Until each front holds at least one stream (the kernel picks a front per connection).
        threads = []
        for _ in range(16):
            t = threading.Thread(target=stream)
            t.start()
            threads.append(t)
            started.acquire(timeout=30)
            stats = ray.get([f.stats.remote() for f in fronts])
            if all(s["arrivals"]["anonymous"] > 0 for s in stats):
                break
        assert all(s["arrivals"]["anonymous"] > 0 for s in stats), stats
        ray.kill(fronts[0])
        for t in threads:
            t.join(90)
        assert "cut" in ends and "done" in ends, ends  # the survivor's streams finished
        short = {**body, "max_tokens": 8, "stream": False}
        for _ in range(8):  # fresh connections: every one lands on the live front
            with httpx.Client(timeout=60) as fresh:
                r = fresh.post(url, json=short)
            assert r.status_code == 200 and json.loads(r.text)["usage"]["completion_tokens"] == 8
        deadline = time.monotonic() + 15
        while len(ray.get(cluster.workers[0].handle.stats.remote())["output_fronts"]) != 1:
            assert time.monotonic() < deadline  # the worker let go of the dead front's stream
            time.sleep(0.2)
        alive_idle(cluster, set())
    finally:
        stop_fronts(fronts[1:])
        cluster.stop()
