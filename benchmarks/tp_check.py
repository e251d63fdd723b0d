"""``gpu_check``'s tensor-parallel stage: TP=2 against TP=1 on one model, greedy parity in fp32
token for token and offline output tok/s in bf16, ranks in processes (NCCL on CUDA, one GPU per
rank; gloo on the CPU in ``--engine-smoke``). Skipped, with the reason, on fewer than two GPUs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

PROMPTS = [list(range(10, 60)), [7, 8, 9] * 20, list(range(300, 420))]


def _greedy(model: Path, device: torch.device, tp: int, new_tokens: int, **engine: Any) -> list[list[int]]:
    from baton_serve.workers.llm import LLM
    from baton_serve.workers.sampling.params import SamplingParams

    llm = LLM(model=str(model), dtype="float32", device=str(device), tensor_parallel_size=tp, **engine)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
    finally:
        llm.shutdown()


def tp_stage(model: Path, device: torch.device, smoke: bool = False, **engine: Any) -> dict[str, Any]:
    """Parity and throughput of TP=2 vs TP=1 on ``model`` (its KV heads must divide by 2)."""
    from benchmarks import engine_check

    if device.type == "cuda" and torch.cuda.device_count() < 2:
        return {"skipped": f"needs 2 or more GPUs; this machine has {torch.cuda.device_count()}"}
    new_tokens = 6 if smoke else 32
    one = _greedy(model, device, 1, new_tokens, **engine)
    two = _greedy(model, device, 2, new_tokens, **engine)
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(one, two)]
    size = (4, 16, 8) if smoke else (64, 512, 128)
    runs = {f"tp{tp}": engine_check.offline_throughput(model, device, "bfloat16", *size,
                                                       tensor_parallel_size=tp, **engine) for tp in (1, 2)}
    return {"parity": {"ok": one == two, "prompts": len(PROMPTS), "agreeing_prefix": agree,
                       "new_tokens": new_tokens, "backend": "nccl" if device.type == "cuda" else "gloo"},
            "throughput": runs,
            "ratio_tp2_over_tp1": runs["tp2"]["output_tok_per_s"] / runs["tp1"]["output_tok_per_s"]}
