"""Admission's costs and its fairness, measured (issue 17).

1. **Ingress gate under a flood of rejections**: a front whose only tenant is far over its request
   rate, driven at ``--reject-rate`` requests/s over HTTP (keep-alive connections) for
   ``--reject-seconds``; reported: the server process's CPU time per rejected request (from
   /proc, so the client's own work does not count), the rate achieved, rejection latency. Plus
   the gate alone in process (``IngressGate.admit`` refusing), in microseconds.
2. **Stage 2 on TTFT at low load**: one deployment of the default model; requests one at a time,
   alternating between the front with its KV admission and the same front without it
   (``PoolClient.admission = None``), TTFT measured at the client. Plus ``KVAdmission.reserve`` +
   ``release`` alone.
3. **A flood from one tenant**: tenants A and B, each allowed ``--tenant-rate`` requests/s; B sends
   at its rate (Poisson) alone, then while A sends at its rate, then while A sends at 10x its rate.
   Reported: B's TTFT p50/p99 in each phase, the ratios to B alone (target: p99 within 1.5x) and to
   B beside A at its rate (what the flood's excess costs B), A's 429s and admitted count.
4. **Tenant isolation in time**: B's TTFT on a prompt A has just cached against a fresh one of the
   same length (equal: A's blocks are in A's namespace), and A's own hit, for scale.

    .venv/bin/python benchmarks/admission.py --out benchmarks/results/admission.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: see tests/conftest.py

from benchmarks.machine import cpu_name, pct  # noqa: E402

FLOOD_KEY, A_KEY, B_KEY, WARM_KEY = "sk-flood", "sk-tenant-a", "sk-tenant-b", "sk-warm-up"


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


# ---------------------------------------------------------------------------- 1. the gate
def serve_gate(port: int, tenants: str) -> None:
    """The server side of part 1 (run in its own process): the OpenAI app with a gate in front."""
    from baton_serve.cluster.admission.gate import IngressGate
    from baton_serve.cluster.admission.tenants import TenantDirectory
    from baton_serve.router.api import build_app
    from baton_serve.router.gateway import Gateway
    from baton_serve.router.server import run_server
    from baton_serve.workers.engine.async_engine import AsyncEngine
    from baton_serve.workers.engine.config import EngineConfig
    from baton_serve.workers.llm import build_engine

    engine, tokenizer, _ = build_engine(EngineConfig(dtype="float32", num_kv_blocks=64))
    client = AsyncEngine(engine)
    gate = IngressGate(TenantDirectory.from_file(tenants), max_queued=4096)
    app = build_app(client, tokenizer, "default", engine.max_model_len, gateway=Gateway(gate))
    run_server(app, port=port, log_level="error")


def gate_micro(n: int = 200_000) -> dict[str, float]:
    from baton_serve.cluster.admission.gate import AdmissionError, IngressGate
    from baton_serve.cluster.admission.tenants import Tenant, TenantDirectory, hash_key

    d = TenantDirectory({"flood": Tenant("flood", requests_per_second=0.001, request_burst=1)})
    d._by_digest[hash_key(FLOOD_KEY)] = "flood"
    gate = IngressGate(d)
    gate.admit(f"Bearer {FLOOD_KEY}")  # the one request the burst allows
    header = f"Bearer {FLOOD_KEY}"
    start = time.process_time()
    for _ in range(n):
        try:
            gate.admit(header)
        except AdmissionError:
            pass
    per = (time.process_time() - start) / n
    return {"admit_refused_us": per * 1e6, "calls": n}


async def _flood_http(url: str, rate: float, seconds: float, connections: int) -> dict[str, Any]:
    """Paced POSTs over ``connections`` keep-alive sockets (a lean HTTP/1.1 client: httpx would
    spend more CPU than the server it measures, on the same two cores)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    body = json.dumps({"model": "default", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 1}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + FLOOD_KEY.encode()
               + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
               + b"\r\n\r\n" + body)
    codes: dict[int, int] = {}
    latencies: list[float] = []
    total = int(rate * seconds)
    next_i = 0
    start = time.perf_counter()

    async def connection() -> None:
        nonlocal next_i
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            while next_i < total:
                i, next_i = next_i, next_i + 1
                delay = start + i / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                t0 = time.perf_counter()
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                await reader.readexactly(length)
                latencies.append(time.perf_counter() - t0)
                code = int(head[9:12])
                codes[code] = codes.get(code, 0) + 1
        finally:
            writer.close()

    await asyncio.gather(*(connection() for _ in range(connections)))
    elapsed = time.perf_counter() - start
    return {"codes": codes, "elapsed_s": elapsed, "sent": total, "achieved_rps": total / elapsed,
            "latency_p50_ms": pct(latencies, 50) * 1e3, "latency_p99_ms": pct(latencies, 99) * 1e3}


