"""One benchmark run: warm-up (the first request alone, reported as the cold start), then the
measured requests, open loop on a schedule or closed loop with fixed concurrency.

Open loop never waits for the server before sending the next request: a dispatcher sleeps to
each scheduled time and spawns the request, so a stalled server accumulates late requests
whose latencies count from their scheduled arrival. A ``max_concurrency`` cap with a finite rate
queues requests *in the client*, and that wait counts too. Only with an infinite rate and a
cap is the run closed loop: ``max_concurrency`` users, each sending its next request when the
previous one ends (its arrival time).
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

import httpx
import numpy as np
from baton_serve.cluster.bench.arrivals import arrival_offsets, trace_offsets
from baton_serve.cluster.bench.client import Endpoint, fetch_model_name, send
from baton_serve.cluster.bench.metrics import DEFAULT_PERCENTILES, SLO, RequestRecord, summarize
from baton_serve.cluster.bench.prompts import Prompt, PromptFactory, load_tokenizer
from baton_serve.cluster.bench.workload import RequestSpec, WorkloadConfig, WorkloadError

_LOOP_PROBE_S = 0.02


@dataclass(frozen=True)
class BenchConfig:
    """Everything one run needs; ``model`` None asks the server (``GET /v1/models``).

    ``tokenizer_source`` (a folder or a model name, default ``model``) finds the tokenizer for
    exact prompt lengths. ``max_client_lag_ms`` is the p99 client lag above which a warning says
    the client, not the server, may be the bottleneck.
    """

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    tokenizer_source: str | None = None
    tokenizer: str | None = None
    endpoint: str = "/v1/completions"
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    num_prompts: int | None = 100
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    trace_speedup: float = 1.0
    seed: int = 0
    slo: SLO | None = None
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    num_warmups: int = 1
    # shared-prefix: first send each system prompt once, with a fresh suffix (steady-state caches)
    warmup_prefixes: bool = False
    ignore_eos: bool = True
    temperature: float = 0.0
    token_ids: bool = True
    request_timeout_s: float = 600.0
    max_client_lag_ms: float = 25.0
    disable_tqdm: bool = False


@dataclass
class BenchResult:
    """A finished run: the summary (vLLM keys), per-request records, the cold request, warnings."""

    config: BenchConfig
    model: str
    summary: dict[str, Any]
    records: list[RequestRecord]
    cold: RequestRecord | None
    prompt_lengths: str
    tokenizer_note: str
    mode: str
    warnings: list[str]
    started: str


def _log(msg: str) -> None:
    print(f"baton bench: {msg}", file=sys.stderr, flush=True)


@dataclass
class _Phase:
    """Shared pieces of one phase: the HTTP client, the clock origin and a completion hook."""

    client: httpx.AsyncClient
    endpoint: Endpoint
    timeout_s: float
    t0: float = field(default_factory=time.perf_counter)
    on_done: Callable[[], None] = lambda: None

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def run_one(self, rec: RequestRecord, prompt: Prompt) -> RequestRecord:
        try:
            await asyncio.wait_for(send(self.client, self.endpoint, prompt, rec, self.t0), self.timeout_s)
        except asyncio.TimeoutError:
            rec.ok, rec.error = False, f"timed out after {self.timeout_s:g} s"
        self.on_done()
        return rec


def _record(i: int, spec: RequestSpec, prompt: Prompt, t_scheduled: float) -> RequestRecord:
    return RequestRecord(index=i, prompt_len=prompt.num_tokens, expected_output_len=spec.output_len,
                         t_scheduled=t_scheduled)


async def _open_loop(ph: _Phase, specs: list[RequestSpec], prompts: list[Prompt], offsets: list[float],
                     cap: int | None) -> list[RequestRecord]:
    sem = asyncio.Semaphore(cap) if cap else None

    async def one(i: int) -> RequestRecord:
        rec = _record(i, specs[i], prompts[i], offsets[i])
        if sem is None:
            rec.t_ready = rec.t_scheduled
            return await ph.run_one(rec, prompts[i])
        async with sem:
            rec.t_ready = max(rec.t_scheduled, ph.now())
            return await ph.run_one(rec, prompts[i])

    tasks = []
    for i, offset in enumerate(offsets):
        delay = offset - ph.now()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    return list(await asyncio.gather(*tasks))


async def _closed_loop(ph: _Phase, specs: list[RequestSpec], prompts: list[Prompt],
                       users: int) -> list[RequestRecord]:
    pending = iter(range(len(specs)))
    records: list[RequestRecord] = []

    async def user() -> None:
        for i in pending:  # a shared iterator: each index goes to exactly one user
            rec = _record(i, specs[i], prompts[i], ph.now())
            rec.t_ready = rec.t_scheduled
            records.append(await ph.run_one(rec, prompts[i]))

    await asyncio.gather(*(user() for _ in range(users)))
    return sorted(records, key=lambda r: r.index)


async def _probe_loop(samples: list[float]) -> None:
    """Oversleep of a short timer: how far behind the client's event loop is running."""
    while True:
        start = time.perf_counter()
        await asyncio.sleep(_LOOP_PROBE_S)
        samples.append(time.perf_counter() - start - _LOOP_PROBE_S)


