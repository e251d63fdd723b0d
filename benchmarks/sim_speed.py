"""How fast ``baton plan sim`` runs: wall time of one simulated layout as requests and workers
grow, and the sweep the issue sets as the bar (20 layouts x 10,000 requests on 64 workers, every
layout's workers on hardware of their own, ``--jobs`` processes).

Every request runs through the real scheduler, block manager, router and admission, so the cost
grows with engine steps (decode tokens over batch size) and routing decisions, not with the
simulated time. The workload is ``baton bench``'s random one; the rate scales with the workers
(``--rate-per-worker``) so each cluster size runs at a similar load.

    .venv/bin/python benchmarks/sim_speed.py --profile benchmarks/results/profile_zen4_bf16.json \
        --out benchmarks/results/sim_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: see tests/conftest.py


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _bench(n: int, rate: float, input_len: int, output_len: int, seed: int):
    from baton_serve.cluster.bench.runner import BenchConfig
    from baton_serve.cluster.bench.workload import LengthDist, WorkloadConfig

    wl = WorkloadConfig("random", input_len=LengthDist(input_len, range_ratio=0.5),
                        output_len=LengthDist(output_len, range_ratio=0.5))
    return BenchConfig(workload=wl, num_prompts=n, request_rate=rate, seed=seed, disable_tqdm=True, num_warmups=0)


def _layout(workers: int, colocated: bool):
    from baton_serve.cluster.bench.plan import Layout

    return Layout(colocated=workers) if colocated else Layout(prefill=workers // 2, decode=workers - workers // 2)


def growth(args, profile, hardware) -> list[dict]:
    """One layout per (requests, workers): its wall time, events and engine steps."""
    from baton_serve.cluster.config import load_config
    from baton_serve.cluster.sim.run import simulate

    rows = []
    for workers in _ints(args.workers):
        for n in _ints(args.requests):
            for colocated in (False, True):
                layout = _layout(workers, colocated)
                cfg = load_config(None).with_overrides(**{"pools.prefill": layout.prefill, "pools.decode": layout.decode,
                                                          "pools.colocated": layout.colocated})
                bench = _bench(n, args.rate_per_worker * workers, args.input_len, args.output_len, args.seed)
                res = simulate(cfg, layout, bench, profile, hardware, seed=args.seed)
                steps = sum(w["steps"] for w in res.workers.values())
                row = {"layout": layout.name, "workers": workers, "requests": n, "wall_s": round(res.wall_s, 3),
                       "events": res.events, "engine_steps": steps, "completed": res.summary["completed"],
                       "simulated_s": round(res.summary["duration"], 1),
                       "us_per_step": round(1e6 * res.wall_s / max(steps, 1), 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def sweep(args, profile, hardware) -> dict:
    """``--layouts`` prefill:decode splits and colocated of ``--sweep-workers`` workers, ``--sweep-requests`` each."""
    from baton_serve.cluster.config import load_config
    from baton_serve.cluster.sim.plan import run_sim_plan, search_space

    w = args.sweep_workers
    ratios = [(p, w - p) for p in range(1, w)]
    step = max(1, len(ratios) // (args.layouts - 1))
    ratios = ratios[::step][: args.layouts - 1]
    cases = search_space([w], ratios, True, ["cost"], [load_config(None).engine.max_num_batched_tokens])
    bench = _bench(args.sweep_requests, args.rate_per_worker * w, args.input_len, args.output_len, args.seed)
    t = time.perf_counter()
    pr = run_sim_plan(load_config(None), cases, bench, profile, hardware, seed=args.seed, jobs=args.jobs,
                      progress=False)
    wall = time.perf_counter() - t
    out = {"layouts": len(cases), "workers": w, "requests": args.sweep_requests, "jobs": args.jobs, "wall_s": round(wall, 1),
           "per_layout_s": [round(s.get("wall_s", float("nan")), 2) for s in pr.sims],
           "failed_layouts": sum(not r.ok for r in pr.results), "best_layout": pr.best}
    print(json.dumps(out), flush=True)
    return out


def main() -> int:
    from baton_serve.cluster.sim.profile import LatencyProfile
    from baton_serve.cluster.sim.run import SimHardware

    from benchmarks.machine import cpu_name

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--requests", default="1000,3000,10000")
    ap.add_argument("--workers", default="8,16,64")
    ap.add_argument("--rate-per-worker", type=float, default=0.5, help="req/s per simulated worker")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--layouts", type=int, default=20)
    ap.add_argument("--sweep-workers", type=int, default=64)
    ap.add_argument("--sweep-requests", type=int, default=10000)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    profile = LatencyProfile.load(args.profile)
    hardware = SimHardware(shared_cores=0, threads=int(profile.machine.get("threads", 1)))
    result = {"benchmark": "sim_speed", "date": date.today().isoformat(), "cpu": cpu_name(),
              "cores": os.cpu_count(), "python": platform.python_version(), "profile": args.profile,
              "command": " ".join(["python", *sys.argv]),
              "workload": {"kind": "random", "input_len": args.input_len, "output_len": args.output_len,
                           "range_ratio": 0.5, "rate_per_worker": args.rate_per_worker},
              "growth": growth(args, profile, hardware)}
    if not args.skip_sweep:
        result["sweep"] = sweep(args, profile, hardware)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
