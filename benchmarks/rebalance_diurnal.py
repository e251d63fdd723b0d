"""A day on a large cluster, in ``baton plan sim``: chat (short prompts, long outputs) peaks by day,
batch summarisation (long prompts, short outputs) by night, and the total rises and falls with
them. Each static prefill:decode split in ``--static`` against one split with the rebalancer on:
SLO attainment and goodput over the day and per window, the flips and when.

The trace is made here (seeded): each class arrives as a Poisson process whose rate follows the
day, ``low + (1 - low) * (1 - cos(2 pi t / day)) / 2`` of its peak for chat and the same curve
half a day later for batch; lengths drawn +-25% around ``--chat`` and ``--batch``. Every worker
has hardware of its own (a GPU each, or a reserved machine), timed by ``--profile``.

    .venv/bin/python benchmarks/rebalance_diurnal.py --profile benchmarks/results/profile_zen4_bf16.json \\
        --out benchmarks/results/rebalance_diurnal.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import tempfile
from datetime import date
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: see tests/conftest.py

from benchmarks.rebalance_sim import sim_run, write_outputs  # noqa: E402


def day_curve(t: float, day_s: float, low: float, shift: float = 0.0) -> float:
    """The share of its peak a class arrives at, ``t`` seconds into the day (peak at mid-day,
    ``low`` at midnight; ``shift`` days later)."""
    phase = 2 * math.pi * (t / day_s - shift)
    return low + (1 - low) * (1 - math.cos(phase)) / 2


def make_diurnal_trace(path: Path, day_s: float, classes: list[tuple[int, int, float, float]], low: float,
                       seed: int) -> int:
    """Write the trace (``classes``: prompt, output, peak rate, shift in days) to ``path``; the number
    of requests. Arrivals by thinning a Poisson process at the peak rate."""
    rng, rows = random.Random(seed), []
    for prompt, output, peak, shift in classes:
        t = 0.0
        while (t := t + rng.expovariate(peak)) < day_s:
            if rng.random() < day_curve(t, day_s, low, shift):
                rows.append({"timestamp": round(t, 4), "prompt_len": max(1, round(prompt * rng.uniform(0.75, 1.25))),
                             "output_len": max(1, round(output * rng.uniform(0.75, 1.25)))})
    rows.sort(key=lambda r: r["timestamp"])
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return len(rows)


def _shape(text: str, name: str) -> tuple[int, int, float]:
    try:
        prompt, output, rate = text.split(":")
        return int(prompt), int(output), float(rate)
    except ValueError:
        raise SystemExit(f"{name} takes prompt:output:peak_rate, got {text!r}") from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--static", default="4,8,12,16,24,32", help="prefill workers of each static split")
    ap.add_argument("--start", type=int, default=16, help="prefill workers the rebalanced run starts with")
    ap.add_argument("--chat", default="64:256:100", help="prompt:output:peak_rate of the daytime class")
    ap.add_argument("--batch", default="1024:16:24", help="prompt:output:peak_rate of the night-time class")
    ap.add_argument("--low", type=float, default=0.2, help="each class's rate at its trough, over its peak")
    ap.add_argument("--day-s", type=float, default=720.0, help="seconds of virtual time the day takes")
    ap.add_argument("--ttft-slo-s", type=float, default=2.0)
    ap.add_argument("--tpot-slo-s", type=float, default=0.1)
    ap.add_argument("--window-s", type=float, default=60.0, help="the report's windows")
    ap.add_argument("--rebalance-window-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from baton_serve.cluster.bench.metrics import SLO
    from baton_serve.cluster.bench.plan import Layout
    from baton_serve.cluster.bench.runner import BenchConfig
    from baton_serve.cluster.bench.workload import WorkloadConfig
    from baton_serve.cluster.sim.profile import LatencyProfile

    w = args.workers
    try:
        static = [int(x) for x in args.static.split(",") if x]
    except ValueError:
        ap.error(f"--static takes prefill counts, got {args.static!r}")
    if any(not 0 < p < w for p in static + [args.start]):
        ap.error(f"--static and --start need 0 < prefill < {w}")
    chat, batch = _shape(args.chat, "--chat"), _shape(args.batch, "--batch")
    trace = Path(tempfile.mkdtemp()) / "rebalance_diurnal.jsonl"
    n = make_diurnal_trace(trace, args.day_s, [(*chat, 0.0), (*batch, 0.5)], args.low, args.seed)
    profile = LatencyProfile.load(args.profile)
    slo = SLO(ttft_ms=1e3 * args.ttft_slo_s, tpot_ms=1e3 * args.tpot_slo_s)
    bench = BenchConfig(workload=WorkloadConfig("trace", trace_path=str(trace)), num_prompts=n,
                        request_rate=float("inf"), seed=args.seed, disable_tqdm=True, num_warmups=0, slo=slo)
    runs = [(f"{p}P+{w - p}D static", Layout(p, w - p), False) for p in static]
    runs.append((f"{args.start}P+{w - args.start}D rebalanced", Layout(args.start, w - args.start), True))
    rows = []
    for name, layout, on in runs:
        row = sim_run(name, layout, on, bench, profile, slo, args.ttft_slo_s, args.tpot_slo_s,
                      args.rebalance_window_s, args.window_s, args.day_s, args.seed)
        row["prefill_workers"] = _prefill_over_time(layout.prefill, row["flips"], args.window_s, args.day_s)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("windows", "flips")}), flush=True)
    result = {"benchmark": "rebalance_diurnal", "date": date.today().isoformat(), "python": platform.python_version(),
              "profile": args.profile, "profile_machine": profile.machine,
              "command": "python benchmarks/rebalance_diurnal.py " + " ".join(sys.argv[1:]),
              "workers": w, "day_s": args.day_s, "low": args.low,
              "classes": {"chat": dict(zip(("prompt", "output", "peak_rate"), chat)),
                          "batch": dict(zip(("prompt", "output", "peak_rate"), batch))},
              "slo": slo.as_dict(), "window_s": args.window_s, "requests": n, "runs": rows}
    write_outputs(Path(args.out) if args.out else None, result, markdown(result))
    return 0


def _prefill_over_time(start: int, flips: list[dict], window_s: float, end_s: float) -> list[int]:
    """Prefill workers at the end of each window, from the flips' completion times."""
    out, k = [], 1
    while (k - 1) * window_s < end_s:
        done = [f for f in flips if f.get("done_s") is not None and f["done_s"] < k * window_s]
        out.append(start + sum(1 if f["to_role"] == "prefill" else -1 for f in done))
        k += 1
    return out


