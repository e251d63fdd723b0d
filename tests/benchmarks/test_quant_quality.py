"""The quality gate on the real default model: int8 as ``baton convert --quantize int8`` writes it
loses at most 1% relative perplexity on the shipped passage (and int4-g32 stays close too)."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks import quant_quality

# Each evaluation is one process's forward passes over the passage, nothing else running: every
# core of the machine shortens the suite (the rest of it runs one thread per process).
THREADS = min(os.cpu_count() or 1, 4)


@pytest.fixture(scope="module", autouse=True)
def _threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def full(default_model_dir):
    return quant_quality.evaluate(str(default_model_dir), "float32", THREADS)


@pytest.mark.parametrize("method,group_size,max_loss", [("int8", 32, quant_quality.INT8_MAX_PPL_LOSS),
                                                         ("int4", 32, 0.05)])
def test_quantised_perplexity_stays_within_the_gate(full, default_model_dir, tmp_path, method, group_size,
                                                   max_loss) -> None:
    from baton_serve.workers.checkpoint.quantize import quantize_folder

    folder = quantize_folder(default_model_dir, tmp_path / method, method, group_size)
    got = quant_quality.evaluate(str(folder), "float32", THREADS)
    assert got["tokens_scored"] == full["tokens_scored"] > 2000
    assert 10 < full["perplexity"] < 100  # the passage is ordinary English for this model
    assert got["perplexity"] / full["perplexity"] - 1 <= max_loss
