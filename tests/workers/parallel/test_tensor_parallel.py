"""Tensor parallelism in one engine: greedy text equal to TP=1, token for token, in fp32; sizes
that do not fit fail at start naming the sizes that do; a rank that dies ends the replica, never
hangs it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from baton_serve.workers.errors import ModelLoadError, TensorParallelError
from baton_serve.workers.llm import LLM
from baton_serve.workers.model.checkpoint_slice import CheckpointSlice
from baton_serve.workers.model.config import ModelConfig
from baton_serve.workers.parallel.sizes import kv_head_owners, kv_heads_of_rank, valid_sizes
from baton_serve.workers.sampling.params import SamplingParams
from safetensors import safe_open
from safetensors.torch import save_file

from tests.tiny_model import write_tiny_llama

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9] * 7, [11, 12, 13] * 3, list(range(20, 90)), [40, 41] * 12]


@pytest.fixture(scope="module")
def eight_head_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 query heads, 2 KV heads: TP=2 splits the KV heads, TP=4 replicates each on 2 ranks."""
    return write_tiny_llama(tmp_path_factory.mktemp("tp-llama"), num_heads=8, num_kv_heads=2, hidden_size=64,
                            intermediate_size=128, num_layers=2, seed=3)


def _greedy(model: Path, tp: int, prompts: list[list[int]], **kwargs: object) -> list[list[int]]:
    llm = LLM(model=str(model), dtype="float32", num_threads=1, tensor_parallel_size=tp, **kwargs)
    try:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_text_equals_tp1(eight_head_model: Path, tp: int) -> None:
    want = _greedy(eight_head_model, 1, PROMPTS)
    assert _greedy(eight_head_model, tp, PROMPTS) == want


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL tensor parallelism needs 2 or more CUDA devices")
def test_greedy_text_equals_tp1_over_nccl(eight_head_model: Path) -> None:
    want = _greedy(eight_head_model, 1, PROMPTS, device="cuda")
    assert _greedy(eight_head_model, 2, PROMPTS, device="cuda") == want


def test_chunked_prefill_and_prefix_hits_equal_tp1(eight_head_model: Path) -> None:
    # 16-token chunks split every long prompt; the repeated prompts hit the prefix cache
    prompts = PROMPTS + PROMPTS[:2]
    kwargs = {"max_num_batched_tokens": 16, "block_size": 8}
    want = _greedy(eight_head_model, 1, prompts, **kwargs)
    llm = LLM(model=str(eight_head_model), dtype="float32", num_threads=1, tensor_parallel_size=2, **kwargs)
    try:
        first = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)]
        second = llm.generate(prompts, GREEDY)  # every full block of each prompt is a prefix hit now
    finally:
        llm.shutdown()
    assert first == want
    assert [list(o.outputs[0].token_ids) for o in second] == want
    assert sum(o.num_cached_tokens for o in second) >= 48


def test_tp3_on_the_default_model_equals_tp1(default_model_dir: Path) -> None:
    prompts = [[1, 520, 2000, 33, 712, 9, 44], list(range(300, 340))]
    assert _greedy(default_model_dir, 3, prompts) == _greedy(default_model_dir, 1, prompts)


def test_a_size_that_does_not_divide_the_heads_names_the_sizes_that_work(eight_head_model: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"tensor_parallel_size = 3 .*sizes that work: 1, 2, 4, 8"):
        LLM(model=str(eight_head_model), dtype="float32", tensor_parallel_size=3)


def test_valid_sizes_of_the_default_model_shape() -> None:
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 576, "intermediate_size": 1536,
                                 "num_hidden_layers": 1, "num_attention_heads": 9, "num_key_value_heads": 3,
                                 "max_position_embeddings": 64})
    assert valid_sizes(cfg) == [1, 3]  # 9 divides the heads but not intermediate_size (1536)


def test_kv_heads_are_split_or_replicated() -> None:
    assert [kv_heads_of_rank(4, 2, r) for r in range(2)] == [(0, 2), (2, 2)]
    assert [kv_heads_of_rank(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert kv_head_owners(2, 4) == [[0, 1], [2, 3]]
    assert kv_head_owners(3, 3) == [[0], [1], [2]]


def test_checkpoint_slice_reads_only_the_narrowed_part(tmp_path: Path) -> None:
    full = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        lazy = CheckpointSlice(f.get_slice("w"), torch.bfloat16)
        assert tuple(lazy.shape) == (6, 8)
        part = lazy.narrow(0, 2, 3).narrow(1, 4, 4)
        assert tuple(part.shape) == (3, 4)
        assert torch.equal(part.materialize(), full[2:5, 4:8].to(torch.bfloat16))
        with pytest.raises(ValueError, match="outside"):
            lazy.narrow(1, 6, 4)


def test_a_rank_that_dies_ends_the_replica_within_the_timeout(eight_head_model: Path) -> None:
    llm = LLM(model=str(eight_head_model), dtype="float32", num_threads=1, tensor_parallel_size=2)
    try:
        assert llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids
        (pid,) = llm.engine.tensor_parallel.ranks.pids()
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(TensorParallelError):
            for _ in range(50):  # the loss is seen at the next send, all-reduce or by the watcher
                llm.generate([PROMPTS[1]], GREEDY)
                time.sleep(0.1)
        assert time.monotonic() - started < 30
    finally:
        llm.shutdown()
