"""Prefill on one engine, KV moved block by block, decode on another: same tokens as colocated."""

from __future__ import annotations

import pytest
import torch
from baton_serve.kernels import backend
from baton_serve.workers import LLM, SamplingParams
from baton_serve.workers.errors import OutOfBlocksError


def _engines(tiny_model_dir, decode_blocks: int = 64):
    kw = dict(model=str(tiny_model_dir), dtype="float32", block_size=8)
    return LLM(num_kv_blocks=64, **kw), LLM(num_kv_blocks=decode_blocks, **kw)


def _ship(p_engine, d_engine, member_id: str) -> int:
    """The mechanism under test without the network: reserve, copy the needed blocks, admit, release."""
    meta, src_table = p_engine.migration_meta(member_id)
    needed = d_engine.reserve_remote(meta)
    dst_table = d_engine.incoming_block_table(member_id)
    src = torch.tensor([src_table[i] for i in needed], dtype=torch.long)
    dst = torch.tensor([dst_table[i] for i in needed], dtype=torch.long)
    for (pk, pv), (dk, dv) in zip(p_engine.runner.kv_caches, d_engine.runner.kv_caches):
        backend.scatter_kv_blocks(dk, dst, backend.gather_kv_blocks(pk, src))
        backend.scatter_kv_blocks(dv, dst, backend.gather_kv_blocks(pv, src))
    d_engine.admit_remote(member_id)
    assert p_engine.release_parked(member_id)
    return len(needed)


def _run_disaggregated(p_llm, d_llm, prompts, params):
    p, d = p_llm.engine, d_llm.engine
    for i, ids in enumerate(prompts):
        p.add_request(str(i), ids, params, prefill_only=True)
    tokens: dict[tuple[str, int], list[int]] = {}
    shipped = []
    while p.has_unfinished_requests() or d.has_unfinished_requests():
        for delta in p.step():
            tokens.setdefault((delta.request_id, delta.index), []).extend(delta.token_ids)
            if delta.kv_ready:
                member = delta.request_id if params.n == 1 else f"{delta.request_id}#{delta.index}"
                shipped.append(_ship(p, d, member))
        for delta in d.step():
            tokens.setdefault((delta.request_id, delta.index), []).extend(delta.token_ids)
    return tokens, shipped


def test_disaggregated_greedy_equals_colocated(tiny_model_dir):
    p_llm, d_llm = _engines(tiny_model_dir)
    prompts = [p_llm.tokenizer.encode(t) for t in
               ("Hello world! How are you today?", "你好，世界！", "def add(a, b):\n    return a + b", "The")]
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    tokens, _ = _run_disaggregated(p_llm, d_llm, prompts, params)
    colocated = p_llm.generate(prompts, params)
    for i, out in enumerate(colocated):
        assert tokens[(str(i), 0)] == out.outputs[0].token_ids
    assert p_llm.engine.block_manager.num_free_blocks == 64
    assert d_llm.engine.block_manager.num_free_blocks == 64
    assert not p_llm.engine.parked and not d_llm.engine.incoming


def test_seeded_sampling_survives_the_hop_and_prefix_hits_skip_blocks(tiny_model_dir):
    p_llm, d_llm = _engines(tiny_model_dir)
    prompt = p_llm.tokenizer.encode("Paris is the capital of France. Berlin is the capital of Germany.")
    params = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=8, ignore_eos=True)
    tokens, shipped = _run_disaggregated(p_llm, d_llm, [prompt], params)
    colocated = p_llm.generate([prompt], params)[0]
    assert [tokens[("0", i)] for i in (0, 1)] == [c.token_ids for c in colocated.outputs]
    full_blocks = len(prompt) // 8
    # the second sample's full prompt blocks are already in the decode worker's prefix cache
    assert shipped[0] == (len(prompt) + 7) // 8 and shipped[1] == shipped[0] - full_blocks


def test_reserve_fails_cleanly_when_decode_cache_is_full(tiny_model_dir):
    p_llm, d_llm = _engines(tiny_model_dir, decode_blocks=2)
    prompt = p_llm.tokenizer.encode("Hello world! How are you today? " * 2)
    p = p_llm.engine
    p.add_request("x", prompt, SamplingParams(temperature=0, max_tokens=5), prefill_only=True)
    while "x" not in p.parked:
        p.step()
    meta, _ = p.migration_meta("x")
    with pytest.raises(OutOfBlocksError):
        d_llm.engine.reserve_remote(meta)
    assert d_llm.engine.block_manager.num_free_blocks == 2 and not d_llm.engine.incoming
    p.abort_request("x")  # an abort while parked frees the held KV
    assert p.block_manager.num_free_blocks == 64 and not p.parked and not p.groups


def test_the_tenant_travels_with_the_kv(tiny_model_dir):
    p_llm, d_llm = _engines(tiny_model_dir)
    p, d = p_llm.engine, d_llm.engine
    p.add_request("t", p_llm.tokenizer.encode("Hello there"), SamplingParams(max_tokens=4), prefill_only=True,
                  tenant="acme")
    while not any(delta.kv_ready for delta in p.step()):
        pass
    meta, _ = p.migration_meta("t")
    assert meta.tenant == "acme"
    d.reserve_remote(meta)
    assert d.incoming["t"].tenant == "acme"
    d.admit_remote("t")
    assert d.scheduler.requests["t"].tenant == "acme"
