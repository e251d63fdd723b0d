"""``baton plan sim --against RESULT.json``: the simulator checked against a measured run. Each
layout of a ``plan live`` result (or the one layout a ``baton bench`` result was run against) is
simulated with the same workload, seed and config, and the simulated figures are set beside the
measured ones with their relative error."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baton_serve.cluster.bench.plan import Layout
from baton_serve.cluster.bench.runner import BenchConfig, config_from_dict
from baton_serve.cluster.bench.workload import WorkloadError
from baton_serve.cluster.config import ClusterConfig
from baton_serve.cluster.sim.run import SimHardware, simulate

# (summary key, label): what the table compares
METRICS = (("goodput_per_worker", "goodput/worker"), ("median_ttft_ms", "p50 TTFT"), ("p99_ttft_ms", "p99 TTFT"),
           ("median_tpot_ms", "p50 TPOT"), ("p99_tpot_ms", "p99 TPOT"))


@dataclass
class Measured:
    """One measured layout: its summary, the workload that made it and the config it ran with."""

    layout: Layout
    summary: dict[str, Any]
    bench: BenchConfig
    cluster: ClusterConfig | None


def parse_layout(text: str) -> Layout:
    """``"2P+1D"`` or ``"3 colocated"`` (the names ``plan live`` gives) -> Layout; ValueError otherwise."""
    t = text.strip()
    if t.endswith("colocated") and t[:-len("colocated")].strip().isdigit():
        return Layout(colocated=int(t[:-len("colocated")]))
    p, plus, d = t.upper().partition("+")
    if plus and p.endswith("P") and d.endswith("D") and p[:-1].isdigit() and d[:-1].isdigit():
        return Layout(prefill=int(p[:-1]), decode=int(d[:-1]))
    raise ValueError(f"a layout is like 2P+1D or '3 colocated', got {text!r}")


def _goodput(summary: dict[str, Any]) -> float:
    return float(summary.get("request_goodput", summary.get("request_throughput", 0.0)))


def load_measured(path: str | Path, layout: str | None = None) -> list[Measured]:
    """The measured layouts in a ``plan live`` JSON, or the one of a ``baton bench`` JSON (its layout
    given by ``layout``, which bench results do not record). WorkloadError when it is neither."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise WorkloadError(f"cannot read {path}: {exc}") from None
    if isinstance(data, dict) and "layouts" in data and "bench_config" in data:
        bench = config_from_dict(data["bench_config"])
        cluster = ClusterConfig.model_validate(data["cluster_config"]) if data.get("cluster_config") else None
        out = []
        for row in data["layouts"]:
            if not row.get("ok") or not row.get("summary"):
                continue
            lay = Layout(int(row["prefill"]), int(row["decode"]), int(row["colocated"]))
            summary = dict(row["summary"])
            summary["goodput_per_worker"] = _goodput(summary) / lay.workers
            out.append(Measured(lay, summary, bench, cluster))
        return out
    if isinstance(data, dict) and "config" in data and "request_throughput" in data:
        if layout is None:
            raise WorkloadError(f"{path} is a baton bench result: say which layout it ran against with --layout")
        lay = parse_layout(layout)
        summary = {k: v for k, v in data.items() if not isinstance(v, list)}
        summary["goodput_per_worker"] = _goodput(summary) / lay.workers
        return [Measured(lay, summary, config_from_dict(data["config"]), None)]
    raise WorkloadError(f"{path} is neither a baton plan live nor a baton bench result")


def _error(sim: float | None, live: float | None) -> float | None:
    if sim is None or live is None or live == 0:
        return None
    return (sim - live) / live


def compare(measured: list[Measured], base: ClusterConfig, profile: Any, hardware: SimHardware,
            seed: int = 0) -> list[dict[str, Any]]:
    """Per measured layout: each metric measured, simulated, and the relative error (sim - live) / live."""
    rows = []
    for m in measured:
        config = (m.cluster or base).with_overrides(**{"pools.prefill": m.layout.prefill, "pools.decode": m.layout.decode,
                                                       "pools.colocated": m.layout.colocated})
        res = simulate(config, m.layout, m.bench, profile, hardware, seed=seed)
        sim = dict(res.summary)
        sim["goodput_per_worker"] = _goodput(sim) / m.layout.workers
        cells = {key: {"live": m.summary.get(key), "sim": sim.get(key), "error": _error(sim.get(key), m.summary.get(key))}
                 for key, _ in METRICS}
        rows.append({"layout": m.layout.name, "workers": m.layout.workers, "metrics": cells,
                     "sim_wall_s": res.wall_s})
    return rows


def best_layouts(rows: list[dict[str, Any]]) -> tuple[str | None, str | None]:
    """The layout with the highest goodput per worker, measured and simulated."""
    def best(side: str) -> str | None:
        ok = [r for r in rows if r["metrics"]["goodput_per_worker"][side] is not None]
        return max(ok, key=lambda r: r["metrics"]["goodput_per_worker"][side])["layout"] if ok else None
    return best("live"), best("sim")


def error_markdown(rows: list[dict[str, Any]], source: str) -> str:
    """The error table: measured / simulated / error per layout and metric, and the best of each."""
    head = "| layout | " + " | ".join(f"{label} live | sim | error" for _, label in METRICS) + " |"
    lines = [f"## baton plan sim --against {source}", "", head, "|" + "---|" * (1 + 3 * len(METRICS))]
    for r in rows:
        cells = []
        for key, _ in METRICS:
            c = r["metrics"][key]
            fmt = ".3f" if key == "goodput_per_worker" else ".0f"
            live = "n/a" if c["live"] is None else format(c["live"], fmt)
            sim = "n/a" if c["sim"] is None else format(c["sim"], fmt)
            err = "n/a" if c["error"] is None else f"{c['error']:+.1%}"
            cells += [live, sim, err]
        lines.append(f"| {r['layout']} | " + " | ".join(cells) + " |")
    live, sim = best_layouts(rows)
    same = "the same" if live == sim else "**different**"
    lines += ["", f"- best by goodput per worker: measured {live}, simulated {sim} ({same})"]
    return "\n".join(lines) + "\n"
