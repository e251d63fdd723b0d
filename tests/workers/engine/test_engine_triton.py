"""The whole engine on the Triton kernels: a tiny model run with ``BATON_KERNEL_BACKEND=triton``
under ``TRITON_INTERPRET=1`` (CPU tensors) gives the reference backend's greedy tokens, and every
kernel the engine dispatches really ran on Triton. On a CUDA machine the same kernels compile;
``benchmarks/gpu_check.py`` checks them there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]

# In a child process: TRITON_INTERPRET must be set before the first Triton kernel is defined, and
# the kernel modules may already be imported (compiled) in this one.
_SCRIPT = r"""
import json, os, sys
import baton_serve.kernels.triton_ops as triton_ops
from baton_serve.kernels import backend
from baton_serve.workers import LLM, SamplingParams

calls = {}
for op in backend._OPS:
    real = getattr(triton_ops, op)
    def counted(*args, _real=real, _op=op, **kwargs):
        calls[_op] = calls.get(_op, 0) + 1
        return _real(*args, **kwargs)
    setattr(triton_ops, op, counted)

model = sys.argv[1]
params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
out = {}
for name in ("torch", "triton"):
    os.environ["BATON_KERNEL_BACKEND"] = name
    llm = LLM(model=model, dtype="float32", block_size=8, num_kv_blocks=32, max_num_batched_tokens=16)
    long = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. Hello world!")
    # two prompts in one batch (one prefilled in chunks of 16), then one that shares two full
    # blocks with the first: its prefill attends over cached context
    first = llm.generate([long, long[:7]], params)
    again = llm.generate([long[:16] + long[3:9]], params)
    out[name] = {"tokens": [o.outputs[0].token_ids for o in first + again],
                 "cached": again[0].num_cached_tokens}
out["triton_calls"] = calls
print("RESULT " + json.dumps(out))
"""


def test_the_engine_on_triton_kernels_matches_the_reference_backend(tiny_model_dir):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("BATON_KERNEL_BACKEND", None)
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(tiny_model_dir)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    assert out["triton"]["tokens"] == out["torch"]["tokens"]
    assert out["triton"]["cached"] == out["torch"]["cached"] == 16
    ran = out["triton_calls"]
    for op in ("write_kv_cache", "paged_decode_attention", "paged_prefill_attention", "rms_norm",
               "fused_add_rms_norm", "rotary_embedding", "silu_and_mul"):
        assert ran.get(op, 0) > 0, f"{op} never ran on Triton: {ran}"
