"""Results as JSON (vLLM's ``--result-file`` keys first), a Markdown table, and PNG plots."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from baton_serve.cluster.bench.metrics import METRICS, RequestRecord
from baton_serve.cluster.bench.runner import BenchResult, config_dict

from baton_serve.extras import install_hint

_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}


def _finite(v: float) -> float | str:
    return "inf" if isinstance(v, float) and math.isinf(v) else v


def _record_dict(r: RequestRecord) -> dict[str, Any]:
    return {"index": r.index, "ok": r.ok, "status": r.status, "error": r.error, "prompt_len": r.prompt_len,
            "output_len": r.output_tokens, "cached_tokens": r.cached_tokens, "scheduled_s": r.t_scheduled,
            "sent_s": r.t_sent, "ttft_s": r.ttft, "tpot_s": r.tpot, "e2el_s": r.e2el}


def result_json(res: BenchResult) -> dict[str, Any]:
    """vLLM's result layout (config echo, summary keys, per-request ``input_lens`` / ``output_lens``
    / ``ttfts`` / ``itls`` / ``errors`` in seconds) plus Baton's fields."""
    cfg = res.config
    recs = res.records
    out: dict[str, Any] = {
        "date": res.started, "backend": "openai-chat" if "chat" in cfg.endpoint else "openai",
        "base_url": cfg.base_url, "endpoint": cfg.endpoint, "model_id": res.model,
        "num_prompts": len(recs), "request_rate": _finite(cfg.request_rate),
        "burstiness": _finite(cfg.burstiness),
        "max_concurrency": cfg.max_concurrency, "seed": cfg.seed,
    }
    out.update(res.summary)
    out.update({
        "input_lens": [r.prompt_len for r in recs], "output_lens": [r.output_tokens for r in recs],
        "ttfts": [r.ttft or 0.0 for r in recs], "itls": [r.itls for r in recs],
        "errors": [r.error for r in recs],
        "mode": res.mode, "prompt_lengths": res.prompt_lengths, "tokenizer": res.tokenizer_note,
        "warnings": res.warnings, "cold_request": _record_dict(res.cold) if res.cold else None,
        "num_warmups": cfg.num_warmups, "requests": [_record_dict(r) for r in recs],
        "config": config_dict(cfg),
    })
    return out


def write_json(data: dict[str, Any], path: str | Path) -> Path:
    """Write ``data`` (NaN as null) to ``path``, creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def clean(v: Any) -> Any:
        if isinstance(v, float) and math.isnan(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v
    path.write_text(json.dumps(clean(data), indent=1) + "\n", encoding="utf-8")
    return path


def write_plan_outputs(data: dict[str, Any], md: str, path: Path,
                       plot: Callable[[Path], Path] | None) -> list[Path]:
    """Write a plan's JSON at ``path``, its Markdown beside it and, if ``plot`` runs, its PNG."""
    written = [write_json(data, path), path.with_suffix(".md")]
    written[1].write_text(md, encoding="utf-8")
    if plot is not None:
        try:
            written.append(plot(path.with_suffix(".png")))
        except ImportError:
            print(f"baton plan: warning: no matplotlib, no plot ({install_hint('matplotlib')})", file=sys.stderr)
    return written


def _pcols(summary: dict[str, Any]) -> list[str]:
    return [k.split("_")[0] for k in summary if k.startswith("p") and k.endswith("_ttft_ms")]


def markdown(res: BenchResult) -> str:
    """A short report: mode, throughput and goodput lines, and a latency table (ms)."""
    s = res.summary
    pcols = _pcols(s)
    lines = [f"## baton bench: {res.model} at {res.config.base_url}", "",
             f"- {res.mode}; prompt lengths {res.prompt_lengths}",
             f"- completed {s['completed']}, failed {s['failed']}, duration {s['duration']:.2f} s",
             f"- request throughput {s['request_throughput']:.2f} req/s, output {s['output_throughput']:.1f} tok/s,"
             f" total {s['total_token_throughput']:.1f} tok/s"]
    lines.append(_hit_rate_line(s))
    if "request_goodput" in s:
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in s["goodput_slo"].items())
        lines.append(f"- goodput {s['request_goodput']:.2f} req/s, "
                     f"SLO attainment {s['slo_attainment']:.1%} ({slo})")
    lines.append(f"- client lag p99 {s['p99_client_lag_ms']:.1f} ms, "
                 f"event-loop lag p99 {s['p99_loop_lag_ms']:.1f} ms")
    cold = res.cold
    if cold is not None and cold.ttft is not None and cold.e2el is not None:
        lines.append(f"- cold first request (excluded): TTFT {cold.ttft * 1e3:.1f} ms, "
                     f"E2E {cold.e2el * 1e3:.1f} ms")
    for w in res.warnings:
        lines.append(f"- **warning**: {w}")
    head = ["metric (ms)", "mean", *pcols, "max", "samples"]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in METRICS:
        vals = [s[f"mean_{m}_ms"], *(s[f"{p}_{m}_ms"] for p in pcols), s[f"max_{m}_ms"]]
        lines.append(f"| {_LABELS[m]} | " + " | ".join(f"{v:.1f}" for v in vals) + f" | {s[f'{m}_samples']} |")
    return "\n".join(lines) + "\n"


def _hit_rate_line(s: dict[str, Any]) -> str:
    rate, n = s.get("prefix_hit_rate"), s.get("cached_tokens_reported", 0)
    if rate is None:
        return "- prefix cache hit rate unknown: no response reported usage.prompt_tokens_details.cached_tokens"
    return (f"- prefix cache hit rate {rate:.1%} of prompt tokens "
            f"(cached tokens reported by {n} of {s['completed']} completed requests)")


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt: Any, fig: Any, path: str | Path) -> Path:
    """Lay out ``fig``, write it as a PNG at ``path`` (folders made as needed) and close it."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(res: BenchResult, path: str | Path) -> Path:
    """Two panels: TTFT and E2E latency of each request against its scheduled arrival (stalls
    show as ramps), and the percentiles of each metric."""
    plt = pyplot()
    s = res.summary
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ok = [r for r in res.records if r.ok]
    xs = [r.t_scheduled for r in ok]
    ax1.scatter(xs, [(r.e2el or 0.0) * 1e3 for r in ok], s=10, label="E2E latency")
    ax1.scatter(xs, [(r.ttft or 0.0) * 1e3 for r in ok], s=10, label="TTFT")
    bad = [r for r in res.records if not r.ok]
    if bad:
        ax1.scatter([r.t_scheduled for r in bad], [0] * len(bad), marker="x", color="red", label="failed")
    ax1.set(xlabel="scheduled arrival (s)", ylabel="ms", title=res.mode)
    ax1.legend()
    pcols = _pcols(s)
    cols = [*([] if "p50" in pcols else ["median"]), *pcols, "max"]
    width = 0.8 / len(cols)
    for j, c in enumerate(cols):
        ax2.bar([i + j * width for i in range(len(METRICS))], [s[f"{c}_{m}_ms"] for m in METRICS], width, label=c)
    ax2.set_xticks([i + 0.4 - width / 2 for i in range(len(METRICS))],
                   [f"{_LABELS[m]}\n(n={s[f'{m}_samples']})" for m in METRICS])
    ax2.set(ylabel="ms", title=f"{s['completed']} requests, {s['request_throughput']:.2f} req/s")
    ax2.set_yscale("log")
    ax2.legend()
    return save_figure(plt, fig, path)
