"""Every Prometheus metric Baton exports, in one place, named as vLLM users expect.

A ``Metrics`` object owns its own registry (no process-global state); the HTTP front records
request timings, and ``observe_worker`` copies worker load snapshots into the gauges.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 1.0)
_ERROR_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 8.0)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class _WorkerCounters:
    """Last cumulative values seen from a worker, to turn snapshots into counter increments."""

    values: dict[str, float] = field(default_factory=dict)

    def delta(self, name: str, value: float) -> float:
        prev = self.values.get(name, 0.0)
        self.values[name] = value
        return max(value - prev, 0.0)


class Metrics:
    """The metric families; label ``model_name`` on request metrics, ``role``/``worker`` on workers."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]
        w = ["role", "worker"]
        self.ttft = Histogram("baton:time_to_first_token_seconds", "Arrival to first token, end to end",
                              m, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("baton:inter_token_latency_seconds", "Gap between consecutive output tokens",
                             m, buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("baton:request_time_per_output_token_seconds",
                              "(last token - first token) / (output tokens - 1) per request", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("baton:e2e_request_latency_seconds", "Arrival to last token", m,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("baton:request_queue_time_seconds", "Seconds a request waited in "
                                    "admission's queue for KV room (0 when admitted at once)",
                                    m, buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("baton:prompt_tokens", "Prompt tokens processed", m, registry=r)
        self.generation_tokens = Counter("baton:generation_tokens", "Output tokens generated", m, registry=r)
        self.request_success = Counter("baton:request_success", "Finished requests by finish reason",
                                       m + ["finished_reason"], registry=r)
        self.request_rejected = Counter("baton:requests_rejected", "Requests refused at admission, by "
                                        "reason (unauthenticated, tenant_request_rate, tenant_token_rate, "
                                        "queue_full, kv_queue_full, queue_deadline, draining, ...)",
                                        m + ["reason", "tenant"], registry=r)
        self.tenant_prompt_tokens = Counter("baton:tenant_prompt_tokens", "Prompt tokens of finished "
                                            "requests, per tenant", ["tenant"], registry=r)
        self.tenant_generation_tokens = Counter("baton:tenant_generation_tokens", "Output tokens of "
                                                "finished requests, per tenant", ["tenant"], registry=r)
        self.admission_queue_depth = Gauge("baton:admission_queue_depth", "Requests queued for KV room at "
                                           "this front, per priority class", ["priority"], registry=r)
        self.kv_reserved_blocks = Gauge("baton:kv_reserved_blocks", "KV blocks this front's admitted "
                                        "requests hold in the worker's reservation ledger", ["worker"],
                                        registry=r)
        self.kv_reservable_blocks = Gauge("baton:kv_reservable_blocks", "The worker's KV blocks this front "
                                          "may reserve (its share of them)", ["worker"], registry=r)
        self.migrations = Counter("baton:request_migrations_total", "Requests placed again because a worker "
                                  "holding them died, by the dead worker's role", ["role"], registry=r)
        self.worker_restarts = Counter("baton:worker_restarts_total", "Dead workers the controller started "
                                       "again, as this front adopted them", ["role"], registry=r)
        self.rebalance = Counter("baton:rebalance_total", "Rebalancer actions carried out, as this front saw "
                                 "them (flip: a worker changed role)", ["action", "reason"], registry=r)
        self.peer_scrape_failures = Counter("baton:metrics_peer_scrape_failures", "Scrapes of this front "
                                            "that left out another front's share: it did not answer in "
                                            "time", registry=r)
        self.running = Gauge("baton:num_requests_running", "Requests in the engine's running batch", w,
                             registry=r)
        self.paused = Gauge("baton:num_requests_paused", "Requests descheduled because their reader fell "
                            "behind (backpressure); their KV is kept", w, registry=r)
        self.waiting = Gauge("baton:num_requests_waiting", "Requests waiting to be scheduled", w, registry=r)
        self.kv_usage = Gauge("baton:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", w,
                              registry=r)
        self.prefix_queries = Counter("baton:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache", w, registry=r)
        self.prefix_hits = Counter("baton:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   w, registry=r)
        self.prefix_evictions = Counter("baton:prefix_cache_evicted_blocks", "Cached KV blocks evicted to make "
                                        "room (a prefix that comes back computes them again)", w, registry=r)
        self.preemptions = Counter("baton:num_preemptions", "Requests preempted", w, registry=r)
        self.engine_steps = Counter("baton:engine_steps", "Engine steps (forward passes)", w, registry=r)
        self.engine_busy = Counter("baton:engine_busy_seconds", "Seconds the engine spent in steps; its "
                                   "rate is the worker's utilisation", w, registry=r)
        self.tokens_computed = Counter("baton:tokens_computed", "Tokens run through the model, by kind "
                                       "(prefill or decode)", w + ["kind"], registry=r)
        self.kv_transfer_seconds = Histogram("baton:kv_transfer_seconds", "Time to ship one request's KV",
                                             w, buckets=_TRANSFER_BUCKETS, registry=r)
        self.kv_transfer_bytes = Counter("baton:kv_transfer_bytes", "Bytes of KV shipped", w, registry=r)
        self.core_wait = Counter("baton:core_wait_seconds", "Seconds the worker's steps waited for their "
                                 "turn at cores it shares with co-located workers", w, registry=r)
        self.worker_up = Gauge("baton:worker_up", "1 while the worker answers health checks", w, registry=r)
        # The router: what it decided, why, and how far its cost model was off.
        self.router_decisions = Counter("baton:router_decisions", "Routing decisions by policy and reason",
                                        ["policy", "reason"], registry=r)
        self.router_prefix_match = Histogram("baton:router_prefix_match_tokens", "Prompt tokens the chosen "
                                             "worker holds according to the prefix index", ["policy"],
                                             buckets=_TOKEN_BUCKETS, registry=r)
        self.router_prefix_match_ratio = Histogram("baton:router_prefix_match_ratio", "Fraction of the prompt "
                                                   "the chosen worker holds", ["policy"],
                                                   buckets=_RATIO_BUCKETS, registry=r)
        self.router_ttft_estimated = Histogram("baton:router_estimated_ttft_seconds", "The cost model's "
                                               "TTFT estimate per decision", ["policy"],
                                               buckets=_LATENCY_BUCKETS, registry=r)
        self.router_ttft_measured = Histogram("baton:router_measured_ttft_seconds", "Measured TTFT of the "
                                              "same decisions (arrival to first token at this front)",
                                              ["policy"], buckets=_LATENCY_BUCKETS, registry=r)
        self.router_ttft_ratio = Histogram("baton:router_ttft_estimate_ratio", "Measured / estimated TTFT "
                                           "per decision (1 = the cost model was exact)", ["policy"],
                                           buckets=_ERROR_RATIO_BUCKETS, registry=r)
        self.router_index_blocks = Gauge("baton:router_index_blocks", "Prefix-cache blocks the router's "
                                         "index holds for the worker", w, registry=r)
        self.router_index_lag = Gauge("baton:router_index_lag_seconds", "Seconds since the worker's KV "
                                      "events last reached the router", w, registry=r)
        self.router_index_stale = Gauge("baton:router_index_stale", "1 while the router has no fresh KV "
                                        "events from the worker and routes as if it cached nothing", w,
                                        registry=r)
        self.router_index_resyncs = Counter("baton:router_index_resyncs", "Full resyncs of the router's "
                                            "index from a worker, by reason (epoch: first sync or a "
                                            "restarted worker; gap: events lost)", ["worker", "reason"],
                                            registry=r)
        # Counted per front (each request passes one front): a scrape of the whole deployment sums
        # these over the fronts (cluster.metrics_merge); the rest mirror the workers alike at every front.
        self.per_front = {metric.describe()[0].name for metric in (
            self.ttft, self.itl, self.tpot, self.e2e, self.queue_time, self.prompt_tokens,
            self.generation_tokens, self.request_success, self.request_rejected, self.tenant_prompt_tokens,
            self.tenant_generation_tokens, self.admission_queue_depth, self.kv_reserved_blocks,
            self.kv_reservable_blocks, self.migrations, self.router_decisions, self.router_prefix_match,
            self.router_prefix_match_ratio, self.router_ttft_estimated, self.router_ttft_measured,
            self.router_ttft_ratio)}
        self._counters: dict[tuple[str, str], _WorkerCounters] = {}
        self._queued_classes: set[int] = set()  # priority classes the queue-depth gauge shows

    def observe_request(self, arrival: float, first_token: float | None, token_times: list[float],
                        prompt_tokens: int, output_tokens: int, finish_reason: str | None,
                        queue_time: float | None = None) -> None:
        """Record one finished request from its timestamps (``time.monotonic`` seconds)."""
        m = self.model_name
        if first_token is not None:
            self.ttft.labels(m).observe(first_token - arrival)
        for a, b in zip(token_times, token_times[1:]):
            self.itl.labels(m).observe(b - a)
        if len(token_times) > 1:
            self.tpot.labels(m).observe((token_times[-1] - token_times[0]) / (len(token_times) - 1))
        if token_times:
            self.e2e.labels(m).observe(token_times[-1] - arrival)
        if queue_time is not None:
            self.queue_time.labels(m).observe(queue_time)
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(output_tokens)
        self.request_success.labels(m, finish_reason or "abort").inc()

    def observe_rejected(self, reason: str, tenant: str) -> None:
        """The ingress gate's or stage 2's ``on_reject`` hook."""
        self.request_rejected.labels(self.model_name, reason, tenant).inc()

    def observe_tenant_finish(self, ticket: Any, prompt_tokens: int, completion_tokens: int) -> None:
        """The gate's ``on_finish`` hook: per-tenant tokens and the time queued for KV room."""
        self.tenant_prompt_tokens.labels(ticket.tenant_name).inc(prompt_tokens)
        self.tenant_generation_tokens.labels(ticket.tenant_name).inc(completion_tokens)
        self.queue_time.labels(self.model_name).observe(ticket.queue_time_s)

    def observe_admission_queue(self, depths: dict[int, int]) -> None:
        """Stage 2's ``on_queue`` hook; a class whose queue emptied reads 0, not its last depth."""
        for priority in self._queued_classes - depths.keys():
            self.admission_queue_depth.labels(str(priority)).set(0)
        for priority, depth in depths.items():
            self.admission_queue_depth.labels(str(priority)).set(depth)
        self._queued_classes = set(depths)

    def observe_ledger(self, worker: str, reserved: int, capacity: int) -> None:
        self.kv_reserved_blocks.labels(worker).set(reserved)
        self.kv_reservable_blocks.labels(worker).set(capacity)

    def on_worker_stats(self, worker: Any, stats: dict[str, Any] | None) -> None:
        """``PoolClient``'s ``on_stats`` hook: a worker's stats dict, or None when it is down."""
        snapshot = SimpleNamespace(**stats) if stats is not None else None
        self.observe_worker(worker.role, worker.worker_id, snapshot, up=stats is not None)

    def observe_worker(self, role: str, worker: str, stats: Any, up: bool = True) -> None:
        """Copy a worker's ``EngineStats`` snapshot (plus optional transfer stats) into the metrics."""
        self.worker_up.labels(role, worker).set(1.0 if up else 0.0)
        if not up or stats is None:
            return
        self.running.labels(role, worker).set(stats.num_running)
        self.waiting.labels(role, worker).set(stats.num_waiting)
        self.paused.labels(role, worker).set(stats.num_paused)
        self.kv_usage.labels(role, worker).set(stats.kv_cache_usage)
        c = self._counters.setdefault((role, worker), _WorkerCounters())
        self.prefix_queries.labels(role, worker).inc(c.delta("q", stats.prefix_cache_queries))
        self.prefix_hits.labels(role, worker).inc(c.delta("h", stats.prefix_cache_hits))
        self.prefix_evictions.labels(role, worker).inc(c.delta("ev", stats.num_evicted_blocks))
        self.preemptions.labels(role, worker).inc(c.delta("p", stats.num_preemptions))
        self.engine_steps.labels(role, worker).inc(c.delta("s", stats.num_steps))
        self.engine_busy.labels(role, worker).inc(c.delta("busy", stats.busy_seconds))
        self.tokens_computed.labels(role, worker, "prefill").inc(
            c.delta("tp", stats.num_prefill_tokens_computed))
        self.tokens_computed.labels(role, worker, "decode").inc(
            c.delta("td", stats.num_decode_tokens_computed))
        if stats.extra and "core_wait_seconds" in stats.extra:
            self.core_wait.labels(role, worker).inc(c.delta("cw", stats.extra["core_wait_seconds"]))
        transfer = stats.extra.get("kv_transfer") if stats.extra else None
        if transfer:
            self.kv_transfer_bytes.labels(role, worker).inc(c.delta("b", transfer.get("bytes", 0)))
            for seconds in transfer.get("recent_seconds", []):
                self.kv_transfer_seconds.labels(role, worker).observe(seconds)

    def observe_restart(self, role: str) -> None:
        self.worker_restarts.labels(role).inc()

    def observe_rebalance(self, action: str, reason: str) -> None:
        self.rebalance.labels(action, reason).inc()

    def observe_migration(self, role: str) -> None:
        self.migrations.labels(role).inc()

    def observe_route(self, policy: str, reason: str, matched_tokens: int, prompt_tokens: int) -> None:
        """One routing decision (``PoolClient``'s ``metrics`` hook)."""
        self.router_decisions.labels(policy, reason).inc()
        self.router_prefix_match.labels(policy).observe(matched_tokens)
        self.router_prefix_match_ratio.labels(policy).observe(matched_tokens / max(prompt_tokens, 1))

    def observe_route_ttft(self, policy: str, estimated: float | None, measured: float) -> None:
        """The cost model's TTFT estimate for a decision beside the TTFT it got."""
        self.router_ttft_measured.labels(policy).observe(measured)
        if estimated is not None and estimated > 0:
            self.router_ttft_estimated.labels(policy).observe(estimated)
            self.router_ttft_ratio.labels(policy).observe(measured / estimated)

    def observe_index(self, role: str, worker: str, blocks: int, lag_s: float | None, stale: bool) -> None:
        self.router_index_blocks.labels(role, worker).set(blocks)
        if lag_s is not None:
            self.router_index_lag.labels(role, worker).set(lag_s)
        self.router_index_stale.labels(role, worker).set(1.0 if stale else 0.0)

    def observe_index_resync(self, worker: str, reason: str) -> None:
        self.router_index_resyncs.labels(worker, reason).inc()
