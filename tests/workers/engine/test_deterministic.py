"""The deterministic mode: a prompt's greedy tokens and logprobs, bit for bit, do not depend on
its batch, its place in it, the prompt's chunking, prefix hits, or whether its KV was decoded or
prefilled. In bf16 (the dtype where batch effects flip tokens) and in fp32 (where any change of
summation order shows in the logprobs, so these tests see a kernel that is not invariant even on
a tiny model whose bf16 rounding would hide it), on whatever CPU runs this."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from baton_serve.kernels import cpu_ops
from baton_serve.workers.checkpoint.quantize import quantize_folder
from baton_serve.workers.errors import ModelLoadError
from baton_serve.workers.llm import LLM
from baton_serve.workers.sampling.params import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the mode needs the native CPU kernels")

TOKENS = 10


@pytest.fixture(params=["bfloat16", "float32"])
def dtype(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module", params=["head_dim_16", "head_dim_64"])
def model_dir(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both attention paths: head dim 16 (the 8-lane kernel everywhere) and 64 (AVX512_BF16 where the CPU has it)."""
    if request.param == "head_dim_16":
        return tiny_model_dir
    from tests.tiny_model import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-d64"), seed=3, hidden_size=256, intermediate_size=512,
                            num_heads=4, num_kv_heads=2, num_layers=3, tie=True)


def _prompts(n: int, seed: int, vocab: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 60))] for _ in range(n)]


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=5)


def _result(out) -> tuple:
    o = out.outputs[0]
    return list(o.token_ids), o.logprobs, o.top_logprobs


def _llm(model_dir: Path, dtype: str, **kwargs) -> LLM:
    kwargs.setdefault("enable_prefix_caching", False)
    return LLM(model=str(model_dir), dtype=dtype, deterministic=True, num_kv_blocks=1024, num_threads=2,
               **kwargs)


@pytest.mark.parametrize("chunk", [4096, 7], ids=["whole-prompts", "chunked-prefill"])
def test_alone_equals_inside_any_batch_at_any_position(model_dir: Path, dtype: str, chunk: int) -> None:
    llm = _llm(model_dir, dtype, max_num_batched_tokens=chunk, max_num_seqs=64)
    targets = _prompts(3, seed=1)
    alone = [_result(llm.generate([t], _params())[0]) for t in targets]
    others = _prompts(31, seed=2)
    for size in (2, 5, 17, 32):
        for pos in sorted({0, size // 2, size - 1}):
            for ti, target in enumerate(targets):
                batch = others[:size - 1]
                batch = batch[:pos] + [target] + batch[pos:]
                got = _result(llm.generate(batch, _params())[pos])
                assert got == alone[ti], f"target {ti} in a batch of {size} at {pos} (chunk {chunk})"


def test_prefix_hits_change_nothing(model_dir: Path, dtype: str) -> None:
    shared = _prompts(1, seed=5)[0] * 3  # long enough for whole cached blocks
    target = shared + [7, 8, 9]
    cold = _result(_llm(model_dir, dtype).generate([target], _params())[0])
    llm = _llm(model_dir, dtype, enable_prefix_caching=True)
    llm.generate([shared + [11, 12]], _params())  # warms the shared blocks
    warm = llm.generate([target], _params())[0]
    assert warm.num_cached_tokens > 0
    assert _result(warm) == cold


def test_prefill_then_decode_equals_one_prefill_of_the_sequence(model_dir: Path, dtype: str) -> None:
    """What recovery does: re-prefill prompt + emitted tokens and go on; the continuation (and its
    logprobs) must be what the undisturbed decode gave."""
    llm = _llm(model_dir, dtype, max_num_batched_tokens=16)
    prompt = _prompts(1, seed=9)[0]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    full = llm.generate([prompt], params)[0].outputs[0]
    for cut in (1, 9, 23):
        rest = SamplingParams(temperature=0.0, max_tokens=24 - cut, ignore_eos=True, logprobs=5)
        again = llm.generate([prompt + list(full.token_ids[:cut])], rest)[0].outputs[0]
        assert list(again.token_ids) == list(full.token_ids[cut:])
        assert again.logprobs == full.logprobs[cut:]
        assert again.top_logprobs == full.top_logprobs[cut:]


def test_default_model_fifteen_concurrent_prompts(default_model_dir: Path) -> None:
    """The issue's drill on the real model: each prompt alone equals it among 15 others, in bf16."""
    llm = LLM(model=str(default_model_dir), dtype="bfloat16", deterministic=True, num_kv_blocks=2048,
              num_threads=2, enable_prefix_caching=False)
    prompts = [f"Write a short story about {thing}." for thing in (
        "a dragon", "the sea", "a robot", "a lost key", "winter", "a library", "a train", "the moon",
        "a garden", "a violin", "a storm", "a market", "a lighthouse", "a clock", "a fox")]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=0)
    together = llm.generate(prompts, params)
    for i in (0, 7, 14):
        alone = llm.generate([prompts[i]], params)[0]
        assert list(alone.outputs[0].token_ids) == list(together[i].outputs[0].token_ids)
        assert alone.outputs[0].logprobs == together[i].outputs[0].logprobs


@pytest.mark.parametrize("method,group", [("int8", 32), ("int4", 32)])
def test_quantised_weights_too(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, dtype: str,
                               method: str, group: int) -> None:
    quantised = quantize_folder(tiny_model_dir, tmp_path_factory.mktemp(method) / "q", method, group)
    llm = _llm(quantised, dtype, max_num_batched_tokens=16, max_num_seqs=32)
    target, others = _prompts(1, seed=11)[0], _prompts(16, seed=12)
    alone = _result(llm.generate([target], _params())[0])
    assert _result(llm.generate(others[:8] + [target] + others[8:], _params())[8]) == alone
    full = alone[0]
    again = llm.generate([target + full[:4]], SamplingParams(temperature=0.0, max_tokens=TOKENS - 4,
                                                             ignore_eos=True, logprobs=5))[0].outputs[0]
    assert list(again.token_ids) == full[4:] and again.logprobs == alone[1][4:]


def test_refuses_what_it_cannot_make_invariant(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ModelLoadError, match="bfloat16 or float32"):
        LLM(model=str(tiny_model_dir), dtype="float16", deterministic=True)
    monkeypatch.setenv("BATON_KERNEL_BACKEND", "torch")
    with pytest.raises(ModelLoadError, match="BATON_KERNEL_BACKEND=torch"):
        LLM(model=str(tiny_model_dir), dtype="bfloat16", deterministic=True)
