"""The rebalancer's decision: a flip toward the short pool only where the other keeps room, the
holds that keep it stable (cool-down, dwell, the per-window cap, hysteresis), the bounds it never
crosses, and the Dynamo 2 <-> 1 oscillation driven in a closed loop, settling."""

from __future__ import annotations

import pytest
from baton_serve.cluster.rebalance.decide import ClusterView, RebalancePolicy, Rebalancer, WorkerView
from baton_serve.cluster.rebalance.signals import (
    PoolSignals,
    RequestSample,
    Signals,
    SignalWindow,
    Targets,
    WorkerSample,
)
from hypothesis import given, settings
from hypothesis import strategies as st


def _pool(role: str, workers: int, load: float, latency: float | None = None) -> PoolSignals:
    return PoolSignals(role, workers, None, None, 0.0, 0.0, 0.0, latency, load)


def _signals(pools: dict[str, PoolSignals], requests: int = 100) -> Signals:
    return Signals(60.0, requests, requests / 60.0, 100, 200, 200, 10, 20, pools)


def _view(now: float, counts: dict[str, int], since: float = 0.0, **kw) -> ClusterView:
    workers = [WorkerView(f"{role}-{i}", role, since) for role, n in counts.items() for i in range(n)]
    return ClusterView(now, workers, **kw)


POLICY = RebalancePolicy(window_s=60, cooldown_s=30, min_dwell_s=100, max_actions_per_window=1, min_requests=10)


def test_a_short_pool_takes_the_least_loaded_worker_of_one_with_room():
    r = Rebalancer(POLICY)
    workers = [WorkerView("prefill-0", "prefill", 0), WorkerView("decode-0", "decode", 0, running=5),
               WorkerView("decode-1", "decode", 0, running=1, kv_usage=0.3),
               WorkerView("decode-2", "decode", 0, running=1, kv_usage=0.1)]
    d = r.decide(_signals({"prefill": _pool("prefill", 1, 1.4), "decode": _pool("decode", 3, 0.3)}),
                 ClusterView(1000.0, workers))
    assert [(a.kind, a.role, a.worker_id) for a in d.actions] == [("flip", "prefill", "decode-2")]
    assert d.reason == "prefill_pressure" and d.pressures == {"prefill": 1.4, "decode": 0.3}
    assert d.inputs["decode"]["workers"] == 3 and r.decisions[-1] is d


def test_no_flip_where_the_donor_would_be_short_on_one_worker_fewer():
    r = Rebalancer(POLICY)
    # decode at 0.5 on 2 workers is 1.0 on 1: giving one up would make it the short pool
    d = r.decide(_signals({"prefill": _pool("prefill", 1, 1.5), "decode": _pool("decode", 2, 0.5)}),
                 _view(1000.0, {"prefill": 1, "decode": 2}))
    assert d.actions == [] and d.reason == "short_at_bounds"
    # nor where its latency is already near its SLO, whatever its load
    d = r.decide(_signals({"prefill": _pool("prefill", 1, 1.5), "decode": _pool("decode", 3, 0.1, latency=0.9)}),
                 _view(1000.0, {"prefill": 1, "decode": 3}))
    assert d.actions == []


def test_holds_name_their_reason():
    sig = _signals({"prefill": _pool("prefill", 1, 1.5), "decode": _pool("decode", 3, 0.2)})
    r = Rebalancer(POLICY)
    assert r.decide(_signals(sig.pools, requests=3), _view(1000.0, {"prefill": 1, "decode": 3})).reason \
        == "too_few_requests"
    assert r.decide(sig, _view(50.0, {"prefill": 1, "decode": 3}, since=0.0)).reason == "short_at_bounds"  # dwell
    busy = _view(1000.0, {"prefill": 1, "decode": 3})
    busy = ClusterView(busy.now, [*busy.workers[:-1], WorkerView("decode-2", "decode", 0, draining=True)])
    assert r.decide(sig, busy).reason == "action_in_progress"
    assert r.decide(sig, _view(1000.0, {"prefill": 1, "decode": 3})).actions  # acts
    assert r.decide(sig, _view(1010.0, {"prefill": 2, "decode": 2})).reason == "cooldown"
    assert r.decide(sig, _view(1040.0, {"prefill": 2, "decode": 2})).reason == "action_cap"  # 1 in 60 s
    calm = _signals({"prefill": _pool("prefill", 1, 0.8), "decode": _pool("decode", 3, 0.8)})
    assert r.decide(calm, _view(2000.0, {"prefill": 1, "decode": 3})).reason == "within_band"


