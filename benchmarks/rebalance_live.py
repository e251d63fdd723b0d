"""The rebalancer live on this machine, beside its simulation: a load that shifts from long
prompts to long outputs and back (``benchmarks/rebalance_sim.py``'s phased trace, replayed by
``baton bench``) against a served 2P+2D with the rebalancer off, then on; with ``--profile``, the
same trace and layouts in ``baton plan sim`` (workers taking turns at this machine's cores).
Per window: SLO attainment; the flips made and when.

    .venv/bin/python benchmarks/rebalance_live.py --profile benchmarks/results/profile_zen4_bf16.json \\
        --out benchmarks/results/rebalance_live.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: see tests/conftest.py

from benchmarks.machine import cpu_name  # noqa: E402
from benchmarks.rebalance_sim import make_trace, parse_phases, per_window, write_outputs  # noqa: E402


def _rebalance(args: argparse.Namespace, on: bool) -> dict:
    return {"enabled": on, "interval_s": args.interval_s, "window_s": args.window_s, "cooldown_s": args.cooldown_s,
            "min_dwell_s": args.min_dwell_s, "min_requests": args.min_requests,
            "ttft_target_s": args.ttft_slo_s, "tpot_target_s": args.tpot_slo_s}


def run_live(args: argparse.Namespace, trace: Path, n: int, on: bool) -> dict:
    """Serve 2P+2D (or ``--workers``), replay the trace through HTTP, read the controller's flips."""
    import ray
    from baton_serve.cluster.bench.metrics import SLO
    from baton_serve.cluster.bench.runner import BenchConfig, run_async
    from baton_serve.cluster.bench.workload import WorkloadConfig
    from baton_serve.cluster.config import ClusterConfig
    from baton_serve.cluster.serve import Deployment
    from baton_serve.router.server import ServerThread

    w = args.workers
    config = ClusterConfig.model_validate({
        "engine": {"threads_per_worker": args.threads_per_worker, "max_num_batched_tokens": 1024},
        "pools": {"prefill": w // 2, "decode": w - w // 2}, "rebalance": _rebalance(args, on),
        "ray": {"num_cpus": os.cpu_count()}})
    dep = Deployment(config).start()
    server = ServerThread(dep.app).start()
    try:
        deadline = time.monotonic() + 120
        while not dep.pool.ready() and time.monotonic() < deadline:
            time.sleep(0.2)
        slo = SLO(ttft_ms=1e3 * args.ttft_slo_s, tpot_ms=1e3 * args.tpot_slo_s)
        cfg = BenchConfig(base_url=server.url, tokenizer_source=str(dep.cluster.model_path),
                          workload=WorkloadConfig("trace", trace_path=str(trace)), num_prompts=n,
                          request_rate=float("inf"), seed=args.seed, slo=slo, num_warmups=0, disable_tqdm=True,
                          request_timeout_s=120)
        t0 = time.time()
        res = asyncio.run(run_async(cfg))
        snap = ray.get(dep.cluster.controller.snapshot.remote())
        for f in snap["flips"]:  # seconds from the first request, as the simulation gives them
            f["done_s"] = round(f["at"] - t0, 1)
        s = res.summary
        return {"summary": {k: s.get(k) for k in ("completed", "failed", "slo_attainment", "request_goodput",
                                                   "p99_ttft_ms", "p99_tpot_ms")},
                "records": res.records, "flips": snap["flips"], "rebalance": snap["rebalance"]}
    finally:
        server.stop()
        dep.stop()


def run_sim(args: argparse.Namespace, trace: Path, n: int, on: bool) -> dict:
    from baton_serve.cluster.bench.metrics import SLO
    from baton_serve.cluster.bench.plan import Layout
    from baton_serve.cluster.bench.runner import BenchConfig
    from baton_serve.cluster.bench.workload import WorkloadConfig
    from baton_serve.cluster.config import load_config
    from baton_serve.cluster.sim.profile import LatencyProfile
    from baton_serve.cluster.sim.run import SimHardware, simulate

    w = args.workers
    layout = Layout(w // 2, w - w // 2)
    cfg = load_config(None).with_overrides(**{
        "pools.prefill": layout.prefill, "pools.decode": layout.decode, "engine.max_num_batched_tokens": 1024,
        **{f"rebalance.{k}": v for k, v in _rebalance(args, on).items()}})
    slo = SLO(ttft_ms=1e3 * args.ttft_slo_s, tpot_ms=1e3 * args.tpot_slo_s)
    bench = BenchConfig(workload=WorkloadConfig("trace", trace_path=str(trace)), num_prompts=n,
                        request_rate=float("inf"), seed=args.seed, slo=slo, num_warmups=0, disable_tqdm=True)
    profile = LatencyProfile.load(args.profile)
    res = simulate(cfg, layout, bench, profile, SimHardware(os.cpu_count() or 1, args.threads_per_worker),
                   seed=args.seed)
    s = res.summary
    return {"summary": {k: s.get(k) for k in ("completed", "failed", "slo_attainment", "request_goodput",
                                               "p99_ttft_ms", "p99_tpot_ms")},
            "records": res.records, "flips": res.rebalance["flips"] if res.rebalance else []}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=None, help="also simulate the runs on this profile")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--threads-per-worker", type=int, default=2)
    ap.add_argument("--shapes", default="1024:16,64:128,1024:16")
    ap.add_argument("--rates", default="0.5,1.5,0.5")
    ap.add_argument("--phase-s", type=float, default=90.0)
    ap.add_argument("--ttft-slo-s", type=float, default=3.0)
    ap.add_argument("--tpot-slo-s", type=float, default=0.15)
    ap.add_argument("--interval-s", type=float, default=5.0)
    ap.add_argument("--window-s", type=float, default=30.0)
    ap.add_argument("--cooldown-s", type=float, default=30.0)
    ap.add_argument("--min-dwell-s", type=float, default=60.0)
    ap.add_argument("--min-requests", type=int, default=10)
    ap.add_argument("--report-window-s", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from baton_serve.cluster.bench.metrics import SLO

    try:
        shapes, rates = parse_phases(args.shapes, args.rates)
    except ValueError as e:
        ap.error(str(e))
    trace = Path(tempfile.mkdtemp()) / "rebalance_live.jsonl"
    n = make_trace(trace, shapes, rates, args.phase_s, args.seed)
    slo = SLO(ttft_ms=1e3 * args.ttft_slo_s, tpot_ms=1e3 * args.tpot_slo_s)
    end_s = args.phase_s * len(shapes)
    runs = []
    for on in (False, True):
        for where in ("live", "sim") if args.profile else ("live",):
            out = run_live(args, trace, n, on) if where == "live" else run_sim(args, trace, n, on)
            row = {"run": f"{'rebalanced' if on else 'static'} {where}", **out["summary"],
                   "flips": [{k: f.get(k) for k in ("worker_id", "from_role", "to_role", "reason", "decided_s",
                                                    "done_s", "drained_s", "given_up")} for f in out["flips"]],
                   "windows": per_window(out["records"], slo, args.report_window_s, end_s)}
            if "rebalance" in out:
                row["rebalance_counts"] = out["rebalance"].get("counts")
            runs.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "windows"}), flush=True)
    result = {"benchmark": "rebalance_live", "date": date.today().isoformat(), "cpu": cpu_name(),
              "cores": os.cpu_count(), "command": "python benchmarks/rebalance_live.py " +
              " ".join(sys.argv[1:]), "phases": [{"prompt": p, "output": o, "rate": r, "seconds": args.phase_s}
                                                 for (p, o), r in zip(shapes, rates)],
              "slo": slo.as_dict(), "rebalance": _rebalance(args, True), "requests": n, "runs": runs}
    write_outputs(Path(args.out) if args.out else None, result, markdown(result, args.report_window_s))
    return 0


