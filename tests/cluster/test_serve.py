"""The product path: Ray pools + the OpenAI HTTP front, through the official SDK and `baton serve`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from baton_serve.cluster.config import ClusterConfig
from baton_serve.cluster.serve import Deployment

from tests.cluster.conftest import serving

ROOT = Path(__file__).resolve().parents[2]


def _config(model_dir, **pools) -> ClusterConfig:
    return ClusterConfig.model_validate({
        "engine": {"model": str(model_dir), "dtype": "float32", "block_size": 8, "num_kv_blocks": 64},
        "pools": pools, "server": {"model_name": "tiny"},
    })


@pytest.fixture(scope="module")
def servers(ray_session, tiny_model_dir):
    from baton_serve.router.server import ServerThread

    deployments = {}
    threads = {}
    for name, pools in (("disagg", {"prefill": 1, "decode": 1}), ("colocated", {"colocated": 1})):
        dep = Deployment(_config(tiny_model_dir, **pools)).start()
        deployments[name] = dep
        threads[name] = ServerThread(dep.app).start()
    yield threads
    for name in threads:
        threads[name].stop()
        deployments[name].stop()


def _chat(url: str, **kw):
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello there"}],
                                          **kw)


def test_streaming_chat_is_identical_disaggregated_and_colocated(servers):
    texts = {}
    for name, server in servers.items():
        chunks = list(_chat(server.url, stream=True, temperature=0, max_tokens=12,
                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        texts[name] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["length"]
        assert chunks[-1].usage.completion_tokens == 12
        whole = _chat(server.url, temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
        assert whole.choices[0].message.content == texts[name]
    assert texts["disagg"] == texts["colocated"]


def test_constrained_chat_is_identical_disaggregated_and_colocated(servers):
    """The grammar's state crosses the prefill -> decode hop: over HTTP, both layouts write the
    same schema-valid JSON, streamed and whole."""
    import json

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": schema, "strict": True}}
    texts = {}
    for name, server in servers.items():
        chunks = list(_chat(server.url, stream=True, temperature=0, max_tokens=60, response_format=fmt))
        texts[name] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        whole = _chat(server.url, temperature=0, max_tokens=60, response_format=fmt)
        assert whole.choices[0].message.content == texts[name]
    assert texts["disagg"] == texts["colocated"]
    value = json.loads(texts["disagg"])
    assert set(value) == {"city", "days"} and 1 <= value["days"] <= 9


def test_metrics_and_health(servers):
    url = servers["disagg"].url
    _chat(url, temperature=0, max_tokens=4)
    assert httpx.get(f"{url}/health").status_code == 200
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/ready").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    body = httpx.get(f"{url}/metrics").text
    for name in ("baton:time_to_first_token_seconds_count", "baton:inter_token_latency_seconds_bucket",
                 "baton:e2e_request_latency_seconds_count", "baton:num_requests_running",
                 "baton:kv_cache_usage_perc", "baton:prefix_cache_queries_total",
                 "baton:kv_transfer_bytes_total"):
        assert name in body, name
    ttft = [line for line in body.splitlines() if line.startswith("baton:time_to_first_token_seconds_count")]
    assert float(ttft[0].split()[-1]) >= 1

    def computed(role: str, kind: str) -> float:
        lines = [ln for ln in httpx.get(f"{url}/metrics").text.splitlines()
                 if ln.startswith("baton:tokens_computed_total{") and f'role="{role}"' in ln
                 and f'kind="{kind}"' in ln]
        return sum(float(ln.split()[-1]) for ln in lines)

    # Worker counters arrive with the periodic stats poll: the prompt ran on the prefill worker,
    # the later tokens on the decode worker, and both spent time in steps.
    deadline = time.monotonic() + 10
    while (computed("prefill", "prefill") == 0 or computed("decode", "decode") == 0) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert computed("prefill", "prefill") > 0 and computed("decode", "decode") > 0

    def local_prefills() -> float:  # conditional disaggregation: short prompts prefilled on the decode side
        return sum(float(ln.split()[-1]) for ln in httpx.get(f"{url}/metrics").text.splitlines()
                   if ln.startswith("baton:router_decisions_total{") and 'reason="local_prefill"' in ln)

    # The decode worker computes prompt tokens exactly when the router sent it a prompt to prefill
    # (the earlier tests' requests on this deployment included).
    deadline = time.monotonic() + 10
    while (computed("decode", "prefill") > 0) != (local_prefills() > 0) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (computed("decode", "prefill") > 0) == (local_prefills() > 0)
    assert "baton:engine_busy_seconds_total" in httpx.get(f"{url}/metrics").text


def test_bad_request_is_a_400_and_leaks_nothing(servers):
    from openai import BadRequestError

    url = servers["disagg"].url
    with pytest.raises(BadRequestError):
        _chat(url, temperature=-1)
    with pytest.raises(BadRequestError):
        _chat(url, max_tokens=100_000)


def test_baton_serve_command_starts_and_stops_cleanly(tiny_model_dir, tmp_path):
    port = 18000 + os.getpid() % 1000
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton_serve.cluster.cli", "serve", "--model", str(tiny_model_dir), "--dtype", "float32",
         "--port", str(port), "--prefill", "1", "--decode", "1", "--served-model-name", "tiny"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    with serving(proc) as lines:
        assert any(f"http://127.0.0.1:{port}/v1" in line for line in lines), "".join(lines)
        for _ in range(100):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        reply = _chat(f"http://127.0.0.1:{port}", temperature=0, max_tokens=5)
        assert reply.choices[0].finish_reason in ("length", "stop")


def test_two_front_actors_share_one_port(ray_session, tiny_model_dir):
    """HTTP fronts are Ray actors; two of them bind one port and both serve the same pools."""
    from concurrent.futures import ThreadPoolExecutor

    from baton_serve.cluster.http_actor import start_fronts, stop_fronts
    from baton_serve.cluster.launcher import Cluster
    from baton_serve.router.server import bind_socket

    probe = bind_socket("127.0.0.1", 0)
    port = probe.getsockname()[1]
    probe.close()
    cluster = Cluster(_config(tiny_model_dir, prefill=1, decode=1))
    cluster.start()
    fronts = []
    try:
        fronts = start_fronts(cluster, 2, "127.0.0.1", port, "tiny", 64)
        urls = set(ray_session.get([f.url.remote() for f in fronts]))
        assert urls == {f"http://127.0.0.1:{port}"}
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda _: _chat(f"http://127.0.0.1:{port}", temperature=0, max_tokens=6,
                                                    extra_body={"ignore_eos": True}), range(8)))
        assert len({r.choices[0].message.content for r in replies}) == 1
        assert all(r.usage.completion_tokens == 6 for r in replies)
        # one scrape target: whichever front a scrape lands on, it counts every front's requests
        # (the fronts' own shares differ: the kernel spread the connections over them)
        shares = ray_session.get([f.metrics_text.remote() for f in fronts])
        assert sum(_successes(text) for text in shares) == 8
        for _ in range(6):
            scrape = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
            assert scrape.status_code == 200 and _successes(scrape.content) == 8
            assert "baton:metrics_peer_scrape_failures_total 0.0" in scrape.text
        # every metric a panel of the Grafana dashboard queries is in the live scrape
        from prometheus_client.parser import text_string_to_metric_families

        sys.path.append(str(ROOT / "deploy"))
        import grafana_dashboard

        live = {f.name for f in text_string_to_metric_families(scrape.text)}
        queried = set().union(*(grafana_dashboard.metric_names(expr) for _, _, _, targets in grafana_dashboard.PANELS
                                for _, expr in targets))
        assert queried and queried <= live, queried - live
    finally:
        stop_fronts(fronts)
        cluster.stop()


def _successes(exposition: bytes) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(exposition.decode()) for s in f.samples
               if s.name == "baton:request_success_total")
