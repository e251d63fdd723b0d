"""The latency profile format: round trip, clear errors naming the field, and the times it gives."""

from __future__ import annotations

import copy
import json

import pytest
from baton_serve.cluster.sim.profile import LatencyProfile, ProfileError


def _data() -> dict:
    return {
        "format": "baton-latency-profile", "version": 1, "created": "2026-12-06T00:00:00+00:00",
        "source": "measured", "note": "test", "machine": {"cpu_model": "test", "cores": 2, "threads": 2, "device": "cpu"},
        "model": {"name": "m", "dtype": "bfloat16", "block_size": 16, "kv_block_bytes": 1024},
        "step_overhead_s": 0.01,
        "prefill": {"new_tokens": [1, 100, 1000], "cached_tokens": [0, 1000],
                    "seconds": [[0.011, 0.012], [0.02, 0.03], [0.11, 0.2]]},
        "decode": {"batch": [1, 10], "context_per_seq": [10, 1010], "seconds": [[0.011, 0.013], [0.015, 0.035]]},
        "mixed": {"rule": "sum", "validation": None},
        "kv_transfer": {"shared_memory": {"fixed_s": 0.001, "per_block_s": 0.0001}},
    }


def test_a_profile_round_trips_through_its_file(tmp_path):
    p = LatencyProfile.from_dict(_data())
    again = LatencyProfile.load(p.dump(tmp_path / "p.json"))
    assert again.to_dict() == p.to_dict() == _data()


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.pop("decode"), "decode: missing"),
    (lambda d: d.__setitem__("format", "other"), "format"),
    (lambda d: d.__setitem__("version", 2), "version"),
    (lambda d: d.__setitem__("extra", 1), "extra: unknown field"),
    (lambda d: d["prefill"]["seconds"][1].__setitem__(0, -1), "prefill.seconds[1][0]"),
    (lambda d: d["decode"]["seconds"][0].__setitem__(1, float("nan")), "decode.seconds[0][1]"),
    (lambda d: d["prefill"]["seconds"].pop(), "prefill.seconds: must have one row"),
    (lambda d: d["decode"]["seconds"][1].pop(), "decode.seconds[1]"),
    (lambda d: d["prefill"].__setitem__("new_tokens", [1, 1000, 100]), "prefill.new_tokens[2]"),
    (lambda d: d["decode"].__setitem__("batch", "1,2"), "decode.batch"),
    (lambda d: d["kv_transfer"]["shared_memory"].pop("per_block_s"), "kv_transfer.shared_memory.per_block_s"),
    (lambda d: d["model"].pop("kv_block_bytes"), "model.kv_block_bytes"),
    (lambda d: d.__setitem__("source", "guessed"), "source"),
    (lambda d: d.update(source="published", note=""), "note"),
    (lambda d: d["mixed"].__setitem__("rule", "max"), "mixed.rule"),
    (lambda d: d.__setitem__("step_overhead_s", "fast"), "step_overhead_s"),
    (lambda d: d.__setitem__("host", {"per_step_s": -1, "per_token_s": 0}), "host.per_step_s"),
    (lambda d: d.__setitem__("host", {"per_step_s": 0}), "host.per_token_s: missing"),
    (lambda d: d.__setitem__("host", {"per_step_s": 0, "per_token_s": 0, "per_row_s": 1}), "host.per_row_s"),
])
def test_a_malformed_profile_names_its_field(edit, field):
    data = copy.deepcopy(_data())
    edit(data)
    with pytest.raises(ProfileError, match=field.replace("[", r"\[").replace("]", r"\]")):
        LatencyProfile.from_dict(json.loads(json.dumps(data)))


def test_a_host_cost_round_trips_and_adds_to_each_step(tmp_path):
    data = _data()
    data["host"] = {"per_step_s": 0.004, "per_token_s": 0.001, "per_request_s": 0.02, "calibrated_against": "x.json"}
    p = LatencyProfile.from_dict(data)
    assert LatencyProfile.load(p.dump(tmp_path / "p.json")).to_dict() == data
    assert p.host_s(3) == pytest.approx(0.007)
    assert LatencyProfile.from_dict(_data()).host_s(3) == 0.0


def test_not_json_and_missing_files_are_profile_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ProfileError, match="not JSON"):
        LatencyProfile.load(bad)
    with pytest.raises(ProfileError, match="cannot read"):
        LatencyProfile.load(tmp_path / "none.json")


def test_times_are_exact_at_grid_points_bilinear_between_and_extrapolated_outside():
    p = LatencyProfile.from_dict(_data())
    assert p.prefill_s(100, 1000) == pytest.approx(0.03)
    assert p.prefill_s(550, 0) == pytest.approx((0.02 + 0.11) / 2)
    assert p.prefill_s(550, 500) == pytest.approx(((0.02 + 0.03) / 2 + (0.11 + 0.2) / 2) / 2)
    assert p.prefill_s(2000, 0) == pytest.approx(0.11 + 0.09 * 1000 / 900)  # beyond the last point
    assert p.decode_s(10, 10 * 1010) == pytest.approx(0.035)
    assert p.decode_s(20, 20 * 2010) > p.decode_s(10, 10 * 1010) > 0
    assert p.prefill_s(0, 0) > 0  # extrapolated down, never below a microsecond


def test_a_step_of_one_chunk_or_only_decodes_is_its_grid_and_a_mixed_one_follows_the_rule():
    p = LatencyProfile.from_dict(_data())
    assert p.step_s([], 0, 0) == 0.0
    assert p.step_s([(100, 1000)], 0, 0) == p.prefill_s(100, 1000)
    assert p.step_s([], 10, 5000) == p.decode_s(10, 5000)
    mixed = p.step_s([(100, 0), (100, 1000)], 10, 5000)
    assert mixed == pytest.approx(p.prefill_s(100, 0) + p.prefill_s(100, 1000) + p.decode_s(10, 5000) - 2 * 0.01)
    rows = LatencyProfile.from_dict(_data() | {"mixed": {"rule": "rows"}})
    expect = (rows.prefill_s(210, 0) + rows.prefill_s(100, 1000) - rows.prefill_s(100, 0)
              + rows.decode_s(10, 5000) - rows.prefill_s(10, 0))
    assert rows.step_s([(100, 0), (100, 1000)], 10, 5000) == pytest.approx(expect)


def test_a_connector_the_profile_lacks_is_named():
    p = LatencyProfile.from_dict(_data())
    assert p.transfer_s("shared_memory", 10) == pytest.approx(0.002)
    with pytest.raises(ProfileError, match="kv_transfer.collective: not in this profile .*shared_memory"):
        p.transfer_s("collective", 1)