def test_without_scale_nothing_is_added_or_removed():
    sig = _signals({"prefill": _pool("prefill", 2, 0.1), "decode": _pool("decode", 2, 0.1)})
    assert Rebalancer(POLICY).decide(sig, _view(1000.0, {"prefill": 2, "decode": 2})).actions == []
    short = _signals({"prefill": _pool("prefill", 1, 2.0), "decode": _pool("decode", 1, 2.0)})
    d = Rebalancer(POLICY).decide(short, _view(1000.0, {"prefill": 1, "decode": 1}, can_add={"prefill": True}))
    assert d.actions == [] and d.reason == "short_at_bounds"


def test_with_scale_a_short_pool_grows_where_the_cluster_has_room_and_up_to_its_max():
    p = RebalancePolicy(scale=True, min_requests=0, max_workers={"decode": 2})
    short = _signals({"prefill": _pool("prefill", 1, 0.9), "decode": _pool("decode", 1, 2.0)})
    d = Rebalancer(p).decide(short, _view(1000.0, {"prefill": 1, "decode": 1}, can_add={"decode": True}))
    assert [(a.kind, a.role) for a in d.actions] == [("add", "decode")]
    assert Rebalancer(p).decide(short, _view(1000.0, {"prefill": 1, "decode": 1})).actions == []  # no room
    at_max = _signals({"prefill": _pool("prefill", 3, 0.1), "decode": _pool("decode", 2, 2.0)})
    d = Rebalancer(p).decide(at_max, _view(1000.0, {"prefill": 3, "decode": 2}, can_add={"decode": True}))
    assert d.actions == []  # neither a flip nor an add past decode's max
    idle = _signals({"prefill": _pool("prefill", 3, 0.1), "decode": _pool("decode", 2, 0.2)})
    d = Rebalancer(p).decide(idle, _view(1000.0, {"prefill": 3, "decode": 2}))
    assert [(a.kind, a.role, a.worker_id) for a in d.actions] == [("remove", "prefill", "prefill-0")]


def test_a_policy_with_slack_not_under_enter_or_bounds_crossed_is_refused():
    with pytest.raises(ValueError, match="slack"):
        RebalancePolicy(slack=1.0, enter=1.0)
    with pytest.raises(ValueError, match="below min"):
        RebalancePolicy(min_workers={"decode": 3}, max_workers={"decode": 2})
    with pytest.raises(ValueError, match="unknown pool"):
        RebalancePolicy(min_workers={"gpu": 1})


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 3), st.floats(0, 3), st.floats(0, 200)), min_size=1, max_size=40),
       st.integers(1, 4), st.integers(1, 4), st.integers(1, 2), st.integers(1, 2), st.booleans())
def test_bounds_dwell_cooldown_and_the_cap_hold_over_any_sequence(steps, n_p, n_d, lo_p, lo_d, scale):
    policy = RebalancePolicy(window_s=60, cooldown_s=20, min_dwell_s=50, max_actions_per_window=2, min_requests=0,
                             scale=scale, min_workers={"prefill": lo_p, "decode": lo_d},
                             max_workers={"prefill": 5, "decode": 5})
    r = Rebalancer(policy)
    workers = {f"prefill-{i}": ("prefill", -1e9) for i in range(n_p)} | {f"decode-{i}": ("decode", -1e9)
                                                                          for i in range(n_d)}
    now, acted, fresh = 0.0, [], 0
    for load_p, load_d, dt in steps:
        now += dt
        counts = {role: sum(1 for r_, _ in workers.values() if r_ == role) for role in ("prefill", "decode")}
        view = ClusterView(now, [WorkerView(w, role, since) for w, (role, since) in sorted(workers.items())],
                           can_add={"prefill": True, "decode": True})
        d = r.decide(_signals({"prefill": _pool("prefill", counts["prefill"], load_p),
                               "decode": _pool("decode", counts["decode"], load_d)}), view)
        if d.actions:  # the cool-down and the cap count decisions; the bounds count workers
            assert not acted or now - acted[-1] >= policy.cooldown_s
            assert sum(1 for t in acted if t >= now - policy.window_s) < policy.max_actions_per_window
            acted.append(now)
            assert len({a.kind for a in d.actions}) == 1 and len({a.worker_id for a in d.actions}) == len(d.actions)
            assert len(d.actions) <= max(1, int(policy.step_fraction * sum(counts.values())))
            assert d.actions[0].kind == "flip" or len(d.actions) == 1
            moved = len(d.actions)
            if d.actions[0].kind in ("flip", "remove"):
                donor = workers[d.actions[0].worker_id][0]
                assert counts[donor] - moved >= policy.lower(donor)
                load = load_p if donor == "prefill" else load_d
                assert load * counts[donor] / (counts[donor] - moved) < policy.slack  # room kept
            if d.actions[0].kind in ("flip", "add"):
                assert counts[d.actions[0].role] + moved <= policy.upper(d.actions[0].role)
        for a in d.actions:
            if a.kind in ("flip", "remove"):
                assert now - workers[a.worker_id][1] >= policy.min_dwell_s
            if a.kind == "flip":
                workers[a.worker_id] = (a.role, now)
            elif a.kind == "remove":
                del workers[a.worker_id]
            else:
                assert scale
                fresh += 1
                workers[f"{a.role}-new{fresh}"] = (a.role, now)
        for role in ("prefill", "decode"):
            assert sum(1 for r_, _ in workers.values() if r_ == role) >= min(policy.lower(role),
                                                                               n_p if role == "prefill" else n_d)


