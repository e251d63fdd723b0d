"""The controller's rebalancer on the virtual clock: the real ``cluster.rebalance`` window and
decision, fed from the simulated front's finished requests and the workers' counters, its flips
carried out as a live flip is: the worker is drained (no new requests; its running ones finish,
its parked KV ships), then changes role in place with its cache kept, and takes requests again.

Adding and removing workers is not simulated (the simulated cluster has no free resources), so
the policy's ``scale`` stays off here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from baton_serve.cluster.bench.metrics import RequestRecord
from baton_serve.cluster.rebalance.decide import (
    Action,
    ClusterView,
    RebalanceDecision,
    Rebalancer,
    WorkerView,
)
from baton_serve.cluster.rebalance.signals import RequestSample, SignalWindow, WorkerSample, time_share
from baton_serve.cluster.sim.events import EventLoop
from baton_serve.cluster.sim.front import SimFront

_DRAIN_POLL_S = 0.05


@dataclass
class Flip:
    """One role change: when it was decided, when the worker was drained and changed role."""

    worker_id: str
    from_role: str
    to_role: str
    decided_s: float
    done_s: float | None = None


class SimRebalance:
    """Every ``interval_s``: a poll of each worker into the window, then a decision; ``dry_run``
    logs decisions and changes nothing. Times in the logs are seconds from the front's ``t0``."""

    def __init__(self, loop: EventLoop, front: SimFront, rebalancer: Rebalancer, window: SignalWindow,
                 interval_s: float, dry_run: bool = False) -> None:
        self.loop, self.front, self.rebalancer, self.window = loop, front, rebalancer, window
        self.interval_s, self.dry_run = interval_s, dry_run
        self.since = {wid: loop.now for wid in front.refs}  # when each worker took its role
        self._busy = {wid: (w.core.busy_seconds, w.core.prefill_seconds) for wid, w in front.sims.items()}
        self._polled = loop.now
        self.decisions: list[RebalanceDecision] = []  # those that acted; holds are counted by reason
        self.holds: dict[str, int] = {}
        self.flips: list[Flip] = []
        front.on_finished.append(self._finished)
        loop.after(interval_s, self._tick)

    def _finished(self, rec: RequestRecord, first_role: str | None) -> None:
        if not rec.ok:
            return
        self.window.add_request(RequestSample(self.loop.now, rec.prompt_len, rec.cached_tokens or 0,
                                              rec.output_tokens, rec.ttft, rec.tpot, first_role))

    def _poll(self) -> None:
        now, elapsed = self.loop.now, self.loop.now - self._polled
        for wid, sim in self.front.sims.items():
            busy, prefill = sim.core.busy_seconds, sim.core.prefill_seconds
            was, was_prefill = self._busy[wid]
            bm = sim.core.block_manager
            self.window.add_poll(WorkerSample(now, wid, sim.role, time_share(busy - was, elapsed),
                                              1.0 - bm.num_free_blocks / max(bm.num_blocks, 1),
                                              sim.core.num_waiting, len(sim.core.scheduler.requests),
                                              time_share(prefill - was_prefill, elapsed)))
            self._busy[wid] = (busy, prefill)
        self._polled = now

    def view(self) -> ClusterView:
        """The workers as the decision sees them now."""
        workers = []
        for wid, ref in self.front.refs.items():
            if not ref.alive:
                continue
            sim = self.front.sims[wid]
            bm = sim.core.block_manager
            workers.append(WorkerView(wid, ref.role, self.since[wid], len(sim.core.scheduler.requests),
                                      sim.core.num_waiting, 1.0 - bm.num_free_blocks / max(bm.num_blocks, 1),
                                      ref.draining))
        return ClusterView(self.loop.now, workers)

    def _tick(self) -> None:
        self._poll()
        roles = {wid: ref.role for wid, ref in self.front.refs.items() if ref.alive}
        decision = self.rebalancer.decide(self.window.signals(self.loop.now, roles), self.view())
        if decision.actions:
            self.decisions.append(decision)
            if not self.dry_run:
                for action in decision.actions:
                    self._carry_out(action)
        else:
            self.holds[decision.reason] = self.holds.get(decision.reason, 0) + 1
        self.loop.after(self.interval_s, self._tick)

    def _carry_out(self, action: Action) -> None:
        if action.kind != "flip" or action.worker_id is None:
            raise ValueError(f"the simulated cluster cannot {action.kind} workers (no free resources)")
        ref = self.front.refs[action.worker_id]
        flip = Flip(action.worker_id, ref.role, action.role, self.loop.now - self.front.t0)
        self.flips.append(flip)
        ref.draining = True

        def drained() -> None:
            sim = self.front.sims[flip.worker_id]
            if ref.load.outstanding > 0 or not sim.idle():
                self.loop.after(_DRAIN_POLL_S, drained)
                return
            self.front.set_role(flip.worker_id, flip.to_role)
            self.since[flip.worker_id] = self.loop.now
            flip.done_s = self.loop.now - self.front.t0

        drained()

    def report(self) -> dict[str, Any]:
        """The flips, the decisions that acted (reasons and inputs), and how often each hold reason came."""
        t0 = self.front.t0
        return {"dry_run": self.dry_run, "interval_s": self.interval_s,
                "flips": [asdict(f) for f in self.flips],
                "decisions": [{"at_s": round(d.at - t0, 3), "reason": d.reason, "pressures": d.pressures,
                               "actions": [asdict(a) for a in d.actions], "inputs": d.inputs}
                              for d in self.decisions],
                "holds": dict(sorted(self.holds.items()))}
