"""Kernel choice: the decision rule, the per-machine cache, the overrides, and a model that runs
the layouts and attention kernel its plan names."""

from __future__ import annotations

import json

import pytest
import torch
from baton_serve.kernels import kernel_choice, packed_linear, sdpa_attention
from baton_serve.kernels.kernel_choice import KernelChoiceError, Workload, pick, plan_for
from hypothesis import given
from hypothesis import strategies as st

SHAPES = {(48, 32): False, (96, 32): True}  # a projection, and an LM head only decode rows reach
GEOMETRY = (4, 2, 16)
SMALL = Workload(4, 32)
_env = ("BATON_KERNEL_TUNING", "BATON_LINEAR_KERNEL", "BATON_PREFILL_ATTENTION", "BATON_PACKED_LINEAR",
        "BATON_KERNEL_BACKEND")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "cache"))
    for name in _env:
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "cache"


def _no_measuring(*_args, **_kwargs):
    raise AssertionError("measured although the verdict was cached or not wanted")


times = st.lists(st.floats(0.01, 100.0), min_size=3, max_size=3)


@given(st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), times, min_size=1))
def test_pick_takes_the_lowest_summed_slowdown(ms) -> None:
    best = [min(ts[i] for ts in ms.values()) for i in range(3)]
    score = {n: sum(t / b for t, b in zip(ts, best)) for n, ts in ms.items()}
    chosen = pick(ms)
    assert chosen in ms and score[chosen] == pytest.approx(min(score.values()))


@given(st.dictionaries(st.sampled_from(["a", "b", "c"]), times, min_size=2), st.sampled_from(["a", "b", "c"]))
def test_the_default_keeps_its_place_only_within_the_tolerance(ms, default) -> None:
    best = [min(ts[i] for ts in ms.values()) for i in range(3)]
    score = {n: sum(t / b for t, b in zip(ts, best)) for n, ts in ms.items()}
    chosen = pick(ms, default)
    if default in ms and score[default] <= min(score.values()) * (1 + kernel_choice.TIE_TOLERANCE):
        assert chosen == default
    else:
        assert score[chosen] == pytest.approx(min(score.values()))


def test_a_layout_fast_at_prefill_only_loses_to_one_good_at_both() -> None:
    # decode ms, prefill ms: "plain" is 5% faster at prefill but 3x slower at decode
    assert pick({"packed:1": [0.1, 1.0], "plain": [0.3, 0.95]}) == "packed:1"


def test_workload_buckets_rows_to_powers_of_two_and_caps_them() -> None:
    assert Workload.for_engine(256, 8192) == Workload(64, 2048)
    assert Workload(64, 512).linear_rows(False) == [1, 64, 512] and Workload(1, 8).linear_rows(True) == [1]
    assert Workload.for_engine(5, 100) == Workload(8, 128)
    assert Workload.for_engine(1, 1) == Workload(1, 1)


def test_measures_once_then_reads_the_cache(own_cache, monkeypatch) -> None:
    plan = plan_for(SHAPES, GEOMETRY, torch.float32, SMALL)
    for shape, decode_only in SHAPES.items():
        choice = plan.linear[shape]
        assert choice.reason == "measured" and choice.kernel in choice.ms and "plain" in choice.ms
        assert choice.rows == ([1, 4] if decode_only else [1, 4, 32])
        assert all(len(ts) == len(choice.rows) and all(t > 0 for t in ts) for ts in choice.ms.values())
    assert plan.prefill_attention.reason == "measured" and "sdpa" in plan.prefill_attention.ms
    files = list((own_cache / "capabilities").glob("kernels_*.json"))
    assert len(files) == 1 and len(json.loads(files[0].read_text())) == 3
    monkeypatch.setattr(kernel_choice, "_measure", _no_measuring)
    again = plan_for(SHAPES, GEOMETRY, torch.float32, SMALL)
    assert [c.kernel for c in again.choices()] == [c.kernel for c in plan.choices()]
    assert {c.reason for c in again.choices()} == {"cached"}


