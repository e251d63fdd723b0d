"""``baton plan profile``: measure a latency profile (``cluster.sim.profile``) by running the real
engine in this process on crafted steps, and the real KV copy and gloo/NCCL send paths.

Each grid point is a step built to hold exactly that work: a prompt chunk over a prefix the
engine has just cached (prefill), or ``batch`` sequences decoding over a shared cached prompt
(decode; shared blocks are read once per sequence, as distinct ones would be). Every point is the
median of a few repeats after a warm-up. Held-out mixed steps (decodes plus prompt chunks) choose
the rule that composes them and say how far it is off.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

from baton_serve.cluster.sim.profile import RULES, Grid, LatencyProfile, TransferCost

FULL = {"new_tokens": [1, 16, 64, 128, 256, 512, 1024, 2048], "cached_tokens": [0, 512, 1024, 2048, 4096],
        "batch": [1, 2, 4, 8, 16, 32, 64], "context_per_seq": [16, 256, 1024, 2048], "repeats": 3,
        "blocks": [1, 8, 32, 128]}
QUICK = {"new_tokens": [1, 16, 64], "cached_tokens": [0, 64], "batch": [1, 4], "context_per_seq": [16, 64],
         "repeats": 2, "blocks": [1, 8]}
# Held-out mixed steps: (decoding batch, its context per sequence, [(new, cached) chunks])
MIXED_FULL = [(8, 256, [(128, 0)]), (16, 512, [(256, 0)]), (4, 128, [(64, 0), (64, 0)]), (0, 0, [(256, 0), (256, 0)]),
              (32, 256, [(512, 0)]), (8, 1024, [(32, 512)]), (64, 256, [(64, 0)])]
MIXED_QUICK = [(4, 32, [(16, 0)]), (0, 0, [(16, 0), (16, 0)])]
_FIRST_ID = 16


class _Bench:
    """An engine and fresh token ids; ``timed_step`` runs one step and returns its wall time."""

    def __init__(self, engine: Any, sync: Callable[[], None], seed: int = 0) -> None:
        self.engine, self.sync = engine, sync
        self.rng = random.Random(seed)
        self.vocab = engine.vocab_size
        self._ids = 0

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(_FIRST_ID, self.vocab) for _ in range(n)]

    def rid(self) -> str:
        self._ids += 1
        return f"p{self._ids}"

    def run_out(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def timed_step(self) -> float:
        self.sync()
        t = time.perf_counter()
        self.engine.step()
        self.sync()
        return time.perf_counter() - t

    def params(self, max_tokens: int) -> Any:
        from baton_serve.workers.sampling.params import SamplingParams

        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)

    def cache_prefix(self, n: int) -> list[int]:
        """``n`` fresh tokens whose full blocks the engine now holds in its prefix cache."""
        prefix = self.tokens(n)
        if n:
            self.engine.add_request(self.rid(), prefix + self.tokens(1), self.params(1))
            self.run_out()
        return prefix

    def prefill_point(self, new: int, cached: int, repeats: int) -> float:
        prefix = self.cache_prefix(cached)
        times = []
        for _ in range(repeats):
            self.engine.add_request(self.rid(), prefix + self.tokens(new), self.params(1))
            times.append(self.timed_step())
            self.run_out()
        return statistics.median(times)

    def start_decodes(self, batch: int, context: int) -> list[str]:
        """``batch`` sequences past their prompts of ``context`` tokens (a shared cached prefix each)."""
        if not batch:
            return []
        prefix = self.cache_prefix(max(context - 1, 0))
        rids = [self.rid() for _ in range(batch)]
        for rid in rids:
            self.engine.add_request(rid, prefix + self.tokens(1), self.params(64))
        while any(self.engine._members[r].num_output_tokens < 1 for r in rids):
            self.engine.step()
        return rids

    def decode_point(self, batch: int, context: int, repeats: int) -> float:
        rids = self.start_decodes(batch, context)
        times = [self.timed_step() for _ in range(repeats + 1)][1:]
        self.engine.abort_request(rids)
        return statistics.median(times)

    def mixed_point(self, batch: int, context: int, chunks: list[tuple[int, int]], repeats: int) -> tuple[float, float]:
        """A step of ``batch`` decodes (at ``context`` per sequence) and ``chunks``: (its time, the
        decodes' mean context)."""
        times, ctxs = [], []
        for _ in range(repeats):
            # the chunks' prefixes first: caching one runs the engine dry, decodes included
            prefixes = [self.cache_prefix(c) for _, c in chunks]
            rids = self.start_decodes(batch, context)
            for (new, _), prefix in zip(chunks, prefixes):
                self.engine.add_request(self.rid(), prefix + self.tokens(new), self.params(1))
            ctxs.append(sum(self.engine._members[r].num_tokens - 1 for r in rids) / max(len(rids), 1))
            times.append(self.timed_step())
            self.engine.abort_request(rids)
            self.run_out()
        return statistics.median(times), statistics.median(ctxs)


def describe_machine(threads: int, device: str) -> dict[str, Any]:
    """CPU model and ISA, cores, threads, device and torch version, for the profile's ``machine``."""
    import torch

    model, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith(("flags", "Features")) and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "asimd", "sve") if f in flags]
    out = {"cpu_model": model or platform.processor(), "arch": platform.machine(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "isa": isa, "cores": os.cpu_count(),
           "threads": threads, "device": "cpu", "torch": torch.__version__}
    if device.startswith("cuda"):
        out["device"] = torch.cuda.get_device_name(torch.device(device))
    return out


def _fit_line(points: Sequence[tuple[int, float]]) -> TransferCost:
    """Least squares ``t = fixed + n * per_block`` (fixed >= 0, per_block > 0)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else my / max(mx, 1)
    slope = max(slope, 1e-9)
    return TransferCost(max(my - slope * mx, 0.0), slope)


def measure_copy(caches: Any, block_size: int, counts: list[int], repeats: int) -> TransferCost:
    """``shared_memory``: the receiving worker's copy of ``n`` blocks from a peer's cache into its own."""
    import torch
    from baton_serve.workers.kv.layout import allocate_kv
    from baton_serve.workers.kv.transfer import KVTransferEngine

    k = caches[0][0]
    shape = (max(counts) * 2 + 1, block_size, k.shape[2], k.shape[3])
    src, dst = allocate_kv(len(caches), shape, k.dtype, k.device), allocate_kv(len(caches), shape, k.dtype, k.device)
    engine = KVTransferEngine(dst, block_size, k.device)
    points = []
    for n in counts:
        ids = list(range(n))
        times = []
        for _ in range(repeats + 1):
            if k.device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            engine.copy_blocks_from(src, ids, [i + n for i in ids])
            times.append(time.perf_counter() - t)
        points.append((n, statistics.median(times[1:])))
    return _fit_line(points)


def _recv_side(conn: Any, rdv: dict[str, Any], spec: dict[str, Any]) -> None:
    """The spawned receiver of ``measure_collective``: join, then receive each batch it is told of."""
    import torch
    from baton_serve.workers.kv.layout import allocate_kv
    from baton_serve.workers.kv.pair_group import PairGroup, PairRendezvous
    from baton_serve.workers.kv.transfer import KVTransferEngine

    torch.set_num_threads(1)
    group = PairGroup(spec["device"])
    group.join(PairRendezvous.from_dict(rdv), 1)
    caches = allocate_kv(spec["layers"], tuple(spec["shape"]), getattr(torch, spec["dtype"]), spec["device"])
    engine = KVTransferEngine(caches, spec["shape"][1], spec["device"])
    conn.send("ready")
    while True:
        n = conn.recv()
        if n is None:
            break
        engine.recv_blocks(group, list(range(n)))
    group.close()


def measure_collective(caches: Any, block_size: int, counts: list[int], repeats: int) -> TransferCost:
    """``collective``: a gloo (NCCL on a GPU) pair group between this process and a spawned one,
    ``send_blocks`` timed until the receiver acknowledges."""
    import multiprocessing

    from baton_serve.workers.kv.pair_group import PairGroup
    from baton_serve.workers.kv.transfer import KVTransferEngine

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    k = caches[0][0]
    shape = [max(counts) + 1, block_size, int(k.shape[2]), int(k.shape[3])]
    group = PairGroup(k.device)
    rdv = group.listen(timeout_s=60.0)
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    spec = {"device": str(k.device), "layers": len(caches), "shape": shape, "dtype": str(k.dtype).split(".")[-1]}
    proc = ctx.Process(target=_recv_side, args=(theirs, rdv.to_dict(), spec), daemon=True)
    proc.start()
    try:
        group.join(rdv, 0)
        if not ours.poll(120) or ours.recv() != "ready":
            raise RuntimeError("the receiving process did not start")
        from baton_serve.workers.kv.layout import allocate_kv

        src = allocate_kv(len(caches), tuple(shape), k.dtype, k.device)
        engine = KVTransferEngine(src, block_size, k.device)
        points = []
        for n in counts:
            times = []
            for _ in range(repeats + 1):
                ours.send(n)
                t = time.perf_counter()
                engine.send_blocks(group, list(range(n)))
                times.append(time.perf_counter() - t)
            points.append((n, statistics.median(times[1:])))
        ours.send(None)
    finally:
        group.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return _fit_line(points)


def _relative_errors(profile: LatencyProfile, measured: list[tuple[int, float, list[tuple[int, int]], float]]
                     ) -> list[float]:
    return [abs(profile.step_s(chunks, b, int(b * ctx)) - t) / t for b, ctx, chunks, t in measured]


def measure_profile(model_path: str | None = None, dtype: str = "auto", threads: int = 2, block_size: int = 16,
                    max_num_batched_tokens: int = 2048, quick: bool = False, device: str = "cpu",
                    connectors: Sequence[str] = ("shared_memory", "collective"),
                    log: Callable[[str], None] = lambda msg: None) -> LatencyProfile:
    """Measure the profile of ``model_path`` (default: the embedded model) on this machine."""
    import torch
    from baton_serve.workers.engine.config import EngineConfig, SchedulerConfig
    from baton_serve.workers.engine.model_runner import kv_cache_block_bytes
    from baton_serve.workers.llm import build_engine

    grid = QUICK if quick else FULL
    new_axis = [n for n in grid["new_tokens"] if n <= max_num_batched_tokens] or [max_num_batched_tokens]
    need = (max(grid["cached_tokens"]) + max(new_axis)) // block_size + max(grid["batch"]) * 4 + 64
    mixed_need = max(b * 2 + (ctx + sum(n + c for n, c in ch)) // block_size for b, ctx, ch in MIXED_FULL) + 64
    sched = SchedulerConfig(max_num_batched_tokens=max(max_num_batched_tokens, max(new_axis) + max(grid["batch"])),
                            max_num_seqs=max(256, max(grid["batch"]) * 2))
    config = EngineConfig(model=model_path, dtype=dtype, device=device, block_size=block_size,
                          num_kv_blocks=2 * max(need, mixed_need if not quick else 0, 256), num_threads=threads,
                          scheduler=sched)
    started = time.perf_counter()
    engine, _, folder = build_engine(config)
    cuda = engine.runner.device.type == "cuda"
    bench = _Bench(engine, torch.cuda.synchronize if cuda else (lambda: None))
    reps = grid["repeats"]
    bench.prefill_point(min(64, new_axis[-1]), 0, 2)  # warm-up: first calls pay for allocations
    bench.decode_point(2, 32, 2)
    prefill = []
    for n in new_axis:
        prefill.append([bench.prefill_point(n, c, reps if n <= 512 else max(reps - 1, 1)) for c in grid["cached_tokens"]])
        log(f"prefill {n:5d} new tokens: " + " ".join(f"{t * 1e3:8.1f}" for t in prefill[-1]) + " ms")
    decode = []
    for b in grid["batch"]:
        decode.append([bench.decode_point(b, ctx, reps) for ctx in grid["context_per_seq"]])
        log(f"decode batch {b:3d}: " + " ".join(f"{t * 1e3:8.1f}" for t in decode[-1]) + " ms")
    mixed = [(b, ctx_got, chunks, t) for b, ctx, chunks in (MIXED_QUICK if quick else MIXED_FULL)
             for t, ctx_got in [bench.mixed_point(b, ctx, chunks, reps)]]
    first, second = new_axis[0], new_axis[1] if len(new_axis) > 1 else None
    t1 = prefill[0][0]
    overhead = t1 if second is None else max(t1 - (prefill[1][0] - t1) * first / (second - first), 0.0)
    model = engine.model
    attn = model.layers[0].self_attn
    info = {"name": folder.name, "num_layers": len(model.layers), "hidden_size": model.cfg.hidden_size,
            "num_kv_heads": attn.num_kv_heads, "head_dim": attn.head_dim, "dtype": engine.config.dtype,
            "block_size": block_size, "max_position_embeddings": model.cfg.max_position_embeddings,
            "kv_block_bytes": kv_cache_block_bytes(model, block_size, model.dtype),
            "max_num_batched_tokens": max_num_batched_tokens}
    profile = LatencyProfile(
        source="gpu_check" if cuda else "measured", machine=describe_machine(threads, str(engine.runner.device)),
        model=info, step_overhead_s=min(overhead, t1),
        prefill=Grid("new_tokens", "cached_tokens", new_axis, list(grid["cached_tokens"]), prefill),
        decode=Grid("batch", "context_per_seq", list(grid["batch"]), list(grid["context_per_seq"]), decode),
        note="baton plan profile" + (" --quick" if quick else ""),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    best = None
    for rule in RULES:
        candidate = dataclasses.replace(profile, mixed={"rule": rule, "validation": None})
        errors = _relative_errors(candidate, mixed)
        score = (statistics.median(errors), max(errors))
        log(f"mixed steps, rule {rule}: median error {score[0]:.1%}, max {score[1]:.1%}")
        if best is None or score < best[0]:
            best = (score, rule)
    (med, worst), rule = best
    held_out = [{"decode_batch": b, "context_per_seq": round(ctx, 1), "chunks": [list(c) for c in chunks],
                 "measured_s": t} for b, ctx, chunks, t in mixed]
    transfers = {}
    for name in connectors:
        if name == "shared_memory":
            transfers[name] = measure_copy(engine.runner.kv_caches, block_size, grid["blocks"], reps)
        elif name == "collective":
            transfers[name] = measure_collective(engine.runner.kv_caches, block_size, grid["blocks"], reps)
        else:
            raise ValueError(f"connector {name!r} cannot be profiled here: use shared_memory or collective")
        log(f"kv transfer {name}: {transfers[name].fixed_s * 1e3:.3f} ms + {transfers[name].per_block_s * 1e6:.1f} us/block")
    log(f"profiled in {time.perf_counter() - started:.0f} s")
    return dataclasses.replace(profile, mixed={"rule": rule, "validation": {"median_error": med, "max_error": worst,
                                                                              "steps": held_out}},
                               kv_transfer=transfers)
