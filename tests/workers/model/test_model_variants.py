"""Llama-family variants against transformers: Llama-3 RoPE scaling, Qwen2 QKV bias, Mistral, tied
embeddings, sharded checkpoints, and the dtypes weights load in."""

from __future__ import annotations

import json

import pytest
import torch
from baton_serve.workers import LLM, SamplingParams
from baton_serve.workers.errors import ModelLoadError
from safetensors.torch import load_file, save_file

from benchmarks.engine_check import hf_greedy
from tests.tiny_model import write_tiny_llama

PROMPT = [5, 17, 42, 7, 99, 3, 150, 23, 8, 61, 77, 12]


def _ours(folder, n=8, **kw) -> list[int]:
    llm = LLM(model=str(folder), dtype=kw.pop("dtype", "float32"), block_size=8, num_kv_blocks=32, **kw)
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0].token_ids


def _hf(folder, cls_name: str = "LlamaForCausalLM", n=8) -> list[int]:
    import transformers

    model = getattr(transformers, cls_name).from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf_greedy(model, PROMPT, n)


def test_llama3_rope_scaling(tmp_path):
    folder = write_tiny_llama(tmp_path / "l3", max_positions=512, extra_config={
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}})
    assert _ours(folder) == _hf(folder)


def test_qwen2_with_qkv_bias(tmp_path):
    folder = write_tiny_llama(tmp_path / "qwen", extra_config={
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_bias": True,
        "use_sliding_window": False, "sliding_window": None})
    assert _ours(folder) == _hf(folder, "Qwen2ForCausalLM")


def test_mistral_and_tied_embeddings(tmp_path):
    folder = write_tiny_llama(tmp_path / "mistral", tie=True, extra_config={
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None})
    assert _ours(folder) == _hf(folder, "MistralForCausalLM")


def test_sharded_checkpoint_and_half_precision_loads(tmp_path):
    folder = write_tiny_llama(tmp_path / "sharded")
    tensors = load_file(str(folder / "model.safetensors"))
    names = sorted(tensors)
    (folder / "model.safetensors").unlink()
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(folder / file))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in halves.items() for k in keys}}))
    assert _ours(folder) == _hf(folder)
    for dtype in ("bfloat16", "float16"):
        assert len(_ours(folder, n=4, dtype=dtype)) == 4


def test_missing_weight_is_a_clear_error(tmp_path):
    folder = write_tiny_llama(tmp_path / "broken")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="down_proj"):
        _ours(folder)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "linear", "factor": 4.0},
])
def test_rope_inverse_frequencies_match_transformers(scaling):
    from baton_serve.workers.model.layers import rope_inv_freq
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0,
                      max_position_embeddings=131072, rope_scaling=dict(scaling))
    ref, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
    ours = rope_inv_freq(128, 500000.0, scaling)
    unscaled = rope_inv_freq(128, 500000.0, None)
    assert not torch.allclose(unscaled, ref.float())  # the case really scales something
    torch.testing.assert_close(ours, ref.float(), rtol=1e-5, atol=0)