def test_the_cache_is_kept_per_thread_count_and_workload(own_cache) -> None:
    plan_for(SHAPES, None, torch.float32, SMALL)
    plan_for(SHAPES, None, torch.float32, Workload(8, 32))  # a new decode row count: new entries, same file
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert {c.reason for c in plan_for(SHAPES, None, torch.float32, SMALL).choices()} == {"measured"}
    finally:
        torch.set_num_threads(threads)
    files = sorted((own_cache / "capabilities").glob("kernels_*.json"))
    assert len(files) == 2 and sorted(len(json.loads(f.read_text())) for f in files) == [2, 4]


def test_forced_linear_kernel_still_measures_attention(monkeypatch) -> None:
    monkeypatch.setenv("BATON_LINEAR_KERNEL", "plain")
    plan = plan_for(SHAPES, GEOMETRY, torch.bfloat16, SMALL)
    assert {c.kernel for c in plan.linear.values()} == {"plain"}
    assert all(c.reason.startswith("forced") and not c.ms for c in plan.linear.values())
    assert plan.prefill_attention.reason == "measured"


def test_forced_attention_and_tuning_off_measure_nothing(own_cache, monkeypatch) -> None:
    monkeypatch.setattr(kernel_choice, "_measure", _no_measuring)
    monkeypatch.setenv("BATON_PREFILL_ATTENTION", "sdpa")
    monkeypatch.setenv("BATON_KERNEL_TUNING", "0")
    plan = plan_for(SHAPES, GEOMETRY, torch.bfloat16, SMALL)
    assert plan.prefill_attention.kernel == "sdpa"
    assert plan.prefill_attention_impl() is sdpa_attention.paged_prefill_attention
    hint = packed_linear.default_hint(torch.bfloat16)
    assert {c.kernel for c in plan.linear.values()} == {f"packed:{hint}"}
    assert not (own_cache / "capabilities").exists()


def test_packing_off_means_plain(monkeypatch) -> None:
    monkeypatch.setenv("BATON_PACKED_LINEAR", "0")
    plan = plan_for(SHAPES, None, torch.float32, SMALL)
    assert {c.kernel for c in plan.linear.values()} == {"plain"}


def test_a_forced_backend_leaves_no_choice(monkeypatch) -> None:
    monkeypatch.setenv("BATON_KERNEL_BACKEND", "torch")
    assert plan_for(SHAPES, GEOMETRY, torch.float32, SMALL) is None


@pytest.mark.parametrize("var", ["BATON_LINEAR_KERNEL", "BATON_PREFILL_ATTENTION"])
def test_an_unknown_override_is_a_typed_error(monkeypatch, var) -> None:
    monkeypatch.setenv(var, "fastest")
    with pytest.raises(KernelChoiceError, match=f"{var} must be 'auto' or one of"):
        plan_for(SHAPES, GEOMETRY, torch.float32, SMALL)


def test_kernels_that_need_the_native_library_are_refused_or_remeasured_without_it(monkeypatch) -> None:
    plan_for(SHAPES, GEOMETRY, torch.float32, SMALL)  # cached, possibly naming invariant/native
    monkeypatch.setattr(kernel_choice.cpu_ops, "available", lambda: False)
    plan = plan_for(SHAPES, GEOMETRY, torch.float32, SMALL)
    assert all(c.kernel not in ("invariant", "native") for c in plan.choices())
    assert plan.prefill_attention.kernel == "sdpa"
    monkeypatch.setenv("BATON_LINEAR_KERNEL", "invariant")
    with pytest.raises(KernelChoiceError, match="needs Baton's native CPU kernels"):
        plan_for(SHAPES, GEOMETRY, torch.float32, SMALL)


def test_the_panel_kernel_is_refused_in_fp16(monkeypatch) -> None:
    monkeypatch.setenv("BATON_LINEAR_KERNEL", "invariant")
    with pytest.raises(KernelChoiceError, match="bf16 or fp32"):
        plan_for(SHAPES, None, torch.float16, SMALL)


def test_the_table_names_every_op_and_candidate() -> None:
    plan = plan_for(SHAPES, GEOMETRY, torch.float32, SMALL)
    table = plan.table().splitlines()
    assert len(table) == 3 and table[0].startswith("linear 48x32 float32: ")
    assert "ms at 32/64 context tokens" in table[2] and "sdpa" in table[2]
    assert [row["op"] for row in kernel_choice.as_dict(plan)] == ["linear", "linear", "prefill_attention"]


# -- a model runs what its plan names ------------------------------------------------------------

