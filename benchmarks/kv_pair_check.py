#!/usr/bin/env python
"""KV blocks between two processes by both mechanisms the KV connectors use, without Ray: a pair
group (``PairGroup`` + ``KVTransferEngine.send_blocks``: the collective connector) and a mapped
cache (``workers.kv.shared`` + ``copy_blocks_from``: the shared-memory connector), checked bit for
bit and timed.

On a CUDA machine the pair group is NCCL, and the mapped cache is GPU memory behind a CUDA IPC
handle: the paths that serve KV between GPU workers, which the CPU-only test suite cannot reach.
Rank 1 takes the second GPU where there is one, else shares the first (a 1P+1D on one GPU, where
NCCL refuses the pair and only the mapped cache works). On a CPU it is the same code over gloo and
a memfd, which the tests run with tiny shapes. Writes JSON to ``--out``; exits 1 when a check fails
(``--expect-fail pair_group`` names a stage whose failure is the expected result).

    python benchmarks/kv_pair_check.py --device cuda --out benchmarks/results/kv_pair_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("float32", "bfloat16", "float16")


def _caches(torch: Any, spec: dict[str, Any], device: Any, seed: int | None) -> list[tuple[Any, Any]]:
    """Per layer (K, V) of ``[blocks, block_size, heads, head_dim]`` in one allocation, as a worker
    holds them (``workers.kv.layout``): seeded random, or NaN-poisoned."""
    from baton_serve.workers.kv.layout import allocate_kv

    shape = (spec["blocks"], spec["block_size"], spec["heads"], spec["head_dim"])
    caches = allocate_kv(spec["layers"], shape, getattr(torch, spec["dtype"]), device)
    gen = torch.Generator().manual_seed(seed or 0)
    for k, v in caches:
        for t in (k, v):
            t.copy_(torch.full(shape, float("nan")) if seed is None else torch.randn(shape, generator=gen))
    return caches


def _ids(spec: dict[str, Any], rank: int) -> list[int]:
    """The shipped blocks: a strided, reversed pick on the sender, a shuffled one on the receiver."""
    n, total = spec["ship"], spec["blocks"]
    picks = [(i * 7 + 3) % total for i in range(n)]
    if len(set(picks)) != n:
        picks = list(range(n))
    return picks[::-1] if rank == 0 else sorted(picks, key=lambda b: (b * 13) % total)


def _rank_main(rank: int, device_name: str, spec: dict[str, Any], queues: list[Any], results: Any) -> None:
    import torch

    sys.path.append(str(ROOT))  # after site-packages: see tests/conftest.py
    out: dict[str, Any] = {"rank": rank, "device": device_name, "stages": {}}
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    for name, stage in (("pair_group", _pair_group_stage), ("shared", _shared_stage)):
        try:
            out["stages"][name] = stage(torch, rank, device, spec, _Mailbox(queues, rank, name, spec))
        except BaseException as exc:  # reported, not raised: the parent prints what each rank saw
            out["stages"][name] = {"error": f"{type(exc).__name__}: {exc}",
                                   "traceback": traceback.format_exc(limit=6)}
            queues[1 - rank].put((name, None))  # a peer waiting on this stage gives up at once
    results.put(out)


class _Mailbox:
    """One stage's messages between the two ranks; what an earlier stage left unread is skipped."""

    def __init__(self, queues: list[Any], rank: int, stage: str, spec: dict[str, Any]) -> None:
        self.queues, self.rank, self.stage, self.timeout_s = queues, rank, stage, spec["timeout_s"]

    def put(self, payload: Any) -> None:
        self.queues[1 - self.rank].put((self.stage, payload))

    def get(self) -> Any:
        deadline = time.monotonic() + self.timeout_s
        while True:
            stage, payload = self.queues[self.rank].get(timeout=max(0.1, deadline - time.monotonic()))
            if stage != self.stage:
                continue
            if payload is None:
                raise RuntimeError("the peer's stage failed")
            return payload


