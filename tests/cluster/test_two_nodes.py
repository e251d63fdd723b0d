"""Two Ray nodes on one machine: Linux network namespaces joined by a veth pair (198.18.0.0/15),
a Ray head in one and a Ray node in the other, ``baton serve`` with the prefill worker pinned to
node A and the decode worker to node B, KV over gloo across the veth. The proof that Baton runs
across nodes: nothing in it may lean on loopback or on sharing memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

from benchmarks.two_nodes import BIN, TwoNodes, Unavailable
from tests.cluster.conftest import serving

KV_TIMEOUT_S = 3.0  # the drill keeps the link down for less than Ray's own node health check
NUM_BLOCKS = 64
HTTP_PORT = 8123


@pytest.fixture(scope="module")
def lab():
    """Two Ray nodes in network namespaces (benchmarks.two_nodes), removed afterwards."""
    nodes = TwoNodes()
    try:
        nodes.start()
    except Unavailable as exc:
        pytest.skip(str(exc))
    try:
        yield nodes
    finally:
        nodes.stop()
    assert nodes.gone()


# A client run inside namespace A (this process cannot reach it): one request, its JSON answer.
_CLIENT = textwrap.dedent("""
    import json, sys, time, urllib.request, urllib.error
    url, body, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
    started = time.monotonic()
    req = urllib.request.Request(url, data=body.encode() if body else None,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    print(json.dumps({"status": status, "body": text, "seconds": time.monotonic() - started}))
""")


def _request(lab: TwoNodes, path: str, body: dict | None = None, timeout: float = 60) -> dict:
    done = lab.run_in(lab.ns_a, sys.executable, "-c", _CLIENT, f"http://{lab.addr_a}:{HTTP_PORT}{path}",
                      json.dumps(body) if body is not None else "", str(timeout), timeout=timeout + 30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _metrics_once(lab: TwoNodes, done, timeout_s: float) -> str:
    """The front's /metrics text once ``done(text)`` holds, or the last read at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = _request(lab, "/metrics")["body"]
        if done(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


def _metric(text: str, name: str, role: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and f'role="{role}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} for {role} in the metrics")


def test_prefill_on_node_a_decode_on_node_b_over_gloo(lab, tiny_model_dir, tmp_path):
    from baton_serve.workers import LLM, SamplingParams

    config = tmp_path / "two-nodes.toml"
    config.write_text(textwrap.dedent(f"""
        [engine]
        model = "{tiny_model_dir}"
        dtype = "float32"
        block_size = 8
        num_kv_blocks = {NUM_BLOCKS}
        threads_per_worker = 1

        [pools]
        prefill = 1
        decode = 1
        prefill_resources = {{ node_a = 0.01 }}
        decode_resources = {{ node_b = 0.01 }}

        [kv_transfer]
        transport = "auto"
        timeout_s = {KV_TIMEOUT_S}

        [router]
        conditional_disaggregation = false  # every request's KV crosses the link

        [recovery]
        max_migrations = 0  # the drill below: one failed transfer ends the request, no retry

        [server]
        host = "{lab.addr_a}"
        port = {HTTP_PORT}
        model_name = "tiny"

        [ray]
        address = "{lab.ray_address}"
    """))
    server = lab.popen_in(lab.ns_a, str(BIN / "baton"), "serve", "--config", str(config),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    with serving(server) as lines:
        assert any(f"http://{lab.addr_a}:{HTTP_PORT}/v1" in ln for ln in lines), "".join(lines)

        llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS)
        prompt = "Hello world! How are you today?"
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        want = llm.generate([prompt], params)[0].outputs[0].text
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        answer = _request(lab, "/v1/completions", body)
        assert answer["status"] == 200, answer
        assert json.loads(answer["body"])["choices"][0]["text"] == want  # as on one node

        # both roles count the KV that crossed the veth (metrics lag a stats interval)
        metrics = _metrics_once(lab, lambda m: _metric(m, "baton:kv_transfer_bytes_total", "prefill") > 0, 15)
        sent = _metric(metrics, "baton:kv_transfer_bytes_total", "prefill")
        assert sent > 0 and _metric(metrics, "baton:kv_transfer_bytes_total", "decode") == sent

        # The link goes down: a request whose KV must cross it ends as an error (503, migration
        # off) within the KV timeout, not a hang; back up, the pair group is rebuilt and nothing leaked.
        lab.link(up=False)
        try:
            failed = _request(lab, "/v1/completions", {**body, "prompt": "Paris is the capital of"}, timeout=30)
        finally:
            lab.link(up=True)
        assert failed["seconds"] < KV_TIMEOUT_S + 10, failed
        assert failed["status"] == 503, failed  # WorkerLostError: no migration was allowed
        assert "did not answer" in json.loads(failed["body"])["error"]["message"], failed
        again = _request(lab, "/v1/completions", body)
        assert again["status"] == 200 and json.loads(again["body"])["choices"][0]["text"] == want, again

        def usage(m: str) -> list[float]:
            return [_metric(m, "baton:kv_cache_usage_perc", role) for role in ("prefill", "decode")]

        metrics = _metrics_once(lab, lambda m: usage(m) == [0.0, 0.0], 20)
        assert usage(metrics) == [0.0, 0.0], metrics
