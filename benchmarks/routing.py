"""Routing policies side by side: the same arrivals through each policy on the same four workers.

For each layout (2 prefill + 2 decode, 4 colocated) and each workload (``shared-prefix``: N system
prompts x user turns; ``skewed``: the same with one hot prefix taking a fraction of the traffic),
every policy gets a fresh deployment of the default model (empty caches), one unmeasured request
per system prompt (``--warmup-prefixes``, on by default; the policy places them), then the same
requests at the same Poisson arrival times (``baton bench``'s runner, same seed). Reported per run: TTFT
p50/p99, TPOT, output throughput, the prefix-cache hit rate the server reported
(``cached_tokens``), goodput at the SLO, and the router's own view (decisions by reason, the
median of measured/estimated TTFT).

    .venv/bin/python benchmarks/routing.py --out benchmarks/results/routing.json

A nominal rate is past capacity on one day's machine and not on another's (these are shared):
``--load F`` first measures each cell's capacity (its requests all at once under
``--capacity-policy``) and runs the cell at F times it, so that cells compare across sessions.

Four workers share this machine's cores through the core-sharing board (``openmp_wait = auto``
picks ``share`` where the workers' threads outnumber the cores), as in every local deployment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: see tests/conftest.py

POLICIES = ("round_robin", "least_loaded", "prefix", "cost")
LAYOUTS = {"2P+2D": {"prefill": 2, "decode": 2}, "4 colocated": {"colocated": 4}}


def _router_view(registry: Any, policy: str) -> dict[str, Any]:
    """Decisions by reason and the cost model's error, from the deployment's own metrics."""
    reasons: dict[str, float] = {}
    ratio_buckets: list[tuple[float, float]] = []
    for family in registry.collect():
        for s in family.samples:
            if s.name == "baton:router_decisions_total" and s.labels.get("policy") == policy:
                reasons[s.labels["reason"]] = s.value
            if s.name == "baton:router_ttft_estimate_ratio_bucket" and s.labels.get("policy") == policy:
                ratio_buckets.append((float(s.labels["le"]), s.value))
    median = None
    if ratio_buckets:
        ratio_buckets.sort()
        total = ratio_buckets[-1][1]
        for le, count in ratio_buckets:
            if total and count >= total / 2:
                median = le  # the bucket bound the median falls under
                break
    return {"decisions": reasons, "ttft_measured_over_estimated_median_le": median}


def _worker_view(registry: Any) -> dict[str, Any]:
    """Prompt tokens computed, cached blocks evicted and requests preempted, per worker: the
    prefill a policy spends again on prefixes it let go cold (or on KV it crowded out), which a
    hit rate over all requests hides; and each worker's
    share of the tokens decoded, which shows a policy piling the decoding onto few workers."""
    out: dict[str, dict[str, float]] = {}
    for family in registry.collect():
        for s in family.samples:
            if s.name == "baton:tokens_computed_total" and s.labels.get("kind") in ("prefill", "decode"):
                out.setdefault(s.labels["worker"], {})[f"{s.labels['kind']}_tokens"] = s.value
            elif s.name == "baton:prefix_cache_evicted_blocks_total":
                out.setdefault(s.labels["worker"], {})["evicted_blocks"] = s.value
            elif s.name == "baton:num_preemptions_total":  # a preempted request computes its prompt again
                out.setdefault(s.labels["worker"], {})["preemptions"] = s.value
    return {"workers": out,
            "prefill_tokens_computed": sum(w.get("prefill_tokens", 0) for w in out.values()),
            "evicted_blocks": sum(w.get("evicted_blocks", 0) for w in out.values()),
            "decode_share": _shares({k: w.get("decode_tokens", 0) for k, w in out.items()})}


def _shares(values: dict[str, float]) -> dict[str, float]:
    total = sum(values.values())
    return {k: v / total for k, v in sorted(values.items()) if v} if total else {}


def policy_config(spec: str) -> dict[str, Any]:
    """``[router]`` settings from a policy spec: a name, or ``name:option=value,...`` (a variant,
    e.g. ``cost:share_weight=0``) compared in the same run as the name alone."""
    name, _, options = spec.partition(":")
    router: dict[str, Any] = {"policy": name}
    for item in filter(None, options.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"policy option {item!r} is not key=value")
        router[key] = json.loads(value) if value not in ("", "nan") else value
    return router


def run_one(args: argparse.Namespace, layout: str, policy: str, workload: str, seed: int,
            decision_log: str | None = None, request_rate: float | None = None,
            max_concurrency: int | None = None) -> dict[str, Any]:
    from baton_serve.cluster.bench.metrics import SLO
    from baton_serve.cluster.bench.runner import BenchConfig, run_async
    from baton_serve.cluster.bench.workload import LengthDist, WorkloadConfig
    from baton_serve.cluster.config import ClusterConfig
    from baton_serve.cluster.serve import Deployment
    from baton_serve.router.server import ServerThread

    config = ClusterConfig.model_validate({
        "engine": {"dtype": args.dtype, "threads_per_worker": args.threads_per_worker,
                   "kv_cache_memory_gib": args.kv_cache_memory_gib, "max_num_batched_tokens": 1024,
                   "long_prefill_token_threshold": args.long_prefill_token_threshold},
        "pools": LAYOUTS[layout], "router": {**policy_config(policy), "decision_log": decision_log},
        "ray": {"num_cpus": os.cpu_count()},
    })
    wl = WorkloadConfig(name="shared-prefix", input_len=LengthDist(args.suffix_len),
                        output_len=LengthDist(args.output_len), num_prefixes=args.num_prefixes,
                        prefix_len=args.prefix_len, hot_fraction=args.hot_fraction if workload == "skewed" else 0.0)
    started = time.monotonic()
    dep = Deployment(config).start()
    server = ServerThread(dep.app).start()
    try:
        # Ready means every worker answered; the first stats let the router measure rates.
        deadline = time.monotonic() + 120
        while not dep.pool.ready() and time.monotonic() < deadline:
            time.sleep(0.2)
        cfg = BenchConfig(base_url=server.url, tokenizer_source=str(dep.cluster.model_path), workload=wl,
                          num_prompts=args.num_prompts, seed=seed, max_concurrency=max_concurrency,
                          request_rate=args.request_rate if request_rate is None else request_rate,
                          slo=SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms), num_warmups=0,
                          warmup_prefixes=args.warmup_prefixes,
                          disable_tqdm=True, request_timeout_s=args.request_timeout)
        res = asyncio.run(asyncio.wait_for(run_async(cfg), args.run_timeout))
        s = res.summary
        keys = ("completed", "failed", "duration", "output_throughput", "request_throughput",
                "median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                "prefix_hit_rate", "cached_tokens_reported", "request_goodput", "slo_attainment")
        out = {k: s.get(k) for k in keys}
        out.update(_router_view(dep.metrics.registry, policy.partition(":")[0]))
        time.sleep(2.5)  # the workers' last stats (every second) carry the run's final prefills
        out.update(_worker_view(dep.metrics.registry))
        out["wall_s"] = time.monotonic() - started
        return out
    finally:
        server.stop()
        dep.stop()


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def _paired(baseline: list[dict[str, Any]], cost: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(baseline, cost) p99 TTFT of the runs that shared a seed and a turn."""
    base = {(r.get("seed"), r.get("repeat")): r["p99_ttft_ms"] for r in baseline}
    return [(base[k], r["p99_ttft_ms"]) for r in cost if (k := (r.get("seed"), r.get("repeat"))) in base]


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets: cost's p99 TTFT against least_loaded's (shared-prefix) and prefix's (skewed),
    and cost's throughput against the best of the others, per layout; over several seeds or
    repeats, each policy's geometric mean of its runs."""
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in results:
        if "error" not in r:
            runs.setdefault((r["layout"], r["workload"], r["policy"]), []).append(r)
    by = {key: {"p99_ttft_ms": _geomean([r["p99_ttft_ms"] for r in rs]),
                "output_throughput": _geomean([r["output_throughput"] for r in rs])} for key, rs in runs.items()}
    out = {}
    for layout in LAYOUTS:
        row = {}
        for workload in ("shared-prefix", "skewed"):
            cost = by.get((layout, workload, "cost"))
            if cost is None:
                continue
            others = [by[(layout, workload, p)] for p in POLICIES if p != "cost" and (layout, workload, p) in by]
            best_tp = max((o["output_throughput"] or 0 for o in others), default=None)
            ll, px = by.get((layout, workload, "least_loaded")), by.get((layout, workload, "prefix"))
            row[workload] = {
                "p99_ttft_least_loaded_over_cost": _ratio(ll and ll["p99_ttft_ms"], cost["p99_ttft_ms"]),
                "p99_ttft_prefix_over_cost": _ratio(px and px["p99_ttft_ms"], cost["p99_ttft_ms"]),
                "throughput_cost_over_best_other": _ratio(cost["output_throughput"], best_tp),
                "runs": len(runs[(layout, workload, "cost")]),
            }
            baseline = "least_loaded" if workload == "shared-prefix" else "prefix"
            pairs = _paired(runs.get((layout, workload, baseline), []), runs[(layout, workload, "cost")])
            if pairs:
                row[workload][f"cost_p99_lower_than_{baseline}_in"] = f"{sum(c < b for b, c in pairs)}/{len(pairs)}"
        out[layout] = row
    return out