class _Plant:
    """A cluster in a closed loop: each pool's work spread over its workers gives how full they
    are (prefill: busy fraction; decode: KV usage); latency grows as a pool nears saturation. The
    window and the rebalancer see only the samples this makes, every 10 s."""

    def __init__(self, roles: dict[str, str], policy: RebalancePolicy) -> None:
        self.roles = dict(roles)
        self.since = {w: -1e9 for w in roles}
        self.targets = Targets(ttft_s=1.0, tpot_s=0.1, utilization=0.8)
        self.window = SignalWindow(policy.window_s, self.targets)
        self.rebalancer = Rebalancer(policy)
        self.log: list[tuple[float, str, str, str | None]] = []
        self.fresh = 0

    def count(self, role: str) -> int:
        return sum(1 for r in self.roles.values() if r == role)

    def run(self, start: float, seconds: float, work: dict[str, float]) -> None:
        t = start
        while t < start + seconds:
            t += 10.0
            busy = {role: min(work[role] / max(self.count(role), 1), 1.0) for role in work}
            for w, role in self.roles.items():
                full = busy[role] * self.targets.kv_high / self.targets.utilization  # the same pressure
                self.window.add_poll(WorkerSample(t, w, role, busy[role] if role == "prefill" else 1.0,
                                                  0.1 if role == "prefill" else full, 0, 1))
            ttft = 0.3 / max(1.0 - busy["prefill"], 0.05)
            tpot = 0.03 / max(1.0 - busy["decode"], 0.05)
            for i in range(10):
                self.window.add_request(RequestSample(t - i, 200, 0, 50, ttft, tpot))
            view = ClusterView(t, [WorkerView(w, r, self.since[w]) for w, r in sorted(self.roles.items())],
                               can_add={"prefill": True, "decode": True})
            d = self.rebalancer.decide(self.window.signals(t, self.roles), view)
            for a in d.actions:
                self.log.append((t, a.kind, a.role, a.worker_id))
                if a.kind == "flip":
                    self.roles[a.worker_id], self.since[a.worker_id] = a.role, t
                elif a.kind == "add":
                    self.fresh += 1
                    w = f"{a.role}-new{self.fresh}"
                    self.roles[w], self.since[w] = a.role, t
                else:
                    del self.roles[a.worker_id]


def test_the_dynamo_two_one_case_settles_at_two():
    # decode work 1.1 worker-seconds a second: on one worker it saturates, on two each is 55% busy
    # and both parts of its pressure are under slack: Dynamo's planner scaled 2 -> 1 at such a load
    # and back up again, forever; only the projection on one worker fewer keeps it at two
    policy = RebalancePolicy(window_s=60, cooldown_s=60, min_dwell_s=120, min_requests=10, scale=True)
    plant = _Plant({"prefill-0": "prefill", "decode-0": "decode"}, policy)
    plant.run(0.0, 3600.0, {"prefill": 0.3, "decode": 1.1})
    assert [(k, r) for _, k, r, _ in plant.log] == [("add", "decode")]
    assert plant.count("decode") == 2 and plant.count("prefill") == 1


