"""A snapshot of an engine's load and counters for metrics and routing: what a worker's ``stats``
call reports, built the same way for a live engine and a simulated one (``cluster.sim``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from baton_serve.workers.engine.config import SchedulerConfig
from baton_serve.workers.engine.core import EngineCore


@dataclass
class EngineStats:
    """A snapshot for metrics and routing (never the scheduler itself)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_paused: int = 0  # descheduled for a slow reader (backpressure), KV kept
    num_steps: int = 0
    busy_seconds: float = 0.0
    num_prefill_tokens_computed: int = 0
    num_decode_tokens_computed: int = 0
    prefill_seconds: float = 0.0  # step time attributed to prefill tokens
    pending_prefill_tokens: int = 0  # prompt positions still to compute (waiting and running)
    num_prefill_steps: int = 0
    num_decode_steps: int = 0
    kv_events_epoch: str = ""
    kv_events_seq: int = 0
    num_evicted_blocks: int = 0  # cached blocks evicted for reuse
    step_moments: list[float] = field(default_factory=list)  # EngineCore.step_moments, for routers' fits
    step_token_budget: int = 0  # max_num_batched_tokens: how many steps a queue of prompts takes
    prefill_chunk: int = 0  # max_prefill_chunk: the most tokens of one prompt in a step (0: no cap)
    extra: dict[str, Any] = field(default_factory=dict)


def engine_stats(e: EngineCore) -> EngineStats:
    """``e``'s snapshot now (call on its loop thread, or where nothing steps it meanwhile)."""
    bm = e.block_manager
    return EngineStats(e.num_running, e.num_waiting, bm.usage, bm.num_free_blocks, bm.num_blocks,
                       bm.num_cached_queries, bm.num_cached_hits, e.scheduler.num_preemptions,
                       len(e.paused), e.num_steps, e.busy_seconds, e.num_prefill_tokens_computed,
                       e.num_decode_tokens_computed, e.prefill_seconds, e.pending_prefill_tokens,
                       e.num_prefill_steps, e.num_decode_steps, e.kv_events.epoch, e.kv_events.seq,
                       num_evicted_blocks=bm.num_evicted_blocks, step_moments=list(e.step_moments),
                       step_token_budget=e.scheduler.config.max_num_batched_tokens,
                       prefill_chunk=_chunk(e.scheduler.config))


def _chunk(config: SchedulerConfig) -> int:
    # a cap of the step's budget or more caps nothing beyond what the budget does
    return config.max_prefill_chunk if config.max_prefill_chunk < config.max_num_batched_tokens else 0
