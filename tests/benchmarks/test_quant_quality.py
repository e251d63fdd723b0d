"""The quality gate on the real default model: int8 as ``baton convert --quantize int8`` writes it
loses at most 1% relative perplexity on the shipped passage (and int4-g32 stays close too)."""

from __future__ import annotations

import pytest

from benchmarks import quant_quality


@pytest.fixture(scope="module")
def full(default_model_dir):
    return quant_quality.evaluate(str(default_model_dir), "float32", 1)


@pytest.mark.parametrize("method,group_size,max_loss", [("int8", 32, quant_quality.INT8_MAX_PPL_LOSS),
                                                         ("int4", 32, 0.05)])
def test_quantised_perplexity_stays_within_the_gate(full, default_model_dir, tmp_path, method, group_size,
                                                   max_loss) -> None:
    from workers.checkpoint.quantize import quantize_folder

    folder = quantize_folder(default_model_dir, tmp_path / method, method, group_size)
    got = quant_quality.evaluate(str(folder), "float32", 1)
    assert got["tokens_scored"] == full["tokens_scored"] > 2000
    assert 10 < full["perplexity"] < 100  # the passage is ordinary English for this model
    assert got["perplexity"] / full["perplexity"] - 1 <= max_loss
