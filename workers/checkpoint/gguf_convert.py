"""Convert a llama-architecture GGUF file into a Hugging Face model folder.

The folder holds ``model.safetensors`` (fp32), ``config.json``, ``generation_config.json``,
``tokenizer.json`` and ``tokenizer_config.json``, so the engine (and ``transformers``) can load
it without any GGUF support. Only ``gguf``, numpy, safetensors and tokenizers are used.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
from baton_serve.workers.errors import ModelLoadError
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tqdm import tqdm

# llama.cpp token types (tokenizer.ggml.token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Tensors llama.cpp stores but HF recomputes (rotary inverse frequencies).
_SKIPPED = {"rope_freqs.weight"}


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """The decoded value of a metadata key, or ``default`` when the file lacks it."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _required(reader: GGUFReader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ModelLoadError(f"GGUF metadata lacks required key {key!r}")
    return value


def _f32(value: float) -> float:
    # GGUF stores floats as float32; 9.999999747e-06 should read back as the 1e-05 it was written from.
    return float(str(np.float32(value)))


def read_hparams(reader: GGUFReader) -> dict[str, Any]:
    """The llama hyper-parameters from GGUF metadata; raises ModelLoadError for other architectures."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"only llama-architecture GGUF files are supported, got {arch!r}")
    hidden = int(_required(reader, "llama.embedding_length"))
    heads = int(_required(reader, "llama.attention.head_count"))
    tokens = _required(reader, "tokenizer.ggml.tokens")
    return {
        "num_hidden_layers": int(_required(reader, "llama.block_count")),
        "max_position_embeddings": int(_required(reader, "llama.context_length")),
        "hidden_size": hidden,
        "intermediate_size": int(_required(reader, "llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, "llama.attention.key_length", hidden // heads)),
        "rms_norm_eps": _f32(_required(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(_field(reader, "llama.rope.freq_base", 10000.0)),
        "vocab_size": int(_field(reader, "llama.vocab_size", len(tokens))),
    }


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a llama.cpp tensor; None for tensors HF does not store."""
    if gguf_name in _SKIPPED:
        return None
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.match(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise ModelLoadError(f"unexpected tensor {gguf_name!r} in a llama GGUF file")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def _unpermute_rotary(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order.

    llama.cpp interleaves the two rotary halves of each head (rows ``i*half + j`` move to
    ``j*2 + i``) because its RoPE rotates adjacent pairs; HF rotates halves, so restore them.
    """
    rows = weight.shape[0]
    half = rows // n_heads // 2
    per_head = weight.reshape(n_heads, half, 2, *weight.shape[1:])
    return np.ascontiguousarray(per_head.swapaxes(1, 2).reshape(weight.shape))


def read_weights(reader: GGUFReader, hparams: dict[str, Any], progress: bool) -> dict[str, np.ndarray]:
    """Dequantised fp32 weights under HF names, keyed in sorted order."""
    weights: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc="Converting GGUF", unit="tensor", disable=not progress):
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if ".attn_q." in tensor.name:
            array = _unpermute_rotary(array, hparams["num_attention_heads"])
        elif ".attn_k." in tensor.name:
            array = _unpermute_rotary(array, hparams["num_key_value_heads"])
        weights[name] = np.ascontiguousarray(array)
    if "model.embed_tokens.weight" not in weights:
        raise ModelLoadError("GGUF file has no token_embd.weight tensor")
    return {name: weights[name] for name in sorted(weights)}


def build_tokenizer(reader: GGUFReader) -> Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` from ``tokenizer.ggml.*`` metadata.

    Encoding adds no BOS/EOS (no post-processor): the chat template writes the markers itself.
    """
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"only gpt2-style (byte-level BPE) GGUF tokenizers are supported, got {kind!r}")
    tokens: list[str] = _required(reader, "tokenizer.ggml.tokens")
    merges: list[str] = _required(reader, "tokenizer.ggml.merges")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    # llama.cpp's "smollm" pre-type also splits digits one by one; this vocabulary has no multi-digit
    # tokens or digit merges, so plain ByteLevel splitting yields the same ids.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    special = [
        AddedToken(tok, special=True, normalized=False)
        for tok, t in zip(tokens, types)
        if t == _TOKEN_CONTROL
    ]
    user = [
        AddedToken(tok, special=False, normalized=False)
        for tok, t in zip(tokens, types)
        if t == _TOKEN_USER_DEFINED
    ]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)
    return tokenizer


def _special_ids(reader: GGUFReader) -> dict[str, int | None]:
    def get(key: str) -> int | None:
        value = _field(reader, f"tokenizer.ggml.{key}")
        return None if value is None else int(value)

    return {
        "bos_token_id": get("bos_token_id"),
        "eos_token_id": get("eos_token_id"),
        "pad_token_id": get("padding_token_id"),
        "unk_token_id": get("unknown_token_id"),
    }


def _model_config(hparams: dict[str, Any], ids: dict[str, int | None], tied: bool) -> dict[str, Any]:
    return {
        **hparams,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "float32",
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": ids["bos_token_id"],
        "eos_token_id": ids["eos_token_id"],
        "pad_token_id": ids["pad_token_id"],
    }


def _tokenizer_config(reader: GGUFReader, ids: dict[str, int | None], max_len: int) -> dict[str, Any]:
    tokens = _required(reader, "tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        return None if ids[key] is None else tokens[ids[key]]

    config: dict[str, Any] = {
        # PreTrainedTokenizerFast loads tokenizer.json verbatim in transformers 4.x and 5.x alike.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("pad_token_id"),
        "unk_token": token("unk_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        # Clean-up would rewrite " ," to "," and break byte-exact round trips.
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
    }
    template = _field(reader, "tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return config


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
    """Write an HF model folder for ``gguf_path`` into ``out_dir`` (created if needed) and return it.

    Deterministic: the same GGUF always yields byte-identical files. Not atomic: callers that
    share ``out_dir`` between processes should convert into a temp folder and rename it.
    Raises ModelLoadError for unreadable or unsupported files.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    try:
        reader = GGUFReader(gguf_path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {exc}") from exc
    hparams = read_hparams(reader)
    ids = _special_ids(reader)
    weights = read_weights(reader, hparams, progress)
    tied = "lm_head.weight" not in weights
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    # safetensors creates the file 0600; match the other files so a shared cache stays readable.
    (out_dir / "model.safetensors").chmod(0o644)
    del weights
    _write_json(out_dir / "config.json", _model_config(hparams, ids, tied))
    generation = {key: ids[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    _write_json(out_dir / "generation_config.json", generation)
    build_tokenizer(reader).save(str(out_dir / "tokenizer.json"), pretty=True)
    max_len = hparams["max_position_embeddings"]
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(reader, ids, max_len))
    return out_dir