def markdown(result: dict, window_s: float) -> str:
    runs = result["runs"]
    lines = [f"## Rebalancer live on {result['cores']} cores: {result['requests']} requests, phases "
             + ", ".join(f"{p['prompt']}:{p['output']} at {p['rate']:g}/s" for p in result["phases"])
             + f", {result['phases'][0]['seconds']:g} s each", "", f"`{result['command']}`", "",
             "| run | SLO attainment | goodput req/s | p99 TTFT ms | p99 TPOT ms | failed | flips |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        flips = "; ".join(f"{f['worker_id']} -> {f['to_role']}"
                          + (" (given up)" if f.get("given_up") else f" at {f.get('done_s') or 0:.0f} s")
                          for f in r["flips"]) or "-"
        lines.append(f"| {r['run']} | {(r['slo_attainment'] or 0):.1%} | {(r['request_goodput'] or 0):.2f} | "
                     f"{(r['p99_ttft_ms'] or 0):.0f} | {(r['p99_tpot_ms'] or 0):.0f} | {r['failed']} | {flips} |")
    starts = [w["start_s"] for w in runs[0]["windows"]]
    lines += ["", f"SLO attainment per {window_s:g} s window (by arrival):", "",
              "| run | " + " | ".join(f"{s:g}" for s in starts) + " |", "|---|" + "---|" * len(starts)]
    for r in runs:
        lines.append(f"| {r['run']} | " + " | ".join("-" if w["attainment"] is None else f"{w['attainment']:.2f}"
                                                    for w in r["windows"]) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
