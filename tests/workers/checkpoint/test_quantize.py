"""``baton convert --quantize``: a separate model folder whose int8/int4 layers compute exactly
what the same model with the dequantised weights computes, under its own cache namespace."""

from __future__ import annotations

import json

import pytest
import torch
from baton_serve.kernels import quant_linear
from baton_serve.workers import LLM, SamplingParams
from baton_serve.workers.checkpoint.quantize import quantize_folder
from baton_serve.workers.errors import ModelLoadError
from baton_serve.workers.llm import weights_fingerprint
from baton_serve.workers.model.config import ModelConfig
from baton_serve.workers.model.layers import ColumnParallelLinear, ParallelContext, RowParallelLinear
from baton_serve.workers.model.quantization import QuantConfig
from safetensors import safe_open
from safetensors.torch import save_file

METHODS = [("int8", 0), ("int8", 32), ("int4", 32), ("int4", 64)]


def _dequantized_twin(quant_dir, out_dir, group_size: int):
    """A full-precision folder holding the dequantised weights of ``quant_dir``."""
    out_dir.mkdir()
    tensors = {}
    with safe_open(str(quant_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        for name in names:
            if name.endswith(".qweight"):
                stem = name[: -len(".qweight")]
                q, s = f.get_tensor(name), f.get_tensor(f"{stem}.scales")
                if f"{stem}.mins" in names:
                    w = quant_linear.dequantize_int4(q, s, f.get_tensor(f"{stem}.mins"), group_size)
                else:
                    w = quant_linear.dequantize_int8(q, s)
                tensors[f"{stem}.weight"] = w.contiguous()
            elif not name.endswith((".scales", ".mins")):
                tensors[name] = f.get_tensor(name)
    save_file(tensors, str(out_dir / "model.safetensors"))
    config = json.loads((quant_dir / "config.json").read_text())
    del config["quantization_config"]
    config["tie_word_embeddings"] = False  # the quantised head is a copy of its own
    (out_dir / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (quant_dir / name).exists():
            (out_dir / name).write_bytes((quant_dir / name).read_bytes())
    return out_dir


@pytest.mark.parametrize("method,group_size", METHODS, ids=["int8-per-channel", "int8-g32", "int4-g32", "int4-g64"])
def test_a_quantised_model_computes_what_its_dequantised_weights_compute(tiny_model_dir, tmp_path, method,
                                                                         group_size) -> None:
    qdir = quantize_folder(tiny_model_dir, tmp_path / "q", method, group_size)
    cfg = ModelConfig.from_folder(qdir)
    assert cfg.quantization == QuantConfig(method, group_size, "int8")
    twin = _dequantized_twin(qdir, tmp_path / "twin", group_size)
    prompts = [[5, 9, 3, 17, 2, 44, 8], [100, 7, 7, 7, 12]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    runs = []
    for folder in (qdir, twin):
        llm = LLM(model=str(folder), dtype="float32", block_size=8, num_kv_blocks=64)
        runs.append(llm.generate(prompts, params))
    for got, want in zip(*runs):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].logprobs == pytest.approx(want.outputs[0].logprobs, abs=1e-4)
        for a, b in zip(got.outputs[0].top_logprobs, want.outputs[0].top_logprobs):
            assert [t for t, _ in a] == [t for t, _ in b]
            assert [lp for _, lp in a] == pytest.approx([lp for _, lp in b], abs=1e-4)


def test_the_quantised_folder_is_its_own_model(tiny_model_dir, tmp_path) -> None:
    q8 = quantize_folder(tiny_model_dir, tmp_path / "q8", "int8")
    q4 = quantize_folder(tiny_model_dir, tmp_path / "q4", "int4", 32)
    q8c = quantize_folder(tiny_model_dir, tmp_path / "q8c", "int8", 0)
    prints = {weights_fingerprint(p) for p in (tiny_model_dir, q8, q4, q8c)}
    assert len(prints) == 4  # four prefix-cache namespaces: no shared KV blocks
    with safe_open(str(q4 / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.down_proj.qweight").dtype == torch.uint8
        assert "model.layers.0.mlp.down_proj.weight" not in names
        assert f.get_tensor("lm_head.qweight").dtype == torch.int8  # the head: int8
        assert f.get_tensor("model.norm.weight").dtype == torch.float32  # norms stay
    assert quantize_folder(tiny_model_dir, tmp_path / "q8", "int8") == q8  # reused, not rewritten


def test_bad_quantisation_requests_are_clear_errors(tiny_model_dir, tmp_path) -> None:
    with pytest.raises(ValueError, match="int8 or int4"):
        quantize_folder(tiny_model_dir, tmp_path / "x", "int3")
    with pytest.raises(ValueError, match="group-size"):
        quantize_folder(tiny_model_dir, tmp_path / "y", "int4", 48)
    with pytest.raises(ValueError, match="group-size"):
        quantize_folder(tiny_model_dir, tmp_path / "z", "int4", 0)  # int4 needs groups
    q8 = quantize_folder(tiny_model_dir, tmp_path / "q8", "int8")
    with pytest.raises(ModelLoadError, match="already quantised"):
        quantize_folder(q8, tmp_path / "again", "int4")
    assert not (tmp_path / "again").exists()


def test_a_foreign_quantization_config_is_refused(tiny_model_dir, tmp_path) -> None:
    folder = tmp_path / "gptq"
    folder.mkdir()
    for item in tiny_model_dir.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="gptq"):
        ModelConfig.from_folder(folder)


@pytest.mark.parametrize("method,group_size", [("int8", 0), ("int8", 32), ("int4", 32)])
def test_tensor_parallel_ranks_load_their_slice_of_quantised_weights(method, group_size) -> None:
    """Column-parallel ranks take output rows, row-parallel ranks input columns: each rank's
    dequantised weight is the matching slice of the whole one."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=gen)
    quant = QuantConfig(method, group_size)
    if method == "int8":
        parts = dict(zip(("qweight", "scales"), quant_linear.quantize_int8(w, group_size)))
        full = quant_linear.dequantize_int8(parts["qweight"], parts["scales"])
    else:
        parts = dict(zip(("qweight", "scales", "mins"), quant_linear.quantize_int4(w, group_size)))
        full = quant_linear.dequantize_int4(parts["qweight"], parts["scales"], parts["mins"], group_size)
    for rank in (0, 1):
        ctx = ParallelContext(tp_size=2, tp_rank=rank)
        col = ColumnParallelLinear(128, [64], False, ctx, torch.float32, quant)
        row = RowParallelLinear(128, 64, False, ctx, torch.float32, quant)
        for layer in (col, row):
            for name, tensor in parts.items():
                param = getattr(layer, name)
                param.weight_loader(param, tensor, None)
        idx = torch.arange(64)
        assert torch.equal(col.method.rows(col, torch.arange(32)), full[rank * 32:(rank + 1) * 32])
        assert torch.equal(row.method.rows(row, idx), full[:, rank * 64:(rank + 1) * 64])


def test_a_w8a8_model_quantises_activations_and_stays_near_weight_only_int8(tiny_model_dir, tmp_path) -> None:
    w8a8 = quantize_folder(tiny_model_dir, tmp_path / "a8", "int8", 0, activations="int8")
    weight_only = quantize_folder(tiny_model_dir, tmp_path / "w8", "int8", 0)
    assert ModelConfig.from_folder(w8a8).quantization == QuantConfig("int8", 0, "int8", "int8")
    assert json.loads((w8a8 / "config.json").read_text())["quantization_config"]["activations"] == "int8"
    assert "activations" not in json.loads((weight_only / "config.json").read_text())["quantization_config"]
    assert weights_fingerprint(w8a8) != weights_fingerprint(weight_only)  # its own prefix-cache namespace
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=5)
    got = []
    for folder in (w8a8, weight_only):
        llm = LLM(model=str(folder), dtype="float32", block_size=8, num_kv_blocks=64)
        layers = [m for m in llm.engine.runner.model.modules() if hasattr(m, "qweight")]
        assert layers and all((getattr(m, "w8a8", None) is not None) == (folder == w8a8) for m in layers)
        got.append(dict(llm.generate([[5, 9, 3, 17, 2, 44, 8]], params)[0].outputs[0].top_logprobs[0]))
    shared = set(got[0]) & set(got[1])
    diffs = [abs(got[0][t] - got[1][t]) for t in shared]
    assert len(shared) >= 3 and max(diffs) < 0.1 and max(diffs) > 0  # rounded activations, not other math


def test_w8a8_needs_int8_weights_per_output_channel(tiny_model_dir, tmp_path) -> None:
    with pytest.raises(ValueError, match="--group-size 0"):
        quantize_folder(tiny_model_dir, tmp_path / "x", "int8", 32, activations="int8")
    with pytest.raises(ValueError, match="--quantize int8"):
        quantize_folder(tiny_model_dir, tmp_path / "y", "int4", 32, activations="int8")
    with pytest.raises(ModelLoadError, match="per output channel"):
        QuantConfig("int8", 32, activations="int8")
    with pytest.raises(ModelLoadError, match="activations must be one of"):
        QuantConfig("int8", 0, activations="fp8")
    assert QuantConfig("int8", 0, "int8", "int8").for_lm_head().activations == "int8"
    assert QuantConfig("int8", 0, "full", "int8").for_lm_head() is None
