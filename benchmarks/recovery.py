"""Failure recovery, measured (issue 18).

1. **Time to recover, per scenario**: a deployment of the default model serves a batch of greedy
   streams; a worker is killed (SIGKILL) at a seeded moment; reported per injection: from the
   kill to the next token of each stream it held (the stream's first token after its migration),
   p50/p99 over ``--injections`` kills. The killed worker is restarted by the controller between
   injections. Scenarios:
   - ``colocated``: two colocated workers, one killed mid-stream (its streams re-prefill on the other);
   - ``decode``: one prefill and two decode workers, a decode worker killed mid-stream;
   - ``prefill``: two prefill workers and one decode, a prefill worker paused (SIGSTOP) while the
     batch's prompts queue on it, then killed (re-prefilled on the other before any token).
   Each injection also checks what the fault suite checks: every stream's tokens equal those of an
   undisturbed run (no token repeated or skipped).
2. **Throughput around a decode failure** (1 prefill + 2 decode): a closed loop of
   ``--concurrency`` greedy streams for ``--load-seconds``; decode-0 killed at a third of it.
   Reported: output tokens/s per second of the run, and the means before the kill, in the 10 s
   after it, and from then to the end.

    .venv/bin/python benchmarks/recovery.py --out benchmarks/results/recovery.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: see tests/conftest.py

from benchmarks.machine import cpu_name, pct  # noqa: E402

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten year old.",
    "List five facts about the planet Mars and why each matters.",
    "Describe the smell of rain on a summer evening in the city.",
]


def _config(model: str | None, pools: dict[str, int]) -> Any:
    from baton_serve.cluster.config import ClusterConfig

    return ClusterConfig.model_validate({
        "engine": {"model": model, "dtype": "float32", "threads_per_worker": 1},
        "pools": pools, "kv_transfer": {"timeout_s": 10},
        # A kill every few seconds on purpose: no doubling backoff, no quarantine.
        "recovery": {"restart_backoff_s": 0.5, "restart_window_s": 0.1, "max_restarts": 1000}})


SCENARIOS = {
    "colocated": ({"colocated": 2}, "colocated"),
    "decode": ({"prefill": 1, "decode": 2}, "decode"),
    "prefill": ({"prefill": 2, "decode": 1}, "prefill"),
}


async def _wait_all_alive(pool: Any, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(w.alive for w in pool.workers.values()):
        if time.monotonic() > deadline:
            raise RuntimeError("a killed worker did not come back")
        await asyncio.sleep(0.2)


async def _injection(pool: Any, prompts: list[list[int]], want: list[list[int]], params: Any, role: str,
                     rng: random.Random) -> dict[str, Any]:
    """One kill under one batch: the recovery time of each stream the victim held."""
    kill_after = rng.randint(4, 24)
    killed_at: list[float] = []
    victim_streams: set[str] = set()
    recovered: dict[str, float] = {}
    reached = asyncio.Event()
    counts = [0] * len(prompts)

    if role == "prefill":
        # Pause the prefill worker first: the prompts routed to it wait there, unprefilled.
        victim = pool.workers["prefill-0"]
        os.kill(victim.info["pid"], signal.SIGSTOP)

    async def one(i: int) -> list[int]:
        rid = f"r{i}-{rng.random():.6f}"
        toks: list[int] = []
        async for d in pool.generate(rid, prompts[i], params):
            if killed_at and rid in victim_streams and rid not in recovered and d.token_ids:
                recovered[rid] = time.monotonic() - killed_at[0]
            toks.extend(d.token_ids)
            counts[i] = len(toks)
            if role != "prefill" and min(counts) >= kill_after:
                reached.set()
        return toks

    tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
    if role == "prefill":
        await asyncio.sleep(1.0)
    else:
        await asyncio.wait_for(reached.wait(), 120)
        held: dict[str, int] = {}
        for s in pool._streams.values():
            for wid in s.workers:
                if pool.workers[wid].role == role:
                    held[wid] = held.get(wid, 0) + 1
        victim = pool.workers[max(held, key=held.get)]
    victim_streams.update(rid for rid, s in pool._streams.items() if victim.worker_id in s.workers)
    killed_at.append(time.monotonic())
    os.kill(victim.info["pid"], signal.SIGKILL)
    got = await asyncio.wait_for(asyncio.gather(*tasks), 300)
    return {"victim": victim.worker_id, "kill_after_tokens": kill_after if role != "prefill" else 0,
            "streams_held": len(victim_streams), "recovery_s": sorted(recovered.values()),
            "identical": got == want}


def scenario(args: argparse.Namespace, name: str) -> dict[str, Any]:
    from baton_serve.cluster.front import PoolClient
    from baton_serve.cluster.launcher import Cluster
    from baton_serve.router.routing import make_policy
    from baton_serve.workers import LLM, SamplingParams

    pools, role = SCENARIOS[name]
    cluster = Cluster(_config(args.model, pools))
    cluster.start()
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    llm = LLM(model=str(cluster.model_path), dtype="float32")
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    del llm
    rng = random.Random(f"recovery-{name}")
    policy = "round_robin" if role != "decode" else "least_loaded"

    async def main() -> list[dict[str, Any]]:
        pool = PoolClient(cluster.workers, cluster.limits, controller=cluster.controller,
                          policy=make_policy(policy), migration_wait_s=120)
        await pool.start(stats_interval_s=0.2)
        out = []
        try:
            for k in range(args.injections):
                await _wait_all_alive(pool)
                result = await _injection(pool, prompts, want, params, role, rng)
                print(f"{name} #{k + 1}: {result['streams_held']} streams on {result['victim']}, recovered in "
                      + ", ".join(f"{s * 1000:.0f}" for s in result["recovery_s"]) + " ms"
                      + ("" if result["identical"] else "  NOT IDENTICAL"), flush=True)
                out.append(result)
        finally:
            await pool.stop()
        return out

    try:
        runs = asyncio.run(main())
    finally:
        cluster.stop()
    times = [s for r in runs for s in r["recovery_s"]]
    return {"pools": pools, "killed_role": role, "injections": len(runs),
            "streams_recovered": len(times), "all_identical": all(r["identical"] for r in runs),
            "recovery_p50_ms": round(pct(times, 50) * 1000, 1) if times else None,
            "recovery_p99_ms": round(pct(times, 99) * 1000, 1) if times else None,
            "recovery_mean_ms": round(statistics.fmean(times) * 1000, 1) if times else None, "runs": runs}


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    from baton_serve.cluster.front import PoolClient
    from baton_serve.cluster.launcher import Cluster
    from baton_serve.router.routing import make_policy
    from baton_serve.workers import SamplingParams
    from baton_serve.workers.text.tokenizer import Tokenizer

    cluster = Cluster(_config(args.model, {"prefill": 1, "decode": 2}))
    cluster.start()
    tok = Tokenizer.from_folder(cluster.model_path)
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    seconds = args.load_seconds
    kill_at = seconds / 3

    async def main() -> dict[str, Any]:
        pool = PoolClient(cluster.workers, cluster.limits, controller=cluster.controller,
                          policy=make_policy("least_loaded"), migration_wait_s=120)
        await pool.start(stats_interval_s=0.2)
        bins = [0] * (int(seconds) + 30)
        errors = 0
        started = time.monotonic()
        stop_at = started + seconds
        counter = 0

        async def loop(slot: int) -> None:
            nonlocal errors, counter
            while time.monotonic() < stop_at:
                counter += 1
                try:
                    async for d in pool.generate(f"t{slot}-{counter}", prompts[counter % len(prompts)], params):
                        bins[min(int(time.monotonic() - started), len(bins) - 1)] += len(d.token_ids)
                except Exception:
                    errors += 1

        async def killer() -> None:
            await asyncio.sleep(kill_at)
            os.kill(pool.workers["decode-0"].info["pid"], signal.SIGKILL)

        try:
            await asyncio.gather(killer(), *(loop(i) for i in range(args.concurrency)))
        finally:
            await pool.stop()
        used = bins[:int(seconds)]
        k = int(kill_at)
        return {"tokens_per_s": used, "kill_at_s": kill_at, "errors": errors,
                "before": round(statistics.fmean(used[:k]), 1),
                "first_10s_after": round(statistics.fmean(used[k:k + 10]), 1),
                "rest": round(statistics.fmean(used[k + 10:]), 1) if used[k + 10:] else None,
                "migrations": pool.migrations_total,
                "restarted": pool.workers["decode-0"].incarnation > 0}

    try:
        return asyncio.run(main())
    finally:
        cluster.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    parser.add_argument("--injections", type=int, default=20)
    parser.add_argument("--output-tokens", type=int, default=48)
    parser.add_argument("--scenarios", default="colocated,decode,prefill")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--load-seconds", type=float, default=45.0)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, Any] = {"config": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                          "date": date.today().isoformat(), "cpu": cpu_name(),
                                          "cores": os.cpu_count()}}
    results["scenarios"] = {}
    for name in (n for n in args.scenarios.split(",") if n):
        results["scenarios"][name] = scenario(args, name)
        if args.out:  # each scenario as it ends: a long run cut short keeps what it measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1) + "\n")
    for name, r in results["scenarios"].items():
        print(f"{name}: {r['streams_recovered']} streams over {r['injections']} kills, recovery p50 "
              f"{r['recovery_p50_ms']} ms, p99 {r['recovery_p99_ms']} ms, identical {r['all_identical']}")
    if not args.skip_throughput:
        results["throughput"] = t = throughput(args)
        print(f"throughput (1P+2D, decode-0 killed at {t['kill_at_s']:.0f}s): before {t['before']} tok/s, "
              f"10 s after {t['first_10s_after']}, then {t['rest']}; errors {t['errors']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
