"""Engine configuration, validated at construction with errors that name the field."""

from __future__ import annotations

from dataclasses import dataclass, field

from baton_serve.kernels.device import check_device_name
from baton_serve.workers.engine.waiting_queue import POLICY_NAMES


def _require(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass
class SchedulerConfig:
    """Per-tick limits and the admission policy."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_prefill_chunk: int = 1 << 30  # per-request cap within one tick (long_prefill_token_threshold)
    policy: str = "fcfs"
    aging_seconds: float = 10.0
    fair_quantum_tokens: int = 512  # policy "fair": tokens a tenant may admit per round, per class
    preemption_mode: str = "recompute"  # or "swap" (needs EngineConfig.swap_space_gib > 0)

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs", ">= 1", self.max_num_seqs)
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1",
                 self.max_num_batched_tokens)
        _require(self.max_prefill_chunk >= 1, "max_prefill_chunk", ">= 1", self.max_prefill_chunk)
        _require(self.policy in POLICY_NAMES, "policy",
                 " or ".join((", ".join(map(repr, POLICY_NAMES[:-1])), repr(POLICY_NAMES[-1]))), self.policy)
        _require(self.aging_seconds > 0, "aging_seconds", "> 0", self.aging_seconds)
        _require(self.fair_quantum_tokens > 0, "fair_quantum_tokens", "> 0", self.fair_quantum_tokens)
        _require(self.preemption_mode in ("recompute", "swap"), "preemption_mode", "'recompute' or 'swap'",
                 self.preemption_mode)


@dataclass
class EngineConfig:
    """What to load and how much KV cache to hold.

    ``num_kv_blocks`` wins over ``kv_cache_memory_gib`` (CPU) or ``gpu_memory_utilization`` (CUDA).
    """

    model: str | None = None  # folder, .gguf file, or None for the embedded default
    dtype: str = "auto"  # auto: bf16 where the CPU computes it natively, else fp32 (kernels.auto_dtype)
    device: str = "auto"  # auto: the first visible CUDA device, else the CPU (kernels.device)
    gpu_memory_utilization: float = 0.9  # on CUDA: the device's share for weights, activations and KV
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float = 2.0
    swap_space_gib: float = 0.0  # host memory for preemption by swap
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_shared: bool = False  # host KV cache in a memfd peers on this machine map (kv_shared)
    num_threads: int | None = None
    seed: int = 0
    deterministic: bool = False  # batch-invariant numerics (kernels.deterministic)
    tensor_parallel_size: int = 1  # ranks the model is split across (workers.parallel)
    distributed_executor_backend: str = "mp"  # where ranks 1..N-1 run: "mp" (processes here) or "ray" (actors)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        _require(self.block_size in (8, 16, 32, 64, 128), "block_size", "one of 8, 16, 32, 64, 128",
                 self.block_size)
        _require(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", ">= 1",
                 self.num_kv_blocks)
        _require(self.kv_cache_memory_gib > 0, "kv_cache_memory_gib", "> 0", self.kv_cache_memory_gib)
        _require(self.swap_space_gib >= 0, "swap_space_gib", ">= 0", self.swap_space_gib)
        _require(self.scheduler.preemption_mode != "swap" or self.swap_space_gib > 0, "swap_space_gib",
                 "> 0 when scheduler.preemption_mode is 'swap'", self.swap_space_gib)
        _require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", ">= 2",
                 self.max_model_len)
        _require(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
                 "'auto', 'float32', 'bfloat16' or 'float16'", self.dtype)
        _require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "in (0, 1]",
                 self.gpu_memory_utilization)
        check_device_name(self.device)
        _require(self.num_threads is None or self.num_threads >= 1, "num_threads", ">= 1", self.num_threads)
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size", ">= 1", self.tensor_parallel_size)
        _require(self.distributed_executor_backend in ("mp", "ray"), "distributed_executor_backend",
                 "'mp' or 'ray'", self.distributed_executor_backend)
        _require(self.tensor_parallel_size == 1 or not self.kv_cache_shared, "kv_cache_shared",
                 "false with tensor_parallel_size > 1 (a replica's cache is one shard per rank)",
                 self.kv_cache_shared)


def engine_config(**kwargs: object) -> EngineConfig:
    """An EngineConfig from flat keyword arguments (scheduler fields among them), as workers and
    ``LLM`` take them."""
    sched_keys = set(SchedulerConfig.__dataclass_fields__)
    sched = SchedulerConfig(**{k: kwargs.pop(k) for k in list(kwargs) if k in sched_keys})
    return EngineConfig(scheduler=sched, **kwargs)
