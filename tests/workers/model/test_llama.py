"""The decoder's forward contract: ``output_rows`` gives those rows of the full output (up to
summation order) and still writes every token's K/V to the cache, bit for bit."""

from __future__ import annotations

import torch
from baton_serve.workers import LLM
from baton_serve.workers.model.attention import AttentionMetadata

from tests.tiny_model import write_tiny_llama


def _prefill_meta(lens: list[int], block_size: int, per_seq: int) -> AttentionMetadata:
    tables = torch.arange(len(lens) * per_seq, dtype=torch.int32).view(len(lens), per_seq)
    slots = torch.cat([tables[i].long().repeat_interleave(block_size)[:n] * block_size
                       + torch.arange(n) % block_size for i, n in enumerate(lens)])
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    empty = torch.zeros(0, dtype=torch.int32)
    return AttentionMetadata(slots, 0, torch.zeros((0, per_seq), dtype=torch.int32), empty, 0, tables, seq_lens,
                             torch.cat([torch.zeros(1, dtype=torch.int32), seq_lens.cumsum(0).int()]))


def test_output_rows_are_the_full_outputs_rows_and_the_cache_is_whole(tmp_path) -> None:
    llm = LLM(model=str(write_tiny_llama(tmp_path / "m")), dtype="float32", block_size=8, num_kv_blocks=32)
    runner = llm.engine.runner
    lens = [13, 5, 20]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (sum(lens),), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lens])
    meta = _prefill_meta(lens, 8, 4)
    full = runner.model(ids, pos, runner.kv_caches, meta)
    cache_full = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for k, v in runner.kv_caches:
        k.zero_()
        v.zero_()
    rows = torch.tensor([12, 17, 37])  # the last token of each prompt, as the runner asks
    part = runner.model(ids, pos, runner.kv_caches, meta, rows)
    assert part.shape == (3, full.shape[1])
    # the same values up to the matmul's summation order, which depends on the row count
    torch.testing.assert_close(part, full[rows], rtol=1e-5, atol=1e-5)
    for (k, v), (k0, v0) in zip(runner.kv_caches, cache_full):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    none = runner.model(ids, pos, runner.kv_caches, meta, torch.zeros(0, dtype=torch.long))
    assert none.shape == (0, full.shape[1])
