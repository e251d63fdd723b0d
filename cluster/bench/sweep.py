"""A load sweep: the same workload at increasing offered rates, from idle past saturation, and
the knee: the highest rate up to which every rate's p99 TTFT and p99 TPOT meet the SLOs.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from baton_serve.cluster.bench.metrics import SLO
from baton_serve.cluster.bench.report import pyplot, save_figure
from baton_serve.cluster.bench.runner import BenchConfig, config_dict, run

MAX_FAILED_FRACTION = 0.01  # failures beyond 1% would hide inside a p99 of the completed ones


@dataclass
class SweepPoint:
    """One rate's summary and whether it meets the SLOs."""

    rate: float
    summary: dict[str, Any]
    meets_slo: bool


@dataclass
class SweepResult:
    """All points (ascending rate), the SLO and the knee (None when even the lowest rate fails)."""

    points: list[SweepPoint]
    slo: SLO
    knee_rate: float | None
    model: str
    started: str
    config: BenchConfig


def meets(summary: dict[str, Any], slo: SLO) -> bool:
    """p99 TTFT, p99 TPOT (and p99 E2E when given) within the SLO, at most 1% failed, and something done."""
    total = summary["completed"] + summary["failed"]
    if summary["completed"] == 0 or summary["failed"] > MAX_FAILED_FRACTION * total:
        return False
    limits = (("ttft", slo.ttft_ms), ("tpot", slo.tpot_ms), ("e2el", slo.e2el_ms))
    return all(limit is None or summary[f"p99_{m}_ms"] <= limit for m, limit in limits)


def find_knee(points: list[SweepPoint]) -> float | None:
    """The last rate of the run of passing rates that starts at the lowest rate."""
    knee = None
    for p in sorted(points, key=lambda p: p.rate):
        if not p.meets_slo:
            break
        knee = p.rate
    return knee


def run_sweep(cfg: BenchConfig, rates: list[float], stop_after: int = 0) -> SweepResult:
    """Run ``cfg`` at each rate (ascending); warm-up only before the first. ``stop_after`` > 0
    ends the sweep after that many consecutive rates miss the SLO (deep past saturation each run
    only adds queueing time). ValueError without TTFT and TPOT SLOs."""
    slo = cfg.slo
    if slo is None or slo.ttft_ms is None or slo.tpot_ms is None:
        raise ValueError("a sweep needs SLOs: --goodput ttft:MS tpot:MS")
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    points: list[SweepPoint] = []
    model = cfg.model or ""
    misses = 0
    for i, rate in enumerate(sorted(rates)):
        print(f"baton bench sweep: rate {rate:g} req/s ({i + 1}/{len(rates)})", file=sys.stderr, flush=True)
        warmups = cfg.num_warmups if i == 0 else 0
        res = run(replace(cfg, request_rate=rate, num_warmups=warmups, model=model or None))
        model = res.model
        points.append(SweepPoint(rate, res.summary, meets(res.summary, slo)))
        misses = 0 if points[-1].meets_slo else misses + 1
        if stop_after and misses >= stop_after:
            break
    return SweepResult(points=points, slo=slo, knee_rate=find_knee(points), model=model, started=started,
                       config=cfg)


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def sweep_json(sw: SweepResult) -> dict[str, Any]:
    """The sweep as JSON-ready data: knee, SLO, and each rate's full summary."""
    return {"date": sw.started, "model_id": sw.model, "base_url": sw.config.base_url,
            "goodput_slo": sw.slo.as_dict(),
            "knee_request_rate": None if sw.knee_rate is None else _rate_json(sw.knee_rate),
            "rates": [_rate_json(p.rate) for p in sw.points],
            "points": [{"request_rate": _rate_json(p.rate), "meets_slo": p.meets_slo, **p.summary}
                       for p in sw.points],
            "config": config_dict(sw.config)}


def sweep_markdown(sw: SweepResult) -> str:
    """One row per rate and the knee."""
    slo = ", ".join(f"p99 {k} <= {v:g} ms" for k, v in sw.slo.as_dict().items())
    knee = "none (the lowest rate already misses)" if sw.knee_rate is None else f"{sw.knee_rate:g} req/s"
    lines = [f"## baton bench sweep: {sw.model} at {sw.config.base_url}", "", f"- SLO: {slo}",
             f"- knee (highest rate still meeting the SLO): **{knee}**", "",
             "| offered req/s | achieved req/s | goodput req/s | SLO attainment | p99 TTFT ms | p99 TPOT ms "
             "| failed | meets SLO |", "|" + "---|" * 8]
    for p in sw.points:
        s = p.summary
        lines.append(f"| {p.rate:g} | {s['request_throughput']:.2f} | {s['request_goodput']:.2f} | "
                     f"{s['slo_attainment']:.1%} | {s['p99_ttft_ms']:.1f} | {s['p99_tpot_ms']:.1f} | {s['failed']} | "
                     f"{'yes' if p.meets_slo else 'no'} |")
    return "\n".join(lines) + "\n"


def plot_sweep(sw: SweepResult, path: str | Path) -> Path:
    """Latency percentiles against offered load (SLO lines dashed) and throughput/goodput against
    offered load, the knee marked; an infinite rate is drawn at twice the highest finite one."""
    plt = pyplot()
    finite = [p.rate for p in sw.points if not math.isinf(p.rate)]
    inf_x = 2 * max(finite) if finite else 1.0
    xs = [inf_x if math.isinf(p.rate) else p.rate for p in sw.points]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for metric, color, limit in (("ttft", "C0", sw.slo.ttft_ms), ("tpot", "C1", sw.slo.tpot_ms)):
        for pct, style in (("median", ":"), ("p99", "-")):
            ax1.plot(xs, [p.summary[f"{pct}_{metric}_ms"] for p in sw.points], style, color=color, marker="o",
                     label=f"{pct} {metric.upper()}")
        if limit is not None:
            ax1.axhline(limit, color=color, linestyle="--", linewidth=1)
    ax1.set(xlabel="offered load (req/s)", ylabel="ms", title="latency vs offered load (dashed: SLO)")
    ax1.set_yscale("log")
    ax2.plot(xs, [p.summary["request_throughput"] for p in sw.points], marker="o", label="throughput")
    ax2.plot(xs, [p.summary["request_goodput"] for p in sw.points], marker="s", label="goodput")
    if finite:
        ax2.plot([0, max(finite)], [0, max(finite)], color="grey", linewidth=0.8, linestyle=":", label="offered")
    ax2.set(xlabel="offered load (req/s)", ylabel="req/s", title="throughput and goodput vs offered load")
    for ax in (ax1, ax2):
        if sw.knee_rate is not None:
            ax.axvline(inf_x if math.isinf(sw.knee_rate) else sw.knee_rate, color="green", linewidth=1,
                       label=f"knee {sw.knee_rate:g} req/s")
        if len(finite) < len(xs):
            ticks = sorted(set(xs))
            ax.set_xticks(ticks, [("inf" if x == inf_x else f"{x:g}") for x in ticks])
        ax.legend(fontsize=8)
    return save_figure(plt, fig, path)
