"""The quantised linear layers against bf16 and fp32 ``F.linear`` over SmolLM2-135M's layer shapes,
one forward's worth (30 x qkv, o, gate_up, down + lm_head), at a few row counts.

Columns: fp32 ``F.linear`` on the plain weight (MKL packs it on every call) and fp32 through
``kernels.packed_linear`` (packed once into oneDNN's layout, x86-64), bf16 (oneDNN, packed),
int8 g32 / int4 g32 / int8 per channel with bf16 activations
(on an AVX512_BF16 build the many-row GEMM runs on bf16 dot products), and int8 g32 with fp32
activations: the fp32 GEMM, which is what bf16 activations ran on before the bf16 GEMM (they
were widened to fp32 first). Median of ``--repeat`` calls per layer shape, random weights.

    .venv/bin/python benchmarks/quant_gemm.py --rows 16,64,256 --out benchmarks/results/quant_gemm.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: see tests/conftest.py

# (N, K) and how many of each per forward
SHAPES = {"qkv": ((960, 576), 30), "o": ((576, 576), 30), "gate_up": ((3072, 576), 30),
          "down": ((576, 1536), 30), "lm_head": ((49152, 576), 1)}


def forward_ms(rows: int, repeat: int) -> dict[str, float]:
    """ms per forward's worth of linear layers, per variant."""
    from baton_serve.kernels import packed_linear
    from baton_serve.kernels import quant_linear as ql

    totals: dict[str, float] = {}
    for (n, k), count in SHAPES.values():
        w = torch.randn(n, k) * 0.05
        wb = w.bfloat16()
        packed = packed_linear.pack(wb)
        packed_f = packed_linear.pack(w)
        q8, s8 = ql.quantize_int8(w, 32)
        qc, sc = ql.quantize_int8(w, 0)
        q4, s4, m4 = ql.quantize_int4(w, 32)
        x = torch.randn(rows, k).bfloat16()
        xf = x.float()
        calls = {"fp32": (packed_linear.linear, (xf, w, None)),
                 "fp32_packed": (packed_linear.linear, (xf, w, packed_f)),
                 "bf16": (packed_linear.linear, (x, wb, packed)),
                 "int8_g32": (ql.linear_int8, (x, q8, s8)),
                 "int4_g32": (ql.linear_int4, (x, q4, s4, m4, 32)),
                 "int8_channel": (ql.linear_int8, (x, qc, sc)),
                 "int8_g32_fp32_activations": (ql.linear_int8, (xf, q8, s8))}
        for name, (fn, fn_args) in calls.items():
            fn(*fn_args)
            times = []
            for _ in range(repeat):
                t = time.perf_counter()
                fn(*fn_args)
                times.append(time.perf_counter() - t)
            totals[name] = totals.get(name, 0.0) + statistics.median(times) * count * 1000
    return totals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="16,64,256", help="comma-separated row counts (M)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from baton_serve.kernels import cpu_ops

    results = {}
    for rows in (int(r) for r in args.rows.split(",")):
        results[rows] = forward_ms(rows, args.repeat)
        print(f"M={rows}: " + "  ".join(f"{k} {v:.1f} ms" for k, v in results[rows].items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
            "machine": {"cpu": platform.processor() or platform.machine(), "kernels": cpu_ops.describe(),
                        "threads": args.threads, "torch": torch.__version__},
            "ms_per_forward": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
