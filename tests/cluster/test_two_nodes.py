"""Two Ray nodes on one machine: Linux network namespaces joined by a veth pair (198.18.0.0/15),
a Ray head in one and a Ray node in the other, ``baton serve`` with the prefill worker pinned to
node A and the decode worker to node B, KV over gloo across the veth. The proof that Baton runs
across nodes: nothing in it may lean on loopback or on sharing memory."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TAG = f"bt{os.getpid() % 100000}"  # names and addresses of this run only
NS_A, NS_B = f"{TAG}a", f"{TAG}b"
OCTET = os.getpid() % 200 + 20
ADDR_A, ADDR_B = f"198.18.{OCTET}.1", f"198.18.{OCTET}.2"
RAY_PORT, HTTP_PORT = 6390, 8123
KV_TIMEOUT_S = 3.0  # the drill keeps the link down for less than Ray's own node health check
NUM_BLOCKS = 64


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _in(ns: str, *cmd: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True, **kwargs)


def _ray_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    # Multi-node needs this on: Ray refuses to join nodes when it reads 0.
    env.update(RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT))
    return env


def _kill_namespace(ns: str) -> None:
    """Every process in ``ns`` (Ray daemons, workers, the server): never ``ray stop``, which
    would take this machine's other Ray instances with it."""
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _ip("netns", "pids", ns, check=False).stdout.strip():
        time.sleep(0.1)


def _teardown(temp_dir: str) -> None:
    for ns in (NS_A, NS_B):
        _kill_namespace(ns)
        _ip("netns", "del", ns, check=False)
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def two_nodes():
    """(namespace A, namespace B) with a Ray head in A and a Ray node in B; removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    probe = _ip("netns", "add", NS_A, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {probe.stderr.strip()}")
    temp_dir = tempfile.mkdtemp(prefix=f"{TAG}-")
    try:
        _ip("netns", "add", NS_B)
        _ip("link", "add", f"{TAG}va", "type", "veth", "peer", "name", f"{TAG}vb")
        _ip("link", "set", f"{TAG}va", "netns", NS_A)
        _ip("link", "set", f"{TAG}vb", "netns", NS_B)
        for ns, dev, addr in ((NS_A, f"{TAG}va", ADDR_A), (NS_B, f"{TAG}vb", ADDR_B)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")
        ray = str(BIN / "ray")
        common = ["--num-cpus", "1", "--disable-usage-stats", "--object-store-memory", str(128 << 20)]
        head = _in(NS_A, ray, "start", "--head", "--node-ip-address", ADDR_A, "--port", str(RAY_PORT),
                   "--resources", '{"node_a": 1}', "--temp-dir", temp_dir, "--include-dashboard", "false",
                   *common, env=_ray_env(), timeout=120)
        assert head.returncode == 0, head.stdout + head.stderr
        node = _in(NS_B, ray, "start", "--address", f"{ADDR_A}:{RAY_PORT}", "--node-ip-address", ADDR_B,
                   "--resources", '{"node_b": 1}', *common, env=_ray_env(), timeout=120)
        assert node.returncode == 0, node.stdout + node.stderr
        yield temp_dir
    finally:
        _teardown(temp_dir)
    assert NS_A not in _ip("netns", "list").stdout and NS_B not in _ip("netns", "list").stdout


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


def _request(path: str, body: dict | None = None, timeout: float = 60) -> dict:
    done = _in(NS_A, sys.executable, "-c", _CLIENT, f"http://{ADDR_A}:{HTTP_PORT}{path}",
               json.dumps(body) if body is not None else "", str(timeout), timeout=timeout + 30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _metric(text: str, name: str, role: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and f'role="{role}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} for {role} in the metrics")


def test_prefill_on_node_a_decode_on_node_b_over_gloo(two_nodes, tiny_model_dir, tmp_path):
    from workers import LLM, SamplingParams

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

        [server]
        host = "{ADDR_A}"
        port = {HTTP_PORT}
        model_name = "tiny"

        [ray]
        address = "{ADDR_A}:{RAY_PORT}"
    """))
    server = subprocess.Popen(["ip", "netns", "exec", NS_A, str(BIN / "baton"), "serve", "--config", str(config)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_ray_env())
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(ln.startswith("ready in") for ln in lines):
            line = server.stdout.readline()
            if not line and server.poll() is not None:
                break
            lines.append(line)
        assert any(f"http://{ADDR_A}:{HTTP_PORT}/v1" in ln for ln in lines), "".join(lines)

        llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS)
        prompt = "Hello world! How are you today?"
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        want = llm.generate([prompt], params)[0].outputs[0].text
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        answer = _request("/v1/completions", body)
        assert answer["status"] == 200, answer
        assert json.loads(answer["body"])["choices"][0]["text"] == want  # as on one node

        # both roles count the KV that crossed the veth (metrics lag a stats interval)
        deadline = time.monotonic() + 15
        while True:
            metrics = _request("/metrics")["body"]
            sent = _metric(metrics, "baton:kv_transfer_bytes_total", "prefill")
            if sent > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert sent > 0 and _metric(metrics, "baton:kv_transfer_bytes_total", "decode") == sent

        # The link goes down: a request whose KV must cross it ends as an error within the KV
        # timeout (not a hang); back up, the pair group is rebuilt and nothing leaked.
        _ip("-n", NS_A, "link", "set", f"{TAG}va", "down")
        try:
            failed = _request("/v1/completions", {**body, "prompt": "Paris is the capital of"}, timeout=30)
        finally:
            _ip("-n", NS_A, "link", "set", f"{TAG}va", "up")
        assert failed["seconds"] < KV_TIMEOUT_S + 10, failed
        choice = json.loads(failed["body"])["choices"][0]
        assert choice["finish_reason"] == "abort" and "did not answer" in choice["stop_reason"], failed
        again = _request("/v1/completions", body)
        assert again["status"] == 200 and json.loads(again["body"])["choices"][0]["text"] == want, again
        deadline = time.monotonic() + 20
        while True:
            metrics = _request("/metrics")["body"]
            usage = [_metric(metrics, "baton:kv_cache_usage_perc", role) for role in ("prefill", "decode")]
            if usage == [0.0, 0.0] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert usage == [0.0, 0.0], metrics
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    assert server.returncode == 0, "".join(lines) + (server.stdout.read() or "")
