"""Tensor parallelism on this machine: offline output tok/s at TP=2 (``--threads`` / 2 per rank)
against TP=1 (``--threads``), side by side in one run, and what one all-reduce of a step's
activations costs over gloo, so the ratio can be read against the roofline.

    python benchmarks/tensor_parallel.py --out benchmarks/results/tensor_parallel.json

The model has random weights in SmolLM2-135M's shape with 8 query / 4 KV heads (the real one
divides only by 1 and 3), and the default model's tokenizer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.engine_check import write_random_llama  # noqa: E402
from benchmarks.machine import cpu_name  # noqa: E402

SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 8,
         "num_key_value_heads": 4}


def collective_seconds(op: str, x: torch.Tensor, reps: int) -> float:
    """Median seconds of one ``TPGroup`` collective (``all_reduce``, ``all_gather``) of ``x``
    between two ranks (threads here), after 3 warm-up calls."""
    from baton_serve.workers.parallel.group import TPGroup, TPRendezvous, listen_store

    sock, store = listen_store("127.0.0.1", 2, 30.0)
    rdv = TPRendezvous("127.0.0.1", sock.getsockname()[1], 0, 2, f"bench-{op}", "x", "gloo", 30.0)
    groups: dict[int, TPGroup] = {}
    times: list[float] = []

    def rank(r: int) -> None:
        groups[r] = TPGroup(rdv, r, store=store if r == 0 else None)
        mine = x.clone()
        for i in range(reps + 3):
            t = time.perf_counter()
            getattr(groups[r], op)(mine)
            if r == 0 and i >= 3:
                times.append(time.perf_counter() - t)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g in groups.values():
        g.close()
    sock.close()
    return statistics.median(times)


def all_reduce_seconds(rows: int, hidden: int, dtype: torch.dtype, reps: int) -> float:
    """Median seconds of one all-reduce of ``[rows, hidden]`` between two ranks."""
    return collective_seconds("all_reduce", torch.ones(rows, hidden, dtype=dtype), reps)


def lm_head_seconds(rows: int, hidden: int, vocab: int, dtype: torch.dtype, reps: int) -> dict[str, float]:
    """Rank 0's LM head at 1 thread per rank: replicated (rank 0 computes every logit, what the
    engine does) against vocab-parallel (each rank half the vocabulary, then an all-gather of the
    fp32 logits over gloo between two ranks)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(vocab, hidden, generator=g).to(dtype)
    x = torch.randn(rows, hidden, generator=g).to(dtype)

    def matmul_seconds(weight: torch.Tensor) -> float:
        times = []
        for i in range(reps + 3):
            t = time.perf_counter()
            (x @ weight.T).float()
            if i >= 3:
                times.append(time.perf_counter() - t)
        return statistics.median(times)

    full, half = matmul_seconds(w), matmul_seconds(w[: vocab // 2])
    torch.set_num_threads(threads)
    gather = collective_seconds("all_gather", torch.ones(rows, vocab // 2), reps)
    return {"replicated": full, "vocab_parallel": half + gather, "half_matmul": half, "all_gather": gather}


def decode_plan(seqs: int, context: int, block_size: int = 16) -> object:
    """A decode step's plan: ``seqs`` sequences of ``context`` tokens (what rank 0 sends per step)."""
    from baton_serve.workers.engine.step_plan import StepPlan

    blocks = -(-context // block_size)
    return StepPlan(input_ids=[7] * seqs, positions=[context - 1] * seqs,
                    slots=[i * blocks * block_size + context - 1 for i in range(seqs)], num_decode_tokens=seqs,
                    decode_tables=[list(range(i * blocks, (i + 1) * blocks)) for i in range(seqs)],
                    decode_lens=[context] * seqs, sample_rows=list(range(seqs)))


def plan_delivery_seconds(plan: object, reps: int) -> dict[str, float]:
    """Median seconds from rank 0 encoding a plan to rank 1 holding it decoded: down the plan
    channel (what the engine does) and as two gloo broadcasts (length, then bytes)."""
    from baton_serve.workers.engine.step_plan import StepPlan
    from baton_serve.workers.parallel.group import TPGroup, TPRendezvous, listen_store
    from baton_serve.workers.parallel.plan_channel import PlanReceiver, PlanSender

    sock, store = listen_store("127.0.0.1", 2, 30.0)
    sender = PlanSender("127.0.0.1", 2, "secret")
    rdv = TPRendezvous("127.0.0.1", sock.getsockname()[1], sender.port, 2, "plans", "secret", "gloo", 30.0)
    got = threading.Event()
    groups: dict[int, TPGroup] = {}
    out: dict[str, list[float]] = {"socket": [], "broadcast": []}

    def rank1() -> None:
        receiver = PlanReceiver("127.0.0.1", sender.port, 1, "secret", 30.0)
        groups[1] = TPGroup(rdv, 1)
        for _ in range(reps):
            StepPlan.decode(receiver.recv())
            got.set()
        for _ in range(reps):
            n = groups[1].broadcast(torch.zeros(1, dtype=torch.int64))
            buf = groups[1].broadcast(torch.empty(int(n.item()), dtype=torch.uint8))
            StepPlan.decode(buf.numpy().tobytes())
            got.set()
        receiver.close()

    t = threading.Thread(target=rank1)
    t.start()
    groups[0] = TPGroup(rdv, 0, store=store)
    sender.accept(30.0)
    for _ in range(reps):
        got.clear()
        start = time.perf_counter()
        sender.send(plan.encode())
        got.wait()
        out["socket"].append(time.perf_counter() - start)
    for _ in range(reps):
        got.clear()
        start = time.perf_counter()
        data = plan.encode()
        groups[0].broadcast(torch.tensor([len(data)], dtype=torch.int64))
        groups[0].broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        got.wait()
        out["broadcast"].append(time.perf_counter() - start)
    t.join()
    sender.close()
    for g in groups.values():
        g.close()
    sock.close()
    return {k: statistics.median(v) for k, v in out.items()} | {"plan_bytes": len(plan.encode())}


def offline(folder: Path, dtype: str, requests: int, input_len: int, output_len: int, tp: int,
            threads: int) -> dict[str, object]:
    """Output tok/s of one ``LLM.generate`` of every prompt at once, and rank 0's step time split
    into all-reduce and the rest."""
    from baton_serve.workers.llm import LLM
    from baton_serve.workers.sampling.params import SamplingParams

    llm = LLM(model=str(folder), dtype=dtype, num_threads=threads, tensor_parallel_size=tp, kv_cache_memory_gib=1.0)
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, llm.engine.vocab_size, (input_len,), generator=g).tolist() for _ in range(requests)]
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
        group = llm.engine.tensor_parallel.group if llm.engine.tensor_parallel else None
        busy0, reduce0 = llm.engine.busy_seconds, group.all_reduce_seconds if group else 0.0
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
        elapsed = time.perf_counter() - start
        busy = llm.engine.busy_seconds - busy0
        reduce = (group.all_reduce_seconds - reduce0) if group else 0.0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"tensor_parallel_size": tp, "threads_per_rank": threads, "dtype": llm.config.dtype,
                "output_tokens": tokens, "seconds": elapsed, "output_tok_per_s": tokens / elapsed,
                "step_seconds": busy, "all_reduce_seconds": reduce, "compute_seconds": busy - reduce}
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from baton_serve.workers.checkpoint.default_model import default_model_path

    folder = write_random_llama(Path(tempfile.gettempdir()) / "baton-bench-tp-llama", default_model_path(), SHAPE,
                                torch.float32)
    runs = {}
    for name, tp, threads in (("tp1", 1, args.threads), ("tp2", 2, max(1, args.threads // 2))):
        runs[name] = offline(folder, args.dtype, args.requests, args.input_len, args.output_len, tp, threads)
        print(name, f"{runs[name]['output_tok_per_s']:.1f} tok/s", flush=True)
    dtype = torch.bfloat16 if runs["tp1"]["dtype"] == "bfloat16" else torch.float32
    reduce = {str(rows): all_reduce_seconds(rows, SHAPE["hidden_size"], dtype, 200) for rows in (1, 16, 64, 512)}
    plans = {f"{seqs}x{ctx}": plan_delivery_seconds(decode_plan(seqs, ctx), 200)
             for seqs, ctx in ((1, 256), (16, 192), (64, 1024))}
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    lm_head = {str(rows): lm_head_seconds(rows, SHAPE["hidden_size"], vocab, dtype, 50) for rows in (1, 16, 64)}
    per_step_decode = 2 * SHAPE["num_hidden_layers"] * reduce[str(args.requests)] if str(args.requests) in reduce \
        else None
    result = {"cpu": cpu_name(), "shape": SHAPE, "runs": runs,
              "ratio_tp2_over_tp1": runs["tp2"]["output_tok_per_s"] / runs["tp1"]["output_tok_per_s"],
              "all_reduce_seconds_by_rows": reduce, "all_reduces_per_step": 2 * SHAPE["num_hidden_layers"],
              "decode_step_all_reduce_seconds": per_step_decode, "plan_delivery_seconds": plans,
              "lm_head_seconds_by_rows": lm_head,
              "command": "python benchmarks/tensor_parallel.py " + " ".join(sys.argv[1:])}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