def markdown(result: dict) -> str:
    """The summary table, then attainment and the prefill pool's size per window."""
    runs, c = result["runs"], result["classes"]
    best = max((r for r in runs if "static" in r["run"]), key=lambda r: r["goodput"])
    lines = [f"## Rebalancer, simulated day: {result['workers']} workers, {result['requests']} requests in "
             f"{result['day_s']:g} s; chat {c['chat']['prompt']}:{c['chat']['output']} peaking at "
             f"{c['chat']['peak_rate']:g}/s by day, batch {c['batch']['prompt']}:{c['batch']['output']} at "
             f"{c['batch']['peak_rate']:g}/s by night, each at {result['low']:g} of its peak at its trough",
             "", f"`{result['command']}`", "",
             "| run | SLO attainment | goodput req/s | p99 TTFT ms | p99 TPOT ms | failed | flips |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        mark = " (best static)" if r is best else ""
        lines.append(f"| {r['run']}{mark} | {r['slo_attainment']:.1%} | {r['goodput']:.2f} | {r['p99_ttft_ms']:.0f} | "
                     f"{r['p99_tpot_ms']:.0f} | {r['failed']} | {len(r['flips']) or '-'} |")
    starts = [w["start_s"] for w in runs[0]["windows"]]
    head = ["| run | " + " | ".join(f"{s:g}" for s in starts) + " |", "|---|" + "---|" * len(starts)]
    lines += ["", f"SLO attainment per {result['window_s']:g} s window (by arrival):", ""] + head
    for r in runs:
        cells = ["-" if w["attainment"] is None else f"{w['attainment']:.2f}" for w in r["windows"]]
        lines.append(f"| {r['run']} | " + " | ".join(cells) + " |")
    rebalanced = [r for r in runs if "rebalanced" in r["run"]]
    if rebalanced:
        lines += ["", "Prefill workers at the end of each window, rebalanced:", ""] + head
        for r in rebalanced:
            lines.append(f"| {r['run']} | " + " | ".join(str(x) for x in r["prefill_workers"]) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