def markdown(results: list[dict[str, Any]], summary: dict[str, Any], args: argparse.Namespace) -> str:
    def f(v: Any, d: int = 0) -> str:
        return "-" if v is None else f"{v:.{d}f}"

    lines = ["| layout | workload | policy | seed/run | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | out tok/s | hit rate | "
             f"goodput req/s (TTFT<={args.slo_ttft_ms:g} ms, TPOT<={args.slo_tpot_ms:g} ms) | prefill tokens computed | "
             "blocks evicted | decode share | decisions |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        run = f"{r.get('seed', args.seed)}/{r.get('repeat', 0)}"
        if "error" in r:
            lines.append(f"| {r['layout']} | {r['workload']} | {r['policy']} | {run} | failed: {r['error']} ||||||||||")
            continue
        reasons = ", ".join(f"{k} {int(v)}" for k, v in sorted(r["decisions"].items()))
        shares = " ".join(f"{100 * v:.0f}%" for v in r.get("decode_share", {}).values()) or "-"
        lines.append(f"| {r['layout']} | {r['workload']} | {r['policy']} | {run} | {f(r['median_ttft_ms'])} | "
                     f"{f(r['p99_ttft_ms'])} | {f(r['median_tpot_ms'])} | {f(r['output_throughput'], 1)} | "
                     f"{f(r['prefix_hit_rate'] and 100 * r['prefix_hit_rate'])}% | {f(r['request_goodput'], 2)} | "
                     f"{f(r.get('prefill_tokens_computed'))} | {f(r.get('evicted_blocks'))} | {shares} | {reasons} |")
    lines.append("")
    for layout, row in summary.items():
        for workload, ratios in row.items():
            lines.append(f"- {layout}, {workload}: " + ", ".join(
                f"{k} {v if isinstance(v, (str, int)) else f(v, 2)}" for k, v in ratios.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="policy names, or variants as name:option=value (e.g. cost:share_weight=0), "
                         "separated by commas or semicolons (a variant of several options)")
    ap.add_argument("--workloads", default="shared-prefix,skewed")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--hot-fraction", type=float, default=0.7)
    ap.add_argument("--request-rate", type=float, default=1.0, help="req/s, Poisson (inf: all at once)")
    ap.add_argument("--load", type=float, default=None, metavar="F",
                    help="instead of --request-rate: F x the capacity measured first in each layout and "
                    "workload (a --capacity-policy run of the same requests, all at once, "
                    "--capacity-concurrency in flight), so cells compare across machines and days")
    ap.add_argument("--capacity-policy", default="prefix")
    ap.add_argument("--capacity-concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", default=None, help="several seeds, comma-separated (instead of --seed)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each seed, the policies taking turns (A B A B): this machine's noise shows "
                         "beside the policies' difference, and the summary takes each policy's geomean")
    ap.add_argument("--warmup-prefixes", action=argparse.BooleanOptionalAction, default=True,
                    help="send each system prompt once, unmeasured, before the run (default on): p99 then "
                         "shows where the policy keeps prefixes, not the first touch of each, cold under every "
                         "policy")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads-per-worker", type=int, default=1)
    ap.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
    ap.add_argument("--long-prefill-token-threshold", type=int, default=None, metavar="N",
                    help="the most tokens of one prompt a worker's step computes (unset: the step's 1024)")
    ap.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=300.0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--run-timeout", type=float, default=600.0)
    ap.add_argument("--decision-log", default=None, metavar="DIR",
                    help="write each run's routing decisions and measured TTFTs to DIR/<run>.jsonl "
                    "([router] decision_log; benchmarks/routing_decisions.py reads them)")
    ap.add_argument("--out", default=None, help="JSON path (a .md beside it)")
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    results, capacities = [], {}
    rates: dict[tuple[str, str], float] = {}
    for layout, workload, seed, repeat, policy in _schedule(args.layouts.split(","), args.workloads.split(","),
                                                            seeds, args.repeats, _policy_specs(args.policies)):
        if args.load is not None and (layout, workload) not in rates:
            capacity = measure_capacity(args, layout, workload, seeds[0])
            capacities[f"{layout} / {workload}"] = capacity
            rates[(layout, workload)] = load_rate(args.load, capacity)
        rate = rates.get((layout, workload), args.request_rate)
        print(f"routing: {layout} / {workload} / seed {seed} run {repeat} / {policy} at {rate:.2f} req/s",
              file=sys.stderr, flush=True)
        row = {"layout": layout, "workload": workload, "policy": policy, "seed": seed, "repeat": repeat,
               "request_rate": rate}
        log = _decision_log_path(args.decision_log, row)
        if log:
            row["decision_log"] = log
        try:
            row.update(run_one(args, layout, policy, workload, seed, log, request_rate=rate))
        except Exception as exc:  # one failed run must not lose the others
            row["error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(row), file=sys.stderr, flush=True)
        results.append(row)
    summary = summarize(results)
    doc = {"date": date.today().isoformat(), "cpu": platform.processor() or platform.machine(),
           "cpu_model": _cpu_model(), "cores": os.cpu_count(), "command": " ".join([sys.executable, *sys.argv]),
           "args": vars(args), "capacities": capacities, "results": results, "summary": summary}
    text = markdown(results, summary, args)
    for cell, c in capacities.items():
        text += (f"\n- {cell}: capacity {c['request_throughput']:.2f} req/s under {c['policy']} "
                 f"({c['concurrency']} in flight), runs at --load {args.load:g} = {args.load * c['request_throughput']:.2f} req/s")
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
        Path(args.out).with_suffix(".md").write_text(text + "\n")
    return 0


def measure_capacity(args: argparse.Namespace, layout: str, workload: str, seed: int) -> dict[str, Any]:
    """The cell's requests all at once, ``--capacity-concurrency`` in flight, under
    ``--capacity-policy``: the request throughput this machine sustains today."""
    print(f"routing: {layout} / {workload} / capacity under {args.capacity_policy}", file=sys.stderr, flush=True)
    run = run_one(args, layout, args.capacity_policy, workload, seed, None, request_rate=math.inf,
                  max_concurrency=args.capacity_concurrency)
    out = {"policy": args.capacity_policy, "concurrency": args.capacity_concurrency,
           **{k: run.get(k) for k in ("completed", "failed", "duration", "request_throughput", "output_throughput",
                                      "p99_ttft_ms")}}
    print(json.dumps({"capacity": out}), file=sys.stderr, flush=True)
    return out


def load_rate(load: float, capacity: dict[str, Any]) -> float:
    """Requests a second at ``load`` times the measured capacity; ValueError where none was measured."""
    throughput = capacity.get("request_throughput")
    if not throughput or capacity.get("failed"):
        raise ValueError(f"no capacity measured to set the load from: {capacity}")
    return load * throughput


def _schedule(layouts: list[str], workloads: list[str], seeds: list[int], repeats: int,
              policies: list[str]) -> list[tuple[str, str, int, int, str]]:
    """Run order: within a cell each seed's runs take the policies in turn, so that drift in the
    machine's speed falls on every policy alike."""
    return [(layout, workload, seed, repeat, policy) for layout in layouts for workload in workloads
            for seed in seeds for repeat in range(repeats) for policy in policies]


def _decision_log_path(folder: str | None, row: dict[str, Any]) -> str | None:
    """DIR/<layout>_<workload>_<policy>_s<seed>_r<repeat>.jsonl, made of safe characters; None without DIR."""
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    name = "_".join([row["layout"], row["workload"], row["policy"], f"s{row['seed']}", f"r{row['repeat']}"])
    return str(Path(folder) / (re.sub(r"[^A-Za-z0-9._=+-]+", "-", name) + ".jsonl"))


def _policy_specs(text: str) -> list[str]:
    if ";" in text:
        return [p.strip() for p in text.split(";") if p.strip()]
    return [p.strip() for p in text.split(",") if p.strip()]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                flags = Path("/proc/cpuinfo").read_text()
                isa = "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "baseline"
                return f"{line.split(':', 1)[1].strip()} ({isa})"
    except OSError:
        pass
    return platform.machine()


if __name__ == "__main__":
    sys.exit(main())