def schedule(cfg: BenchConfig, specs: list[RequestSpec]) -> tuple[list[float] | None, str]:
    """Arrival offsets (None for closed loop) and a description of the mode."""
    if specs and specs[0].arrival_s is not None:
        offs = trace_offsets([s.arrival_s or 0.0 for s in specs], cfg.trace_speedup)
        return offs, f"open loop, trace timestamps (x{cfg.trace_speedup:g})"
    if math.isinf(cfg.request_rate) and cfg.max_concurrency:
        return None, f"closed loop, {cfg.max_concurrency} concurrent users"
    offs = arrival_offsets(len(specs), cfg.request_rate, cfg.burstiness, cfg.seed)
    how = "all at once" if math.isinf(cfg.request_rate) else (
        f"{cfg.request_rate:g} req/s, burstiness {cfg.burstiness:g}")
    cap = f", at most {cfg.max_concurrency} in flight" if cfg.max_concurrency else ""
    return offs, f"open loop, {how}{cap}"


async def run_async(cfg: BenchConfig) -> BenchResult:
    """Run the benchmark described by ``cfg``. Raises ConnectionError when the server is unreachable
    and WorkloadError for a bad workload; request failures are recorded, not raised."""
    from tqdm import tqdm

    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    model = cfg.model or await fetch_model_name(cfg.base_url)
    tok, note = load_tokenizer(cfg.tokenizer, cfg.tokenizer_source or model)
    factory = PromptFactory(tok, cfg.seed)
    warnings = [] if factory.exact else [f"prompt lengths are approximate: {note}"]
    specs = cfg.workload.build(cfg.num_prompts, cfg.seed)
    warm_specs = cfg.workload.warmups(cfg.num_warmups, cfg.seed)
    prompts, warm_prompts = factory.build(specs), factory.build(warm_specs)
    if cfg.warmup_prefixes:
        if not any(s.prefix_group >= 0 for s in specs):
            raise WorkloadError("warm-up of prefixes needs a workload with shared prefixes (shared-prefix)")
        for spec, prompt in factory.prefix_warmups(specs, prompts):  # after: measured prompts unchanged
            warm_specs.append(spec)
            warm_prompts.append(prompt)
    offsets, mode = schedule(cfg, specs)
    endpoint = Endpoint(base_url=cfg.base_url, model=model, path=cfg.endpoint, ignore_eos=cfg.ignore_eos,
                        temperature=cfg.temperature, token_ids=cfg.token_ids, timeout_s=cfg.request_timeout_s)
    # No pool limit without a cap: a pool queue would delay sends invisibly to the lag figure.
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(cfg.request_timeout_s)) as client:
        cold = None
        for i, (spec, prompt) in enumerate(zip(warm_specs, warm_prompts)):
            ph = _Phase(client, endpoint, cfg.request_timeout_s)
            rec = await ph.run_one(_record(i, spec, prompt, 0.0), prompt)
            cold = rec if i == 0 else cold
        _log(f"{len(specs)} requests, {mode}; {note}")
        bar = tqdm(total=len(specs), disable=cfg.disable_tqdm, file=sys.stderr, desc="requests", unit="req")
        ph = _Phase(client, endpoint, cfg.request_timeout_s, on_done=lambda: bar.update(1))
        lag_samples: list[float] = []
        probe = asyncio.create_task(_probe_loop(lag_samples))
        try:
            if offsets is None:
                records = await _closed_loop(ph, specs, prompts, cfg.max_concurrency or 1)
            else:
                records = await _open_loop(ph, specs, prompts, offsets, cfg.max_concurrency)
        finally:
            probe.cancel()
            bar.close()
    duration = max((r.t_end for r in records if not math.isnan(r.t_end)), default=0.0)
    summary = summarize(records, duration, cfg.slo, cfg.percentiles)
    loop_lag_ms = np.asarray(lag_samples or [0.0]) * 1e3
    summary["p99_loop_lag_ms"] = float(np.percentile(loop_lag_ms, 99))
    summary["max_loop_lag_ms"] = float(loop_lag_ms.max())
    worst = max(summary["p99_client_lag_ms"], summary["p99_loop_lag_ms"])
    if worst > cfg.max_client_lag_ms:
        warnings.append(f"the client ran up to {worst:.0f} ms (p99) behind schedule, above "
                        f"{cfg.max_client_lag_ms:g} ms: latencies may include client delay; "
                        "lower the load or run the client on another machine")
    if summary["failed"]:
        first = next(r.error for r in records if not r.ok)
        warnings.append(f"{summary['failed']} of {len(records)} requests failed; first error: {first}")
    for w in warnings:
        _log(f"warning: {w}")
    return BenchResult(config=cfg, model=model, summary=summary, records=records, cold=cold,
                       prompt_lengths="exact" if factory.exact else "approximate", tokenizer_note=note,
                       mode=mode, warnings=warnings, started=started)


