"""What the deterministic mode costs: the offline engine with it on and off, side by side in one
process, on the default model; plus the kernels it swaps (linears and decode attention). Nothing
else should run on the machine meanwhile: a round disturbed for one mode skews its ratio.

Workloads (greedy, ignore_eos): saturation, 64 requests x 256 prompt / 128 output tokens all at
once (the served-speed workload of issue 40); single stream, one request of 256 / 128, for the
time per output token. Rounds interleave off and on; figures are medians over rounds.

    .venv/bin/python benchmarks/deterministic.py --repeat 3 --out benchmarks/results/deterministic.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: see tests/conftest.py

from baton_serve.kernels import backend, capabilities, invariant_linear, packed_linear  # noqa: E402
from baton_serve.workers import LLM, SamplingParams  # noqa: E402

from benchmarks.machine import cpu_name  # noqa: E402

# SmolLM2-135M's matmuls: qkv, o, gate_up, down, lm_head (K, N)
SHAPES = {"qkv": (576, 960), "o_proj": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
          "lm_head": (576, 49152)}


def _best_ms(fn, reps: int = 15) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def time_linears(dtype: torch.dtype) -> list[dict]:
    rows = []
    for name, (k, n) in SHAPES.items():
        w = (torch.randn(n, k) * 0.05).to(dtype)
        inv, packed = invariant_linear.pack(w), packed_linear.pack(w)
        for m in (1, 8, 32, 256):
            x = torch.randn(m, k).to(dtype)
            off = _best_ms(lambda: packed_linear.linear(x, w, packed))
            on = _best_ms(lambda: invariant_linear.linear(x, inv))
            rows.append({"op": name, "m": m, "off_ms": off, "on_ms": on, "on_over_off": on / off})
    return rows


def time_decode_attention(dtype: torch.dtype) -> list[dict]:
    """SmolLM2's attention shape (9 q heads, 3 kv heads, D = 64): the decode kernel (mode off)
    against the prefill kernel on one-token chunks (mode on)."""
    rows = []
    bs, hq, hkv, d = 16, 9, 3, 64
    for seqs, ctx in ((1, 512), (32, 512), (64, 384)):
        per = ctx // bs
        kc = torch.randn(seqs * per, bs, hkv, d).to(dtype)
        vc = torch.randn(seqs * per, bs, hkv, d).to(dtype)
        tables = torch.arange(seqs * per, dtype=torch.int32).view(seqs, per)
        lens = torch.full((seqs,), ctx, dtype=torch.int32)
        q = torch.randn(seqs, hq, d).to(dtype)
        starts = torch.arange(seqs + 1, dtype=torch.int32)
        off = _best_ms(lambda: backend.paged_decode_attention(q, kc, vc, tables, lens, d**-0.5, None, ctx))
        on = _best_ms(lambda: backend.paged_prefill_attention(q, kc, vc, tables, lens, starts, d**-0.5, None))
        rows.append({"seqs": seqs, "context": ctx, "off_ms": off, "on_ms": on, "on_over_off": on / off})
    return rows


def run(llm: LLM, work: list[list[int]], out_len: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(work, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed}


def tpot_ms(llm: LLM, prompt: list[int], out_len: int) -> float:
    """Single stream: (time for out_len tokens - time for 1) / (out_len - 1)."""
    first = min(run(llm, [prompt], 1)["seconds"] for _ in range(2))
    full = run(llm, [prompt], out_len)["seconds"]
    return (full - first) / (out_len - 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kw = dict(dtype=args.dtype, num_threads=args.threads, max_num_seqs=args.num_requests,
              max_num_batched_tokens=2048, kv_cache_memory_gib=2.0, enable_prefix_caching=False)
    engines = {"off": LLM(**kw), "on": LLM(deterministic=True, **kw)}
    dtype = engines["off"].engine.model.dtype
    rng = random.Random(0)
    vocab = engines["off"].engine.vocab_size
    work = [[rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    for llm in engines.values():
        run(llm, work[:2], 4)  # warm-up
    rounds = []
    for i in range(args.repeat):
        r = {}
        order = list(engines.items())
        for mode, llm in order if i % 2 == 0 else order[::-1]:  # each goes first in turn
            r[f"saturation_{mode}"] = run(llm, work, args.output_len)["output_tok_s"]
            r[f"tpot_{mode}"] = tpot_ms(llm, work[0], args.output_len)
        print(f"[round {i + 1}/{args.repeat}] " + " ".join(f"{k}={v:.2f}" for k, v in r.items()), flush=True)
        rounds.append(r)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    results = {
        "saturation_output_tok_s": {"off": med["saturation_off"], "on": med["saturation_on"],
                                    "on_over_off": statistics.median(r["saturation_on"] / r["saturation_off"]
                                                                     for r in rounds)},
        "single_stream_tpot_ms": {"off": med["tpot_off"], "on": med["tpot_on"],
                                  "on_over_off": statistics.median(r["tpot_on"] / r["tpot_off"] for r in rounds)},
        "rounds": rounds,
        "linears": time_linears(dtype),
        "decode_attention": time_decode_attention(dtype),
        "config": {**vars(args), "date": date.today().isoformat(), "cpu": cpu_name(),
                   "isa": capabilities.kernel_target(), "torch": torch.__version__, "dtype": str(dtype),
                   "command": " ".join(["benchmarks/deterministic.py", *sys.argv[1:]])},
    }
    print(json.dumps({k: results[k] for k in ("saturation_output_tok_s", "single_stream_tpot_ms")}, indent=2))
    for row in results["linears"] + results["decode_attention"]:
        print(row)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
