"""Tensor-parallel pools through the HTTP front: prefill tp=a -> decode tp=b (KV resharded rank to
rank) and colocated tp=2 give the greedy text of a tp=1 deployment, with chunked prefill and with
prefix hits on the decode side; every worker ends holding nothing."""

from __future__ import annotations

import httpx
import pytest
from baton_serve.cluster.config import ClusterConfig
from baton_serve.cluster.serve import Deployment

from tests.faults.scenario import alive_idle
from tests.tiny_model import write_tiny_llama

NUM_BLOCKS = 64
# a short prompt, one longer than the prefill pool's 16-token chunks, and the short one again
# (its full blocks are in the decode worker's prefix cache by then)
MESSAGES = ["Hello there", "Tell me about the history of the city of Paris, its river, bridges and people "
            "over the centuries, in detail", "Hello there"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """8 query / 2 KV heads: tp=2 splits the KV heads."""
    return write_tiny_llama(tmp_path_factory.mktemp("tp-http"), num_heads=8, num_kv_heads=2, seed=3)


def _config(model, pools) -> ClusterConfig:
    return ClusterConfig.model_validate({
        "engine": {"model": str(model), "dtype": "float32", "block_size": 8, "num_kv_blocks": NUM_BLOCKS,
                   "threads_per_worker": 1},
        "pools": pools, "server": {"model_name": "tiny"},
        # every prompt is prefilled by the prefill pool, however short
        "router": {"conditional_disaggregation": False},
    })


def _texts(model, pools) -> list[str]:
    from baton_serve.router.server import ServerThread

    dep = Deployment(_config(model, pools)).start()
    try:
        for w in dep.cluster.workers:  # each replica is one worker of its pool's size
            options = dep.config.pools.options_for(w.role)
            assert w.info["tensor_parallel_size"] == options.tensor_parallel_size
        with ServerThread(dep.app) as server:
            out = []
            for text in MESSAGES:
                r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
                    "model": "tiny", "messages": [{"role": "user", "content": text}], "temperature": 0,
                    "max_tokens": 16, "ignore_eos": True})
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 16
                out.append(body["choices"][0]["message"]["content"])
            status = httpx.get(f"{server.url}/v1/models", timeout=30)
            assert status.status_code == 200
        alive_idle(dep.cluster, set(), num_blocks=NUM_BLOCKS)
        return out
    finally:
        dep.stop()


@pytest.fixture(scope="module")
def want(tp_ray_session, model) -> list[str]:
    return _texts(model, {"colocated": 1})


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 1), (2, 2)])
def test_disaggregated_tp_layouts_give_the_text_of_tp1(tp_ray_session, model, want, prefill_tp, decode_tp):
    pools = {"prefill": {"replicas": 1, "tensor_parallel_size": prefill_tp, "max_num_batched_tokens": 16},
             "decode": {"replicas": 1, "tensor_parallel_size": decode_tp}}
    assert _texts(model, pools) == want


def test_colocated_tp2_gives_the_text_of_tp1(tp_ray_session, model, want):
    assert _texts(model, {"colocated": {"replicas": 1, "tensor_parallel_size": 2}}) == want
