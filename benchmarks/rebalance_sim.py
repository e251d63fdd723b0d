"""The rebalancer in ``baton plan sim``: a load that shifts from long prompts to long outputs and
back, on every static prefill:decode split of ``--workers`` workers and on the even split with
the rebalancer on. Per window of ``--window-s``: SLO attainment and goodput; the flips it made.

The trace is made here (seeded), phase by phase: ``--shapes`` prompt:output lengths (each drawn
+-25%), ``--rates`` Poisson arrivals per second, ``--phase-s`` each. Every worker has hardware
of its own (a GPU each, or a reserved machine), timed by ``--profile``.

    .venv/bin/python benchmarks/rebalance_sim.py --profile benchmarks/results/profile_zen4_bf16.json \\
        --out benchmarks/results/rebalance_sim.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
from datetime import date
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: see tests/conftest.py


def make_trace(path: Path, shapes: list[tuple[int, int]], rates: list[float], phase_s: float, seed: int) -> int:
    """Write the phased trace to ``path``; the number of requests."""
    rng, rows, t = random.Random(seed), [], 0.0
    for (prompt, output), rate in zip(shapes, rates):
        end = t + phase_s
        while (t := t + rng.expovariate(rate)) < end:
            rows.append({"timestamp": round(t, 4), "prompt_len": max(1, round(prompt * rng.uniform(0.75, 1.25))),
                         "output_len": max(1, round(output * rng.uniform(0.75, 1.25)))})
        t = end
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return len(rows)


def parse_phases(shapes: str, rates: str) -> tuple[list[tuple[int, int]], list[float]]:
    """``--shapes`` "prompt:output,..." and ``--rates`` "r,..." as lists; ValueError if malformed."""
    try:
        pairs = [tuple(int(x) for x in s.split(":")) for s in shapes.split(",")]
        per_s = [float(x) for x in rates.split(",")]
    except ValueError:
        raise ValueError(f"--shapes takes prompt:output,... and --rates r,...; got {shapes!r}, {rates!r}") from None
    if len(pairs) != len(per_s) or any(len(p) != 2 for p in pairs):
        raise ValueError("--shapes and --rates need one entry per phase, a shape as prompt:output")
    return pairs, per_s


def per_window(records, slo, window_s: float, end_s: float) -> list[dict]:
    """Attainment and goodput of the requests that arrived in each window."""
    out = []
    k = 0
    while k * window_s < end_s:
        sel = [r for r in records if k * window_s <= r.t_scheduled < (k + 1) * window_s]
        good = sum(1 for r in sel if slo.met_by(r))
        out.append({"start_s": k * window_s, "requests": len(sel),
                    "attainment": round(good / len(sel), 3) if sel else None,
                    "goodput": round(good / window_s, 3)})
        k += 1
    return out


def sim_run(name: str, layout, rebalanced: bool, bench, profile, slo, ttft_s: float, tpot_s: float,
            rebalance_window_s: float, report_window_s: float, end_s: float, seed: int) -> dict:
    """One layout in ``baton plan sim``, the rebalancer on or off, as a results row: the summary,
    attainment per report window, the flips and how often each hold came."""
    from baton_serve.cluster.config import load_config
    from baton_serve.cluster.sim.run import SimHardware, simulate

    cfg = load_config(None).with_overrides(**{
        "pools.prefill": layout.prefill, "pools.decode": layout.decode, "rebalance.enabled": rebalanced,
        "rebalance.ttft_target_s": ttft_s, "rebalance.tpot_target_s": tpot_s,
        "rebalance.window_s": rebalance_window_s})
    res = simulate(cfg, layout, bench, profile, SimHardware(0, int(profile.machine.get("threads", 1))), seed=seed)
    s = res.summary
    return {"run": name, "completed": s["completed"], "failed": s["failed"],
            "slo_attainment": round(s.get("slo_attainment", 0.0), 4), "goodput": round(s.get("request_goodput", 0.0), 4),
            "p99_ttft_ms": round(s["p99_ttft_ms"], 1), "p99_tpot_ms": round(s["p99_tpot_ms"], 1),
            "windows": per_window(res.records, slo, report_window_s, end_s),
            "flips": res.rebalance["flips"] if res.rebalance else [],
            "holds": res.rebalance["holds"] if res.rebalance else {}, "wall_s": round(res.wall_s, 1)}


def write_outputs(out: Path | None, result: dict, md: str) -> None:
    """Print the markdown; with ``out``, write the result there as JSON and the markdown beside it."""
    print(md)
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(md, encoding="utf-8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--shapes", default="1024:16,64:256,1024:16", help="prompt:output per phase")
    ap.add_argument("--rates", default="2.2,7,2.2", help="arrivals per second per phase")
    ap.add_argument("--phase-s", type=float, default=300.0)
    ap.add_argument("--ttft-slo-s", type=float, default=2.0)
    ap.add_argument("--tpot-slo-s", type=float, default=0.1)
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--trace-out", default=None, help="keep the trace here (baton bench --dataset-name trace "
                    "replays it live)")
    args = ap.parse_args()

    from baton_serve.cluster.bench.metrics import SLO
    from baton_serve.cluster.bench.plan import Layout
    from baton_serve.cluster.bench.runner import BenchConfig
    from baton_serve.cluster.bench.workload import WorkloadConfig
    from baton_serve.cluster.sim.profile import LatencyProfile

    try:
        shapes, rates = parse_phases(args.shapes, args.rates)
    except ValueError as e:
        ap.error(str(e))
    out_path = Path(args.out) if args.out else None
    trace = Path(args.trace_out) if args.trace_out else Path(tempfile.mkdtemp()) / "rebalance_sim.jsonl"
    n = make_trace(trace, shapes, rates, args.phase_s, args.seed)
    profile = LatencyProfile.load(args.profile)
    slo = SLO(ttft_ms=1e3 * args.ttft_slo_s, tpot_ms=1e3 * args.tpot_slo_s)
    bench = BenchConfig(workload=WorkloadConfig("trace", trace_path=str(trace)), num_prompts=n,
                        request_rate=float("inf"), seed=args.seed, disable_tqdm=True, num_warmups=0, slo=slo)
    end_s = args.phase_s * len(shapes)
    w = args.workers
    runs = [(f"{p}P+{w - p}D static", Layout(p, w - p), False) for p in range(1, w)]
    runs.append((f"{w // 2}P+{w - w // 2}D rebalanced", Layout(w // 2, w - w // 2), True))
    rows = []
    for name, layout, on in runs:
        row = sim_run(name, layout, on, bench, profile, slo, args.ttft_slo_s, args.tpot_slo_s, args.window_s,
                      args.window_s, end_s, args.seed)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "windows"}), flush=True)
    result = {"benchmark": "rebalance_sim", "date": date.today().isoformat(), "python": platform.python_version(),
              "profile": args.profile, "profile_machine": profile.machine,
              "command": "python benchmarks/rebalance_sim.py " + " ".join(sys.argv[1:]),
              "phases": [{"prompt": p, "output": o, "rate": r, "seconds": args.phase_s}
                         for (p, o), r in zip(shapes, rates)],
              "slo": slo.as_dict(), "window_s": args.window_s, "requests": n, "runs": rows}
    write_outputs(out_path, result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    """The summary table, attainment per window, and the flips."""
    runs = result["runs"]
    phases = ", ".join(f"{p['prompt']}:{p['output']} at {p['rate']:g}/s" for p in result["phases"])
    lines = [f"## Rebalancer, simulated: {result['requests']} requests, phases {phases}, "
             f"{result['phases'][0]['seconds']:g} s each", "", f"`{result['command']}`", "",
             "| run | SLO attainment | goodput req/s | p99 TTFT ms | p99 TPOT ms | failed | flips |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        flips = "; ".join(f"{f['worker_id']} -> {f['to_role']} at {f['decided_s']:.0f} s" for f in r["flips"]) or "-"
        lines.append(f"| {r['run']} | {r['slo_attainment']:.1%} | {r['goodput']:.2f} | {r['p99_ttft_ms']:.0f} | "
                     f"{r['p99_tpot_ms']:.0f} | {r['failed']} | {flips} |")
    starts = [w["start_s"] for w in runs[0]["windows"]]
    lines += ["", f"SLO attainment per {result['window_s']:g} s window (by arrival):", "",
              "| run | " + " | ".join(f"{s:g}" for s in starts) + " |", "|---|" + "---|" * len(starts)]
    for r in runs:
        cells = ["-" if w["attainment"] is None else f"{w['attainment']:.2f}" for w in r["windows"]]
        lines.append(f"| {r['run']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
