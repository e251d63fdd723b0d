"""``benchmarks/gpu_check.py``'s engine stage, run on the CPU with small shapes (``--engine-smoke``):
parity with transformers and offline throughput go through the same code as on a CUDA machine."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import gpu_check


def test_engine_stage_checks_parity_and_times_both_models(tmp_path: Path):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--engine-smoke", "--out", str(out), "--work-dir", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    parity = result["engine"]["parity"]
    assert result["all_ok"] and parity["ok"]
    assert parity["identical"] == parity["prompts"] == 4 and parity["agreeing_prefix"] == [6] * 4
    runs = result["engine"]["throughput"]
    assert runs[0]["model"].startswith("SmolLM2-135M") and runs[1]["model"] == "random-llama-smoke"
    for r in runs:
        assert r["device"] == "cpu" and r["dtype"] == "bfloat16"
        assert r["output_tokens"] == r["requests"] * r["output_len"] and r["output_tok_per_s"] > 0
    tp = result["engine"]["tensor_parallel"]  # TP=2 vs TP=1 over gloo: the code NCCL runs on a GPU machine
    assert tp["parity"]["ok"] and tp["parity"]["agreeing_prefix"] == [6] * 3 and tp["parity"]["backend"] == "gloo"
    assert tp["throughput"]["tp2"]["output_tokens"] == tp["throughput"]["tp1"]["output_tokens"] > 0