def part_gate(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from baton_serve.cluster.admission.tenants import hash_key
    from baton_serve.router.server import bind_socket

    tenants = workdir / "flood_tenants.toml"
    tenants.write_text(f'[tenants.flood]\napi_keys = ["{hash_key(FLOOD_KEY)}"]\nrequests_per_second = 0.001\n'
                       "request_burst = 1\n")
    probe = bind_socket()
    port = probe.getsockname()[1]
    probe.close()
    server = subprocess.Popen([sys.executable, __file__, "--serve-gate", str(port), "--tenants", str(tenants)],
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        asyncio.run(_flood_http(url, 500, 1.0, args.connections))  # warm-up: connections, code paths
        cpu0 = _proc_cpu_s(server.pid)
        time.sleep(args.reject_seconds)
        idle = _proc_cpu_s(server.pid) - cpu0  # what the server spends with nothing to do
        cpu0 = _proc_cpu_s(server.pid)
        result = asyncio.run(_flood_http(url, args.reject_rate, args.reject_seconds, args.connections))
        cpu = _proc_cpu_s(server.pid) - cpu0
        result["server_idle_cpu_s"] = idle
    finally:
        server.terminate()
        server.wait(30)
    rejected = result["codes"].get(429, 0)
    result["server_cpu_s"] = cpu
    result["server_cpu_per_rejected_us"] = cpu / max(rejected, 1) * 1e6
    result["in_process"] = gate_micro()
    return result


# ---------------------------------------------------------------------------- 2. stage 2 on TTFT
async def _ttft(client: Any, url: str, headers: dict[str, str], prompt: str, max_tokens: int = 1) -> float:
    body = {"model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {await r.aread()!r}")
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter() - t0
    return first if first is not None else time.perf_counter() - t0


def _deployment(workdir: Path, tenants: Path | None, model: str | None) -> Any:
    from baton_serve.cluster.config import ClusterConfig
    from baton_serve.cluster.serve import Deployment

    server: dict[str, Any] = {"model_name": "default"}
    if tenants is not None:
        server["tenants"] = str(tenants)
    config = ClusterConfig.model_validate({
        "engine": {"model": model, "dtype": "float32"}, "pools": {"colocated": 1}, "server": server,
        "usage": {"path": str(workdir / "usage.sqlite3")}})
    return Deployment(config).start()


def part_stage2(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import httpx
    from baton_serve.router.server import ServerThread

    dep = _deployment(workdir, None, args.model)
    server = ServerThread(dep.app).start()
    kv = dep.pool.admission
    on, off = [], []
    prompt = args.stage2_prompt or "Summarise the plot of a novel about a lighthouse keeper in two sentences. " * 2

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            for _ in range(3):
                await _ttft(client, server.url, {}, prompt)
            for i in range(args.stage2_rounds):
                # ABBA order, so a drift of the machine's speed during the run cancels out
                for with_admission in ((True, False) if i % 2 == 0 else (False, True)):
                    dep.pool.admission = kv if with_admission else None
                    (on if with_admission else off).append(await _ttft(client, server.url, {}, prompt))
        dep.pool.admission = kv

    try:
        asyncio.run(run())
    finally:
        server.stop()
        dep.stop()
    diffs = [a - b for a, b in zip(on, off)]
    return {"rounds": args.stage2_rounds, "prompt": prompt,
            "paired_difference_stderr_ms": statistics.stdev(diffs) / len(diffs) ** 0.5 * 1e3,
            "ttft_with_ms": {"p50": pct(on, 50) * 1e3, "p90": pct(on, 90) * 1e3},
            "ttft_without_ms": {"p50": pct(off, 50) * 1e3, "p90": pct(off, 90) * 1e3},
            "overhead_p50_ms": (statistics.median(on) - statistics.median(off)) * 1e3,
            "paired_difference_median_ms": statistics.median(a - b for a, b in zip(on, off)) * 1e3,
            "paired_difference_mean_ms": statistics.fmean(a - b for a, b in zip(on, off)) * 1e3,
            "paired_difference_stdev_ms": statistics.stdev(a - b for a, b in zip(on, off)) * 1e3,
            "reserve_release_us": _stage2_micro()}


def _stage2_micro(n: int = 20_000) -> float:
    from baton_serve.cluster.admission.kv import KVAdmission, KVDemand
    from baton_serve.cluster.admission.tenants import Tenant

    kv = KVAdmission({f"w{i}": 4096 for i in range(4)}, block_size=16)
    tenant = Tenant("t")
    allowed = ["w0", "w1", "w2", "w3"]

    async def run() -> float:
        start = time.perf_counter()
        for i in range(n):
            await kv.reserve(KVDemand(f"r{i}", tenant, 512, 128, 1, 0), lambda: allowed, lambda: "w1")
            kv.release(f"r{i}")
        return (time.perf_counter() - start) / n * 1e6

    return asyncio.run(run())


# ---------------------------------------------------------------------------- 3. the flood
async def _raw_post(port: int, request: bytes) -> int:
    """Send a prepared request on a fresh connection; the status code, once the body is read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        status = int((await reader.readline())[9:12])
        while await reader.read(1 << 16):
            pass
        return status
    finally:
        writer.close()
def part_flood(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import httpx
    from baton_serve.cluster.admission.tenants import hash_key

    rate = args.tenant_rate
    burst = rate * 5  # Poisson arrivals at the rate clump: a tenant keeping to its rate is not refused
    tenants = workdir / "flood_ab.toml"
    tenants.write_text(
        f'[tenants.a]\napi_keys = ["{hash_key(A_KEY)}"]\nrequests_per_second = {rate}\nrequest_burst = {burst}\n'
        f'[tenants.b]\napi_keys = ["{hash_key(B_KEY)}"]\nrequests_per_second = {rate}\nrequest_burst = {burst}\n'
        f'[tenants.warm]\napi_keys = ["{hash_key(WARM_KEY)}"]\n')
    # The front in its own process (an HTTPFront actor, as baton serve runs it): in this process,
    # the load generator's own work would hold the GIL the front needs.
    from baton_serve.cluster.config import ClusterConfig
    from baton_serve.cluster.http_actor import start_fronts, stop_fronts
    from baton_serve.cluster.launcher import Cluster
    from baton_serve.router.server import bind_socket

    config = ClusterConfig.model_validate({
        "engine": {"model": args.model, "dtype": "float32"}, "pools": {"colocated": 1},
        "server": {"model_name": "default", "tenants": str(tenants)},
        "usage": {"path": str(workdir / "usage.sqlite3")}})
    cluster = Cluster(config)
    cluster.start()
    probe = bind_socket()
    port = probe.getsockname()[1]
    probe.close()
    fronts = start_fronts(cluster, 1, "127.0.0.1", port, "default", config.server.max_queued_requests)
    server = argparse.Namespace(url=f"http://127.0.0.1:{port}")
    prompt = "Write one sentence about the sea and one about the mountains. " * 2
    a_body = json.dumps({"model": "default", "messages": [{"role": "user", "content": prompt}],
                         "max_tokens": args.flood_output_tokens, "temperature": 0, "ignore_eos": True}).encode()
    a_request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer "
                 + A_KEY.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(a_body)).encode() + b"\r\n\r\n" + a_body)
    rng = random.Random(1)

    async def tenant_load(client: Any, key: str, rps: float, seconds: float, ttfts: list[float],
                          codes: dict[int, int]) -> None:
        async def one() -> None:
            if key == A_KEY:  # counted, not timed: a lean client, so its CPU does not slow the server
                code = await _raw_post(port, a_request)
                codes[code] = codes.get(code, 0) + 1
                if code == 200:
                    ttfts.append(0.0)
                return
            try:
                ttfts.append(await _ttft(client, server.url, {"Authorization": f"Bearer {key}"}, prompt,
                                         args.flood_output_tokens))
                codes[200] = codes.get(200, 0) + 1
            except RuntimeError as exc:
                code = int(str(exc).split(":", 1)[0])
                codes[code] = codes.get(code, 0) + 1

        tasks, t, end = [], 0.0, seconds
        start = time.perf_counter()
        while True:
            t += rng.expovariate(rps)
            if t > end:
                break
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)

    async def run() -> dict[str, Any]:
        limits = httpx.Limits(max_connections=256)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            for _ in range(3):
                await _ttft(client, server.url, {"Authorization": f"Bearer {WARM_KEY}"}, prompt)
            alone: list[float] = []
            codes_alone: dict[int, int] = {}
            await tenant_load(client, B_KEY, rate, args.flood_seconds, alone, codes_alone)
            await asyncio.sleep(5)  # A's bucket is full again; nothing left running
            # A at exactly its rate: the load its legitimate share adds, to tell it from the flood's
            b1, a1 = [], []
            codes_b1: dict[int, int] = {}
            codes_a1: dict[int, int] = {}
            await asyncio.gather(tenant_load(client, B_KEY, rate, args.flood_seconds, b1, codes_b1),
                                 tenant_load(client, A_KEY, rate, args.flood_seconds, a1, codes_a1))
            await asyncio.sleep(5)
            b, a = [], []
            codes_b: dict[int, int] = {}
            codes_a: dict[int, int] = {}
            await asyncio.gather(tenant_load(client, B_KEY, rate, args.flood_seconds, b, codes_b),
                                 tenant_load(client, A_KEY, rate * 10, args.flood_seconds, a, codes_a))
        return {"b_alone": {"codes": codes_alone, "ttft_p50_ms": pct(alone, 50) * 1e3,
                            "ttft_p99_ms": pct(alone, 99) * 1e3, "n": len(alone)},
                "b_with_a_at_its_rate": {"codes": codes_b1, "ttft_p50_ms": pct(b1, 50) * 1e3,
                                         "ttft_p99_ms": pct(b1, 99) * 1e3, "n": len(b1),
                                         "a_codes": codes_a1},
                "b_under_flood": {"codes": codes_b, "ttft_p50_ms": pct(b, 50) * 1e3,
                                  "ttft_p99_ms": pct(b, 99) * 1e3, "n": len(b)},
                "a_flood": {"codes": codes_a, "admitted": len(a)},
                "b_p99_ratio": pct(b, 99) / pct(alone, 99),
                "b_p99_ratio_flood_vs_a_at_its_rate": pct(b, 99) / pct(b1, 99)}

    try:
        result = asyncio.run(run())
    finally:
        stop_fronts(fronts)
        cluster.stop()
    result.update({"tenant_rate_rps": rate, "tenant_burst": burst, "seconds": args.flood_seconds, "output_tokens": args.flood_output_tokens})
    return result


# ---------------------------------------------------------------------------- 4. isolation
def part_isolation(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Does another tenant's cache show in a tenant's TTFT? B sends the long prompt A has just run
    (cached in A's namespace only) and, alternately, a fresh prompt of the same length; A re-sends
    its own cached prompt, to show what a hit is worth."""
    import httpx
    from baton_serve.cluster.admission.tenants import hash_key
    from baton_serve.router.server import ServerThread

    tenants = workdir / "isolation.toml"
    tenants.write_text(f'[tenants.a]\napi_keys = ["{hash_key(A_KEY)}"]\n[tenants.b]\napi_keys = ["{hash_key(B_KEY)}"]\n')
    dep = _deployment(workdir, tenants, args.model)
    server = ServerThread(dep.app).start()
    a, b = {"Authorization": f"Bearer {A_KEY}"}, {"Authorization": f"Bearer {B_KEY}"}
    rng = random.Random(3)
    words = "river stone lantern orchard copper meadow harbour signal velvet ember".split()
    seen_by_b, fresh_for_b, hit_for_a = [], [], []

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            for i in range(args.isolation_rounds):
                text = " ".join(rng.choice(words) for _ in range(300))  # ~300 tokens, new each round
                other = " ".join(rng.choice(words) for _ in range(300))
                await _ttft(client, server.url, a, text)  # now cached for A
                hit_for_a.append(await _ttft(client, server.url, a, text))
                order = [(text, seen_by_b), (other, fresh_for_b)]
                for prompt, sink in (order if i % 2 == 0 else order[::-1]):
                    sink.append(await _ttft(client, server.url, b, prompt))

    try:
        asyncio.run(run())
    finally:
        server.stop()
        dep.stop()
    ms = lambda xs: {"p50": pct(xs, 50) * 1e3, "p90": pct(xs, 90) * 1e3}  # noqa: E731
    return {"rounds": args.isolation_rounds, "b_on_a_cached_prompt_ms": ms(seen_by_b),
            "b_on_fresh_prompt_ms": ms(fresh_for_b), "a_on_its_cached_prompt_ms": ms(hit_for_a),
            "b_cached_over_fresh_p50": statistics.median(seen_by_b) / statistics.median(fresh_for_b)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve-gate", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tenants", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--parts", default="gate,stage2,flood,isolation")
    parser.add_argument("--isolation-rounds", type=int, default=20)
    parser.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    parser.add_argument("--reject-rate", type=float, default=2000.0)
    parser.add_argument("--reject-seconds", type=float, default=5.0)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--stage2-rounds", type=int, default=60)
    parser.add_argument("--stage2-prompt", default=None,
                        help="the prompt of stage 2's TTFT pairs (a short one makes TTFT, and so its noise, small)")
    parser.add_argument("--tenant-rate", type=float, default=2.0)
    parser.add_argument("--flood-seconds", type=float, default=20.0)
    parser.add_argument("--flood-output-tokens", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.serve_gate is not None:
        serve_gate(args.serve_gate, args.tenants)
        return 0
    import tempfile

    results: dict[str, Any] = {"date": date.today().isoformat(), "cpu": cpu_name(), "cores": os.cpu_count(),
                               "command": " ".join([Path(sys.executable).name, *sys.argv])}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        runners = {"gate": part_gate, "stage2": part_stage2, "flood": part_flood, "isolation": part_isolation}
        for part in args.parts.split(","):
            results[part] = runners[part](args, workdir)
            print(json.dumps(results[part], indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
