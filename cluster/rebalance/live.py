"""The rebalancer in the controller: every ``interval_s`` it reads each worker's new latency
samples (``Worker.latency_samples``) and the stats the health checks keep, decides
(``cluster.rebalance.decide``), logs the decision and, unless ``dry_run``, starts the flip
(``GlobalController.flip``). The thin I/O around the plain decision; the simulator's twin is
``cluster.sim.rebalance``."""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from baton_serve.cluster.rebalance.decide import ClusterView, RebalanceDecision, Rebalancer, WorkerView
from baton_serve.cluster.rebalance.signals import RequestSample, SignalWindow, WorkerSample, time_share

log = logging.getLogger("baton.rebalance")


class LiveRebalance:
    """Built from a ``[rebalance]`` section (``cluster.config.RebalanceSection``)."""

    def __init__(self, section: Any) -> None:
        self.section = section
        self.rebalancer = Rebalancer(section.policy())
        self.window = SignalWindow(section.window_s, section.targets())
        self._cursor: dict[str, int] = {}
        self._busy: dict[str, tuple[float, float, float]] = {}  # worker -> (when, busy s, prefill s) last poll
        self._next_at: float | None = None
        self.counts: dict[str, int] = {}  # "action:reason" (holds as "hold:reason") -> decisions
        self.acted: deque[dict[str, Any]] = deque(maxlen=16)  # the last decisions with an action
        self.last: dict[str, Any] | None = None

    def due(self, now: float) -> bool:
        if self._next_at is None:
            self._next_at = now + self.section.interval_s
        return now >= self._next_at

    def tick(self, now: float, members: dict[str, Any], handles: dict[str, Any],
             get: Callable[[Any], Any], flip: Callable[[str, str, str], None]) -> RebalanceDecision:
        """One decision over ``members`` (the controller's ``Member``s, by id): ``get`` resolves a
        Ray call (with the controller's timeout), ``flip`` starts a flip."""
        self._next_at = now + self.section.interval_s
        alive = {wid: m for wid, m in members.items() if m.alive and not m.restarting}
        calls = {wid: handles[wid].latency_samples.remote(self._cursor.get(wid, 0)) for wid in alive}
        for wid, ref in calls.items():
            try:
                seq, samples = get(ref)
            except Exception as exc:  # a worker that does not answer adds nothing this time
                log.debug("latency samples of %s: %r", wid, exc)
                continue
            self._cursor[wid] = seq
            for s in samples:
                ttft = s["seconds"] if s["kind"] == "ttft" else None
                tpot = s["seconds"] if s["kind"] == "tpot" else None
                self.window.add_request(RequestSample(now, s["prompt_tokens"], s["cached_tokens"],
                                                      s["output_tokens"], ttft, tpot, alive[wid].role))
        for wid, m in alive.items():
            st = m.stats or {}
            busy, prefill = float(st.get("busy_seconds", 0.0)), float(st.get("prefill_seconds", 0.0))
            then, was, was_prefill = self._busy.get(wid, (now, busy, prefill))
            self._busy[wid] = (now, busy, prefill)
            wall = now - then
            self.window.add_poll(WorkerSample(now, wid, m.role, time_share(busy - was, wall),
                                              float(st.get("kv_cache_usage", 0.0)), int(st.get("num_waiting", 0)),
                                              int(st.get("num_running", 0)), time_share(prefill - was_prefill, wall)))
        view = ClusterView(now, [WorkerView(wid, m.role, m.role_since, int((m.stats or {}).get("num_running", 0)),
                                            int((m.stats or {}).get("num_waiting", 0)),
                                            float((m.stats or {}).get("kv_cache_usage", 0.0)), m.draining)
                                 for wid, m in alive.items()])
        decision = self.rebalancer.decide(self.window.signals(now, {wid: m.role for wid, m in alive.items()}), view)
        record = {"reason": decision.reason, "pressures": decision.pressures,
                  "actions": [{"kind": a.kind, "role": a.role, "worker_id": a.worker_id} for a in decision.actions],
                  "dry_run": self.section.dry_run}
        self.last = record
        for a in decision.actions or [None]:
            key = f"{a.kind}:{a.reason}" if a is not None else f"hold:{decision.reason}"
            self.counts[key] = self.counts.get(key, 0) + 1
        if not decision.actions:
            log.debug("rebalance: hold (%s) %s", decision.reason, json.dumps(decision.pressures))
            return decision
        self.acted.append({**record, "inputs": decision.inputs})
        log.info("rebalance%s: %s %s", " (dry run)" if self.section.dry_run else "",
                 json.dumps(record["actions"]), json.dumps({"pressures": decision.pressures, "inputs": decision.inputs}))
        if not self.section.dry_run:
            for a in decision.actions:
                if a.kind != "flip" or a.worker_id is None:  # scale is not on live (no add/remove yet)
                    continue
                try:
                    flip(a.worker_id, a.role, a.reason)
                except ValueError as exc:  # the view moved (a death, a manual flip): next time
                    log.warning("rebalance: flip of %s refused: %s", a.worker_id, exc)
        return decision

    def status(self) -> dict[str, Any]:
        """For the controller's snapshot: what it is set to, counts, the last decision, the last acts."""
        return {"enabled": True, "dry_run": self.section.dry_run, "interval_s": self.section.interval_s,
                "counts": dict(sorted(self.counts.items())), "last": self.last, "acted": list(self.acted)}