def _timed(torch: Any, device: Any, spec: dict[str, Any], move: Any) -> tuple[int, float]:
    """(bytes of one move, median seconds over ``iters`` moves after one warm-up)."""
    times, nbytes = [], 0
    for i in range(spec["iters"] + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        nbytes = move(i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
    return nbytes, statistics.median(times)


def _pair_group_stage(torch: Any, rank: int, device: Any, spec: dict[str, Any], mail: _Mailbox) -> dict[str, Any]:
    """Rank 0 sends the blocks over a pair group, rank 1 receives and checks them."""
    from baton_serve.workers.kv.transfer import KVTransferEngine, PairGroup, PairRendezvous

    out: dict[str, Any] = {}
    group = PairGroup(device)
    try:
        t0 = time.perf_counter()
        if rank == 0:
            rdv = group.listen("127.0.0.1", timeout_s=spec["timeout_s"])
            mail.put(rdv.to_dict())
        else:
            rdv = PairRendezvous.from_dict(mail.get())
        out["backend"] = rdv.backend
        group.join(rdv, rank)
        out["join_s"] = time.perf_counter() - t0
        caches = _caches(torch, spec, device, seed=1 if rank == 0 else None)
        engine = KVTransferEngine(caches, spec["block_size"], device)
        ids = _ids(spec, rank)
        for per_layer in (False, True):
            if rank == 0:
                nbytes, median = _timed(torch, device, spec, lambda i, pl=per_layer: engine.send_blocks(
                    group, ids, transfer_id=i, per_layer=pl))
            else:
                nbytes, median = _timed(torch, device, spec, lambda i: engine.recv_blocks(group, ids, transfer_id=i))
            mode = {"bytes": nbytes, "median_s": median, "gb_per_s": nbytes / median / 1e9}
            if rank == 1:
                mode["ok"] = _received_intact(torch, spec, caches, ids)
            out["per_layer" if per_layer else "whole"] = mode
    finally:
        group.close()
    return out


def _shared_stage(torch: Any, rank: int, device: Any, spec: dict[str, Any], mail: _Mailbox) -> dict[str, Any]:
    """Rank 0 exports its cache; rank 1 maps it and copies the blocks into its own, then checks."""
    from baton_serve.workers.kv.shared import KVExport, allocate_shared, map_export
    from baton_serve.workers.kv.transfer import KVTransferEngine

    shape = (spec["blocks"], spec["block_size"], spec["heads"], spec["head_dim"])
    if rank == 0:
        caches, export = allocate_shared(spec["layers"], shape, getattr(torch, spec["dtype"]), device)
        for (k, v), (sk, sv) in zip(caches, _caches(torch, spec, device, seed=1)):
            k.copy_(sk)
            v.copy_(sv)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        mail.put(export.to_dict())
        mail.get()  # the cache must outlive the peer's copies
        return {"mechanism": "cuda_ipc" if export.cuda else "memfd"}
    export = KVExport.from_dict(mail.get())
    try:
        source = map_export(export)
        caches = _caches(torch, spec, device, seed=None)
        engine = KVTransferEngine(caches, spec["block_size"], device)
        src, dst = _ids(spec, 0), _ids(spec, 1)
        nbytes, median = _timed(torch, device, spec, lambda i: engine.copy_blocks_from(source, src, dst))
        return {"mechanism": "cuda_ipc" if export.cuda else "memfd", "bytes": nbytes, "median_s": median,
                "gb_per_s": nbytes / median / 1e9, "ok": _received_intact(torch, spec, caches, dst)}
    finally:
        mail.put("done")


def _received_intact(torch: Any, spec: dict[str, Any], caches: list[tuple[Any, Any]], dst: list[int]) -> bool:
    """Every shipped block equals the sender's, bit for bit; every other block is still poisoned."""
    source = _caches(torch, spec, "cpu", seed=1)
    src = _ids(spec, 0)
    others = [b for b in range(spec["blocks"]) if b not in set(dst)]
    for (sk, sv), (k, v) in zip(source, caches):
        for s_cache, d_cache in ((sk, k.cpu()), (sv, v.cpu())):
            got = d_cache[dst].contiguous().view(torch.uint8)
            if not torch.equal(got, s_cache[src].contiguous().view(torch.uint8)):
                return False
            if others and not d_cache[others].float().isnan().all():
                return False
    return True


def run(device: str, spec: dict[str, Any], timeout_s: float, expect_fail: tuple[str, ...] = ()) -> dict[str, Any]:
    """Spawn the two ranks, wait for both (bounded), and gather what each saw."""
    import torch
    import torch.multiprocessing as mp

    devices = [device, device]
    if device == "cuda":
        count = torch.cuda.device_count()
        devices = ["cuda:0", "cuda:1" if count > 1 else "cuda:0"]
    ctx = mp.get_context("spawn")
    queues, results = [ctx.Queue(), ctx.Queue()], ctx.Queue()  # queues[r]: messages to rank r
    procs = [ctx.Process(target=_rank_main, args=(r, devices[r], spec, queues, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    seen: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < 2 and time.monotonic() < deadline:
        try:
            got = results.get(timeout=1.0)
            seen[got["rank"]] = got
        except Exception:  # queue.Empty: keep waiting until the deadline
            if all(not p.is_alive() for p in procs) and results.empty():
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    ranks = [seen.get(r, {"rank": r, "error": "no result (timed out or died)", "stages": {}}) for r in (0, 1)]
    stages = {}
    for name in ("pair_group", "shared"):
        views = [r["stages"].get(name, {"error": r.get("error", "not run")}) for r in ranks]
        checks = [m.get("ok") for m in views[1].values() if isinstance(m, dict)] + [views[1].get("ok")]
        passed = all("error" not in v for v in views) and any(c is not None for c in checks) \
            and all(c is not False for c in checks)
        stages[name] = {"passed": passed, "expected_to_fail": name in expect_fail}
    ok = all(s["passed"] != s["expected_to_fail"] for s in stages.values())
    return {"device": device, "rank_devices": devices, "spec": spec, "stages": stages, "ranks": ranks,
            "all_ok": ok, "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    # SmolLM2-135M's cache by default: 30 layers, 3 KV heads, head dim 64, 16-token blocks
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=512, help="blocks in each side's cache")
    parser.add_argument("--ship", type=int, default=64, help="blocks per transfer (64 = a 1k-token prompt)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--expect-fail", default="", help="comma-separated stages whose failure is the "
                        "expected result (pair_group on one GPU: NCCL refuses two ranks on a device)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.ship > args.blocks:
        parser.error("--ship must not exceed --blocks")
    spec = {"layers": args.layers, "heads": args.heads, "head_dim": args.head_dim, "block_size": args.block_size,
            "blocks": args.blocks, "ship": args.ship, "dtype": args.dtype, "iters": args.iters,
            "timeout_s": min(30.0, args.timeout_s / 2)}
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("kv_pair_check: skipped (no CUDA device)")
            return 0
    expect = tuple(x for x in args.expect_fail.split(",") if x)
    result = run(args.device, spec, args.timeout_s, expect)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    for name, verdict in result["stages"].items():
        views = [r["stages"].get(name, {}) for r in result["ranks"]]
        error = next((v["error"].splitlines()[0] for v in views if "error" in v), None)
        rates = [f"{k} {m['gb_per_s']:.2f} GB/s" for k, m in views[1].items() if isinstance(m, dict)]
        rates += [f"{views[1]['gb_per_s']:.2f} GB/s"] if "gb_per_s" in views[1] else []
        print(f"{name}: {'passed' if verdict['passed'] else 'failed'}"
              f"{' (expected)' if verdict['expected_to_fail'] and not verdict['passed'] else ''}: "
              f"{error or ', '.join(rates)}")
    print(f"kv_pair_check: {'all checks as expected' if result['all_ok'] else 'CHECKS FAILED'}; wrote {out}")
    return 0 if result["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
