"""Served throughput through HTTP (Ray pools, KV shipping, SSE) vs the offline engine, one run.

Starts a deployment in this process (workers are Ray actors), fires every request at once over
HTTP with streaming, and counts output tokens/s from the first request sent to the last token
received. Then runs the same requests through ``LLM.generate`` with the same engine settings.
The client is ``benchmarks.sse_client``: it shares the cores with the server it measures, so it
should cost as little CPU as it can.

    .venv/bin/python benchmarks/serving_throughput.py --num-requests 32 --repeat 5 \
        --modes disaggregated,disaggregated@collective,colocated --out benchmarks/results/serving_throughput.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: see tests/conftest.py

from benchmarks.engine_throughput import make_workload  # noqa: E402


async def _fire(url: str, model: str, work: list[tuple[list[int], int]]) -> dict:
    from benchmarks.sse_client import stream_sse

    async def one(prompt: list[int], max_tokens: int) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        tokens = 0
        async for data in stream_sse(f"{url}/v1/completions", body):
            if b'"usage":{' in data or b'"usage": {' in data:  # the last chunk; the rest carry null
                usage = json.loads(data).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
        return tokens

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(p, o) for p, o in work))
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": sum(counts), "output_tok_s": sum(counts) / elapsed}


def run_served(mode: str, args: argparse.Namespace, work: list[tuple[list[int], int]]) -> dict:
    from baton_serve.cluster.config import ClusterConfig
    from baton_serve.cluster.serve import Deployment
    from baton_serve.router.server import ServerThread

    # Same cores either way: one colocated worker uses all the offline engine's threads; the
    # disaggregated pools split them across 1 prefill + (workers - 1) decode workers.
    # "disaggregated@collective": the same with that KV transport instead of the default.
    mode, _, transport = mode.partition("@")
    if mode == "colocated":
        pools, threads = {"colocated": 1}, args.offline_threads
    else:
        pools, threads = {"prefill": 1, "decode": args.workers - 1}, args.threads_per_worker
    config = ClusterConfig.model_validate({
        "engine": {"dtype": args.dtype, "max_num_batched_tokens": args.max_num_batched_tokens,
                   "max_num_seqs": 256, "kv_cache_memory_gib": 2.0, "threads_per_worker": threads},
        "pools": pools, "ray": {"num_cpus": os.cpu_count()},
        **({"kv_transfer": {"transport": transport}} if transport else {}),
    })
    dep = Deployment(config).start()
    server = ServerThread(dep.app).start()
    try:
        asyncio.run(_fire(server.url, dep.cluster.model_path.name, work[:2]))  # warm-up
        return asyncio.run(_fire(server.url, dep.cluster.model_path.name, work))
    finally:
        server.stop()
        dep.stop()


def run_offline(args: argparse.Namespace, work: list[tuple[list[int], int]]) -> dict:
    import torch
    from baton_serve.workers import LLM, SamplingParams

    torch.set_num_threads(args.offline_threads)
    llm = LLM(dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=256,
              kv_cache_memory_gib=2.0)
    llm.generate([w[0] for w in work[:2]], SamplingParams(max_tokens=4))
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", default="64:512")
    ap.add_argument("--output-len", default="32:256")
    ap.add_argument("--dtype", default="auto", help="auto: what the engine chooses on this CPU")
    ap.add_argument("--workers", type=int, default=2, help="workers in the deployment (disaggregated: 1 prefill)")
    ap.add_argument("--threads-per-worker", type=int, default=2)
    ap.add_argument("--offline-threads", type=int, default=2)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--modes", default="disaggregated,colocated",
                    help="served modes: colocated, disaggregated, disaggregated@TRANSPORT")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, help="rounds (each: offline, then every served mode)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    lo_p, hi_p = map(int, args.prompt_len.split(":"))
    lo_o, hi_o = map(int, args.output_len.split(":"))
    work = make_workload(args.num_requests, args.seed, (lo_p, hi_p), (lo_o, hi_o), 49152)
    modes = args.modes.split(",")
    # Each round runs offline and every served mode in turn, so a slow spell of this shared
    # machine hits all of them; ratios are medians of the per-round ratios.
    rounds = []
    for r in range(args.repeat):
        one: dict = {"offline": run_offline(args, work)}
        print(f"round {r + 1}: offline engine ({args.offline_threads} threads): "
              f"{one['offline']['output_tok_s']:.1f} tok/s", flush=True)
        for mode in modes:
            one[mode] = run_served(mode, args, work)
            if one[mode]["output_tokens"] != one["offline"]["output_tokens"]:  # ignore_eos: must agree
                raise RuntimeError(f"{mode}: {one[mode]['output_tokens']} output tokens, offline "
                                   f"{one['offline']['output_tokens']}")
            one[f"{mode}_over_offline"] = one[mode]["output_tok_s"] / one["offline"]["output_tok_s"]
            print(f"round {r + 1}: served {mode}: {one[mode]['output_tok_s']:.1f} tok/s "
                  f"({one[f'{mode}_over_offline']:.2f}x offline)", flush=True)
        rounds.append(one)
    results: dict = {}
    for key in ("offline", *modes):
        runs = [one[key] for one in rounds]
        results[key] = {"output_tok_s": statistics.median(x["output_tok_s"] for x in runs),
                        "rounds_output_tok_s": [x["output_tok_s"] for x in runs],
                        "output_tokens": runs[0]["output_tokens"],
                        "seconds": [x["seconds"] for x in runs]}
    for mode in modes:
        ratios = [one[f"{mode}_over_offline"] for one in rounds]
        results[f"{mode}_over_offline"] = statistics.median(ratios)
        results[f"{mode}_over_offline_rounds"] = ratios
        print(f"median: served {mode} {results[mode]['output_tok_s']:.1f} tok/s, "
              f"{results[f'{mode}_over_offline']:.2f}x offline (rounds {', '.join(f'{x:.2f}' for x in ratios)})")
    results["config"] = {**vars(args), "date": date.today().isoformat(), "cores": os.cpu_count(),
                         "machine": platform.machine(), "command": " ".join(sys.argv)}
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
