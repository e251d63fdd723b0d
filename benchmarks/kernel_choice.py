"""What the measured kernel choice picks on this CPU, and what each fixed choice gives end to end.

One process loads the default model once per variant (the measured plan, the old fixed defaults,
each linear layout forced, and int8 checkpoints: weight-only per channel, and W8A8 with int8
activations, ``baton convert --quantize int8 --group-size 0 [--activations int8]``), then runs rounds in turn: the saturation workload through the
offline engine (N prompts x P tokens in, O out, greedy, ignore_eos) and one stream's TPOT. The
plan's table (every candidate's ms per shape) goes into the results file with the figures.

    .venv/bin/python benchmarks/kernel_choice.py --out benchmarks/results/kernel_choice_zen4.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: see tests/conftest.py

from baton_serve.kernels import capabilities, kernel_choice  # noqa: E402
from baton_serve.workers import LLM, SamplingParams  # noqa: E402

VARIANTS: dict[str, dict[str, str]] = {  # name -> environment at load ("model": a quantised copy)
    "measured": {},
    "fixed defaults (BATON_KERNEL_TUNING=0)": {"BATON_KERNEL_TUNING": "0"},
    "plain F.linear": {"BATON_LINEAR_KERNEL": "plain"},
    "invariant panels": {"BATON_LINEAR_KERNEL": "invariant"},
    "sdpa prefill attention": {"BATON_PREFILL_ATTENTION": "sdpa"},
    "int8 per channel": {"model": "int8"},
    "W8A8": {"model": "int8-a8"},
}


def _model(spec: str | None) -> str | None:
    if spec is None:
        return None
    from baton_serve.workers.checkpoint.default_model import resolve_model
    from baton_serve.workers.checkpoint.quantize import quantize_folder

    activations = "int8" if spec.endswith("-a8") else "float"
    return str(quantize_folder(resolve_model(None), None, "int8", 0, activations=activations))


def _load(variant: dict[str, str], threads: int, dtype: str) -> LLM:
    env = {k: v for k, v in variant.items() if k != "model"}
    model = _model(variant.get("model"))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return LLM(model=model, dtype=dtype, num_threads=threads)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _plan_of(llm: LLM) -> list[dict]:
    plan = llm.engine.runner.model.kernel_plan
    return kernel_choice.as_dict(plan) if plan else []


def _saturation(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def _tpot_ms(llm: LLM, prompt: list[int], output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    first = time.perf_counter() - started
    started = time.perf_counter()
    llm.generate([prompt], params)
    return (time.perf_counter() - started - first) / (output_len - 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="activations' dtype (auto: what the engine picks here)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(list(VARIANTS)[:5]), help="comma-separated names of VARIANTS")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = [n for n in args.variants.split(",") if n]
    llms = {name: _load(VARIANTS[name], args.threads, args.dtype) for name in names}
    vocab = llms[names[0]].engine.runner.model.cfg.vocab_size
    sat: dict[str, list[float]] = {n: [] for n in names}
    tpot: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        # new prompts each round (the same for every variant in it): no prefix-cache hits from an earlier round
        rng = random.Random(r)
        prompts = [[rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
        order = names if r % 2 == 0 else names[::-1]  # ABBA: drift in the machine lands on all alike
        for name in order:
            sat[name].append(_saturation(llms[name], prompts, args.output_len))
            tpot[name].append(_tpot_ms(llms[name], prompts[0], args.output_len))
            print(f"round {r} {name}: {sat[name][-1]:.1f} tok/s, TPOT {tpot[name][-1]:.2f} ms", flush=True)
    base = statistics.median(sat[names[0]])
    rows = [{"variant": n, "saturation_tok_s": round(statistics.median(sat[n]), 1),
             "vs_first": round(statistics.median(sat[n]) / base, 3),
             "single_stream_tpot_ms": round(statistics.median(tpot[n]), 2),
             "rounds": {"saturation": sat[n], "tpot_ms": tpot[n]}} for n in names]
    for row in rows:
        print(f"{row['variant']:<40} {row['saturation_tok_s']:>8} tok/s ({row['vs_first']:.3f}x)  "
              f"TPOT {row['single_stream_tpot_ms']} ms")
    result = {
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "date": date.today().isoformat(), "cpu": capabilities.cpu().describe(), "machine": platform.machine(),
        "torch": torch.__version__, "threads": args.threads, "dtype": llms[names[0]].config.dtype,
        "env": {k: os.environ[k] for k in ("ONEDNN_MAX_CPU_ISA", "BATON_CPU_TARGET") if k in os.environ},
        "workload": f"{args.num_requests} x {args.prompt_len} in / {args.output_len} out, offline engine, greedy",
        "measured_plan": _plan_of(llms[names[0]]) if names[0] == "measured" else [],
        "results": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
