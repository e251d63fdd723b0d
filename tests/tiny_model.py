"""Writes tiny random-weight Llama-family model folders for tests (Hugging Face layout)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello world! How are you today? I am fine, thank you.",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "Emoji test 🙂👍🏽 👩‍👩‍👧‍👦 and combining e\u0301 n\u0303.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Paris is the capital of France. Berlin is the capital of Germany.",
]


def build_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def write_tiny_llama(folder: Path, seed: int = 0, vocab_size: int = 384, hidden_size: int = 64,
                     intermediate_size: int = 128, num_layers: int = 2, num_heads: int = 4,
                     num_kv_heads: int = 2, max_positions: int = 512, tie: bool = False,
                     extra_config: dict[str, Any] | None = None) -> Path:
    """A Llama with random weights and a trained byte-level BPE tokenizer; returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size)
    tok.save(str(folder / "tokenizer.json"))
    vocab_size = tok.get_vocab_size()  # the trainer may stop short of the target
    head_dim = hidden_size // num_heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
        "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": tie, "hidden_act": "silu", "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2, "attention_bias": False,
    }
    config.update(extra_config or {})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML_TEMPLATE, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "add_bos_token": False}))
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    kv = num_kv_heads * head_dim
    tensors = {"model.embed_tokens.weight": rnd(vocab_size, hidden_size, scale=0.5),
               "model.norm.weight": 1.0 + rnd(hidden_size, scale=0.1)}
    if not tie:
        tensors["lm_head.weight"] = rnd(vocab_size, hidden_size, scale=0.3)
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": rnd(num_heads * head_dim, hidden_size, scale=0.3),
            p + "self_attn.k_proj.weight": rnd(kv, hidden_size, scale=0.3),
            p + "self_attn.v_proj.weight": rnd(kv, hidden_size),
            p + "self_attn.o_proj.weight": rnd(hidden_size, num_heads * head_dim),
            p + "mlp.gate_proj.weight": rnd(intermediate_size, hidden_size),
            p + "mlp.up_proj.weight": rnd(intermediate_size, hidden_size),
            p + "mlp.down_proj.weight": rnd(hidden_size, intermediate_size),
            p + "input_layernorm.weight": 1.0 + rnd(hidden_size, scale=0.1),
            p + "post_attention_layernorm.weight": 1.0 + rnd(hidden_size, scale=0.1),
        })
        if config.get("attention_bias"):
            tensors[p + "self_attn.q_proj.bias"] = rnd(num_heads * head_dim)
            tensors[p + "self_attn.k_proj.bias"] = rnd(kv)
            tensors[p + "self_attn.v_proj.bias"] = rnd(kv)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder
