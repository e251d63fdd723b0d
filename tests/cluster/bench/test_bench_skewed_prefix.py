"""The skewed shared-prefix workload of `baton bench`: a hot fraction on prefix 0, the rest even over
the others, deterministic by seed, bad options refused, and the fraction echoed in the result JSON."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
from baton_serve.cluster.bench.fakeserver import FakeOpenAIServer, FakeServerConfig
from baton_serve.cluster.bench.workload import (
    LengthDist,
    WorkloadConfig,
    WorkloadError,
    shared_prefix_workload,
)
from baton_serve.cluster.cli import main
from hypothesis import given, settings
from hypothesis import strategies as st


def _groups(n: int, num_prefixes: int, hot: float, seed: int = 0) -> list[int]:
    specs = shared_prefix_workload(n, num_prefixes, prefix_len=8, suffix_len=LengthDist(3),
                                   output_len=LengthDist(2), seed=seed, hot_fraction=hot)
    return [s.prefix_group for s in specs]


def test_a_hot_fraction_goes_to_prefix_0_and_the_rest_evenly_to_the_others():
    groups = _groups(20, num_prefixes=4, hot=0.4)
    assert Counter(groups) == {0: 8, 1: 4, 2: 4, 3: 4}
    assert groups != sorted(groups)  # shuffled, not in blocks
    assert Counter(_groups(10, num_prefixes=3, hot=0.25)) == {0: 3, 1: 4, 2: 3}  # 2.5 rounds up; 7 over 2
    assert Counter(_groups(12, num_prefixes=3, hot=0.0)) == {0: 4, 1: 4, 2: 4}  # off: the even spread


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 400), st.integers(2, 12), st.floats(0.01, 0.99))
def test_group_counts_for_any_size(n, num_prefixes, hot):
    counts = Counter(_groups(n, num_prefixes, hot))
    assert set(counts) <= set(range(num_prefixes)) and sum(counts.values()) == n
    assert abs(counts[0] - hot * n) <= 0.5 + 1e-9  # round(F*n)
    cold = [counts[g] for g in range(1, num_prefixes)]
    assert max(cold) - min(cold) <= 1


def test_the_skewed_workload_is_deterministic_by_seed():
    assert _groups(50, 5, 0.6, seed=3) == _groups(50, 5, 0.6, seed=3)
    assert _groups(50, 5, 0.6, seed=3) != _groups(50, 5, 0.6, seed=4)
    cfg = WorkloadConfig(name="shared-prefix", input_len=LengthDist(4, range_ratio=0.5), num_prefixes=3,
                         prefix_len=8, hot_fraction=0.5)
    assert cfg.build(30, seed=7) == cfg.build(30, seed=7)
    assert Counter(s.prefix_group for s in cfg.build(30, seed=7)) == {0: 15, 1: 8, 2: 7}


@pytest.mark.parametrize("hot", [1.0, 1.5, -0.1, math.nan])
def test_a_hot_fraction_outside_0_1_is_refused(hot):
    with pytest.raises(WorkloadError, match=r"hot-fraction must be in \[0, 1\)"):
        _groups(10, 3, hot)
    with pytest.raises(WorkloadError, match=r"hot-fraction must be in \[0, 1\)"):
        WorkloadConfig(name="shared-prefix", hot_fraction=hot)


def test_a_hot_prefix_needs_another_prefix_and_the_shared_prefix_dataset():
    with pytest.raises(WorkloadError, match="needs at least 2 prefixes"):
        _groups(10, 1, 0.5)
    with pytest.raises(WorkloadError, match="needs at least 2 prefixes"):
        WorkloadConfig(name="shared-prefix", num_prefixes=1, hot_fraction=0.5)
    with pytest.raises(WorkloadError, match="shared-prefix only"):
        WorkloadConfig(name="random", hot_fraction=0.5)
    assert set(_groups(5, 1, 0.0)) == {0}  # one prefix without a hot fraction is still fine


@pytest.mark.parametrize("extra, message", [
    (["--prefix-repetition-hot-fraction", "1"], "must be in [0, 1)"),
    (["--prefix-repetition-hot-fraction", "0.5", "--prefix-repetition-num-prefixes", "1"], "at least 2 prefixes"),
])
def test_bad_hot_fractions_are_one_line_errors_before_any_request(extra, message, capsys):
    # The port is never contacted: the options are refused first.
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--dataset-name", "shared-prefix", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_hot_fraction_reaches_the_server_and_the_result_json(tmp_path):
    out = tmp_path / "hot.json"
    with FakeOpenAIServer(FakeServerConfig(ttft_s=0.02, itl_s=0.005)) as server:
        rc = main(["bench", "--base-url", server.url, "--disable-tqdm", "--request-timeout", "30",
                   "--endpoint", "/v1/chat/completions", "--dataset-name", "shared-prefix",
                   "--prefix-repetition-num-prefixes", "3", "--prefix-repetition-prefix-len", "8",
                   "--prefix-repetition-suffix-len", "4", "--prefix-repetition-output-len", "2",
                   "--prefix-repetition-hot-fraction", "0.5", "--num-prompts", "8", "--num-warmups", "0",
                   "--no-plot", "--result-file", str(out)])
        bodies = server.bodies
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["config"]["workload"]["hot_fraction"] == 0.5 and data["config"]["workload"]["num_prefixes"] == 3
    per_system = Counter(b["messages"][0]["content"] for b in bodies)
    assert sorted(per_system.values()) == [2, 2, 4]
