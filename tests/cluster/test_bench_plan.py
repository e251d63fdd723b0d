"""`baton plan live`: ratios split into whole pools, the best layout by goodput per worker, and one
real run of two layouts (1P+1D and 2 colocated) on Ray with the tiny model."""

from __future__ import annotations

import json

import pytest
from baton_serve.cluster.bench.plan import (
    Layout,
    LayoutResult,
    PlanResult,
    choose_best,
    parse_ratios,
    plan_layouts,
    plan_markdown,
    split,
)
from baton_serve.cluster.bench.runner import BenchConfig
from baton_serve.cluster.cli import main
from baton_serve.cluster.config import ClusterConfig


def test_parse_ratios():
    assert parse_ratios("1:3,1:1, 3:1,") == [(1, 3), (1, 1), (3, 1)]
    for bad in ("1", "0:1", "1:-1", "a:b", "1:1:1", ","):
        with pytest.raises(ValueError):
            parse_ratios(bad)


def test_a_ratio_splits_only_when_its_parts_divide_the_workers():
    assert split(4, (1, 3)) == Layout(prefill=1, decode=3)
    assert split(8, (1, 3)) == Layout(prefill=2, decode=6)
    assert split(4, (1, 1)) == Layout(prefill=2, decode=2)
    assert split(6, (1, 3)) is None
    assert split(2, (3, 1)) is None


def test_plan_layouts():
    assert [x.name for x in plan_layouts(4, None, True)] == ["1P+3D", "2P+2D", "3P+1D", "4 colocated"]
    assert [x.name for x in plan_layouts(4, [(1, 1), (2, 2), (3, 1)], False)] == ["2P+2D", "3P+1D"]
    assert plan_layouts(2, [(1, 1)], True) == [Layout(1, 1), Layout(colocated=2)]
    assert plan_layouts(1, None, True) == [Layout(colocated=1)]
    with pytest.raises(ValueError, match=r"ratio 1:3 does not split 2 workers.*fit: 1:1$"):
        plan_layouts(2, [(1, 1), (1, 3)], True)
    with pytest.raises(ValueError, match="add --colocated"):
        plan_layouts(1, None, False)
    with pytest.raises(ValueError, match="at least 1"):
        plan_layouts(0, None, True)


def _res(layout: Layout, goodput: float | None, p99_tpot: float = 10.0, slo: bool = True) -> LayoutResult:
    if goodput is None:
        return LayoutResult(layout, error="RuntimeError: boom")
    summary = {"request_throughput": goodput + 1.0, "p99_tpot_ms": p99_tpot}
    if slo:
        summary["request_goodput"] = goodput
    return LayoutResult(layout, summary=summary)


def test_best_is_the_highest_goodput_per_worker_ties_to_lower_p99_tpot():
    a, b, c = Layout(1, 1), Layout(1, 3), Layout(colocated=2)
    # 4 req/s over 4 workers loses to 3 req/s over 2.
    assert choose_best([_res(a, 3.0), _res(b, 4.0), _res(c, None)]).layout == a
    assert choose_best([_res(a, 2.0, p99_tpot=30.0), _res(c, 2.0, p99_tpot=20.0)]).layout == c
    assert choose_best([_res(a, 0.0), _res(c, None)]) is None
    # Without an SLO, goodput is the completed rate.
    assert _res(a, 3.0, slo=False).goodput == 4.0
    assert choose_best([_res(a, 3.0, slo=False), _res(b, 9.0, slo=False)]).layout == b


def test_markdown_reports_a_failed_layout_and_the_goodput_without_slo():
    results = [_res(Layout(colocated=2), None)]
    pr = PlanResult(workers=2, results=results, best=None, model="m", bench=BenchConfig(),
                    cluster=ClusterConfig(), started="", command="", machine={})
    md = plan_markdown(pr)
    assert "| 2 colocated | 0 | 0 | 2 | failed: RuntimeError: boom |" in md
    assert "no SLO given: goodput is the completed-request rate" in md and "best layout" in md


def test_bad_options_are_one_line_errors_before_ray_starts(capsys):
    assert main(["plan", "live", "--workers", "3", "--ratios", "1:1"]) == 2
    err = capsys.readouterr().err
    assert "ratio 1:1 does not split 3 workers" in err and "1:2, 2:1" in err and "Traceback" not in err
    assert main(["plan", "live", "--address", "ray://head:10001"]) == 2
    assert main(["plan", "live", "--goodput", "speed:3"]) == 2


def test_plan_live_runs_each_layout_and_names_the_best(ray_session, tiny_model_dir, tmp_path, capsys):
    config = tmp_path / "tiny.toml"
    config.write_text('[engine]\ndtype = "float32"\nblock_size = 8\nnum_kv_blocks = 64\n'
                      '[server]\nmodel_name = "tiny"\n')
    rc = main(["plan", "live", "--workers", "2", "--ratios", "1:1", "--config", str(config),
               "--model", str(tiny_model_dir), "--num-prompts", "4", "--random-input-len", "12",
               "--random-output-len", "4", "--max-concurrency", "2", "--num-warmups", "0",
               "--goodput", "ttft:20000", "tpot:10000", "--request-timeout", "60", "--disable-tqdm",
               "--result-dir", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0
    path = tmp_path / "out" / "plan_live_2w.json"
    data = json.loads(path.read_text())
    layouts = {x["name"]: x for x in data["layouts"]}
    assert list(layouts) == ["1P+1D", "2 colocated"]
    for x in layouts.values():
        assert x["ok"] and x["actors_stopped"], x
        assert x["summary"]["completed"] == 4 and x["summary"]["failed"] == 0
        assert x["goodput_per_worker"] == pytest.approx(x["summary"]["request_goodput"] / 2)
    assert (layouts["1P+1D"]["prefill"], layouts["1P+1D"]["decode"], layouts["2 colocated"]["colocated"]) == (1, 1, 2)
    assert data["best_layout"] in layouts and data["model"] == "tiny"
    assert data["command"].startswith("baton plan live --workers 2") and data["machine"]["ray_cpus"] == 2
    assert f"best layout by goodput per worker: **{data['best_layout']}**" in out
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert path.with_suffix(".md").read_text() in out


def test_a_layout_that_fails_to_start_is_reported_and_the_plan_goes_on(ray_session, monkeypatch):
    from baton_serve.cluster.bench.plan import run_plan
    from baton_serve.cluster.launcher import Cluster

    calls = []

    def fail(self):
        calls.append(self.config.pools.colocated)
        raise RuntimeError("no room")

    monkeypatch.setattr(Cluster, "start", fail)
    pr = run_plan(ClusterConfig(), [Layout(1, 1), Layout(colocated=2)], BenchConfig())
    assert calls == [0, 2] and pr.best is None
    assert [(r.ok, r.error, r.actors_stopped) for r in pr.results] == [(False, "RuntimeError: no room", True)] * 2
    assert "failed: RuntimeError: no room" in plan_markdown(pr)
