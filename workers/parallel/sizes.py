"""Which tensor-parallel sizes a model can be split into, and which heads each rank holds.

Megatron's split: query heads and the MLP's intermediate features divide evenly across ranks;
KV heads divide too, or (more ranks than KV heads) each is replicated on ``tp / num_kv_heads``
ranks, as vLLM does, so a rank's query heads always share one KV head.
"""

from __future__ import annotations

from baton_serve.workers.model.config import ModelConfig


class TensorParallelSizeError(ValueError):
    """A tensor-parallel size this model cannot be split into; the message names the sizes that work."""


def split_problem(cfg: ModelConfig, tp: int) -> str | None:
    """Why ``cfg`` cannot be split into ``tp`` ranks, or None when it can."""
    if tp < 1:
        return "it must be >= 1"
    if cfg.num_attention_heads % tp:
        return f"num_attention_heads ({cfg.num_attention_heads}) is not divisible by it"
    kv = cfg.num_key_value_heads
    if kv % tp and tp % kv:
        return f"it neither divides num_key_value_heads ({kv}) nor is a multiple of it"
    if cfg.intermediate_size % tp:
        return f"intermediate_size ({cfg.intermediate_size}) is not divisible by it"
    quant = cfg.quantization
    group = getattr(quant, "group_size", 0) or 0
    if group:
        for name, size in (("intermediate_size", cfg.intermediate_size),
                           ("num_attention_heads * head_dim", cfg.num_attention_heads * cfg.head_dim)):
            if (size // tp) % group:
                return f"{name} / {tp} = {size // tp} is not a multiple of the quantisation group size {group}"
    return None


def valid_sizes(cfg: ModelConfig) -> list[int]:
    """Every tensor-parallel size ``cfg`` splits into (1 always)."""
    return [tp for tp in range(1, cfg.num_attention_heads + 1) if split_problem(cfg, tp) is None]


def check_tensor_parallel_size(cfg: ModelConfig, tp: int, field: str = "tensor_parallel_size") -> None:
    """Raise ``TensorParallelSizeError`` naming ``field``, the model's sizes and those that work."""
    problem = split_problem(cfg, tp)
    if problem is not None:
        raise TensorParallelSizeError(
            f"{field} = {tp} does not fit this model: {problem}; sizes that work: "
            f"{', '.join(map(str, valid_sizes(cfg)))}")


def kv_heads_of_rank(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """(first KV head, how many) that ``rank`` of ``tp`` holds in its cache."""
    if num_kv_heads % tp == 0:
        per = num_kv_heads // tp
        return rank * per, per
    return rank // (tp // num_kv_heads), 1


def kv_head_owners(num_kv_heads: int, tp: int) -> list[list[int]]:
    """For each KV head, the ranks of a ``tp`` replica whose cache holds it."""
    owners: list[list[int]] = [[] for _ in range(num_kv_heads)]
    for rank in range(tp):
        first, count = kv_heads_of_rank(num_kv_heads, tp, rank)
        for head in range(first, first + count):
            owners[head].append(rank)
    return owners
