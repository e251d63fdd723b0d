"""The routing decision log: what a decision saw and weighed, read back by the benchmark's reader."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from baton_serve.router.routing import Candidates, RouteRequest, WorkerLoad, make_policy
from baton_serve.router.routing.decision_log import DecisionLog
from baton_serve.router.routing.rates import LinearCost

from benchmarks import routing_decisions

BS = 16


@dataclass
class Fake:
    worker_id: str
    role: str = "prefill"
    load: WorkerLoad = field(default_factory=WorkerLoad)


def _worker(wid: str, role: str = "prefill", pending: int = 0) -> Fake:
    load = WorkerLoad(num_free_blocks=500, num_blocks=1000, sole_front=False, reported_pending_prefill=pending,
                      prefill=LinearCost(fixed=0.005, per_unit=1 / 2000, fitted=True),
                      decode=LinearCost(fixed=0.02, per_unit=0.002, fitted=True))
    return Fake(wid, role, load)


def _request() -> RouteRequest:
    return RouteRequest(1024, [bytes([i]) * 16 for i in range(63)], BS, 16, 1024)


def test_a_cost_decision_is_logged_with_every_option_and_worker_and_read_back_as_a_copy(tmp_path: Path) -> None:
    log_path = tmp_path / "decisions.jsonl"
    log = DecisionLog(str(log_path), "front-x")
    policy = make_policy("cost", seed=0)
    hot, cold, dec = _worker("p0", pending=8000), _worker("p1"), _worker("d0", "decode")
    hot.load.num_waiting = 5  # the requests its queue holds, as the worker reports them
    candidates = Candidates([hot, cold], [dec], {"p0": 63}, cached_blocks={"p0": 63})
    decision = policy.route(_request(), candidates)
    assert decision.first is cold and decision.reason == "hotspot_avoided"
    log.decision("r1", "cost", _request(), candidates, decision)
    log.ttft("r1", 0.25)
    log.close()
    log.ttft("r2", 1.0)  # after close: dropped, not an error

    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [r["kind"] for r in records] == ["decision", "ttft"]
    d = records[0]
    assert d["front"] == "front-x" and (d["first"], d["decode"], d["reason"]) == ("p1", "d0", "hotspot_avoided")
    # one option per (prefill, decode) pair plus the decode worker prefilling alone where it may
    assert {(o[0], o[1]) for o in d["options"]} >= {("p0", "d0"), ("p1", "d0")}
    chosen = min(d["options"], key=lambda o: o[2])
    assert chosen[0] == "p1" and chosen[3] == d["estimated_ttft_s"]
    views = {w["id"]: w for w in d["workers"]}
    assert views["p0"]["matched"] == 63 and views["p0"]["pending_prefill"] == 8000
    assert views["p0"]["pending_requests"] == 5 and views["p1"]["pending_requests"] == 0
    assert views["p0"]["prefill_fit"] == [0.005, 1 / 2000]  # the interval fit: no step moments came
    assert views["p0"]["step_fit"][3:] == [False, False]

    summary = routing_decisions.summarize(log_path)
    assert summary["decisions"] == 1 and summary["with_ttft"] == 1 and summary["reasons"] == {"hotspot_avoided": 1}
    (copy,) = summary["copies"]
    assert (copy["to"], copy["holder"], copy["holder_matched"], copy["measured_ttft_s"]) == ("p1", "p0", 63, 0.25)
    assert summary["workers"]["p1"]["measured_over_estimated"]["p50"] == round(0.25 / d["estimated_ttft_s"], 3)
    # a 1024-token prompt p1 held none of, with nothing queued there: a long prompt, no queue
    assert summary["by_kind"] == {"long": {"n": 1, "measured_p50_s": 0.25,
                                           "estimated_p50_s": round(d["estimated_ttft_s"], 4),
                                           "measured_over_estimated": summary["workers"]["p1"]["measured_over_estimated"]}}


def test_a_rerouted_request_keeps_its_last_decision(tmp_path: Path) -> None:
    log_path = tmp_path / "decisions.jsonl"
    log = DecisionLog(str(log_path), "front-x")
    policy = make_policy("least_loaded")
    a, b = _worker("c0", "colocated"), _worker("c1", "colocated")
    for first in (a, b):
        log.decision("r1", "least_loaded", _request(), Candidates([first], []),
                     policy.route(_request(), Candidates([first], [])), rerouted=first is b)
    log.close()
    decisions, _ = routing_decisions.load(log_path)
    assert [(d["first"], d["rerouted"], d["options"]) for d in decisions] == [("c1", True, [])]


def test_the_reader_tells_a_decode_worker_s_local_prefills_from_the_prefill_pool_s(tmp_path: Path) -> None:
    log_path = tmp_path / "decisions.jsonl"
    log = DecisionLog(str(log_path), "front-x")
    policy = make_policy("cost", seed=0)
    p, d = _worker("p0", pending=1056), _worker("d0", "decode")
    request = RouteRequest(1024 + 40, [bytes([i]) * 16 for i in range(64)], BS, 16, 1024)
    candidates = Candidates([p], [d], {"p0": 64, "d0": 64}, cached_blocks={"p0": 64, "d0": 64})
    decision = policy.route(request, candidates)
    assert decision.local  # the tail escapes the prefill queue
    log.decision("r1", "cost", request, candidates, decision)
    log.ttft("r1", 0.1)
    log.close()
    assert list(routing_decisions.summarize(log_path)["by_kind"]) == ["local tail"]
