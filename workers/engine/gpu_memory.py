"""KV cache size on a CUDA device, as vLLM's ``gpu_memory_utilization`` sizes it: the share of the
device this worker may use, less its weights, less the activation peak of the largest step the
scheduler can build (profiled by running one), and never more than the device has free (workers
sharing one GPU each take their share).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

import torch
from baton_serve.kernels.device import kv_cache_bytes
from baton_serve.workers.engine.config import EngineConfig
from baton_serve.workers.engine.core import EngineCore
from baton_serve.workers.engine.model_runner import kv_cache_block_bytes
from baton_serve.workers.model.llama import LlamaForCausalLM
from baton_serve.workers.sampling.params import SamplingParams

log = logging.getLogger("baton.engine")


@dataclasses.dataclass(frozen=True)
class GpuMemoryPlan:
    """What the sizing saw (bytes) and the blocks it leaves room for."""

    total: int
    free: int
    weights: int
    activation_peak: int
    block_bytes: int
    num_blocks: int


def profile_shape(config: EngineConfig, max_model_len: int) -> tuple[int, int]:
    """(prompts, tokens each) of the profiling step: the scheduler's token budget spread over as
    many sequences as it may run, so both the widest prefill and the most sampled rows are in it."""
    tokens = max(min(config.scheduler.max_num_batched_tokens, max_model_len - 1), 1)
    prompts = max(min(config.scheduler.max_num_seqs, tokens), 1)
    return prompts, max(tokens // prompts, 1)


def plan_gpu_kv_cache(model: LlamaForCausalLM, config: EngineConfig, device: torch.device,
                      eos_token_ids: Sequence[int], max_model_len: int) -> GpuMemoryPlan:
    """Profile one full step on a throwaway engine and size the cache from what is left."""
    dtype = model.dtype
    block_bytes = kv_cache_block_bytes(model, config.block_size, dtype)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    prompts, length = profile_shape(config, max_model_len)
    blocks = prompts * math.ceil((length + 1) / config.block_size) + 1
    probe_config = dataclasses.replace(config, enable_prefix_caching=False, kv_cache_shared=False,
                                       swap_space_gib=0.0, num_kv_blocks=blocks,
                                       scheduler=dataclasses.replace(config.scheduler, preemption_mode="recompute"))
    torch.cuda.reset_peak_memory_stats(device)
    probe = EngineCore(model, probe_config, blocks, eos_token_ids=eos_token_ids, device=device)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i in range(prompts):
        probe.add_request(f"profile-{i}", [0] * length, params)
    while probe.has_unfinished_requests():
        probe.step()
    torch.cuda.synchronize(device)
    peak = max(torch.cuda.max_memory_allocated(device) - weights - blocks * block_bytes, 0)
    del probe
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    room = kv_cache_bytes(total, config.gpu_memory_utilization, weights, peak, free)
    plan = GpuMemoryPlan(total, free, weights, peak, block_bytes, room // block_bytes)
    log.info("KV cache on %s: %d blocks (%.2f GiB) = %.0f%% of %.1f GiB - weights %.2f GiB - activations "
             "%.2f GiB (%.2f GiB free)", device, plan.num_blocks, plan.num_blocks * block_bytes / 2**30,
             100 * config.gpu_memory_utilization, total / 2**30, weights / 2**30, plan.activation_peak / 2**30,
             free / 2**30)
    return plan
