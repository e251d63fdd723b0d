"""``baton plan live``: a fixed number of workers split at several prefill:decode ratios (and
colocated), each layout started in turn, given the same workload, and ranked by goodput per worker.

A ratio must split the workers into whole pools: ``p:d`` fits N workers when ``p + d`` divides N
(1:3 fits 4 or 8, not 6). Ratios that do not fit are rejected, naming those that do; without
``--ratios`` every split of N is tried.
"""

from __future__ import annotations

import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from baton_serve.cluster.bench.metrics import SLO
from baton_serve.cluster.bench.report import pyplot, save_figure
from baton_serve.cluster.bench.runner import BenchConfig, config_dict, run
from baton_serve.cluster.bench.workload import WorkloadError
from baton_serve.cluster.config import ClusterConfig

READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
_TIE = 1e-9  # goodputs this close (req/s per worker) count as equal: p99 TPOT decides


@dataclass(frozen=True)
class Layout:
    """Worker counts of one deployment: prefill + decode pools, or colocated workers."""

    prefill: int = 0
    decode: int = 0
    colocated: int = 0

    @property
    def workers(self) -> int:
        return self.prefill + self.decode + self.colocated

    @property
    def name(self) -> str:
        return f"{self.colocated} colocated" if self.colocated else f"{self.prefill}P+{self.decode}D"


def parse_ratios(text: str) -> list[tuple[int, int]]:
    """``"1:3,1:1,3:1"`` -> ``[(1, 3), (1, 1), (3, 1)]``; ValueError for anything but positive integers."""
    ratios = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        p, sep, d = item.partition(":")
        if not sep or not p.strip().isdigit() or not d.strip().isdigit() or int(p) < 1 or int(d) < 1:
            raise ValueError(f"--ratios takes PREFILL:DECODE positive integers, e.g. 1:3,1:1; got {item!r}")
        ratios.append((int(p), int(d)))
    if not ratios:
        raise ValueError("--ratios is empty")
    return ratios


def split(workers: int, ratio: tuple[int, int]) -> Layout | None:
    """The pools ``ratio`` gives ``workers`` workers, or None when it does not split them whole."""
    p, d = ratio
    if workers % (p + d):
        return None
    k = workers // (p + d)
    return Layout(prefill=p * k, decode=d * k)


def plan_layouts(workers: int, ratios: list[tuple[int, int]] | None, colocated: bool) -> list[Layout]:
    """Layouts to run, in order: each ratio's split (duplicates once), then ``workers`` colocated.

    ``ratios`` None: every split of ``workers`` (1:N-1 ... N-1:1). ValueError for a ratio that
    does not fit, naming those that do, or when nothing is left to run.
    """
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    every = [Layout(prefill=p, decode=workers - p) for p in range(1, workers)]
    if ratios is None:
        layouts = every
    else:
        layouts = []
        for r in ratios:
            layout = split(workers, r)
            if layout is None:
                fits = ", ".join(f"{x.prefill}:{x.decode}" for x in every) or "none (use --colocated)"
                raise ValueError(f"ratio {r[0]}:{r[1]} does not split {workers} workers into whole pools "
                                 f"(prefill + decode must divide {workers}); ratios that fit: {fits}")
            if layout not in layouts:
                layouts.append(layout)
    if colocated:
        layouts = [*layouts, Layout(colocated=workers)]
    if not layouts:
        raise ValueError(f"{workers} worker cannot be split into prefill and decode pools: add --colocated")
    return layouts


@dataclass
class LayoutResult:
    """One layout's outcome: its bench summary, or the error that stopped it (``summary`` None)."""

    layout: Layout
    summary: dict[str, Any] | None = None
    error: str | None = None
    model: str = ""
    startup_s: float = 0.0
    actors_stopped: bool = False
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.summary is not None

    @property
    def goodput(self) -> float:
        """Requests meeting the SLO per second; without an SLO, completed requests per second."""
        if self.summary is None:
            return 0.0
        return float(self.summary.get("request_goodput", self.summary["request_throughput"]))

    @property
    def goodput_per_worker(self) -> float:
        return self.goodput / self.layout.workers


def choose_best(results: list[LayoutResult]) -> LayoutResult | None:
    """Highest goodput per worker, ties to the lower p99 TPOT; None when no layout had any goodput."""
    ran = [r for r in results if r.ok and r.goodput > 0]
    if not ran:
        return None
    top = max(r.goodput_per_worker for r in ran)
    tied = [r for r in ran if r.goodput_per_worker >= top - _TIE]
    return min(tied, key=lambda r: r.summary["p99_tpot_ms"] if r.summary else math.inf)


