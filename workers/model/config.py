"""Model architecture read from a Hugging Face ``config.json``, validated at construction."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from baton_serve.workers.errors import ModelLoadError
from baton_serve.workers.model.quantization import QuantConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    """The fields a Llama-family decoder needs; anything else in config.json is ignored."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    quantization: QuantConfig | None = None  # weight-only int8/int4 checkpoints (workers.checkpoint.quantize)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"config.json: {name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a parsed config.json; raises ModelLoadError naming what is wrong."""
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architectures {archs!r}; Baton runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            window = raw.get("sliding_window")
            if raw.get("use_sliding_window") is False:
                window = None
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", 10000.0)),
                rope_scaling=raw.get("rope_scaling"),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
                sliding_window=int(window) if window else None,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                quantization=QuantConfig.from_dict(raw.get("quantization_config")),
            )
        except KeyError as exc:
            raise ModelLoadError(f"config.json is missing required field {exc.args[0]!r}") from exc

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        cfg = Path(path) / "config.json"
        if not cfg.is_file():
            raise ModelLoadError(f"{path} has no config.json (a model folder needs config.json, "
                                 "*.safetensors and tokenizer.json)")
        return cls.from_dict(json.loads(cfg.read_text()))