def test_a_load_shift_moves_workers_toward_the_short_pool_and_back_then_settles():
    policy = RebalancePolicy(window_s=60, cooldown_s=60, min_dwell_s=120, min_requests=10)
    roles = {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode", "decode-1": "decode"}
    plant = _Plant(roles, policy)
    plant.run(0.0, 1200.0, {"prefill": 2.4, "decode": 0.3})  # prefill-heavy: 3 prefill workers needed
    assert (plant.count("prefill"), plant.count("decode")) == (3, 1)
    flips_before = len(plant.log)
    plant.run(1200.0, 1200.0, {"prefill": 0.3, "decode": 2.4})  # decode-heavy
    assert (plant.count("prefill"), plant.count("decode")) == (1, 3)
    plant.run(2400.0, 1200.0, {"prefill": 1.0, "decode": 1.0})  # balanced: stays where it has room
    settled = [e for e in plant.log if e[0] > 2400.0 + 300.0]
    assert settled == [] and flips_before == 1 and len(plant.log) <= 4
    assert all(k == "flip" for _, k, _, _ in plant.log)


def test_a_tpot_slowed_by_local_prefill_flips_no_prefill_worker_to_decode():
    # TPOT twice its SLO, but the decode workers spend 80% of their busy time on prompts they
    # prefill themselves: a prefill worker more in decode would not help; nothing is short
    window = SignalWindow(60.0, Targets(ttft_s=1.0, tpot_s=0.1, utilization=0.8, kv_high=0.9))
    roles = {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode", "decode-1": "decode"}
    for t in range(0, 60, 10):
        for w, role in roles.items():
            window.add_poll(WorkerSample(float(t), w, role, 0.2 if role == "prefill" else 1.0, 0.1, 0, 2,
                                         0.2 if role == "prefill" else 0.8))
        for _ in range(5):
            window.add_request(RequestSample(float(t), 1000, 0, 16, 0.5, 0.2))
    d = Rebalancer(POLICY).decide(window.signals(60.0, roles), _view(1000.0, {"prefill": 2, "decode": 2}))
    assert d.pressures["decode"] == pytest.approx(2.0 * 0.2) and d.actions == []


def test_a_large_cluster_moves_several_workers_in_one_decision_within_its_step():
    # prefill at 2.4 on 8 workers comes to the middle of the band (0.85) on 23: 15 more; decode
    # at 0.2 on 56 can spare many
    d = Rebalancer(POLICY).decide(_signals({"prefill": _pool("prefill", 8, 2.4), "decode": _pool("decode", 56, 0.2)}),
                                  _view(1000.0, {"prefill": 8, "decode": 56}))
    assert [a.kind for a in d.actions] == ["flip"] * 15 and {a.role for a in d.actions} == {"prefill"}
    # at 3.0 it would take 21 more; one decision moves a quarter of the 64 at most
    d = Rebalancer(POLICY).decide(_signals({"prefill": _pool("prefill", 8, 3.0), "decode": _pool("decode", 56, 0.2)}),
                                  _view(1000.0, {"prefill": 8, "decode": 56}))
    assert len(d.actions) == 16
    # where only latency is over, one worker: a queue's wait does not scale with the pool
    d = Rebalancer(POLICY).decide(_signals({"prefill": _pool("prefill", 8, 0.5, latency=2.4),
                                            "decode": _pool("decode", 56, 0.2)}),
                                  _view(1000.0, {"prefill": 8, "decode": 56}))
    assert len(d.actions) == 1
    # a smaller shortage moves only what it needs: 1.2 on 8 is 0.85 on 12 (the band's middle)
    d = Rebalancer(POLICY).decide(_signals({"prefill": _pool("prefill", 8, 1.2), "decode": _pool("decode", 56, 0.2)}),
                                  _view(1000.0, {"prefill": 8, "decode": 56}))
    assert len(d.actions) == 4
    # and no more than the donor can spare: decode at 0.6 on 56 stays below 0.7 down to 49
    d = Rebalancer(POLICY).decide(_signals({"prefill": _pool("prefill", 8, 2.4), "decode": _pool("decode", 56, 0.6)}),
                                  _view(1000.0, {"prefill": 8, "decode": 56}))
    assert len(d.actions) == 7  # 0.6 * 56 / 49 = 0.686 < 0.7; on 48 it would be 0.7
