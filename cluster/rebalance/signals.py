"""What the rebalancer decides from: a sliding window of finished requests and worker polls,
reduced to one ``PoolSignals`` per pool.

Plain code (no Ray, sockets or clocks of its own): the controller and the simulator feed it the
samples they have and read ``Signals`` when they decide. Each pool's ``pressure`` is one number,
1.0 at its target: above it the pool is short of capacity, below it the pool has room. It is the
larger of the latency part (the pool's latency at the attainment quantile over its SLO: TTFT for
prefill, TPOT for decode, the worse of both colocated) and the load part (for prefill, the busy
fraction over the utilization target; for the pools that keep KV until the last token, KV usage
over its high-water mark: a decode worker is busy whenever one sequence runs, so its busy time
says nothing of its room). The load part scales with the pool's size, so the rebalancer can
project what removing or adding a worker would do to it; the latency part tells that a pool is
short before its load shows it (queues, batches grown past the TPOT target).

Prompts a decode worker prefills itself (conditional disaggregation) are the decode pool's: their
TTFT counts against its TTFT SLO, not the prefill pool's (their wait was in its queue), and of its
TPOT only the decode share of its step time counts (a step's time splits by token share, as the
engine accounts it), so a TPOT slowed by prompts does not read as a shortage of decode workers.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestSample:
    """One finished request as a front saw it (times in seconds)."""

    at: float  # when it finished
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float | None  # None: it failed before its first token
    tpot_s: float | None  # None: fewer than two output tokens
    first_role: str | None = None  # the role of the worker that made its first token (None: prefill)


@dataclass(frozen=True)
class WorkerSample:
    """One worker's load at one stats poll."""

    at: float
    worker_id: str
    role: str  # prefill, decode or colocated
    busy_fraction: float  # engine busy seconds over wall seconds since the previous poll, 0..1
    kv_usage: float  # used KV blocks over all, 0..1
    waiting: int
    running: int
    prefill_fraction: float = 0.0  # of the wall seconds, those its steps spent on prompt tokens, 0..1


def time_share(seconds: float, wall: float) -> float:
    """``seconds`` of engine time over ``wall`` seconds, clamped to 0..1 (0 over no time)."""
    return min(max(seconds / wall, 0.0), 1.0) if wall > 0 else 0.0


@dataclass(frozen=True)
class Targets:
    """The SLOs the pools are sized for, and the load each pool may run at."""

    ttft_s: float = 2.0
    tpot_s: float = 0.1
    attainment: float = 0.9  # the share of requests that must meet each SLO
    utilization: float = 0.8  # busy fraction a pool may average
    kv_high: float = 0.9  # KV usage above which the keeping pool is short of room


@dataclass(frozen=True)
class PoolSignals:
    """One pool's window: its size, latency at the attainment quantile, load, and pressure."""

    role: str
    workers: int
    latency_s: float | None  # TTFT (prefill) or TPOT (decode) at the attainment quantile
    attainment: float | None  # share of the window's requests within the SLO
    busy_fraction: float  # mean over its workers and polls
    kv_usage: float  # mean over its workers and polls
    waiting: float  # mean waiting requests per worker
    latency_pressure: float | None
    load_pressure: float
    local_prefill: float = 0.0  # mean prefill fraction of its workers: prompts they prefilled themselves

    @property
    def pressure(self) -> float:
        """The larger of the two parts; 1.0 is the target."""
        return max(self.load_pressure, self.latency_pressure or 0.0)

    def projected(self, workers: int) -> float:
        """The load part with ``workers`` instead of today's (the same work shared by more or fewer)."""
        if workers <= 0:
            return math.inf
        return self.load_pressure * self.workers / workers


