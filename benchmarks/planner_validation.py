"""The simulator against live runs: three workloads (prefill-heavy, decode-heavy, shared-prefix
with reuse) on the layouts this machine runs (1P+1D, 2 colocated, 1P+2D, 2P+1D, 3 colocated),
each measured with ``baton plan live`` and simulated with ``baton plan sim``'s ``--against`` on a
profile of this machine. Per cell: goodput per worker and p50/p99 TTFT/TPOT, measured, simulated
and the error; per workload: the best layout each way.

    .venv/bin/python benchmarks/planner_validation.py --profile benchmarks/results/profile_zen4_bf16.json \
        --out-dir benchmarks/results/planner_validation

``--skip-live`` re-simulates against the live results already in ``--out-dir``. With
``--calibrate-on WORKLOAD`` the profile's host cost (``baton plan sim --calibrate``) is fitted to
that workload's live runs and every workload is simulated a second time with it: the other two
workloads are out of sample.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: see tests/conftest.py

ROOT = Path(__file__).resolve().parent.parent
# name -> (baton bench workload options, SLOs): each loads two or three CPU workers past what some
# layouts serve within the SLO, so layouts differ
WORKLOADS = {
    "prefill_heavy": (["--random-input-len", "1024", "--random-output-len", "16", "--random-range-ratio", "0.25",
                       "--request-rate", "0.8"], ["ttft:3000", "tpot:150"]),
    "decode_heavy": (["--random-input-len", "64", "--random-output-len", "160", "--random-range-ratio", "0.25",
                      "--request-rate", "2"], ["ttft:2000", "tpot:100"]),
    "shared_prefix": (["--dataset-name", "shared-prefix", "--prefix-repetition-num-prefixes", "4",
                       "--prefix-repetition-prefix-len", "768", "--prefix-repetition-suffix-len", "64",
                       "--prefix-repetition-output-len", "32", "--warmup-prefixes", "--request-rate", "2"],
                      ["ttft:2000", "tpot:100"]),
}
RUNS = ((2, "1:1"), (3, "1:2,2:1"))  # with colocated each: the five layouts


def live(name: str, args, out_dir: Path) -> list[Path]:
    """``baton plan live`` for the workload's layouts; the result files."""
    opts, slo = WORKLOADS[name]
    paths = []
    for workers, ratios in RUNS:
        path = out_dir / f"live_{name}_{workers}w.json"
        paths.append(path)
        if args.skip_live:
            continue
        cmd = [str(ROOT / ".venv/bin/baton"), "plan", "live", "--workers", str(workers), "--ratios", ratios,
               "--num-prompts", str(args.num_prompts), "--seed", str(args.seed), *opts, "--goodput", *slo,
               "--result-dir", str(out_dir), "--result-file", path.name, "--no-plot", "--disable-tqdm"]
        print("+", " ".join(cmd), file=sys.stderr, flush=True)
        t = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=ROOT)
        print(f"  {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    return paths


def simulate(paths: list[Path], profile, hardware) -> list[dict]:
    from baton_serve.cluster.config import load_config
    from baton_serve.cluster.sim.against import compare, load_measured

    rows = []
    for path in paths:
        measured = load_measured(path)
        rows += compare(measured, load_config(None), profile, hardware, seed=measured[0].bench.seed)
    return rows


def markdown(result: dict, key: str = "workloads", title: str = "") -> str:
    from baton_serve.cluster.sim.against import METRICS, best_layouts

    head = "| workload | layout | " + " | ".join(f"{label} live / sim (error)" for _, label in METRICS) + " |"
    lines = [f"## Simulated vs measured{title}: {result['cpu']}, {result['model']}", "",
             f"- profile: `{result['profile']}`; simulated on {result['hardware']}", f"- `{result['command']}`", "",
             head, "|" + "---|" * (2 + len(METRICS))]
    summary = []
    for wl, rows in result[key].items():
        for r in rows:
            cells = []
            for key, _ in METRICS:
                c = r["metrics"][key]
                fmt = ".3f" if key == "goodput_per_worker" else ".0f"
                if c["live"] is None or c["sim"] is None:
                    cells.append("n/a")
                    continue
                err = "n/a" if c["error"] is None else f"{c['error']:+.0%}"
                cells.append(f"{format(c['live'], fmt)} / {format(c['sim'], fmt)} ({err})")
            lines.append(f"| {wl} | {r['layout']} | " + " | ".join(cells) + " |")
        best_live, best_sim = best_layouts(rows)
        errs = [abs(r["metrics"]["goodput_per_worker"]["error"]) for r in rows
                if r["metrics"]["goodput_per_worker"]["error"] is not None]
        summary.append(f"- {wl}: best layout measured **{best_live}**, simulated **{best_sim}** "
                       f"({'same' if best_live == best_sim else 'different'}); goodput/worker error max "
                       f"{max(errs):.0%}, cells within 10%: {sum(e <= 0.10 for e in errs)}/{len(errs)}")
    return "\n".join(lines + [""] + summary) + "\n"


def main() -> int:
    from baton_serve.cluster.sim.profile import LatencyProfile
    from baton_serve.cluster.sim.run import SimHardware

    from benchmarks.machine import cpu_name

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="benchmarks/results/planner_validation")
    ap.add_argument("--skip-live", action="store_true", help="simulate against the live results already there")
    ap.add_argument("--calibrate-on", default=None, metavar="WORKLOAD",
                    help="fit the host cost to this workload's live runs, then simulate every workload with it")
    args = ap.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    profile = LatencyProfile.load(args.profile)
    cores = int(profile.machine.get("cores", os.cpu_count() or 1))
    hardware = SimHardware(shared_cores=cores, threads=min(int(profile.machine.get("threads", 1)), cores))
    result = {"benchmark": "planner_validation", "date": date.today().isoformat(), "cpu": cpu_name(),
              "model": profile.model.get("name"), "profile": args.profile,
              "hardware": f"{hardware.shared_cores} shared cores, {hardware.threads} threads a step",
              "command": " ".join(["python", *sys.argv]), "workloads": {}}
    for name in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        if name not in WORKLOADS:
            ap.error(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)}")
        result["workloads"][name] = simulate(live(name, args, out_dir), profile, hardware)
        (out_dir / "planner_validation.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    if args.calibrate_on:
        import dataclasses

        from baton_serve.cluster.config import load_config
        from baton_serve.cluster.sim.against import load_measured
        from baton_serve.cluster.sim.calibrate import calibrate

        paths = [out_dir / f"live_{args.calibrate_on}_{w}w.json" for w, _ in RUNS]
        measured = [m for p in paths for m in load_measured(p)]
        fitted, after, before = calibrate(measured, load_config(None), profile, hardware,
                                          ", ".join(p.name for p in paths), seed=args.seed)
        fitted = dataclasses.replace(fitted, note=f"{profile.note}; host cost calibrated on {args.calibrate_on}")
        cal_path = fitted.dump(out_dir / "profile_calibrated.json")
        h = fitted.host
        result["calibration"] = {"workload": args.calibrate_on, "profile": str(cal_path),
                                 "per_step_s": h.per_step_s, "per_token_s": h.per_token_s,
                                 "per_request_s": h.per_request_s, "loss_before": before, "loss_after": after}
        result["calibrated"] = {name: simulate(live(name, argparse.Namespace(**{**vars(args), "skip_live": True}),
                                                    out_dir), fitted, hardware)
                                for name in result["workloads"]}
        (out_dir / "planner_validation.json").write_text(json.dumps(result, indent=2) + "\n")
        md += ("\n" + markdown(result, "calibrated", f", host cost calibrated on {args.calibrate_on} (in sample; "
               "the others out of sample)")
               + f"\n- host cost: {h.per_step_s * 1e3:g} ms a step + {h.per_token_s * 1e3:g} ms a sampled token, "
               f"{h.per_request_s * 1e3:g} ms a request before routing (`{cal_path}`)\n")
    (out_dir / "planner_validation.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
