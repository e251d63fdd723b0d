"""The rebalancer in ``simulate``: the real window and decision on the virtual clock, a flip
carried out as a drain then a role change in place. A load shift from long prompts to long
outputs moves a prefill worker to decode; the run still gives back every block, slot and
reservation; a dry run decides and changes nothing."""

from __future__ import annotations

import json
import random

import pytest
from baton_serve.cluster.bench.plan import Layout
from baton_serve.cluster.bench.runner import BenchConfig
from baton_serve.cluster.bench.workload import WorkloadConfig
from baton_serve.cluster.config import ConfigError, load_config
from baton_serve.cluster.sim.profile import LatencyProfile
from baton_serve.cluster.sim.run import SimHardware, simulate

from tests.cluster.sim.test_simulate import profile_data


@pytest.fixture
def shift_trace(tmp_path):
    """60 s of long prompts with short outputs, then 60 s of short prompts with long outputs."""
    rng, rows, t = random.Random(1), [], 0.0
    for prompt, output, rate in ((1500, 8, 3.0), (32, 300, 6.0)):
        end = t + 60.0
        while (t := t + rng.expovariate(rate)) < end:
            rows.append({"timestamp": round(t, 3), "prompt_len": prompt, "output_len": output})
        t = end
    path = tmp_path / "shift.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path, len(rows)


def _run(trace, **rebalance):
    path, n = trace
    bench = BenchConfig(workload=WorkloadConfig("trace", trace_path=str(path)), num_prompts=n,
                        request_rate=float("inf"), seed=0, disable_tqdm=True, num_warmups=0)
    overrides = {"engine.num_kv_blocks": 2048, "rebalance.window_s": 20, "rebalance.cooldown_s": 20,
                 "rebalance.min_dwell_s": 20, "rebalance.interval_s": 5, "rebalance.min_requests": 5,
                 "rebalance.tpot_target_s": 0.03}
    overrides.update({f"rebalance.{k}": v for k, v in rebalance.items()})
    cfg = load_config(None).with_overrides(**overrides)
    return simulate(cfg, Layout(2, 2), bench, LatencyProfile.from_dict(profile_data()), SimHardware(0, 2), seed=0)


def _given_back(res) -> None:
    assert res.summary["failed"] == 0
    assert res.admission_blocks_held == 0
    for w in res.workers.values():
        assert (w["blocks_held"], w["requests_left"], w["parked"], w["incoming"]) == (0, 0, 0, 0)


def test_a_shift_to_long_outputs_drains_a_prefill_worker_into_the_decode_pool(shift_trace):
    res = _run(shift_trace, enabled=True)
    flips = res.rebalance["flips"]
    assert flips and flips[0]["from_role"] == "prefill" and flips[0]["to_role"] == "decode"
    assert 60.0 < flips[0]["decided_s"] <= flips[0]["done_s"]  # after the shift, and drained before it changed
    moved = flips[0]["worker_id"]
    assert res.workers[moved]["started_as"] == "prefill" and res.workers[moved]["role"] == "decode"
    assert res.workers[moved]["decode_tokens"] > 0  # it decoded once it was a decode worker
    decision = res.rebalance["decisions"][0]
    assert decision["reason"] == "decode_pressure" and decision["pressures"]["decode"] > 1.0
    assert decision["inputs"]["decode"]["workers"] == 2
    assert res.summary["completed"] == shift_trace[1]
    _given_back(res)
    # the flip is the rebalancer's doing: with it off, the roles stay and decoding is slower
    static = _run(shift_trace, enabled=False)
    assert static.rebalance is None
    assert all(w["role"] == w["started_as"] for w in static.workers.values())
    assert res.summary["p90_tpot_ms"] < static.summary["p90_tpot_ms"]


def test_a_dry_run_decides_and_changes_nothing(shift_trace):
    res = _run(shift_trace, enabled=True, dry_run=True)
    assert res.rebalance["decisions"] and res.rebalance["flips"] == []
    assert all(w["role"] == w["started_as"] for w in res.workers.values())
    _given_back(res)


def test_a_rebalance_section_with_slack_above_enter_names_the_field():
    with pytest.raises(ConfigError, match="slack"):
        load_config(None).with_overrides(**{"rebalance.slack": 1.5})
