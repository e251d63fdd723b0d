#!/usr/bin/env python
"""Check every Triton kernel against the torch reference on real sizes, then time it.

On a CUDA machine (about 2-4 minutes): correctness at 64 sequences x 4k context, 32 query /
8 kv heads, head dim 128, bf16, block size 16 (plus a long-context split-K case and a chunked
prefill); then median CUDA-event timings over rotated input sets, decode bandwidth as a fraction
of a measured device-to-device copy, and prefill TFLOP/s next to torch SDPA (flash) on the same
non-paged shapes. Writes JSON to ``--out``; exits 1 if any check fails.

Then the whole engine on the device (``benchmarks/engine_check.py``): greedy parity with a plain
``transformers`` loop on the same device in fp32, and offline output tok/s for SmolLM2 and for a
random-weight Llama of ~1B shape in bf16; with two or more GPUs, the same Llama at TP=2 against
TP=1 over NCCL (``benchmarks/tp_check.py``), skipped with the reason otherwise.

Without CUDA it prints that it was skipped and exits 0. ``--interpret-smoke`` runs the kernel code
on tiny CPU shapes under ``TRITON_INTERPRET=1``, and ``--engine-smoke`` the engine stage on the CPU
with small shapes, so the script itself stays tested.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 240.0  # stop timing (not checking) past this, to stay under 5 minutes


@dataclass(frozen=True)
class Sizes:
    num_seqs: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    long_seqs: int  # few long sequences: the split-K regime
    long_context: int
    prefill_seqs: int
    prefill_len: int  # whole prompts, compared with SDPA
    chunk_context: int  # chunked prefill: context already cached before the chunk
    chunk_len: int
    tokens: int  # rows for the norm / rotary / activation / cache-write ops
    hidden: int
    intermediate: int
    sets: int  # distinct input sets rotated through while timing
    warmup: int
    iters: int
    ref_iters: int


REAL = Sizes(64, 4096, 32, 8, 128, 16, 4, 32768, 8, 2048, 3584, 512, 8192, 4096, 14336, 4, 10, 100, 10)
SMOKE = Sizes(3, 50, 4, 2, 32, 16, 1, 1100, 2, 20, 30, 9, 40, 64, 48, 2, 1, 2, 1)


def _paged(torch: Any, s: Sizes, seq_lens: list[int], q_lens: list[int], dev: Any) -> dict[str, Any]:
    """Caches holding ``s.sets`` disjoint batches; set ``j`` uses its own blocks and queries."""
    per_seq = [math.ceil(n / s.block_size) for n in seq_lens]
    per_set = sum(per_seq)
    shape = (per_set * s.sets, s.block_size, s.num_kv_heads, s.head_dim)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device=dev)
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device=dev)
    tables, queries = [], []
    for j in range(s.sets):
        ids = torch.randperm(per_set, device=dev) + j * per_set
        table = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32, device=dev)
        used = 0
        for i, nb in enumerate(per_seq):
            table[i, :nb] = ids[used : used + nb].int()
            used += nb
        tables.append(table)
        queries.append(torch.randn(sum(q_lens), s.num_heads, s.head_dim, dtype=torch.bfloat16, device=dev))
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return dict(k=k_cache, v=v_cache, tables=tables, queries=queries,
                lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
                qsl=torch.tensor(starts, dtype=torch.int32, device=dev), scale=s.head_dim**-0.5)


def _compare(torch: Any, got: Any, want: Any, atol: float = 1e-2, rtol: float = 1e-2) -> dict[str, Any]:
    if isinstance(got, tuple):
        parts = [_compare(torch, g, w, atol, rtol) for g, w in zip(got, want)]
        return {"ok": all(p["ok"] for p in parts), "max_abs_err": max(p["max_abs_err"] for p in parts)}
    g, w = got.double(), want.double()
    err = (g - w).abs()
    ok = bool((err <= atol + rtol * w.abs()).all()) and not bool(g.isnan().any())
    return {"ok": ok, "max_abs_err": float(err.max()) if err.numel() else 0.0}


def _time_ms(torch: Any, fn: Callable[[int], Any], iters: int, warmup: int, sets: int, cuda: bool) -> float:
    """Median milliseconds of ``fn(set_index)``, rotating sets so no call reuses a warm cache."""
    for i in range(warmup):
        fn(i % sets)
    times = []
    if cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        torch.cuda.synchronize()
        for i, (start, end) in enumerate(events):
            start.record()
            fn(i % sets)
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for i in range(iters):
            t0 = time.perf_counter()
            fn(i % sets)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


class Run:
    """Collects checks and timings for one invocation (one instance per run, no globals)."""

    def __init__(self, torch: Any, ref: Any, tri: Any, s: Sizes, dev: Any, timing: bool) -> None:
        self.torch, self.ref, self.tri, self.s, self.dev, self.timing = torch, ref, tri, s, dev, timing
        self.checks: dict[str, dict[str, Any]] = {}
        self.timings: dict[str, dict[str, Any]] = {}
        self.t0 = time.monotonic()

    def check(self, name: str, got: Any, want: Any) -> None:
        self.checks[name] = _compare(self.torch, got, want)
        print(f"check {name:<28} {'ok' if self.checks[name]['ok'] else 'FAIL'} "
              f"max_abs_err={self.checks[name]['max_abs_err']:.3g}", flush=True)

    def time(self, name: str, triton_fn: Callable[[int], Any], ref_fn: Callable[[int], Any] | None,
             nbytes: float = 0.0, flops: float = 0.0) -> dict[str, Any] | None:
        if not self.timing:
            return None
        if time.monotonic() - self.t0 > BUDGET_S:
            self.timings[name] = {"skipped": "time budget"}
            return None
        s = self.s
        cuda = self.dev.type == "cuda"
        row: dict[str, Any] = {"triton_ms": _time_ms(self.torch, triton_fn, s.iters, s.warmup, s.sets, cuda)}
        if ref_fn is not None:
            row["reference_ms"] = _time_ms(self.torch, ref_fn, s.ref_iters, 1, s.sets, cuda)
        if nbytes:
            row["gb_per_s"] = nbytes / row["triton_ms"] / 1e6
        if flops:
            row["tflop_per_s"] = flops / row["triton_ms"] / 1e9
        self.timings[name] = row
        print(f"time  {name:<28} " + " ".join(f"{k}={v:.4g}" for k, v in row.items()), flush=True)
        return row


def _decode(run: Run, name: str, seqs: int, context: int, splits: Sequence[int | None]) -> None:
    torch, s = run.torch, run.s
    lens = [max(1, context - (i % 16) * 7) for i in range(seqs)]  # ragged tails, ~context long
    p = _paged(torch, s, lens, [1] * seqs, run.dev)
    args = lambda j: (p["queries"][j], p["k"], p["v"], p["tables"][j], p["lens"], p["scale"])  # noqa: E731
    want = run.ref.paged_decode_attention(*args(0), None, max(lens))
    for n in splits:
        run.check(f"{name}_splits{n}", run.tri.paged_decode_attention(*args(0), None, max(lens), n), want)
    # The deterministic mode's fixed split size: right, and a sequence's output alone is bitwise
    # its output inside the batch (the automatic split count follows the batch).
    fixed = run.tri.paged_decode_attention(*args(0), None, max(lens), None, 512)
    run.check(f"{name}_split_keys512", fixed, want)
    q, k, v, tables, seq_lens, scale = args(0)
    alone = run.tri.paged_decode_attention(q[:1], k, v, tables[:1], seq_lens[:1], scale, None, None, None, 512)
    key = f"{name}_split_keys512_batch_invariant"
    run.checks[key] = _compare(torch, fixed[:1], alone, atol=0.0, rtol=0.0)
    print(f"check {key:<28} {'ok' if run.checks[key]['ok'] else 'FAIL'} bitwise", flush=True)
    window = max(1, context // 3)
    run.check(f"{name}_window", run.tri.paged_decode_attention(*args(0), window, max(lens)),
              run.ref.paged_decode_attention(*args(0), window, max(lens)))
    kv_bytes = sum(lens) * s.num_kv_heads * s.head_dim * 2 * 2  # K and V, bf16
    for n in splits:
        ours = lambda j, n=n: run.tri.paged_decode_attention(*args(j), None, max(lens), n)  # noqa: E731
        theirs = lambda j: run.ref.paged_decode_attention(*args(j), None, max(lens))  # noqa: E731
        run.time(f"{name}_splits{n}", ours, theirs if n is None else None, nbytes=kv_bytes)


def _prefill(run: Run) -> None:
    torch, s, F = run.torch, run.s, run.torch.nn.functional
    for name, ctx, q_len, seqs in (("prefill", 0, s.prefill_len, s.prefill_seqs),
                                   ("prefill_chunked", s.chunk_context, s.chunk_len, s.prefill_seqs)):
        p = _paged(torch, s, [ctx + q_len] * seqs, [q_len] * seqs, run.dev)
        args = lambda j, p=p: (  # noqa: E731
            p["queries"][j], p["k"], p["v"], p["tables"][j], p["lens"], p["qsl"], p["scale"])
        run.check(name, run.tri.paged_prefill_attention(*args(0)), run.ref.paged_prefill_attention(*args(0)))
        run.check(f"{name}_window", run.tri.paged_prefill_attention(*args(0), q_len // 2),
                  run.ref.paged_prefill_attention(*args(0), q_len // 2))
        visible = sum(ctx + i + 1 for i in range(q_len)) * seqs
        flops = 4.0 * visible * s.num_heads * s.head_dim
        run.time(name, lambda j, args=args: run.tri.paged_prefill_attention(*args(j)),
                 lambda j, args=args: run.ref.paged_prefill_attention(*args(j)), flops=flops)
    # torch SDPA on the same, non-paged shapes (whole prompts; K/V given per query head, which is
    # the same FLOP count as GQA and keeps SDPA on its plain flash path).
    shape = (s.prefill_seqs, s.num_heads, s.prefill_len, s.head_dim)
    qkv = [[torch.randn(shape, dtype=torch.bfloat16, device=run.dev) for _ in range(3)]
           for _ in range(s.sets)]
    backend = "flash"
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            F.scaled_dot_product_attention(*qkv[0], is_causal=True)
    except (RuntimeError, ImportError):
        backend = "default"  # flash unavailable here (e.g. CPU smoke): time whatever torch picks

    def sdpa(j: int) -> Any:
        if backend == "flash":
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(*qkv[j], is_causal=True)
        return F.scaled_dot_product_attention(*qkv[j], is_causal=True)

    visible = s.prefill_len * (s.prefill_len + 1) // 2 * s.prefill_seqs
    row = run.time(f"sdpa_{backend}", sdpa, None, flops=4.0 * visible * s.num_heads * s.head_dim)
    if row is not None and "tflop_per_s" in run.timings.get("prefill", {}):
        run.timings["prefill"]["vs_sdpa"] = run.timings["prefill"]["tflop_per_s"] / row["tflop_per_s"]


def _cache_and_elementwise(run: Run) -> None:
    torch, s, ref, tri, dev = run.torch, run.s, run.ref, run.tri, run.dev
    bf16, T, H, Hk, D = torch.bfloat16, s.tokens, s.num_heads, s.num_kv_heads, s.head_dim
    nb = math.ceil(T / s.block_size)
    caches = [torch.randn(2, nb * 2, s.block_size, Hk, D, dtype=bf16, device=dev) for _ in range(s.sets)]
    kv = [torch.randn(2, T, Hk, D, dtype=bf16, device=dev) for _ in range(s.sets)]
    slots = [torch.randperm(nb * 2 * s.block_size, device=dev)[:T] for _ in range(s.sets)]
    slots[0][::5] = -1
    ids = [torch.randperm(nb * 2, device=dev)[:nb] for _ in range(s.sets)]
    a, b = caches[0].clone(), caches[0].clone()
    ref.write_kv_cache(kv[0][0], kv[0][1], a[0], a[1], slots[0])
    tri.write_kv_cache(kv[0][0], kv[0][1], b[0], b[1], slots[0])
    run.check("write_kv_cache", b, a)
    run.check("gather_kv_blocks", tri.gather_kv_blocks(caches[0][0], ids[0]),
              ref.gather_kv_blocks(caches[0][0], ids[0]))
    buf = torch.randn(nb, s.block_size, Hk, D, dtype=bf16, device=dev)
    a, b = caches[0][0].clone(), caches[0][0].clone()
    ref.scatter_kv_blocks(a, ids[0], buf)
    tri.scatter_kv_blocks(b, ids[0], buf)
    run.check("scatter_kv_blocks", b, a)
    src, cow = torch.arange(nb // 2, device=dev), torch.arange(nb // 2, nb // 2 * 2, device=dev)
    a, b = caches[0][0].clone(), caches[0][0].clone()
    ref.copy_blocks(a, src, cow)
    tri.copy_blocks(b, src, cow)
    run.check("copy_blocks", b, a)
    x = [torch.randn(T, s.hidden, dtype=bf16, device=dev) for _ in range(s.sets)]
    w = torch.randn(s.hidden, dtype=bf16, device=dev)
    run.check("rms_norm", tri.rms_norm(x[0], w, 1e-5), ref.rms_norm(x[0], w, 1e-5))
    out, res = tri.fused_add_rms_norm(x[0], x[1], w, 1e-5)
    run.check("fused_add_rms_norm.residual", res, ref.fused_add_rms_norm(x[0], x[1], w, 1e-5)[1])
    # Judge the norm on our own rounded residual so two bf16 roundings don't stack up.
    run.check("fused_add_rms_norm.out", out, ref.rms_norm(res, w, 1e-5))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    table = ref.build_cos_sin_cache(D, 4 * T, inv_freq).to(dev)
    pos = [torch.randint(0, 4 * T, (T,), device=dev) for _ in range(s.sets)]
    qk = [(torch.randn(T, H, D, dtype=bf16, device=dev), torch.randn(T, Hk, D, dtype=bf16, device=dev))
          for _ in range(s.sets)]
    for neox in (True, False):
        run.check(f"rotary_embedding.{'neox' if neox else 'gptj'}",
                  tri.rotary_embedding(pos[0], *qk[0], table, neox),
                  ref.rotary_embedding(pos[0], *qk[0], table, neox))
    gate_up = [torch.randn(T, 2 * s.intermediate, dtype=bf16, device=dev) for _ in range(s.sets)]
    run.check("silu_and_mul", tri.silu_and_mul(gate_up[0]), ref.silu_and_mul(gate_up[0]))

    e, kvb = 2, T * Hk * D * 2 * 2
    block_bytes = nb * s.block_size * Hk * D * e
    write = lambda op, j: op(kv[j][0], kv[j][1], caches[j][0], caches[j][1], slots[j])  # noqa: E731
    run.time("write_kv_cache", lambda j: write(tri.write_kv_cache, j), lambda j: write(ref.write_kv_cache, j),
             nbytes=2 * kvb)
    run.time("gather_kv_blocks", lambda j: tri.gather_kv_blocks(caches[j][0], ids[j]),
             lambda j: ref.gather_kv_blocks(caches[j][0], ids[j]), nbytes=2 * block_bytes)
    run.time("scatter_kv_blocks", lambda j: tri.scatter_kv_blocks(caches[j][0], ids[j], buf),
             lambda j: ref.scatter_kv_blocks(caches[j][0], ids[j], buf), nbytes=2 * block_bytes)
    run.time("copy_blocks", lambda j: tri.copy_blocks(caches[j][1], src, cow),
             lambda j: ref.copy_blocks(caches[j][1], src, cow),
             nbytes=2 * (nb // 2) * s.block_size * Hk * D * e)
    run.time("rms_norm", lambda j: tri.rms_norm(x[j], w, 1e-5), lambda j: ref.rms_norm(x[j], w, 1e-5),
             nbytes=2 * T * s.hidden * e)
    fused = lambda op, j: op(x[j], x[(j + 1) % s.sets], w, 1e-5)  # noqa: E731
    run.time("fused_add_rms_norm", lambda j: fused(tri.fused_add_rms_norm, j),
             lambda j: fused(ref.fused_add_rms_norm, j), nbytes=4 * T * s.hidden * e)
    run.time("rotary_embedding", lambda j: tri.rotary_embedding(pos[j], *qk[j], table, True),
             lambda j: ref.rotary_embedding(pos[j], *qk[j], table, True), nbytes=2 * T * (H + Hk) * D * e)
    run.time("silu_and_mul", lambda j: tri.silu_and_mul(gate_up[j]),
             lambda j: ref.silu_and_mul(gate_up[j]), nbytes=3 * T * s.intermediate * e)


def _copy_bandwidth(run: Run) -> float:
    """Device-to-device copy GB/s (bytes read + written), the roofline for memory-bound ops."""
    torch = run.torch
    n = (1 << 28) if run.dev.type == "cuda" else (1 << 16)  # 512 MiB of bf16 on the GPU
    bufs = [torch.empty(n, dtype=torch.bfloat16, device=run.dev) for _ in range(2)]
    row = run.time("device_copy", lambda j: bufs[1].copy_(bufs[0]), None, nbytes=2 * n * 2)
    return row["gb_per_s"] if row else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_check.json"),
                        help="where to write the JSON result")
    parser.add_argument("--interpret-smoke", action="store_true",
                        help="tiny CPU shapes under TRITON_INTERPRET=1 (exercises this script)")
    parser.add_argument("--checks-only", action="store_true", help="correctness checks, no timing")
    parser.add_argument("--engine-smoke", action="store_true",
                        help="only the engine stage, on the CPU with small shapes (exercises it)")
    parser.add_argument("--skip-engine", action="store_true", help="kernels only")
    parser.add_argument("--work-dir", default=None, help="where the random-weight 1B model is written "
                        "(default: the Baton cache)")
    parser.add_argument("--smol-shape-from", default=None, metavar="DIR",
                        help="a folder with the default model's config and tokenizer but not its weights: "
                        "the engine stage fills that shape with random weights (a device machine the "
                        "94 MB GGUF cannot travel to)")
    parser.add_argument("--profile", default=None, metavar="OUT",
                        help="also write baton plan sim's latency profile of the random-weight 1B model "
                        "on this GPU (source gpu_check)")
    args = parser.parse_args(argv)
    if args.engine_smoke:
        return _write(Path(args.out), _engine_only(args))
    if args.interpret_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit decorator runs
    import torch

    if not args.interpret_smoke and not torch.cuda.is_available():
        print("gpu_check: skipped (no CUDA device; use --interpret-smoke to exercise the script on CPU)")
        return 0
    try:
        import triton
    except ImportError as exc:
        print(f"gpu_check: skipped (triton cannot be imported: {exc})")
        return 0
    sys.path.append(str(ROOT))  # after site-packages: see tests/conftest.py
    from baton_serve.kernels import reference, triton_ops

    torch.manual_seed(0)
    s, dev = (SMOKE, torch.device("cpu")) if args.interpret_smoke else (REAL, torch.device("cuda"))
    run = Run(torch, reference, triton_ops, s, dev, timing=not args.checks_only)
    copy_gbps = _copy_bandwidth(run)
    _decode(run, "decode", s.num_seqs, s.context, [None, 1, 4])  # None: automatic split choice
    _decode(run, "decode_long", s.long_seqs, s.long_context, [None, 1, 4])
    _prefill(run)
    _cache_and_elementwise(run)
    for row in run.timings.values():
        if "gb_per_s" in row and math.isfinite(copy_gbps):
            row["fraction_of_copy_bw"] = row["gb_per_s"] / copy_gbps
    engine = None if args.skip_engine or args.interpret_smoke else _engine_stage(torch.device("cuda"), args)
    result = {
        "mode": "interpret-smoke" if args.interpret_smoke else "cuda",
        "timed": not args.checks_only,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__, "triton": triton.__version__, "sizes": asdict(s),
        "copy_gb_per_s": copy_gbps if math.isfinite(copy_gbps) else None,
        "checks": run.checks, "timings": run.timings,
        "engine": engine,
        "all_ok": all(c["ok"] for c in run.checks.values()) and (engine is None or _engine_ok(engine)),
        "elapsed_s": time.monotonic() - run.t0,
    }
    if args.profile and engine is not None:
        result["profile"] = _latency_profile(args, Path(args.profile))
    return _write(Path(args.out), result)


def _latency_profile(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """``baton plan profile --device cuda`` of the engine stage's 1B model: step grids and the
    device-to-device KV copy (``collective`` needs a second GPU; NCCL does not pair a GPU with itself)."""
    from baton_serve.cluster.sim.profiler import measure_profile
    from baton_serve.workers.checkpoint.default_model import cache_root

    work = Path(args.work_dir) if args.work_dir else cache_root() / "models"
    try:
        profile = measure_profile(str(work / "random-llama-1b"), "bfloat16", 1, 16, 2048, False, "cuda",
                                  ["shared_memory"], log=lambda msg: print(f"gpu_check: profile: {msg}", flush=True))
    except Exception as exc:  # the kernel checks stand without it
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    profile.dump(out)
    return {"ok": True, "path": str(out), "step_overhead_s": profile.step_overhead_s,
            "mixed": profile.mixed["validation"]}


def _engine_stage(device: Any, args: argparse.Namespace, smoke: bool = False) -> dict[str, Any]:
    """Parity (fp32) and offline throughput (bf16) of the whole engine on ``device``."""
    import torch

    sys.path.append(str(ROOT))  # after site-packages: see tests/conftest.py
    from baton_serve.workers.checkpoint.default_model import cache_root, default_model_path

    from benchmarks import engine_check, tp_check

    t0 = time.monotonic()
    work = Path(args.work_dir) if args.work_dir else cache_root() / "models"
    if args.smol_shape_from:  # same shape and tokenizer, random weights: parity holds on any weights
        smol = engine_check.write_random_llama(work / "random-smollm2", Path(args.smol_shape_from), {},
                                               torch.float32)
    else:
        smol = Path(default_model_path())
    cache = {"kv_cache_memory_gib": 0.25} if device.type == "cpu" else {"gpu_memory_utilization": 0.6}
    parity = engine_check.greedy_parity(smol, device, new_tokens=6 if smoke else 32, **cache)
    big_shape = ({"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2} if smoke else engine_check.LLAMA_1B)
    big = engine_check.write_random_llama(work / ("random-llama-smoke" if smoke else "random-llama-1b"), smol,
                                          big_shape, torch.bfloat16)
    # (requests, prompt tokens, output tokens) per model: the 1B one with a quarter of the requests
    sizes = [(4, 16, 8), (4, 32, 8)] if smoke else [(256, 256, 128), (64, 512, 128)]
    runs = [engine_check.offline_throughput(folder, device, "bfloat16", *size, **cache)
            for folder, size in zip((smol, big), sizes)]
    # TP=2 on the model whose KV heads divide by 2 (SmolLM2's 3 do not)
    tp = tp_check.tp_stage(big, device, smoke, **cache)
    return {"parity": parity, "throughput": runs, "tensor_parallel": tp,
            "smollm2_weights": "random" if args.smol_shape_from else "real", "elapsed_s": time.monotonic() - t0}


def _engine_only(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    t0 = time.monotonic()
    engine = _engine_stage(torch.device("cpu"), args, smoke=True)
    return {"mode": "engine-smoke", "device": "cpu", "torch": torch.__version__, "engine": engine,
            "all_ok": _engine_ok(engine), "elapsed_s": time.monotonic() - t0}


def _engine_ok(engine: dict[str, Any]) -> bool:
    tp = engine.get("tensor_parallel") or {}
    return bool(engine["parity"]["ok"]) and ("skipped" in tp or bool(tp.get("parity", {}).get("ok")))


def _write(out: Path, result: dict[str, Any]) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"gpu_check: {'all checks passed' if result['all_ok'] else 'CHECKS FAILED'}; "
          f"{result['elapsed_s']:.0f}s; wrote {out}")
    return 0 if result["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
