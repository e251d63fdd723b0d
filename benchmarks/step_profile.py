"""Where one engine step's time goes: wall time per kernel op, per matmul and per model stage.

Fills the engine with a decode batch (``--mode decode``: N sequences, prompts 64-512, a few
decode steps in) or one prefill chunk (``--mode prefill``: N prompts of ``--prompt-len`` tokens),
then times ``--steps`` steps with every ``kernels.backend`` op and the packed matmuls wrapped.

    .venv/bin/python benchmarks/step_profile.py --mode decode --num-seqs 32 --threads 2
    .venv/bin/python benchmarks/step_profile.py --mode prefill --num-seqs 7 --prompt-len 292
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: see tests/conftest.py


def _timed(name: str, fn: Callable[..., Any], acc: collections.Counter, calls: collections.Counter
           ) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] += time.perf_counter() - started
            calls[name] += 1
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=292, help="prefill mode: tokens per prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10, help="decode mode: steps timed (prefill: 1)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from baton_serve.kernels import backend, packed_linear
    from baton_serve.workers import LLM, SamplingParams

    acc: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    # The model modules look these up at call time (``backend.op``, ``packed_linear.linear``).
    for op in (*backend._OPS, "argmax_rows"):
        setattr(backend, op, _timed(op, getattr(backend, op), acc, calls))
    packed_linear.linear = _timed("linear (all matmuls)", packed_linear.linear, acc, calls)

    llm = LLM(dtype=args.dtype, max_num_batched_tokens=max(2048, args.num_seqs * args.prompt_len),
              max_num_seqs=max(args.num_seqs, 1), kv_cache_memory_gib=4.0)
    eng = llm.engine
    runner = eng.runner
    runner.model.forward = _timed("model forward", runner.model.forward, acc, calls)
    runner.model.compute_logits = _timed("compute_logits (lm_head + upcast)", runner.model.compute_logits,
                                         acc, calls)
    rng = random.Random(args.seed)

    def add(tag: str, length: int, max_tokens: int) -> None:
        for i in range(args.num_seqs):
            n = length or rng.randint(64, 512)
            eng.add_request(f"{tag}{i}", [rng.randrange(100, 40000) for _ in range(n)],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))

    if args.mode == "decode":
        add("d", 0, 2048)
        while eng.num_waiting:
            eng.step()
        for _ in range(3):
            eng.step()
        steps = args.steps
    else:
        add("warm", args.prompt_len, 1)  # the first step builds kernels and warms caches
        while eng.has_unfinished_requests():
            eng.step()
        add("p", args.prompt_len, 1)
        steps = 1
    acc.clear()
    calls.clear()
    started = time.perf_counter()
    for _ in range(steps):
        eng.step()
    step_ms = (time.perf_counter() - started) / steps * 1e3
    rows = [{"what": k, "ms_per_step": v / steps * 1e3, "calls_per_step": calls[k] / steps}
            for k, v in acc.most_common()]
    print(f"{args.mode} step, {args.num_seqs} sequences, {args.threads} threads: {step_ms:.1f} ms")
    for r in rows:
        print(f"  {r['what']:36s} {r['ms_per_step']:8.2f} ms  {r['calls_per_step']:6.0f} calls")
    if args.out:
        Path(args.out).write_text(json.dumps({"step_ms": step_ms, "rows": rows, "config": vars(args)},
                                             indent=2) + "\n")


if __name__ == "__main__":
    main()
