"""What a turn at shared cores costs: step time of two workers alternating through a core-share
board vs one worker alone, at several libgomp spin counts, and with the default spin plus the
team ended at each handoff (``300000+release``: what sharing workers do where libgomp can).

Each worker is a process with a 2-thread OpenMP team on a 2-core board whose "step" is a
decode-like burst of small parallel regions (``--regions`` bf16 linears of SmolLM2-135M's MLP
shape, 32 rows). Alone, a step runs uncontended. Alternating, each step starts the moment the
other worker's step ends (its bell rings), while that worker's team may still spin for
``GOMP_SPINCOUNT`` iterations on a core the new step needs, unless it ends its team when it
hands over (``kernels.openmp.release_team``). Rounds interleave the variants.

    .venv/bin/python benchmarks/core_share_handoff.py --rounds 3 --out benchmarks/results/core_share_handoff.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: see tests/conftest.py


def _worker(board: str, slot: int, steps: int, regions: int, release: bool) -> None:
    """One worker: warm up, then ``steps`` turns at the board; prints its median step in ms."""
    import torch
    from baton_serve.kernels import openmp
    from baton_serve.workers.actor.core_share import CoreShare

    torch.set_num_threads(2)
    seat = CoreShare(board, slot, cores=2, threads=2, release_team=openmp.release_team if release else None)
    x = torch.randn(32, 576, dtype=torch.bfloat16)
    w = torch.randn(1536, 576, dtype=torch.bfloat16)
    for _ in range(regions):
        torch.nn.functional.linear(x, w)
    times = []
    for _ in range(steps):
        seat.before_step()
        started = time.perf_counter()
        for _ in range(regions):
            torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - started)
        seat.after_step()
    seat.close()
    print(json.dumps({"slot": slot, "median_step_ms": statistics.median(times[5:]) * 1000}))


def run_variant(workers: int, variant: str, steps: int, regions: int) -> float:
    """Median step time (ms, mean over the workers) of ``workers`` processes sharing 2 cores.
    ``variant``: a GOMP_SPINCOUNT, with ``+release`` to end the team at each handoff."""
    from baton_serve.workers.actor.core_share import create_board, remove_board

    spincount, _, release = variant.partition("+")
    board = create_board(workers)
    env = {**os.environ, "GOMP_SPINCOUNT": spincount, "OMP_NUM_THREADS": "2"}
    env.pop("OMP_WAIT_POLICY", None)
    try:
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(board), str(slot), str(steps),
                                   str(regions), str(int(bool(release)))], env=env, stdout=subprocess.PIPE, text=True)
                 for slot in range(workers)]
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        remove_board(board)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a worker failed: {outs}")
    return statistics.mean(json.loads(o.strip().splitlines()[-1])["median_step_ms"] for o in outs)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1")
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    from baton_serve.cluster.launcher import SHARE_SPINCOUNT

    ap.add_argument("--spin-counts", nargs="+", default=["300000", "100000", SHARE_SPINCOUNT, "300000+release"],
                    help="GOMP_SPINCOUNT values (300000: libgomp's default; SHARE_SPINCOUNT: what sharing "
                         "workers get where libgomp cannot end a team); +release: end the team at handoffs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60, help="steps per worker (the first 5 not timed)")
    ap.add_argument("--regions", type=int, default=200, help="parallel regions per step")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    rows: dict[str, dict[str, list[float]]] = {s: {"alone": [], "alternating": []} for s in args.spin_counts}
    for r in range(args.rounds):
        for spin in args.spin_counts:
            for name, workers in (("alone", 1), ("alternating", 2)):
                ms = run_variant(workers, spin, args.steps, args.regions)
                rows[spin][name].append(ms)
                print(f"round {r + 1}: GOMP_SPINCOUNT={spin} {name}: {ms:.2f} ms/step", flush=True)
    summary = {}
    for spin, v in rows.items():
        ratios = [b / a for a, b in zip(v["alone"], v["alternating"])]
        summary[spin] = {"alone_ms": statistics.median(v["alone"]),
                         "alternating_ms": statistics.median(v["alternating"]),
                         "alternating_over_alone": statistics.median(ratios), "rounds": v}
        print(f"GOMP_SPINCOUNT={spin}: alone {summary[spin]['alone_ms']:.2f} ms, alternating "
              f"{summary[spin]['alternating_ms']:.2f} ms, ratio {summary[spin]['alternating_over_alone']:.3f} "
              f"(per round {', '.join(f'{x:.3f}' for x in ratios)})")
    if args.out:
        args.out.write_text(json.dumps({
            "date": date.today().isoformat(), "machine": f"{platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} CPUs", "command": " ".join(["python", *sys.argv]),
            "steps": args.steps, "regions": args.regions, "results": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