@dataclass
class PlanResult:
    """Every layout's result, the best one's name, and what the runs had in common."""

    workers: int
    results: list[LayoutResult]
    best: str | None
    model: str
    bench: BenchConfig
    cluster: ClusterConfig
    started: str
    command: str
    machine: dict[str, Any]


def _log(msg: str) -> None:
    print(f"baton plan: {msg}", file=sys.stderr, flush=True)


def _start_front(cluster: Any, model_name: str, port: int, max_queued: int) -> tuple[Any, str]:
    """The same HTTP front actor as ``baton serve``, pinned to this node so loopback reaches it."""
    import ray
    from baton_serve.cluster.http_actor import HTTPFront
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    workers = [{"worker_id": w.worker_id, "role": w.role, "handle": w.handle, "info": w.info}
               for w in cluster.workers]
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    front = ray.remote(HTTPFront).options(num_cpus=0, max_concurrency=4, scheduling_strategy=here).remote(
        workers, cluster.limits.__dict__.copy(), str(cluster.model_path), model_name, "127.0.0.1", port,
        max_queued, cluster.controller)
    return front, ray.get(front.url.remote())


def _wait_ready(url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url}/ready did not answer 200 within {timeout_s:g} s")


def _wait_dead(handles: list[Any], timeout_s: float) -> bool:
    """True once every actor in ``handles`` is dead (a ping raises), False after ``timeout_s``."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    deadline = time.monotonic() + timeout_s
    alive = list(handles)
    while alive and time.monotonic() < deadline:
        still = []
        for h in alive:
            try:
                ray.get(h.__ray_ready__.remote(), timeout=1)
                still.append(h)
            except RayActorError:
                pass
            except GetTimeoutError:
                still.append(h)
        alive = still
        if alive:
            time.sleep(0.2)
    return not alive


def run_layout(base: ClusterConfig, layout: Layout, bench: BenchConfig, port: int = 0) -> LayoutResult:
    """Start ``layout``, wait until ready, run ``bench`` against it, stop every actor it started.

    Start-up and bench failures are returned as the result's ``error``; WorkloadError is raised
    (the workload is the same for every layout, so it would fail them all).
    """
    from baton_serve.cluster.http_actor import stop_fronts
    from baton_serve.cluster.launcher import Cluster

    result = LayoutResult(layout)
    config = base.with_overrides(**{"pools.prefill": layout.prefill, "pools.decode": layout.decode,
                                    "pools.colocated": layout.colocated})
    cluster = Cluster(config)
    front = None
    t0 = time.monotonic()
    try:
        cluster.start()
        names = config.server.served_model_names(cluster.model_path)
        model_name = result.model = names[0]
        front, url = _start_front(cluster, names, port, config.server.max_queued_requests)
        _wait_ready(url, READY_TIMEOUT_S)
        result.startup_s = time.monotonic() - t0
        _log(f"{layout.name}: ready in {result.startup_s:.1f} s at {url}")
        res = run(replace(bench, base_url=url, model=model_name, tokenizer_source=str(cluster.model_path)))
        result.summary, result.warnings = res.summary, res.warnings
    except WorkloadError:
        raise
    except Exception as exc:  # a layout that cannot start or be reached is a result, not the end of the plan
        result.error = f"{type(exc).__name__}: {exc}"
        _log(f"{layout.name}: failed: {result.error}")
    finally:
        handles = [w.handle for w in cluster.workers] + [h for h in (cluster.controller, front) if h is not None]
        if front is not None:
            stop_fronts([front])
        cluster.stop()
        result.actors_stopped = _wait_dead(handles, STOP_TIMEOUT_S)
        if not result.actors_stopped:
            _log(f"warning: {layout.name}: actors still alive {STOP_TIMEOUT_S:g} s after stop")
    return result


def _machine() -> dict[str, Any]:
    import ray

    res = ray.cluster_resources()
    return {"system": platform.system(), "machine": platform.machine(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "ray_nodes": len([n for n in ray.nodes() if n.get("Alive")]),
            "ray_cpus": res.get("CPU", 0.0), "ray_gpus": res.get("GPU", 0.0)}


def run_plan(base: ClusterConfig, layouts: list[Layout], bench: BenchConfig, port: int = 0,
             command: str = "") -> PlanResult:
    """Run each layout in turn on one Ray session (started here unless one is up or ``ray.address`` is set)."""
    import ray
    from baton_serve.cluster.launcher import init_ray

    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    own_ray = init_ray(base)
    try:
        machine = _machine()
        results = []
        for i, layout in enumerate(layouts):
            _log(f"layout {layout.name} ({i + 1}/{len(layouts)})")
            results.append(run_layout(base, layout, bench, port))
    finally:
        if own_ray:
            ray.shutdown()
    best = choose_best(results)
    model = next((r.model for r in results if r.model), base.engine.model or "default model")
    return PlanResult(workers=layouts[0].workers, results=results, best=best.layout.name if best else None,
                      model=model, bench=bench, cluster=base, started=started, command=command,
                      machine=machine)


def _goodput_note(slo: SLO | None) -> str:
    if slo is None:
        return "no SLO given: goodput is the completed-request rate"
    limits = ", ".join(f"{k} <= {v:g} ms" for k, v in slo.as_dict().items())
    return f"requests meeting every SLO per second ({limits})"


def plan_json(pr: PlanResult) -> dict[str, Any]:
    """JSON-ready: machine, date, command, model, the best layout and each layout's full summary."""
    return {"date": pr.started, "command": pr.command, "machine": pr.machine, "model": pr.model,
            "workers": pr.workers, "best_layout": pr.best, "goodput_definition": _goodput_note(pr.bench.slo),
            "goodput_slo": pr.bench.slo.as_dict() if pr.bench.slo else None,
            "layouts": [{"name": r.layout.name, "prefill": r.layout.prefill, "decode": r.layout.decode,
                         "colocated": r.layout.colocated, "workers": r.layout.workers, "ok": r.ok,
                         "error": r.error, "startup_s": r.startup_s, "actors_stopped": r.actors_stopped,
                         "goodput": r.goodput, "goodput_per_worker": r.goodput_per_worker,
                         "warnings": r.warnings, "summary": r.summary} for r in pr.results],
            "bench_config": config_dict(pr.bench), "cluster_config": pr.cluster.model_dump()}


