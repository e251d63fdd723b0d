"""Greedy output through the engine equals a plain transformers forward loop, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from baton_serve.workers import LLM, SamplingParams

from benchmarks.engine_check import hf_greedy

PROMPTS = [
    "Hello world! How are you today?",
    "你好，世界！今天天气很好。",
    "Emoji test 🙂👍🏽 and more",
    "def add(a, b):\n    return a + b",
    "The",
    "Paris is the capital of France. Berlin is the capital of Germany. " * 2,
]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def expected(hf_tiny, tiny_model_dir: Path) -> dict[str, list[int]]:
    from baton_serve.workers.text.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(tiny_model_dir)
    with torch.no_grad():
        return {p: hf_greedy(hf_tiny, tok.encode(p), NEW_TOKENS) for p in PROMPTS}


def _greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("budget", [4096, 5])
def test_parity_batch_chunking_block_sizes(tiny_model_dir, expected, block_size, budget):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=block_size, num_kv_blocks=128,
              max_num_batched_tokens=budget)
    outs = llm.generate(PROMPTS, _greedy())
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == expected[prompt], prompt
    assert llm.engine.block_manager.num_free_blocks == 128


def test_parity_staggered_arrivals_mix_prefill_and_decode(tiny_model_dir, expected):
    """Requests join while others decode, so steps mix prefill chunks with decode tokens."""
    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=128,
              max_num_batched_tokens=6)
    engine, results = llm.engine, {}
    tok = llm.tokenizer
    pending = list(enumerate(PROMPTS))
    step = 0
    mixed_steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:
            i, p = pending.pop(0)
            engine.add_request(str(i), tok.encode(p), _greedy())
        sched_before = (engine.num_running, engine.num_waiting)
        for d in engine.step():
            results.setdefault(d.request_id, []).extend(d.token_ids)
        mixed_steps += sched_before[0] > 0 and sched_before[1] > 0
        step += 1
    assert mixed_steps > 0
    for i, p in enumerate(PROMPTS):
        assert results[str(i)] == expected[p], p


def test_parity_with_prefix_hits(tiny_model_dir, expected):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=256)
    first = llm.generate(PROMPTS, _greedy())
    second = llm.generate(PROMPTS, _greedy())
    long_prompt = PROMPTS[-1]
    hits = {p: o.num_cached_tokens for p, o in zip(PROMPTS, second)}
    assert hits[long_prompt] >= 8 * ((len(llm.tokenizer.encode(long_prompt)) - 1) // 8) > 0
    for prompt, a, b in zip(PROMPTS, first, second):
        assert a.outputs[0].token_ids == expected[prompt] == b.outputs[0].token_ids


def test_parity_full_prefix_hit_still_samples_first_token(tiny_model_dir, expected):
    """A prompt of exactly two blocks, fully cached: the last token is recomputed for its logits."""
    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=64)
    ids = llm.tokenizer.encode(PROMPTS[-1])[:16]
    a = llm.generate([ids], _greedy())[0]
    b = llm.generate([ids], _greedy())[0]
    assert b.num_cached_tokens == 8
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_parity_under_preemption(tiny_model_dir, expected):
    """A cache too small for all requests at once forces preemption by recompute."""
    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=14,
              enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, _greedy())
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == expected[prompt], prompt
    assert llm.engine.block_manager.num_free_blocks == 14


def test_parity_default_model_fp32(default_model_dir):
    """The real SmolLM2 in fp32 against transformers, several prompts in one batch."""
    from transformers import LlamaForCausalLM

    llm = LLM(model=str(default_model_dir), dtype="float32", num_kv_blocks=256,
              max_num_batched_tokens=48)
    messages = ["What is the capital of France?", "用中文介绍一下你自己。", "Tell me a joke 🙂",
                "Count from one to ten."]
    prompts = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": m}]))
               for m in messages]
    outs = llm.generate(prompts, _greedy(12))
    hf = LlamaForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12)
    assert "Paris" in outs[0].outputs[0].text


def test_parity_under_preemption_by_swap(tiny_model_dir, expected):
    """Swap mode: victims' KV goes to host memory and comes back; nothing is recomputed."""
    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=14,
              enable_prefix_caching=False, preemption_mode="swap", swap_space_gib=0.01)
    engine = llm.engine
    swaps = {"out": 0, "in": 0}
    schedule = engine.scheduler.schedule

    def counting_schedule():
        out = schedule()
        swaps["out"] += len(out.swap_out)
        swaps["in"] += len(out.swap_in)
        return out

    engine.scheduler.schedule = counting_schedule
    outs = llm.generate(PROMPTS, _greedy())
    assert engine.scheduler.num_preemptions > 0 and swaps["out"] > 0 and swaps["in"] == swaps["out"]
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == expected[prompt], prompt
    assert engine.block_manager.num_free_blocks == 14
    assert engine.scheduler.host_pool.num_free == engine.scheduler.host_pool.num_blocks
