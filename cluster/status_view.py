"""``baton status``: a running deployment's workers as one front sees them (``GET /status``)."""

from __future__ import annotations

import os
from typing import Any

_COLUMNS = ("worker", "role", "tp", "state", "incarnation", "restarts", "running", "waiting", "kv used")


def fetch_status(url: str, api_key: str | None = None, timeout_s: float = 5.0) -> dict[str, Any]:
    """The front's ``/status`` JSON; raises ``RuntimeError`` with the server's message on an error reply."""
    import httpx

    key = api_key or os.environ.get("BATON_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    resp = httpx.get(url.rstrip("/") + "/status", headers=headers, timeout=timeout_s)
    if resp.status_code != 200:
        try:
            message = resp.json()["error"]["message"]
        except Exception:
            message = resp.text[:200]
        raise RuntimeError(f"{url} answered {resp.status_code}: {message}")
    return resp.json()


def _state(w: dict[str, Any]) -> str:
    if w["quarantined"]:
        return "quarantined"
    if w["alive"]:
        return f"draining -> {w['to_role']}" if w.get("draining") else "alive"
    return "restarting" if w["restarting"] else "dead"


def format_status(status: dict[str, Any]) -> str:
    """A table of the workers and a line about the front, for a terminal."""
    # one row per worker: a tensor-parallel replica is one worker, its ranks counted under tp
    rows = [_COLUMNS] + [(w["worker_id"], w["role"], str(w.get("tensor_parallel_size", 1)), _state(w),
                          str(w["incarnation"]), str(w["restarts"]),
                          str(w["num_running"]), str(w["num_waiting"]), f"{100 * w['kv_cache_usage']:.0f}%")
                         for w in status["workers"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    ctl = status.get("controller")
    age = "no controller" if ctl is None else (
        "controller view: none yet" if ctl["view_age_s"] is None else f"controller view {ctl['view_age_s']:.1f} s old")
    lines.append(f"{status['front_id']}: {'ready' if status['ready'] else 'NOT READY'}, "
                 f"{status['open_streams']} open streams, {status['migrations_total']} migrations, {age}")
    rb = (ctl or {}).get("rebalance") or {}
    if rb.get("enabled"):
        last = rb.get("last") or {}
        pressures = ", ".join(f"{k} {v:.2f}" for k, v in (last.get("pressures") or {}).items())
        lines.append(f"rebalancer{' (dry run)' if rb.get('dry_run') else ''}: last decision "
                     f"{last.get('reason', 'none yet')}" + (f", pressure {pressures}" if pressures else ""))
    for f in (ctl or {}).get("flips", [])[-5:]:
        how = f"given up ({f['given_up']})" if f.get("given_up") else f"drained in {f['drained_s']:.1f} s"
        lines.append(f"flip: {f['worker_id']} {f['from_role']} -> {f['to_role']}, {how}")
    return "\n".join(lines)