def plan_markdown(pr: PlanResult) -> str:
    """One row per layout, and the best layout by goodput per worker."""
    b = pr.bench
    rate = "all at once" if math.isinf(b.request_rate) else f"{b.request_rate:g} req/s"
    best = f"**{pr.best}**" if pr.best else "none (no layout completed a request within the SLO)"
    lines = [f"## baton plan live: {pr.workers} workers, {pr.model}", "",
             f"- workload: {b.num_prompts} requests, {rate}, input {b.workload.input_len.mean} / output "
             f"{b.workload.output_len.mean} tokens, seed {b.seed}",
             f"- goodput: {_goodput_note(b.slo)}", f"- best layout by goodput per worker: {best}", "",
             "| layout | P | D | C | req/s | out tok/s | goodput req/s | goodput/worker | SLO attainment "
             "| p50 TTFT ms | p99 TTFT ms | p50 TPOT ms | p99 TPOT ms | completed | failed |", "|" + "---|" * 15]
    for r in pr.results:
        L, s = r.layout, r.summary
        head = f"| {L.name} | {L.prefill} | {L.decode} | {L.colocated} |"
        if s is None:
            lines.append(f"{head} failed: {r.error} |" + " |" * 10)
            continue
        att = f"{s['slo_attainment']:.1%}" if "slo_attainment" in s else "n/a"
        lines.append(f"{head} {s['request_throughput']:.2f} | {s['output_throughput']:.1f} | {r.goodput:.2f} | "
                     f"{r.goodput_per_worker:.3f} | {att} | {s['median_ttft_ms']:.0f} | {s['p99_ttft_ms']:.0f} | "
                     f"{s['median_tpot_ms']:.1f} | {s['p99_tpot_ms']:.1f} | {s['completed']} | {s['failed']} |")
    for r in pr.results:
        lines += [f"- {r.layout.name}: **warning**: {w}" for w in r.warnings]
    return "\n".join(lines) + "\n"


def plot_plan(pr: PlanResult, path: str | Path) -> Path:
    """Bars of goodput per worker per layout, the best highlighted and failed layouts marked."""
    plt = pyplot()
    names = [r.layout.name for r in pr.results]
    values = [r.goodput_per_worker for r in pr.results]
    colors = ["C2" if r.layout.name == pr.best else ("lightgrey" if not r.ok else "C0") for r in pr.results]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(names) + 2), 4.5))
    bars = ax.bar(names, values, color=colors)
    for bar, r in zip(bars, pr.results):
        ax.annotate("failed" if not r.ok else f"{r.goodput_per_worker:.3f}",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=9)
    best = f"best: {pr.best}" if pr.best else "no layout met the SLO"
    ax.set(ylabel="goodput per worker (req/s)", title=f"{pr.workers} workers, goodput per worker\n{best}")
    return save_figure(plt, fig, path)
