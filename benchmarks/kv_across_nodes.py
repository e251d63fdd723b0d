"""KV shipping across nodes vs on one node, on two Ray nodes in network namespaces
(``benchmarks.two_nodes``; needs root).

For each prompt length: the per-request KV transfer time (from the prefill worker parking the
request to the decode worker admitting it) and its MB/s, with decode on the other node (gloo over
the veth: connector ``collective``) and with decode on the prefill worker's node (connector
``shared_memory``). Then served output tok/s of 1 prefill + 1 decode worker, across nodes and on
one node, for one batch of concurrent requests.

    sudo .venv/bin/python benchmarks/kv_across_nodes.py --out benchmarks/results/kv_across_nodes.json

The measuring runs in a driver inside namespace A (``--inner``), which joins the lab's Ray cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after site-packages: see tests/conftest.py
MODES = {"across_nodes": "node_b", "one_node": "node_a"}  # where the decode worker goes


def _inner(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from baton_serve.cluster.config import ClusterConfig
    from baton_serve.cluster.front import PoolClient
    from baton_serve.cluster.launcher import Cluster
    from baton_serve.workers.sampling.params import SamplingParams

    config = ClusterConfig.model_validate({
        "engine": {"model": args.model, "dtype": args.dtype, "threads_per_worker": 1,
                   "kv_cache_memory_gib": 1.0, "max_model_len": max(args.prompt_lens) + 64},
        "pools": {"prefill": 1, "decode": 1, "prefill_resources": {"node_a": 0.01},
                  "decode_resources": {MODES[args.mode]: 0.01}},
        "kv_transfer": {"transport": "auto", "timeout_s": 60},
        "ray": {"address": args.ray_address},
    })
    cluster = Cluster(config)
    cluster.start()
    prefill = next(w for w in cluster.workers if w.role == "prefill")
    rng = random.Random(0)
    vocab = int(prefill.info["vocab_size"])

    def shipped() -> tuple[int, float, int]:
        kv = ray.get(prefill.handle.stats.remote())["extra"]["kv_transfer"]
        return kv["shipments"], kv["ship_seconds"], kv["bytes"]

    async def run() -> dict[str, Any]:
        pool = PoolClient(cluster.workers, cluster.limits)
        await pool.start(stats_interval_s=1.0)
        out: dict[str, Any] = {"transfers": {}}
        try:
            one = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            for n in args.prompt_lens:
                rows = []
                for r in range(args.repeat + 1):  # the first run sets up the pair group: not counted
                    before = shipped()
                    async for _ in pool.generate(f"t{n}-{r}", [rng.randrange(10, vocab) for _ in range(n)], one):
                        pass
                    after = shipped()
                    assert after[0] == before[0] + 1, (before, after)
                    if r:
                        seconds, nbytes = after[1] - before[1], after[2] - before[2]
                        rows.append({"seconds": seconds, "bytes": nbytes, "mb_per_s": nbytes / seconds / 1e6})
                out["transfers"][str(n)] = rows
            params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
            prompts = [[rng.randrange(10, vocab) for _ in range(args.serve_prompt_len)]
                       for _ in range(args.serve_requests)]

            async def stream(i: int) -> int:
                count = 0
                async for d in pool.generate(f"s{i}", prompts[i], params):
                    count += len(d.token_ids)
                return count

            started = time.perf_counter()
            tokens = await asyncio.gather(*(stream(i) for i in range(len(prompts))))
            wall = time.perf_counter() - started
            out["served"] = {"requests": len(prompts), "output_tokens": sum(tokens), "seconds": wall,
                             "output_tok_per_s": sum(tokens) / wall}
        finally:
            await pool.stop()
        return out

    try:
        result = asyncio.run(run())
        result["connector"] = "collective" if args.mode == "across_nodes" else "shared_memory"
        stats = ray.get(prefill.handle.stats.remote())
        result["pair_groups"] = stats["pair_groups"]
        return result
    finally:
        cluster.stop()


def _median(rows: list[dict], key: str) -> float:
    return sorted(r[key] for r in rows)[len(rows) // 2]


def _summary(results: dict[str, Any]) -> str:
    lines = ["| prompt tokens | KV MB | across nodes (gloo over veth) ms | MB/s | one node (shared memory) ms | MB/s |",
             "|---|---|---|---|---|---|"]
    across, local = results["modes"]["across_nodes"], results["modes"]["one_node"]
    for n in results["prompt_lens"]:
        a, o = across["transfers"][str(n)], local["transfers"][str(n)]
        med = _median
        lines.append(f"| {n} | {a[0]['bytes'] / 1e6:.1f} | {med(a, 'seconds') * 1e3:.1f} | {med(a, 'mb_per_s'):.0f} "
                     f"| {med(o, 'seconds') * 1e3:.1f} | {med(o, 'mb_per_s'):.0f} |")
    sa, so = across["served"], local["served"]
    lines += ["", f"Served output tok/s, {sa['requests']} concurrent requests: across nodes "
              f"{sa['output_tok_per_s']:.1f}, one node {so['output_tok_per_s']:.1f} "
              f"(ratio {sa['output_tok_per_s'] / so['output_tok_per_s']:.2f})"]
    return "\n".join(lines)


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-lens", type=lambda s: [int(x) for x in s.split(",")], default=[256, 1024, 4096])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--serve-requests", type=int, default=16)
    parser.add_argument("--serve-prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=sorted(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--ray-address", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inner:
        print("RESULT " + json.dumps(_inner(args)), flush=True)
        return 0

    from benchmarks.two_nodes import TwoNodes

    results: dict[str, Any] = {"benchmark": "kv_across_nodes", "prompt_lens": args.prompt_lens,
                               "repeat": args.repeat, "cpu": _cpu_name(),
                               "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
                               "modes": {}}
    with TwoNodes().running() as lab:
        for mode in MODES:
            cmd = [sys.executable, "-m", "benchmarks.kv_across_nodes", "--inner", "--mode", mode,
                   "--ray-address", lab.ray_address, "--prompt-lens", ",".join(map(str, args.prompt_lens)),
                   "--repeat", str(args.repeat), "--dtype", args.dtype, "--serve-requests", str(args.serve_requests),
                   "--serve-prompt-len", str(args.serve_prompt_len), "--output-len", str(args.output_len)]
            if args.model:
                cmd += ["--model", args.model]
            done = lab.run_in(lab.ns_a, *cmd, timeout=1800, cwd=ROOT)
            line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if done.returncode != 0 or line is None:
                raise SystemExit(f"{mode} run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
            results["modes"][mode] = json.loads(line[len("RESULT "):])
            print(f"{mode}: done", file=sys.stderr, flush=True)
    results["summary"] = _summary(results)
    print(results["summary"])
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(
            f"# KV across nodes ({results['cpu']})\n\n`{results['command']}`\n\n{results['summary']}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
