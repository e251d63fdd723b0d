"""KV cache sizing on a CUDA device (workers.engine.gpu_memory), run on the CPU with the device's
memory meter faked: the profiling step is real (a throwaway engine over the tiny model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from baton_serve.workers.engine import gpu_memory
from baton_serve.workers.engine.config import EngineConfig, SchedulerConfig
from baton_serve.workers.engine.core import EngineCore
from baton_serve.workers.engine.model_runner import kv_cache_block_bytes
from baton_serve.workers.model.loader import load_model

GIB = 1 << 30


class FakeMeter:
    """torch.cuda's memory functions, answering fixed figures."""

    def __init__(self, weights: int, activations: int, total: int, others: int) -> None:
        self.weights, self.activations, self.total, self.others = weights, activations, total, others
        self.probe_bytes = 0
        self.peak_reset = False

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("synchronize", "empty_cache"):
            monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self._reset)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: self.weights)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", self._peak)
        monkeypatch.setattr(torch.cuda, "mem_get_info",
                            lambda *a: (self.total - self.weights - self.others, self.total))

    def _reset(self, *a: object) -> None:
        self.peak_reset = True

    def _peak(self, *a: object) -> int:
        assert self.peak_reset, "the peak must be measured from after the weights were loaded"
        return self.weights + self.probe_bytes + self.activations


def test_profile_shape_spreads_the_token_budget_over_the_sequences():
    config = EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256))
    assert gpu_memory.profile_shape(config, 8192) == (256, 8)
    config = EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=1))
    assert gpu_memory.profile_shape(config, 8192) == (1, 512)
    assert gpu_memory.profile_shape(config, 100) == (1, 99)  # a prompt leaves room for its token


def test_cache_takes_the_share_left_after_weights_and_activations_within_what_is_free(tiny_model_dir: Path, monkeypatch):
    model = load_model(tiny_model_dir, torch.float32)
    config = EngineConfig(dtype="float32", block_size=8, gpu_memory_utilization=0.5,
                          scheduler=SchedulerConfig(max_num_batched_tokens=96, max_num_seqs=8))
    block = kv_cache_block_bytes(model, 8, torch.float32)
    meter = FakeMeter(weights=3 * GIB, activations=GIB, total=40 * GIB, others=2 * GIB)
    meter.install(monkeypatch)
    steps: list[int] = []
    real_step = EngineCore.step

    def counted(engine: EngineCore):
        meter.probe_bytes = engine.block_manager.num_blocks * block
        steps.append(len(engine.groups))
        return real_step(engine)

    monkeypatch.setattr(EngineCore, "step", counted)
    plan = gpu_memory.plan_gpu_kv_cache(model, config, torch.device("cpu"), [2], 512)
    # 8 prompts of 12 tokens: the whole token budget in one step, and every one finished by it
    assert steps == [8]
    assert plan.activation_peak == GIB and plan.weights == 3 * GIB and plan.free == 35 * GIB
    assert plan.num_blocks == (20 * GIB - 3 * GIB - GIB) // block
    # another process holding most of the device: the cache takes what is free, not its share
    meter.others = 30 * GIB
    plan = gpu_memory.plan_gpu_kv_cache(model, config, torch.device("cpu"), [2], 512)
    assert plan.free == 7 * GIB and plan.num_blocks == (7 * GIB - GIB) // block  # activations fit beside it
    assert steps == [8, 8]


def test_engine_device_is_checked_and_cuda_absent_is_an_error(tiny_model_dir: Path, monkeypatch):
    from baton_serve.kernels.device import DeviceUnavailableError
    from baton_serve.workers.llm import LLM

    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(device="gpu")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(DeviceUnavailableError, match="engine.device = 'cuda'"):
        LLM(model=str(tiny_model_dir), dtype="float32", device="cuda", num_kv_blocks=16)
    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=16)  # auto: here, the CPU
    assert llm.config.device == "cpu" and llm.engine.runner.device == torch.device("cpu")


def test_quantised_weights_load_on_the_cpu_only(tiny_model_dir: Path, tmp_path: Path):
    from baton_serve.workers.checkpoint.quantize import quantize_folder
    from baton_serve.workers.errors import ModelLoadError

    folder = quantize_folder(tiny_model_dir, tmp_path / "int8", "int8", 32)
    with pytest.raises(ModelLoadError, match="CPU kernels only"):
        load_model(folder, torch.float32, device="cuda")
    assert load_model(folder, torch.float32).cfg.quantization.method == "int8"  # on the CPU it loads