def _load(tmp_path, dtype=torch.float32, **kwargs):
    from baton_serve.workers.model.loader import load_model

    from tests.tiny_model import write_tiny_llama

    return load_model(write_tiny_llama(tmp_path / "model", **kwargs), dtype=dtype)


def _logits(tmp_path) -> torch.Tensor:
    """The fp32 logits of one 11-token prompt, through whatever the plan chose."""
    from baton_serve.workers import LLM

    from tests.tiny_model import write_tiny_llama
    from tests.workers.model.test_llama import _prefill_meta

    llm = LLM(model=str(write_tiny_llama(tmp_path / "model")), dtype="float32", block_size=8, num_kv_blocks=8)
    runner = llm.engine.runner
    ids = torch.tensor([5, 9, 17, 3, 44, 8, 120, 7, 2, 61, 33])
    hidden = runner.model(ids, torch.arange(11), runner.kv_caches, _prefill_meta([11], 8, 2))
    return runner.model.compute_logits(hidden)


@pytest.mark.parametrize("linear,attention", [("packed:1", "sdpa"), ("packed:512", "native"), ("packed:64", "sdpa")])
def test_every_candidate_gives_the_plain_models_logits(tmp_path, monkeypatch, linear, attention) -> None:
    monkeypatch.setenv("BATON_LINEAR_KERNEL", "plain")
    monkeypatch.setenv("BATON_PREFILL_ATTENTION", "native")
    plain = _logits(tmp_path / "a")
    monkeypatch.setenv("BATON_LINEAR_KERNEL", linear)
    monkeypatch.setenv("BATON_PREFILL_ATTENTION", attention)
    torch.testing.assert_close(_logits(tmp_path / "b"), plain, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tie", [True, False])
def test_a_model_packs_as_its_plan_says(tmp_path, monkeypatch, tie) -> None:
    from baton_serve.workers.model.attention import PagedAttention

    monkeypatch.setenv("BATON_LINEAR_KERNEL", "plain")
    monkeypatch.setenv("BATON_PREFILL_ATTENTION", "sdpa")
    model = _load(tmp_path, tie=tie)
    layer = model.layers[0]
    assert layer.self_attn.qkv_proj.packed is None and layer.self_attn.qkv_proj.weight.numel() > 0
    assert model._lm_head_packed is None
    attentions = [m for m in model.modules() if isinstance(m, PagedAttention)]
    assert attentions and all(m.prefill_kernel is sdpa_attention.paged_prefill_attention for m in attentions)
    shapes, geometry = model.kernel_shapes()
    head = (model.cfg.vocab_size, model.cfg.hidden_size)
    assert shapes[head] is True and sum(not v for v in shapes.values()) == 4  # qkv, o, gate_up, down
    assert geometry == (4, 2, 16)


def test_an_engine_starts_on_a_measured_plan_and_generates(tmp_path) -> None:
    from baton_serve.workers import LLM, SamplingParams

    from tests.tiny_model import write_tiny_llama

    llm = LLM(model=str(write_tiny_llama(tmp_path / "model")), dtype="float32", num_kv_blocks=16)
    plan = llm.engine.runner.model.kernel_plan
    assert plan is not None and {c.reason for c in plan.choices()} <= {"measured", "cached"}
    assert len(plan.linear) == 5 and plan.prefill_attention is not None
    out = llm.generate(["Hello world"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5


def test_a_windowed_model_keeps_the_default_attention(tmp_path) -> None:
    model = _load(tmp_path, extra_config={"sliding_window": 8, "model_type": "mistral"})
    assert model.kernel_shapes()[1] is None


def test_the_deterministic_mode_gets_no_plan(tmp_path, monkeypatch) -> None:
    from baton_serve.workers.model.loader import load_model

    from tests.tiny_model import write_tiny_llama

    monkeypatch.setattr(kernel_choice, "plan_for", _no_measuring)
    load_model(write_tiny_llama(tmp_path / "model"), dtype=torch.float32, deterministic=True)


def test_a_bad_override_fails_the_load_with_a_model_error(tmp_path, monkeypatch) -> None:
    from baton_serve.workers.errors import ModelLoadError

    monkeypatch.setenv("BATON_LINEAR_KERNEL", "packed:7")
    with pytest.raises(ModelLoadError, match="BATON_LINEAR_KERNEL"):
        _load(tmp_path)
