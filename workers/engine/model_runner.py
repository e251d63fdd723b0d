"""Runs the model on what the scheduler chose: builds the flat inputs, owns the KV cache tensors.

Pure mechanism: it never decides anything, it turns a ``SchedulerOutput`` and block tables
into one forward and returns the logits of the rows that sample.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from baton_serve.kernels import backend
from baton_serve.workers.engine.scheduler import ScheduledRequest, SchedulerOutput
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
                 device: torch.device | str = "cpu", num_host_blocks: int = 0, shared: bool = False) -> None:
        self.model = model
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
        self.apply_swaps(out)
        self.apply_block_copies(out.block_copies)
        input_ids, positions, meta, sample_idx = self._prepare(out, block_table)
        rows = None
        if len(sample_idx) != input_ids.shape[0]:  # prefill chunks: only the sampled rows go past attention
            rows = torch.tensor(sample_idx, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, rows)
        if not sample_idx:
            return hidden.new_empty((0, self.model.cfg.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden)

    def _prepare(self, out: SchedulerOutput, block_table: Callable[[str], list[int]]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_idx: list[int] = []

        dec_tables, dec_lens = [], []
        for i, s in enumerate(out.decodes):
            r = s.request
            pos = r.num_computed_tokens
            table = block_table(r.request_id)
            tokens.append(r.all_token_ids[pos])
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            dec_tables.append(table)
            dec_lens.append(pos + 1)
            sample_idx.append(i)

        pre_tables, pre_lens, starts = [], [], [0]
        for s in out.prefills:
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            table = block_table(r.request_id)
            tokens.extend(r.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            pre_tables.append(table)
            pre_lens.append(end)
            starts.append(starts[-1] + s.num_new_tokens)
            if s.samples:
                sample_idx.append(len(tokens) - 1)

        dev = self.device
        dec_max = max(dec_lens, default=0)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode_tokens=len(out.decodes),
            decode_block_tables=_pad_tables(dec_tables, (dec_max + bs - 1) // bs, dev),
            decode_seq_lens=torch.tensor(dec_lens, dtype=torch.int32, device=dev),
            decode_max_seq_len=dec_max,
            prefill_block_tables=_pad_tables(pre_tables, (max(pre_lens, default=0) + bs - 1) // bs, dev),
            prefill_seq_lens=torch.tensor(pre_lens, dtype=torch.int32, device=dev),
            prefill_query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        )
        return (torch.tensor(tokens, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev), meta, sample_idx)


def _pad_tables(tables: list[list[int]], width: int, device: torch.device) -> torch.Tensor:
    """``[len(tables), width]`` int32, each row truncated or zero-padded to ``width``."""
    if not tables:
        return torch.zeros((0, max(width, 1)), dtype=torch.int32, device=device)
    rows = [t[:width] + [0] * (width - len(t)) if len(t) < width else t[:width] for t in tables]
    return torch.tensor(rows, dtype=torch.int32, device=device)


def sampling_requests(out: SchedulerOutput) -> list[ScheduledRequest]:
    """The scheduled entries that sample this tick, in logits-row order."""
    return [s for s in out.scheduled if s.samples]
