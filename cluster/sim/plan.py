"""``baton plan sim``: the layouts of a search space (worker counts, prefill:decode splits or
colocated, routing policies, step token budgets) each simulated on a latency profile, ranked by
goodput per worker, in the JSON / Markdown shape of ``baton plan live`` so the two diff cleanly.

Layouts run side by side in worker processes (``jobs``); each run is deterministic for its seed.
"""

from __future__ import annotations

import math
import os
import platform
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from baton_serve.cluster.bench.metrics import SLO
from baton_serve.cluster.bench.plan import Layout, LayoutResult, choose_best, plan_layouts
from baton_serve.cluster.bench.runner import BenchConfig, config_dict
from baton_serve.cluster.config import ClusterConfig
from baton_serve.cluster.sim.run import SimHardware, simulate


@dataclass(frozen=True)
class SimCase:
    """One point of the search space."""

    layout: Layout
    policy: str
    max_num_batched_tokens: int

    def name(self, policies: int, budgets: int) -> str:
        parts = [self.layout.name]
        if policies > 1:
            parts.append(self.policy)
        if budgets > 1:
            parts.append(f"{self.max_num_batched_tokens} tok/step")
        return ", ".join(parts)


def search_space(workers: list[int], ratios: list[tuple[int, int]] | None, colocated: bool, policies: list[str],
                 budgets: list[int]) -> list[SimCase]:
    """Every (layout, policy, budget): each worker count's splits (as ``plan live`` makes them),
    with every policy and step token budget. ValueError as ``plan_layouts`` raises it."""
    if not policies or not budgets:
        raise ValueError("the search space needs at least one policy and one max_num_batched_tokens")
    cases = []
    for n in workers:
        for layout in plan_layouts(n, ratios, colocated):
            cases.extend(SimCase(layout, p, b) for p in policies for b in budgets)
    return cases


@dataclass
class SimPlanResult:
    """Every case's result, the best one, and what the runs had in common."""

    cases: list[SimCase]
    results: list[LayoutResult]
    sims: list[dict[str, Any]]  # per case: simulator cost and per-worker counters
    best: str | None
    bench: BenchConfig
    cluster: ClusterConfig
    profile: Any
    hardware: SimHardware
    started: str
    command: str
    names: list[str] = field(default_factory=list)


def _case_config(base: ClusterConfig, case: SimCase) -> ClusterConfig:
    return base.with_overrides(**{"pools.prefill": case.layout.prefill, "pools.decode": case.layout.decode,
                                  "pools.colocated": case.layout.colocated, "router.policy": case.policy,
                                  "engine.max_num_batched_tokens": case.max_num_batched_tokens})


def _run_case(job: tuple[ClusterConfig, SimCase, BenchConfig, dict[str, Any], SimHardware, int]) -> dict[str, Any]:
    """One case, in a worker process (everything in and out is plain data)."""
    from baton_serve.cluster.sim.profile import LatencyProfile

    base, case, bench, profile, hardware, seed = job
    try:
        res = simulate(_case_config(base, case), case.layout, bench, LatencyProfile.from_dict(profile),
                       hardware, seed=seed)
    except Exception as exc:  # a case that cannot run is a result, not the end of the plan
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"summary": res.summary, "wall_s": res.wall_s, "events": res.events, "workers": res.workers,
            "rebalance": res.rebalance}


def run_sim_plan(base: ClusterConfig, cases: list[SimCase], bench: BenchConfig, profile: Any,
                 hardware: SimHardware, seed: int = 0, jobs: int | None = None, command: str = "",
                 progress: bool = True) -> SimPlanResult:
    """Simulate every case (``jobs`` processes, default one per core), best by goodput per worker."""
    from tqdm import tqdm

    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    data = profile.to_dict()
    work = [(base, c, bench, data, hardware, seed) for c in cases]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(cases)))
    bar = tqdm(total=len(cases), disable=not progress, file=sys.stderr, desc="layouts", unit="layout")
    outs: list[dict[str, Any]] = []
    try:
        if jobs == 1:
            for job in work:
                outs.append(_run_case(job))
                bar.update(1)
        else:
            import multiprocessing

            # spawn: a forked child of a process that ran torch's thread pools can hang in them
            with multiprocessing.get_context("spawn").Pool(jobs) as pool:
                for out in pool.imap(_run_case, work):
                    outs.append(out)
                    bar.update(1)
    finally:
        bar.close()
    results = [LayoutResult(c.layout, summary=o.get("summary"), error=o.get("error"), model="simulated")
               for c, o in zip(cases, outs)]
    policies = len({c.policy for c in cases})
    budgets = len({c.max_num_batched_tokens for c in cases})
    names = [c.name(policies, budgets) for c in cases]
    best = choose_best(results)
    best_name = names[results.index(best)] if best is not None else None
    sims = [{k: v for k, v in o.items() if k != "summary"} for o in outs]
    return SimPlanResult(cases, results, sims, best_name, bench, base, profile, hardware, started, command, names)


def _goodput_note(slo: SLO | None) -> str:
    if slo is None:
        return "no SLO given: goodput is the completed-request rate"
    return "requests meeting every SLO per second (" + ", ".join(f"{k} <= {v:g} ms" for k, v in slo.as_dict().items()) + ")"