@dataclass(frozen=True)
class Signals:
    """The whole window: arrivals and length distributions, and each pool's signals by role."""

    window_s: float
    requests: int
    arrival_rate: float  # requests per second that got their first token in the window
    prompt_p50: float
    prompt_p90: float
    uncached_p90: float
    output_p50: float
    output_p90: float
    pools: dict[str, PoolSignals]


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear between order statistics); NaN for none."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class SignalWindow:
    """The last ``window_s`` seconds of samples; ``signals(now, roles)`` reduces them."""

    def __init__(self, window_s: float, targets: Targets = Targets()) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.targets = targets
        self._requests: deque[RequestSample] = deque()
        self._polls: deque[WorkerSample] = deque()

    def add_request(self, sample: RequestSample) -> None:
        self._requests.append(sample)

    def add_poll(self, sample: WorkerSample) -> None:
        self._polls.append(sample)

    def _trim(self, now: float) -> None:
        start = now - self.window_s
        for q in (self._requests, self._polls):
            while q and q[0].at < start:
                q.popleft()

    def signals(self, now: float, roles: dict[str, str]) -> Signals:
        """The window ending at ``now``, for the workers in ``roles`` (worker id -> its role now):
        a worker's polls from before a role change count for the role it has now only."""
        self._trim(now)
        reqs = list(self._requests)
        t = self.targets
        polls: dict[str, list[WorkerSample]] = {}
        for p in self._polls:
            if roles.get(p.worker_id) == p.role:
                polls.setdefault(p.role, []).append(p)
        counts: dict[str, int] = {}
        for role in roles.values():
            counts[role] = counts.get(role, 0) + 1
        ttfts = [r.ttft_s for r in reqs if r.ttft_s is not None]
        local = [r.ttft_s for r in reqs if r.ttft_s is not None and r.first_role == "decode"]
        remote = [r.ttft_s for r in reqs if r.ttft_s is not None and r.first_role in (None, "prefill")]
        tpots = [r.tpot_s for r in reqs if r.tpot_s is not None]
        # which SLO bounds a pool: TTFT the prefill pool's, TPOT the decode pool's, and the TTFT of
        # the prompts a decode worker prefilled itself its own (their wait is in its queue); a
        # colocated pool answers for both; the one further off is a pool's latency
        slos = {"prefill": [(remote, t.ttft_s, "ttft")], "decode": [(tpots, t.tpot_s, "tpot"), (local, t.ttft_s, "ttft")],
                "colocated": [(ttfts, t.ttft_s, "ttft"), (tpots, t.tpot_s, "tpot")]}
        pools = {role: self._pool(role, n, polls.get(role, []), slos.get(role, []))
                 for role, n in sorted(counts.items())}
        # live, a disaggregated request leaves two samples: its TTFT where its first token was
        # made, its TPOT where its last was; prompts count once (by TTFT), outputs once (by TPOT)
        started = [r for r in reqs if r.ttft_s is not None] or reqs
        ended = [r for r in reqs if r.tpot_s is not None] or reqs
        prompts = [float(r.prompt_tokens) for r in started]
        outputs = [float(r.output_tokens) for r in ended]
        uncached = [float(r.prompt_tokens - r.cached_tokens) for r in started]
        n = max(len(started), len(ended)) if reqs else 0
        return Signals(self.window_s, n, len(started) / self.window_s, quantile(prompts, 0.5),
                       quantile(prompts, 0.9), quantile(uncached, 0.9), quantile(outputs, 0.5),
                       quantile(outputs, 0.9), pools)

    def _pool(self, role: str, workers: int, polls: list[WorkerSample],
              slos: list[tuple[list[float], float, str]]) -> PoolSignals:
        t = self.targets
        busy = sum(p.busy_fraction for p in polls) / len(polls) if polls else 0.0
        kv = sum(p.kv_usage for p in polls) / len(polls) if polls else 0.0
        waiting = sum(p.waiting for p in polls) / len(polls) if polls else 0.0
        local = sum(p.prefill_fraction for p in polls) / len(polls) if polls else 0.0
        # a prefill worker's busy time is its prompts' work, so it measures how full the pool is;
        # a decode worker steps whenever one sequence runs, so there KV room is the measure
        load = busy / t.utilization if role == "prefill" else kv / t.kv_high
        # of a decode pool's TPOT, the share its own prompts took is not decode's (see above)
        decode_share = max(0.0, 1.0 - local / busy) if role == "decode" and busy > 0.0 else 1.0
        worst: tuple[float, float, float] | None = None  # (pressure, latency, attainment)
        for latencies, slo, kind in slos:
            if not latencies or not slo > 0:
                continue
            latency = quantile(latencies, t.attainment)
            attained = sum(1 for x in latencies if x <= slo) / len(latencies)
            pressure = latency / slo * (decode_share if kind == "tpot" else 1.0)
            if worst is None or pressure > worst[0]:
                worst = (pressure, latency, attained)
        if worst is None:
            return PoolSignals(role, workers, None, None, busy, kv, waiting, None, load, local)
        return PoolSignals(role, workers, worst[1], worst[2], busy, kv, waiting, worst[0], load, local)
