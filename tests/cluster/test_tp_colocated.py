"""A colocated pool of tensor_parallel_size = 2 replicas over HTTP: the same greedy text as a tp = 1
deployment, one placement group per replica that a restart reuses and stop removes, and the
start-time refusals (a size the model cannot split into, a group the cluster cannot place)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
from baton_serve.cluster import launcher
from baton_serve.cluster.config import ClusterConfig, ConfigError
from baton_serve.cluster.launcher import Cluster
from baton_serve.cluster.placement_groups import PlacementError
from baton_serve.cluster.serve import Deployment


def _config(model_dir, colocated: dict, pools: dict | None = None, **sections: dict) -> ClusterConfig:
    return ClusterConfig.model_validate({
        "engine": {"model": str(model_dir), "dtype": "float32", "block_size": 8, "num_kv_blocks": 64,
                   "threads_per_worker": 1},
        "pools": {"colocated": colocated, **(pools or {})}, "server": {"model_name": "tiny"}, **sections})


def _groups(ray, state: str) -> list[dict]:
    return [g for g in ray.util.placement_group_table().values() if g["state"] == state]


@pytest.fixture(scope="module")
def servers(ray_session, tiny_model_dir):
    from baton_serve.router.server import ServerThread

    deployments, threads = {}, {}
    try:
        for tp in (1, 2):
            dep = Deployment(_config(tiny_model_dir, {"replicas": 1, "tensor_parallel_size": tp},
                                     recovery={"restart_backoff_s": 0.1})).start()
            deployments[tp] = dep
            threads[tp] = ServerThread(dep.app).start()
        yield deployments, {tp: t.url for tp, t in threads.items()}
    finally:
        for tp in threads:
            threads[tp].stop()
        for dep in deployments.values():
            dep.stop()
    assert not _groups(ray_session, "CREATED")  # stop removed the replica's group


def _chat(url: str, stream: bool = False) -> tuple[str, int]:
    """Greedy text and completion tokens of one chat request."""
    import json

    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        return reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"]
    body["stream_options"] = {"include_usage": True}
    text, tokens = "", 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    return text, tokens


def test_a_tp2_replica_answers_as_a_tp1_worker_does(servers, ray_session):
    deployments, urls = servers
    one, two = _chat(urls[1]), _chat(urls[2])
    assert two == one and one[1] == 12
    assert _chat(urls[2], stream=True) == one
    rows = deployments[2].pool.status()["workers"]
    assert [(r["worker_id"], r["tensor_parallel_size"]) for r in rows] == [("colocated-0", 2)]  # one row a replica
    assert deployments[1].pool.status()["workers"][0]["tensor_parallel_size"] == 1
    assert [g["bundles"] for g in _groups(ray_session, "CREATED")] == [{0: {"CPU": 1.0}, 1: {"CPU": 1.0}}]


def test_a_restarted_replica_comes_back_in_its_group(servers, ray_session):
    deployments, urls = servers
    before = _chat(urls[2])
    ray_session.kill(deployments[2].cluster.workers[0].handle, no_restart=True)
    deadline = time.monotonic() + 30
    row = {}
    while time.monotonic() < deadline:
        row = deployments[2].pool.status()["workers"][0]
        if row["alive"] and row["restarts"] == 1:
            break
        time.sleep(0.2)
    assert row["alive"] and row["restarts"] == 1 and row["tensor_parallel_size"] == 2
    assert _chat(urls[2]) == before
    assert len(_groups(ray_session, "CREATED")) == 1  # the same group: no second one was made


def test_a_group_the_cluster_cannot_place_fails_start_naming_the_field(ray_session, tiny_model_dir):
    # 4 ranks of 1 CPU each on a 2-CPU Ray: the tiny model splits into 4, the cluster does not fit it
    cluster = Cluster(_config(tiny_model_dir, {"tensor_parallel_size": 4}, {"placement_timeout_s": 0.5}))
    with pytest.raises(PlacementError, match=r"pools\.colocated\.tensor_parallel_size = 4: a replica needs a "
                       r"placement group of 4 bundles \(CPU 1 each, STRICT_PACK\).*the cluster has CPU 2"):
        cluster.start()
    assert cluster.workers == [] and not _groups(ray_session, "PENDING")


def test_a_size_the_model_cannot_split_into_fails_before_ray_starts(tiny_model_dir, monkeypatch):
    def no_ray(*_: object) -> bool:
        raise AssertionError("Ray was started")

    monkeypatch.setattr(launcher, "init_ray", no_ray)
    with pytest.raises(ConfigError, match=r"pools\.colocated\.tensor_parallel_size = 3 .*sizes that work: 1, 2, 4"):
        Cluster(_config(tiny_model_dir, {"tensor_parallel_size": 3})).start()


def test_baton_serve_refuses_a_bad_size_in_one_line_without_starting_ray(tiny_model_dir):
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    proc = subprocess.run([sys.executable, "-m", "baton_serve.cluster.cli", "serve", "--model", str(tiny_model_dir),
                           "--colocated", "1", "--colocated-tp", "3"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "baton: error: pools.colocated.tensor_parallel_size = 3 does not fit" in proc.stderr
    assert "Ray instance" not in proc.stderr + proc.stdout