def run(cfg: BenchConfig) -> BenchResult:
    """Synchronous :func:`run_async`."""
    return asyncio.run(run_async(cfg))


def config_dict(cfg: BenchConfig) -> dict[str, Any]:
    """``cfg`` as JSON-ready data (infinities as the string "inf")."""
    def clean(v: Any) -> Any:
        if isinstance(v, float) and math.isinf(v):
            return "inf"
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v
    return clean(asdict(cfg))


def config_from_dict(data: dict[str, Any]) -> BenchConfig:
    """The inverse of :func:`config_dict`: a BenchConfig from a result file's ``config`` (or
    ``bench_config``). Raises WorkloadError naming a field that does not fit."""
    from baton_serve.cluster.bench.workload import LengthDist

    def num(v: Any) -> Any:
        return math.inf if v == "inf" else v

    try:
        raw = {k: num(v) for k, v in data.items() if k in BenchConfig.__dataclass_fields__}
        w = dict(raw.get("workload") or {})
        for key in ("input_len", "output_len"):
            if isinstance(w.get(key), dict):
                w[key] = LengthDist(**w[key])
        raw["workload"] = WorkloadConfig(**w)
        raw["slo"] = SLO(**raw["slo"]) if raw.get("slo") else None
        if "percentiles" in raw:
            raw["percentiles"] = tuple(raw["percentiles"])
        return BenchConfig(**raw)
    except (TypeError, ValueError) as exc:
        raise WorkloadError(f"the result's bench config does not fit this version of baton: {exc}") from None
