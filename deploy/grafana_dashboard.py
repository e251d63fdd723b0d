"""The Grafana dashboard (``deploy/grafana/baton.json``), built from the panel list below.

Every query names ``baton:`` metrics the fronts export (one scrape target sees the whole deployment,
``cluster/metrics_merge.py``); a test checks each one exists in a live deployment's scrape."""

from __future__ import annotations

import re

RATE = "$__rate_interval"
# The SLO a panel judges against must be a bucket boundary of the histogram (cluster/metrics.py).
TTFT_SLOS = ("0.25", "0.5", "1.0", "2.5", "5.0")
TPOT_SLOS = ("0.02", "0.04", "0.06", "0.08", "0.1", "0.25")


def _quantiles(metric: str, by: str = "") -> list[tuple[str, str]]:
    group = f"le{', ' + by if by else ''}"
    return [(f"p{int(q * 100)}", f"histogram_quantile({q}, sum by ({group}) "
             f"(rate({metric}_bucket{{model_name=~\"$model\"}}[{RATE}])))") for q in (0.5, 0.9, 0.99)]


def _attainment(metric: str, slo: str) -> str:
    sel = 'model_name=~"$model"'
    return (f'sum(rate({metric}_bucket{{{sel}, le="${slo}"}}[{RATE}])) / '
            f"sum(rate({metric}_count{{{sel}}}[{RATE}]))")


# (row, title, unit, [(legend, PromQL)])
PANELS: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    ("Latency", "Time to first token", "s", _quantiles("baton:time_to_first_token_seconds")),
    ("Latency", "Inter-token latency", "s", _quantiles("baton:inter_token_latency_seconds")),
    ("Latency", "Time per output token", "s", _quantiles("baton:request_time_per_output_token_seconds")),
    ("Latency", "End-to-end latency", "s", _quantiles("baton:e2e_request_latency_seconds")),
    ("SLO", "SLO attainment", "percentunit", [
        ("TTFT <= $ttft_slo s", _attainment("baton:time_to_first_token_seconds", "ttft_slo")),
        ("TPOT <= $tpot_slo s", _attainment("baton:request_time_per_output_token_seconds", "tpot_slo"))]),
    ("SLO", "Goodput", "reqps", [
        ("requests/s within the TTFT SLO",
         f'sum(rate(baton:time_to_first_token_seconds_bucket{{model_name=~"$model", le="$ttft_slo"}}[{RATE}]))'),
        ("finished requests/s: {{finished_reason}}",
         f'sum by (finished_reason) (rate(baton:request_success_total{{model_name=~"$model"}}[{RATE}]))')]),
    ("SLO", "Output tokens", "short", [
        ("output tokens/s", f'sum(rate(baton:generation_tokens_total{{model_name=~"$model"}}[{RATE}]))'),
        ("prompt tokens/s", f'sum(rate(baton:prompt_tokens_total{{model_name=~"$model"}}[{RATE}]))')]),
    ("Load", "Requests per pool", "short", [
        ("running: {{role}}", "sum by (role) (baton:num_requests_running)"),
        ("waiting: {{role}}", "sum by (role) (baton:num_requests_waiting)"),
        ("paused (backpressure): {{role}}", "sum by (role) (baton:num_requests_paused)")]),
    ("Load", "Admission: queued and rejected", "short", [
        ("queued for KV room: class {{priority}}", "sum by (priority) (baton:admission_queue_depth)"),
        ("rejected/s: {{reason}}", f"sum by (reason) (rate(baton:requests_rejected_total[{RATE}]))")]),
    ("Load", "Worker utilisation", "percentunit", [
        ("{{worker}}", f"rate(baton:engine_busy_seconds_total[{RATE}])")]),
    ("KV cache", "KV cache usage per worker", "percentunit", [("{{worker}}", "baton:kv_cache_usage_perc")]),
    ("KV cache", "Prefix cache hit rate per pool", "percentunit", [
        ("{{role}}", f"sum by (role) (rate(baton:prefix_cache_hits_total[{RATE}])) / "
                     f"sum by (role) (rate(baton:prefix_cache_queries_total[{RATE}]))")]),
    ("KV cache", "KV transfer", "Bps", [
        ("bytes/s from {{worker}}", f"sum by (worker) (rate(baton:kv_transfer_bytes_total[{RATE}]))")]),
    ("KV cache", "KV transfer time per request", "s", [
        (f"p{int(q * 100)}", f"histogram_quantile({q}, sum by (le) (rate(baton:kv_transfer_seconds_bucket[{RATE}])))")
        for q in (0.5, 0.99)]),
    ("Faults and rebalancing", "Workers up per pool", "short", [
        ("{{role}}", "sum by (role) (baton:worker_up)")]),
    ("Faults and rebalancing", "Migrations and restarts", "short", [
        ("migrated from a dead {{role}} worker", f"sum by (role) (increase(baton:request_migrations_total[{RATE}]))"),
        ("{{role}} worker restarted", f"sum by (role) (increase(baton:worker_restarts_total[{RATE}]))")]),
    ("Faults and rebalancing", "Rebalancing actions", "short", [
        ("{{action}} ({{reason}})", f"sum by (action, reason) (increase(baton:rebalance_total[{RATE}]))")]),
]


def metric_names(expr: str) -> set[str]:
    """The ``baton:`` series a query reads, as families: suffixes (_bucket, _total, ...) dropped."""
    return {re.sub(r"_(bucket|count|sum|total|created)$", "", m) for m in re.findall(r"baton:[a-z0-9_]+", expr)}


def _variable(name: str, label: str, options: tuple[str, ...], default: str) -> dict:
    return {"name": name, "label": label, "type": "custom", "query": ",".join(options),
            "current": {"text": default, "value": default},
            "options": [{"text": o, "value": o, "selected": o == default} for o in options]}


def dashboard(version: str) -> dict:
    """The dashboard as Grafana imports it (schema 39; a Prometheus data source chosen at import)."""
    panels: list[dict] = []
    row, y, pid = None, 0, 1
    for i, (section, title, unit, targets) in enumerate(PANELS):
        if section != row:
            row = section
            panels.append({"id": pid, "type": "row", "title": section, "collapsed": False,
                           "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
            pid, y, col = pid + 1, y + 1, 0
        panels.append({
            "id": pid, "type": "timeseries", "title": title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (col % 2), "y": y + 8 * (col // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
            "targets": [{"refId": chr(ord("A") + k), "expr": expr, "legendFormat": legend,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for k, (legend, expr) in enumerate(targets)]})
        pid, col = pid + 1, col + 1
        if i + 1 == len(PANELS) or PANELS[i + 1][0] != section:
            y += 8 * ((col + 1) // 2)
    return {
        "title": "Baton", "uid": "baton-serving", "tags": ["baton", "llm-serving"], "version": 1,
        "description": f"Baton {version}: latency, SLOs, load, KV cache, faults and rebalancing",
        "schemaVersion": 39, "editable": True, "refresh": "30s", "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
            {"name": "model", "label": "Model", "type": "query", "includeAll": True, "multi": True,
             "datasource": {"type": "prometheus", "uid": "${datasource}"}, "refresh": 2,
             "query": {"query": "label_values(baton:time_to_first_token_seconds_count, model_name)",
                       "refId": "model"}, "current": {"text": "All", "value": "$__all"}},
            _variable("ttft_slo", "TTFT SLO (s)", TTFT_SLOS, "1.0"),
            _variable("tpot_slo", "TPOT SLO (s)", TPOT_SLOS, "0.1")]},
        "panels": panels,
    }
