"""Workloads of `baton bench`: arrival schedules, length distributions, shared prefixes, traces,
and prompts of exact token lengths."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from baton_serve.cluster.bench.arrivals import arrival_offsets, trace_offsets
from baton_serve.cluster.bench.prompts import PromptFactory, load_tokenizer
from baton_serve.cluster.bench.workload import (
    LengthDist,
    RequestSpec,
    WorkloadConfig,
    WorkloadError,
    load_trace,
    random_workload,
    shared_prefix_workload,
)


def test_poisson_and_gamma_arrivals_have_the_rate_and_burstiness_asked_for():
    poisson = np.diff(arrival_offsets(20001, rate=8.0, burstiness=1.0, seed=1))
    bursty = np.diff(arrival_offsets(20001, rate=8.0, burstiness=0.25, seed=1))
    assert poisson.mean() == pytest.approx(1 / 8, rel=0.03)
    assert bursty.mean() == pytest.approx(1 / 8, rel=0.05)
    # Coefficient of variation 1/sqrt(shape): 1 for Poisson, 2 for burstiness 0.25.
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.08)
    assert arrival_offsets(3, 4.0, math.inf) == pytest.approx([0, 0.25, 0.5])
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_offsets(5, 2.0, seed=7) == arrival_offsets(5, 2.0, seed=7)
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)
    assert trace_offsets([10.0, 10.5, 12.0], speedup=2.0) == pytest.approx([0, 0.25, 1.0])


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert set(LengthDist(100).sample(rng, 50)) == {100}
    uni = LengthDist(100, range_ratio=0.5).sample(rng, 5000)
    assert min(uni) >= 50 and max(uni) <= 150 and np.mean(uni) == pytest.approx(100, rel=0.03)
    logn = LengthDist(100, kind="lognormal", sigma=0.8, max_len=2000).sample(rng, 20000)
    assert np.mean(logn) == pytest.approx(100, rel=0.05) and np.median(logn) < 90 and min(logn) >= 1
    with pytest.raises(WorkloadError):
        LengthDist(0)
    specs = random_workload(10, LengthDist(7), LengthDist(3), seed=0)
    assert [(s.prompt_len, s.output_len) for s in specs] == [(7, 3)] * 10


def test_shared_prefix_workload_spreads_turns_over_prefixes():
    specs = shared_prefix_workload(12, num_prefixes=3, prefix_len=20, suffix_len=LengthDist(5),
                                   output_len=LengthDist(4), seed=0)
    groups = [s.prefix_group for s in specs]
    assert sorted(groups) == [0] * 4 + [1] * 4 + [2] * 4 and groups != sorted(groups)
    assert all(s.prompt_len == 25 and s.prefix_len == 20 for s in specs)


def test_trace_replay(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 5.0, "prompt_len": 10, "output_len": 3}, {"timestamp": 5.5, "prompt": "hi there", "max_tokens": 2}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    specs = load_trace(path)
    assert specs == [RequestSpec(10, 3, arrival_s=5.0), RequestSpec(0, 2, arrival_s=5.5, text="hi there")]
    assert len(WorkloadConfig(name="trace", trace_path=str(path)).build(1, 0)) == 1
    warm = WorkloadConfig(name="trace", trace_path=str(path)).warmups(2, 0)
    assert all(s.arrival_s is None for s in warm)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"timestamp": 1, "prompt_len": 3}) + "\n")
    with pytest.raises(WorkloadError, match="bad.jsonl:1.*output_len"):
        load_trace(bad)
    bad.write_text(json.dumps({"timestamp": 1, "prompt_len": 3, "output_len": 1}) + "\n"
                   + json.dumps({"prompt_len": 3, "output_len": 1}) + "\n")
    with pytest.raises(WorkloadError, match="every row"):
        load_trace(bad)


@pytest.fixture
def word_tokenizer(tmp_path):
    """A word-level tokenizer folder: decode joins words with spaces, so ids round-trip."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<eos>"] + "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<unk>", special=True), AddedToken("<eos>", special=True)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return tmp_path


def _check_exact(tok, specs, prompts):
    for spec, p in zip(specs, prompts):
        assert p.num_tokens == spec.prompt_len == len(p.token_ids)
        assert tok.encode(p.text) == p.token_ids  # same length as ids or as text
        assert not set(p.token_ids) & tok.special_token_ids


def test_exact_prompts_with_a_local_tokenizer(word_tokenizer):
    tok, note = load_tokenizer(str(word_tokenizer), None)
    assert tok is not None and str(word_tokenizer) in note
    specs = random_workload(20, LengthDist(30, range_ratio=0.9), LengthDist(2), seed=3)
    factory = PromptFactory(tok, seed=0)
    assert factory.exact
    _check_exact(tok, specs, factory.build(specs))
    shared = shared_prefix_workload(6, 2, 8, LengthDist(4), LengthDist(2), seed=0)
    prompts = factory.build(shared)
    _check_exact(tok, shared, prompts)
    by_group: dict[int, set[tuple[int, ...]]] = {}
    for s, p in zip(shared, prompts):
        by_group.setdefault(s.prefix_group, set()).add(tuple(p.token_ids[:8]))
    assert all(len(v) == 1 for v in by_group.values()) and len({next(iter(v)) for v in by_group.values()}) == 2
    assert prompts[0].system is not None and prompts[0].user is not None


def test_exact_prompts_with_the_default_model_tokenizer():
    from baton_serve.workers.checkpoint.default_model import DEFAULT_MODEL_NAME, cache_root

    folders = sorted((cache_root() / "models").glob(f"{DEFAULT_MODEL_NAME}-*"))
    if not folders or not (folders[0] / "tokenizer.json").is_file():
        pytest.skip("the default model has not been converted here (make setup)")
    tok, _ = load_tokenizer(None, str(folders[0]))
    specs = random_workload(30, LengthDist(200, range_ratio=0.99), LengthDist(2), seed=1)
    specs += shared_prefix_workload(10, 2, 64, LengthDist(40, kind="lognormal"), LengthDist(2), seed=1)
    _check_exact(tok, specs, PromptFactory(tok, seed=5).build(specs))


def test_without_a_tokenizer_lengths_are_approximate_and_said_so():
    tok, note = load_tokenizer(None, "some-remote-model")
    assert tok is None and "--tokenizer" in note
    factory = PromptFactory(None, seed=0)
    assert not factory.exact
    [p] = factory.build([RequestSpec(prompt_len=50, output_len=1)])
    assert p.token_ids is None and len(p.text.split()) == 50 and p.num_tokens == 50