def sim_plan_json(pr: SimPlanResult) -> dict[str, Any]:
    """``plan live``'s JSON layout (one entry per case), plus the profile and simulated hardware."""
    p = pr.profile
    return {"date": pr.started, "command": pr.command, "simulated": True,
            "machine": {"system": platform.system(), "machine": platform.machine(), "cpu_count": os.cpu_count()},
            "profile": {"source": p.source, "note": p.note, "machine": p.machine, "model": p.model},
            "hardware": {"shared_cores": pr.hardware.shared_cores, "threads": pr.hardware.threads,
                         "workers_per_node": pr.hardware.workers_per_node},
            "model": p.model.get("name", ""), "best_layout": pr.best,
            "goodput_definition": _goodput_note(pr.bench.slo),
            "goodput_slo": pr.bench.slo.as_dict() if pr.bench.slo else None,
            "layouts": [{"name": name, "prefill": r.layout.prefill, "decode": r.layout.decode,
                         "colocated": r.layout.colocated, "workers": r.layout.workers, "policy": c.policy,
                         "max_num_batched_tokens": c.max_num_batched_tokens, "ok": r.ok, "error": r.error,
                         "goodput": r.goodput, "goodput_per_worker": r.goodput_per_worker, "summary": r.summary,
                         "simulator": sim}
                        for name, c, r, sim in zip(pr.names, pr.cases, pr.results, pr.sims)],
            "bench_config": config_dict(pr.bench), "cluster_config": pr.cluster.model_dump()}


def _cell(s: dict[str, Any], key: str, fmt: str) -> str:
    v = s.get(key)
    return "n/a" if v is None else format(v, fmt)


def sim_plan_markdown(pr: SimPlanResult) -> str:
    """One row per case, the best by goodput per worker, and what the profile was measured on."""
    b, p = pr.bench, pr.profile
    rate = "all at once" if math.isinf(b.request_rate) else f"{b.request_rate:g} req/s"
    where = (f"{pr.hardware.shared_cores} shared cores, {pr.hardware.threads} threads a step"
             if pr.hardware.shared_cores else "hardware of its own per worker")
    best = f"**{pr.best}**" if pr.best else "none (no layout completed a request within the SLO)"
    lines = [f"## baton plan sim: {p.model.get('name', 'model')} on {p.machine.get('cpu_model') or p.machine.get('device')}",
             "", f"- profile: {p.source} ({p.machine.get('device', 'cpu')}, {p.model.get('dtype')}); {where}",
             f"- workload: {b.workload.name}, {b.num_prompts} requests, {rate}, seed {b.seed}",
             f"- goodput: {_goodput_note(b.slo)}", f"- best layout by goodput per worker: {best}", "",
             "| layout | req/s | out tok/s | goodput req/s | goodput/worker | SLO attainment | prefix hit "
             "| p50 TTFT ms | p99 TTFT ms | p50 TPOT ms | p99 TPOT ms | p99 ITL ms | completed | failed |",
             "|" + "---|" * 14]
    for name, r in zip(pr.names, pr.results):
        s = r.summary
        if s is None:
            lines.append(f"| {name} | failed: {r.error} |" + " |" * 12)
            continue
        att = f"{s['slo_attainment']:.1%}" if "slo_attainment" in s else "n/a"
        hit = "n/a" if s.get("prefix_hit_rate") is None else f"{s['prefix_hit_rate']:.1%}"
        lines.append(f"| {name} | {s['request_throughput']:.2f} | {s['output_throughput']:.1f} | {r.goodput:.2f} | "
                     f"{r.goodput_per_worker:.3f} | {att} | {hit} | {_cell(s, 'median_ttft_ms', '.0f')} | "
                     f"{_cell(s, 'p99_ttft_ms', '.0f')} | {_cell(s, 'median_tpot_ms', '.1f')} | "
                     f"{_cell(s, 'p99_tpot_ms', '.1f')} | {_cell(s, 'p99_itl_ms', '.1f')} | {s['completed']} | "
                     f"{s['failed']} |")
    flips = [(name, sim["rebalance"]["flips"]) for name, sim in zip(pr.names, pr.sims)
             if (sim.get("rebalance") or {}).get("flips")]
    if any(sim.get("rebalance") for sim in pr.sims):
        lines += ["", "Rebalancer role flips (simulated seconds from the first measured request):"]
        lines += [f"- {name}: " + ", ".join(f"{f['worker_id']} {f['from_role']} -> {f['to_role']} at "
                                            f"{f['decided_s']:.0f} s" for f in fl) for name, fl in flips] or ["- none"]
    return "\n".join(lines) + "\n"



def plot_sim_plan(pr: SimPlanResult, path: Any) -> Any:
    """Bars of simulated goodput per worker per case, the best highlighted, failed ones marked."""
    from baton_serve.cluster.bench.report import pyplot, save_figure

    plt = pyplot()
    values = [r.goodput_per_worker for r in pr.results]
    colors = ["C2" if n == pr.best else ("lightgrey" if not r.ok else "C0") for n, r in zip(pr.names, pr.results)]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(values) + 2), 4.5))
    bars = ax.bar(range(len(values)), values, color=colors)
    ax.set_xticks(range(len(values)), pr.names, rotation=30, ha="right", fontsize=8)
    for bar, r in zip(bars, pr.results):
        ax.annotate("failed" if not r.ok else f"{r.goodput_per_worker:.3f}",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    best = f"best: {pr.best}" if pr.best else "no layout met the SLO"
    ax.set(ylabel="goodput per worker (req/s)", title=f"simulated goodput per worker\n{best}")
    fig.tight_layout()
    return save_figure(plt, fig, path)
