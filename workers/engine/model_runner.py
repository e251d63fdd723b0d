"""Runs the model on what the scheduler chose: builds the flat inputs, owns the KV cache tensors.

Pure mechanism: it never decides anything, it turns a ``SchedulerOutput`` and block tables
into a ``StepPlan`` (one forward's flat inputs), runs it and returns the logits of the rows that
sample.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from baton_serve.kernels import backend
from baton_serve.workers.engine.scheduler import ScheduledRequest, SchedulerOutput
from baton_serve.workers.engine.step_plan import StepPlan
from baton_serve.workers.kv.layout import allocate_kv
from baton_serve.workers.kv.shared import KVExport, allocate_shared
from baton_serve.workers.model.attention import AttentionMetadata
from baton_serve.workers.model.llama import KVCache, LlamaForCausalLM


def kv_cache_block_bytes(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V): 2 * L * block_size * Hkv * D * elem."""
    attn = model.layers[0].self_attn
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * len(model.layers) * block_size * attn.num_kv_heads * attn.head_dim * elem


class ModelRunner:
    """Owns the model and its paged KV cache; one ``execute`` call is one forward."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 device: torch.device | str = "cpu", num_host_blocks: int = 0, shared: bool = False,
                 plan_sink: Callable[[StepPlan], None] | None = None) -> None:
        """``plan_sink``: where rank 0 of a tensor-parallel replica sends each step's plan first."""
        self.model = model
        self.plan_sink = plan_sink
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        attn = model.layers[0].self_attn
        shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        # shared: where decode workers on this machine map it (workers.kv.shared): a memfd, or on a
        # GPU behind a CUDA IPC handle
        self.kv_export: KVExport | None = None
        if shared:
            self.kv_caches, self.kv_export = allocate_shared(len(model.layers), shape, model.dtype, self.device)
        else:
            self.kv_caches: list[KVCache] = allocate_kv(len(model.layers), shape, model.dtype, self.device)
        # Swap space: [layers, K/V, host blocks, ...] in host memory (pinned when the cache is on a GPU).
        self.host_cache = torch.zeros((len(model.layers), 2, num_host_blocks) + shape[1:], dtype=model.dtype,
                                      pin_memory=self.device.type == "cuda") if num_host_blocks else None

    def apply_block_copies(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks in every layer before they are written."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            backend.copy_blocks(k_cache, src, dst)
            backend.copy_blocks(v_cache, src, dst)

    def apply_swaps(self, out: SchedulerOutput) -> None:
        """A tick without a forward that only moves blocks to or from host memory (on every rank)."""
        if out.swap_out or out.swap_in:
            self._send_and_run(StepPlan(swap_out=out.swap_out, swap_in=out.swap_in))

    def _swap(self, out: StepPlan) -> None:
        """Swap-outs first (their device blocks may be reused by this very tick), then swap-ins."""
        if out.swap_out:
            dev = torch.tensor([d for d, _ in out.swap_out], device=self.device)
            host = torch.tensor([h for _, h in out.swap_out])
            for layer, (k_cache, v_cache) in enumerate(self.kv_caches):
                self.host_cache[layer, 0].index_copy_(0, host, backend.gather_kv_blocks(k_cache, dev).cpu())
                self.host_cache[layer, 1].index_copy_(0, host, backend.gather_kv_blocks(v_cache, dev).cpu())
        if out.swap_in:
            host = torch.tensor([h for h, _ in out.swap_in])
            dev = torch.tensor([d for _, d in out.swap_in], device=self.device)
            for layer, (k_cache, v_cache) in enumerate(self.kv_caches):
                backend.scatter_kv_blocks(k_cache, dev, self.host_cache[layer, 0].index_select(0, host).to(self.device))
                backend.scatter_kv_blocks(v_cache, dev, self.host_cache[layer, 1].index_select(0, host).to(self.device))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_table: Callable[[str], list[int]]) -> torch.Tensor:
        """One forward over ``out``; returns fp32 logits ``[num_sampling_rows, vocab]``.

        Rows follow ``out.scheduled`` order, keeping only entries whose ``samples`` is true.
        Must be called before the scheduler advances ``num_computed_tokens``.
        """
        return self._send_and_run(self.plan(out, block_table))

    def _send_and_run(self, plan: StepPlan) -> torch.Tensor | None:
        if self.plan_sink is not None:
            self.plan_sink(plan)  # every other rank of the replica runs the same plan on its shard
        return self.run(plan)

    @torch.inference_mode()
    def run(self, plan: StepPlan, logits: bool = True) -> torch.Tensor | None:
        """Apply the plan's block moves, then its forward; the logits of its sampled rows (None
        with ``logits=False``: the ranks other than 0 of a tensor-parallel replica)."""
        self._swap(plan)
        self.apply_block_copies(plan.block_copies)
        if not plan.has_forward:
            return None
        input_ids, positions, meta = self._tensors(plan)
        rows = None
        if len(plan.sample_rows) != len(plan.input_ids):  # prefill chunks: only sampled rows go past attention
            rows = torch.tensor(plan.sample_rows, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, rows)
        if not logits:
            return None
        if not plan.sample_rows:
            return hidden.new_empty((0, self.model.cfg.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden)

    def plan(self, out: SchedulerOutput, block_table: Callable[[str], list[int]]) -> StepPlan:
        """The step's flat inputs and block moves, from the scheduler's output and block tables."""
        bs = self.block_size
        plan = StepPlan(block_copies=out.block_copies, swap_out=out.swap_out, swap_in=out.swap_in,
                        num_decode_tokens=len(out.decodes))
        tokens, positions, slots, sample_idx = plan.input_ids, plan.positions, plan.slots, plan.sample_rows
        for i, s in enumerate(out.decodes):
            r = s.request
            pos = r.num_computed_tokens
            table = block_table(r.request_id)
            tokens.append(r.all_token_ids[pos])
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            plan.decode_tables.append(table)
            plan.decode_lens.append(pos + 1)
            sample_idx.append(i)
        starts = plan.prefill_starts
        for s in out.prefills:
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            table = block_table(r.request_id)
            tokens.extend(r.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            plan.prefill_tables.append(table)
            plan.prefill_lens.append(end)
            starts.append(starts[-1] + s.num_new_tokens)
            if s.samples:
                sample_idx.append(len(tokens) - 1)
        return plan

    def _tensors(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs, dev = self.block_size, self.device
        dec_max = max(plan.decode_lens, default=0)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(plan.slots, dtype=torch.int64, device=dev),
            num_decode_tokens=plan.num_decode_tokens,
            decode_block_tables=_pad_tables(plan.decode_tables, (dec_max + bs - 1) // bs, dev),
            decode_seq_lens=torch.tensor(plan.decode_lens, dtype=torch.int32, device=dev),
            decode_max_seq_len=dec_max,
            prefill_block_tables=_pad_tables(plan.prefill_tables, (max(plan.prefill_lens, default=0) + bs - 1) // bs,
                                             dev),
            prefill_seq_lens=torch.tensor(plan.prefill_lens, dtype=torch.int32, device=dev),
            prefill_query_start_loc=torch.tensor(plan.prefill_starts, dtype=torch.int32, device=dev),
        )
        return (torch.tensor(plan.input_ids, dtype=torch.int64, device=dev),
                torch.tensor(plan.positions, dtype=torch.int64, device=dev), meta)


def _pad_tables(tables: list[list[int]], width: int, device: torch.device) -> torch.Tensor:
    """``[len(tables), width]`` int32, each row truncated or zero-padded to ``width``."""
    if not tables:
        return torch.zeros((0, max(width, 1)), dtype=torch.int32, device=device)
    rows = [t[:width] + [0] * (width - len(t)) if len(t) < width else t[:width] for t in tables]
    return torch.tensor(rows, dtype=torch.int32, device=device)


def sampling_requests(out: SchedulerOutput) -> list[ScheduledRequest]:
    """The scheduled entries that sample this tick, in logits-row order."""
    return [s for s in out.scheduled if s.samples]
