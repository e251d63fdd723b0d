"""KV resharding cost: the time one request's KV takes from a prefill worker of tp=a to a decode
worker of tp=b (Ray workers on this machine, the collective connector, gloo over loopback), for
tp 1->1, 1->2, 2->1 and 2->2 at 1k and 4k prompt tokens.

    python benchmarks/kv_reshard.py --out benchmarks/results/kv_reshard.json

The model has random weights with Qwen2.5-0.5B's KV shape (24 layers, 2 KV heads of 64) and a
small hidden size, so the prefill stays short and the KV is what a 0.5B model ships. Reported
per request: the prefill side's whole shipment (reserve, checksums, every route, the decode
side's admission) and the decode side's receive, with the bytes moved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.engine_check import write_random_llama  # noqa: E402
from benchmarks.machine import cpu_name  # noqa: E402

SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 24, "num_attention_heads": 2,
         "num_key_value_heads": 2}
LAYOUTS = ((1, 1), (1, 2), (2, 1), (2, 2))


def _worker(ray, model: Path, wid: str, role: str, tp: int, dtype: str, blocks: int):
    from baton_serve.workers.actor.worker import Worker

    engine = {"model": str(model), "dtype": dtype, "num_kv_blocks": blocks, "tensor_parallel_size": tp,
              "max_num_batched_tokens": 4096}
    return ray.remote(Worker).options(num_cpus=0, max_concurrency=32).remote(wid, role, engine, 1, "collective", 60.0)


def _one(ray, prefill, decode, rid: str, prompt: list[int]) -> None:
    from baton_serve.workers.actor.messages import decode_deltas, params_to_dict
    from baton_serve.workers.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    ray.get(prefill.add_request.remote(rid, prompt, params_to_dict(params),
                                       decode_worker="decode-0", front_id="b"))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for d in decode_deltas(ray.get(decode.poll.remote("b", 0.2))):
            if d.request_id == rid and d.finish_reason:
                if d.finish_reason != "length":
                    raise RuntimeError(f"{rid} ended with {d.finish_reason}: {d.stop_reason}")
                return
        ray.get(prefill.poll.remote("b", 0.0))
    raise RuntimeError(f"{rid} did not finish")


def measure(ray, model: Path, src_tp: int, dst_tp: int, lengths: list[int], reps: int, dtype: str) -> dict:
    blocks = 2 * max(lengths) // 16 + 64
    prefill = _worker(ray, model, "prefill-0", "prefill", src_tp, dtype, blocks)
    decode = _worker(ray, model, "decode-0", "decode", dst_tp, dtype, blocks)
    out: dict[str, dict] = {}
    try:
        ray.get([prefill.info.remote(), decode.info.remote()])
        ray.get([prefill.set_peers.remote({"decode-0": decode}), decode.set_peers.remote({"prefill-0": prefill})])
        g = torch.Generator().manual_seed(src_tp * 10 + dst_tp)
        _one(ray, prefill, decode, "warm", torch.randint(100, 40000, (64,), generator=g).tolist())  # pairs joined
        for n in lengths:
            ship, recv, nbytes = [], [], 0
            for i in range(reps):
                p0 = ray.get(prefill.stats.remote())["extra"]["kv_transfer"]
                d0 = ray.get(decode.stats.remote())["extra"]["kv_transfer"]
                _one(ray, prefill, decode, f"r{n}-{i}", torch.randint(100, 40000, (n,), generator=g).tolist())
                p1 = ray.get(prefill.stats.remote())["extra"]["kv_transfer"]
                d1 = ray.get(decode.stats.remote())["extra"]["kv_transfer"]
                ship.append((p1["ship_seconds"] - p0["ship_seconds"]) / max(1, p1["shipments"] - p0["shipments"]))
                recv.append(d1["seconds"] - d0["seconds"])
                nbytes = p1["bytes"] - p0["bytes"]
            out[str(n)] = {"ship_seconds_median": statistics.median(ship), "receive_seconds_median": statistics.median(recv),
                           "bytes": nbytes, "ship_seconds": ship}
            print(f"tp {src_tp}->{dst_tp} {n} tokens: ship {1e3 * out[str(n)]['ship_seconds_median']:.1f} ms, "
                  f"receive {1e3 * out[str(n)]['receive_seconds_median']:.1f} ms, {nbytes / 1e6:.1f} MB", flush=True)
    finally:
        for w in (prefill, decode):
            ray.get(w.shutdown.remote())
            ray.kill(w)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import ray
    from baton_serve.workers.checkpoint.default_model import default_model_path

    folder = write_random_llama(Path(tempfile.gettempdir()) / "baton-bench-reshard", default_model_path(), SHAPE,
                                torch.float32)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        layouts = {f"{a}->{b}": measure(ray, folder, a, b, args.lengths, args.reps, args.dtype) for a, b in LAYOUTS}
    finally:
        ray.shutdown()
    result = {"cpu": cpu_name(), "shape": SHAPE, "dtype": args.dtype, "transport": "collective (gloo, loopback)",
              "layouts": layouts, "command": "python benchmarks/kv_reshard.py " + " ".join(sys.argv[1:])}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
