"""``baton plan sim`` and ``baton plan profile`` as a user types them: the JSON in ``plan live``'s
shape, ``--against`` on a result, a real profile measured from a (tiny) model, clear errors."""

from __future__ import annotations

import json

import pytest
from baton_serve.cluster.cli import main
from baton_serve.cluster.sim.against import load_measured, parse_layout
from baton_serve.cluster.sim.profile import LatencyProfile

from tests.cluster.sim.test_simulate import profile_data

WORKLOAD = ["--num-prompts", "16", "--request-rate", "6", "--random-input-len", "160", "--random-output-len", "12",
            "--seed", "2", "--disable-tqdm"]


@pytest.fixture
def profile_file(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_data()))
    return path


def _sim(tmp_path, profile_file, *extra: str) -> dict:
    out = tmp_path / "out"
    rc = main(["plan", "sim", "--profile", str(profile_file), "--workers", "2,3", "--jobs", "1",
               "--result-dir", str(out), "--no-plot", *WORKLOAD, *extra])
    assert rc == 0
    return json.loads((out / "plan_sim.json").read_text())


def test_plan_sim_writes_plan_lives_shape_with_the_best_layout(tmp_path, profile_file, capsys):
    data = _sim(tmp_path, profile_file, "--goodput", "ttft:1500", "tpot:150")
    names = [row["name"] for row in data["layouts"]]
    assert names == ["1P+1D", "2 colocated", "1P+2D", "2P+1D", "3 colocated"]
    assert data["simulated"] is True and data["profile"]["source"] == "published"
    assert data["best_layout"] == max(data["layouts"], key=lambda r: r["goodput_per_worker"])["name"]
    for row in data["layouts"]:
        assert row["ok"] and row["summary"]["completed"] == 16
        assert 0 <= row["summary"]["slo_attainment"] <= 1
        assert row["goodput_per_worker"] == pytest.approx(row["goodput"] / row["workers"])
    md = (tmp_path / "out" / "plan_sim.md").read_text()
    assert f"best layout by goodput per worker: **{data['best_layout']}**" in md
    assert md in capsys.readouterr().out
    assert data["bench_config"]["num_prompts"] == 16


def test_against_its_own_result_the_simulator_has_no_error(tmp_path, profile_file, capsys):
    _sim(tmp_path, profile_file)
    measured = load_measured(tmp_path / "out" / "plan_sim.json")
    assert [m.layout.name for m in measured] == ["1P+1D", "2 colocated", "1P+2D", "2P+1D", "3 colocated"]
    capsys.readouterr()
    rc = main(["plan", "sim", "--profile", str(profile_file), "--against", str(tmp_path / "out" / "plan_sim.json"),
               "--result-dir", str(tmp_path / "against")])
    assert rc == 0
    rows = json.loads((tmp_path / "against" / "plan_sim_against.json").read_text())["rows"]
    assert len(rows) == 5
    for row in rows:
        for cell in row["metrics"].values():
            assert cell["error"] == pytest.approx(0.0, abs=1e-12)
    assert "(the same)" in capsys.readouterr().out


def test_against_a_bench_result_needs_its_layout(tmp_path, profile_file, capsys):
    bench = {"config": {"num_prompts": 4}, "request_throughput": 1.0, "completed": 4}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    rc = main(["plan", "sim", "--profile", str(profile_file), "--against", str(path)])
    assert rc == 2 and "--layout" in capsys.readouterr().err
    assert parse_layout("2P+1D").workers == 3 and parse_layout("3 colocated").colocated == 3
    with pytest.raises(ValueError, match="2P\\+1D"):
        parse_layout("two and one")


def test_bad_options_are_one_line_errors(tmp_path, profile_file, capsys):
    with pytest.raises(SystemExit):  # argparse's own: usage and the option named
        main(["plan", "sim", "--profile", str(profile_file), "--workers", "0"])
    assert "positive integers" in capsys.readouterr().err
    for args, message in ((["--policies", "nearest"], "nearest"), (["--random-input-len", "0"], "at least 1"),
                          (["--ratios", "2:0"], "ratio")):
        assert main(["plan", "sim", "--profile", str(profile_file), "--disable-tqdm", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("baton plan: error:") and message in err and err.count("\n") == 1


def test_a_malformed_profile_is_named_before_anything_runs(tmp_path, capsys):
    data = profile_data()
    data["decode"]["seconds"][0][0] = "slow"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    assert main(["plan", "sim", "--profile", str(path)]) == 2
    assert "decode.seconds[0][0]" in capsys.readouterr().err


def test_plan_profile_measures_the_real_engine(tmp_path, tiny_model_dir):
    out = tmp_path / "p.json"
    rc = main(["plan", "profile", "--model", str(tiny_model_dir), "--quick", "--threads", "1",
               "--dtype", "float32", "--connectors", "shared_memory", "--out", str(out)])
    assert rc == 0
    p = LatencyProfile.load(out)
    assert p.source == "measured" and p.model["dtype"] == "float32" and p.machine["threads"] == 1
    assert p.machine["cpu_model"] and p.machine["isa"] is not None
    assert set(p.kv_transfer) == {"shared_memory"}
    from baton_serve.cluster.sim.profiler import QUICK

    # the quick grid, every point measured (times themselves depend on the machine: not asserted)
    assert p.prefill.rows == QUICK["new_tokens"] and p.prefill.cols == QUICK["cached_tokens"]
    assert p.decode.rows == QUICK["batch"] and p.decode.cols == QUICK["context_per_seq"]
    assert all(t > 0 for row in p.prefill.seconds + p.decode.seconds for t in row)
    assert 0 <= p.step_overhead_s <= p.prefill_s(1, 0)
    assert p.mixed["rule"] in ("sum", "rows") and p.mixed["validation"]["median_error"] >= 0


def test_calibrate_recovers_a_known_host_cost(tmp_path, profile_file, capsys):
    """Runs simulated with a known host cost stand in for measured ones: fitted from a profile
    without it, calibration finds that cost again and the error goes to zero."""
    data = profile_data()
    data["host"] = {"per_step_s": 0.008, "per_token_s": 0.0005, "per_request_s": 0.05, "calibrated_against": ""}
    truth = tmp_path / "truth.json"
    truth.write_text(json.dumps(data))
    out = tmp_path / "measured"
    assert main(["plan", "sim", "--profile", str(truth), "--workers", "2", "--jobs", "1", "--result-dir", str(out),
                 "--no-plot", *WORKLOAD]) == 0
    capsys.readouterr()
    fitted_path = tmp_path / "fitted.json"
    assert main(["plan", "sim", "--profile", str(profile_file), "--calibrate", str(out / "plan_sim.json"),
                 "--write-profile", str(fitted_path)]) == 0
    text = capsys.readouterr().out
    fitted = LatencyProfile.load(fitted_path)
    assert (fitted.host.per_step_s, fitted.host.per_token_s, fitted.host.per_request_s) == (0.008, 0.0005, 0.05)
    assert fitted.host.calibrated_against == "plan_sim.json"
    assert "-> 0.000)" in text
    # everything else is the profile it started from
    assert {k: v for k, v in fitted.to_dict().items() if k != "host"} == profile_data()
