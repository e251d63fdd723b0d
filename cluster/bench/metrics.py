"""Per-request timings and the run summary (vLLM's result keys, SLO attainment, goodput).

Every timestamp is seconds from the run's start on one ``time.perf_counter`` clock, so client
and server-side waits share a system boundary: the client's socket. The arrival of a request is
its *scheduled* time (open loop) or the moment its closed-loop user became free, never the
moment the client got round to sending it; a stalled server or a slow client therefore shows up
in the latencies instead of silently thinning the sample (coordinated omission).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestRecord:
    """What one request did. ``emit_times`` are the arrival times of the chunks carrying text.

    A chunk may carry several tokens (a server holds text back across incomplete UTF-8 or stop
    strings), so ITLs are per chunk while TPOT divides by the token count the server reports.
    ``cached_tokens`` is the server's ``usage.prompt_tokens_details.cached_tokens`` (prompt tokens
    served from its prefix cache); None when it did not say, which is unknown, not zero.
    """

    index: int
    prompt_len: int
    expected_output_len: int
    t_scheduled: float
    t_ready: float = math.nan  # when the client was free to send (>= t_scheduled; a cap may delay it)
    t_sent: float = math.nan
    t_end: float = math.nan
    emit_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int | None = None
    ok: bool = False
    status: int = 0
    error: str = ""

    @property
    def ttft(self) -> float | None:
        """t_first_emit - t_arrival, None when nothing was emitted."""
        return self.emit_times[0] - self.t_scheduled if self.ok and self.emit_times else None

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive text chunks."""
        t = self.emit_times
        return [b - a for a, b in zip(t, t[1:])] if self.ok else []

    @property
    def tpot(self) -> float | None:
        """(t_last_emit - t_first_emit) / (N_out - 1); None unless N_out >= 2."""
        if not self.ok or self.output_tokens < 2 or not self.emit_times:
            return None
        return (self.emit_times[-1] - self.emit_times[0]) / (self.output_tokens - 1)

    @property
    def e2el(self) -> float | None:
        """End of the stream - t_arrival."""
        return self.t_end - self.t_scheduled if self.ok else None

    @property
    def client_lag(self) -> float:
        """How late the client sent it after it was free to: the client's own bottleneck."""
        return self.t_sent - self.t_ready


@dataclass(frozen=True)
class SLO:
    """Latency objectives in milliseconds; None means unconstrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def met_by(self, rec: RequestRecord) -> bool:
        """True when ``rec`` succeeded and meets every given objective (TPOT is vacuous below 2 tokens)."""
        if not rec.ok:
            return False
        checks = ((self.ttft_ms, rec.ttft), (self.tpot_ms, rec.tpot), (self.e2el_ms, rec.e2el))
        return all(limit is None or value is None or value * 1e3 <= limit for limit, value in checks)

    def as_dict(self) -> dict[str, float]:
        """Only the objectives that are set, keyed like vLLM's ``--goodput`` names."""
        items = (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("e2el", self.e2el_ms))
        return {k: v for k, v in items if v is not None}


def parse_goodput(items: list[str] | None) -> SLO | None:
    """``["ttft:500", "tpot:50"]`` (vLLM's ``--goodput`` syntax, milliseconds) -> SLO; ValueError if malformed."""
    if not items:
        return None
    values: dict[str, float] = {}
    for item in items:
        name, sep, ms = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        try:
            values[f"{name}_ms"] = float(ms)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {ms!r} is not a number of milliseconds") from None
        if values[f"{name}_ms"] <= 0:
            raise ValueError(f"--goodput {item!r} must be positive")
    return SLO(**values)


def _stats(name: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float | int]:
    """mean/median/std/pXX/max in ms, with the sample count; zeros (and count 0) when empty."""
    arr = np.asarray(values_s, dtype=float) * 1e3
    empty = arr.size == 0
    out: dict[str, float | int] = {
        f"mean_{name}_ms": 0.0 if empty else float(arr.mean()),
        f"median_{name}_ms": 0.0 if empty else float(np.median(arr)),
        f"std_{name}_ms": 0.0 if empty else float(arr.std()),
    }
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = 0.0 if empty else float(np.percentile(arr, p))
    out[f"max_{name}_ms"] = 0.0 if empty else float(arr.max())
    out[f"{name}_samples"] = int(arr.size)
    return out


def prefix_hit_rate(records: list[RequestRecord]) -> tuple[float | None, int]:
    """sum(cached_tokens) / sum(prompt_len) over the successful requests that reported cached
    tokens, and how many did; None (and 0) when none did."""
    reported = [r for r in records if r.ok and r.cached_tokens is not None]
    prompt = sum(r.prompt_len for r in reported)
    if not reported or prompt <= 0:
        return None, len(reported)
    return sum(r.cached_tokens or 0 for r in reported) / prompt, len(reported)


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO | None = None,
              percentiles: tuple[float, ...] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    """The run summary under vLLM's key names, plus Baton's extras.

    Throughputs and goodput are rates over ``duration_s``; ``slo_attainment`` is the ratio of
    requests meeting every SLO to all requests, failed ones counting as misses; ``prefix_hit_rate``
    is the client's view of the server's prefix cache (see :func:`prefix_hit_rate`).
    """
    done = [r for r in records if r.ok]
    duration = max(duration_s, 1e-9)
    n_in = sum(r.prompt_len for r in done)
    n_out = sum(r.output_tokens for r in done)
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(done) / duration,
        "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration,
    }
    out["prefix_hit_rate"], out["cached_tokens_reported"] = prefix_hit_rate(records)
    if slo is not None:
        good = sum(slo.met_by(r) for r in records)
        out["request_goodput"] = good / duration
        out["slo_attainment"] = good / len(records) if records else 0.0
        out["goodput_slo"] = slo.as_dict()
    series = {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [x for r in done for x in r.itls],
        "e2el": [r.e2el for r in done if r.e2el is not None],
    }
    for name in METRICS:
        out.update(_stats(name, series[name], percentiles))
    lags = [r.client_lag for r in records if not math.isnan(r.t_sent)]
    out.update(_stats("client_lag", lags, (99.0,)))
    return out
