"""Offline engine throughput on the default model, three ways in one process and one run.

(a) Hugging Face ``generate`` with static batching, (b) a raw forward loop of Baton's model over
the paged cache (no scheduler, no sampler: the ceiling for the engine), (c) Baton's engine with
continuous batching through ``LLM.generate``. Same requests, same dtype, greedy, ``ignore_eos``.
Also times the scheduler + block manager per tick at 256 running sequences with no model.

    .venv/bin/python benchmarks/engine_throughput.py --num-requests 64 --out benchmarks/results/engine_throughput.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: see tests/conftest.py

from baton_serve.workers import LLM, SamplingParams  # noqa: E402
from baton_serve.workers.blocks.manager import BlockManager  # noqa: E402
from baton_serve.workers.engine.config import SchedulerConfig  # noqa: E402
from baton_serve.workers.engine.request import Request  # noqa: E402
from baton_serve.workers.engine.scheduler import Scheduler  # noqa: E402
from baton_serve.workers.model.attention import AttentionMetadata  # noqa: E402


def make_workload(n: int, seed: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab - 100) for _ in range(rng.randint(*prompt_range))],
             rng.randint(*output_range)) for _ in range(n)]


def run_hf(folder: Path, dtype: torch.dtype, work: list[tuple[list[int], int]], batch: int) -> dict:
    """Static batching: each batch runs until its longest request is done (left padding)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    useful = sum(o for _, o in work)
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(work), batch):
            chunk = work[i:i + batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, (p, _) in enumerate(chunk):
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            max_new = max(o for _, o in chunk)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                           min_new_tokens=max_new, do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": useful, "output_tok_s": useful / elapsed}


def run_raw_loop(llm: LLM, work: list[tuple[list[int], int]], prefill_tokens: int) -> dict:
    """Baton's model alone: packed prefill chunks, then decode steps over a shrinking batch."""
    runner = llm.engine.runner
    model, bs = runner.model, runner.block_size
    max_len = max(len(p) + o for p, o in work)
    per_seq = (max_len + bs - 1) // bs
    assert per_seq * len(work) <= runner.num_blocks, "KV cache too small for the raw loop"
    tables = torch.arange(len(work) * per_seq, dtype=torch.int32).view(len(work), per_seq)
    outputs = [0] * len(work)
    last_tok = [0] * len(work)
    empty_tables = torch.zeros((0, per_seq), dtype=torch.int32)
    empty_i32 = torch.zeros(0, dtype=torch.int32)
    start = time.perf_counter()
    # prefill: pack whole prompts up to the token budget per forward
    order = list(range(len(work)))
    while order:
        group, total = [], 0
        while order and (not group or total + len(work[order[0]][0]) <= prefill_tokens):
            group.append(order.pop(0))
            total += len(work[group[-1]][0])
        ids = torch.tensor([t for i in group for t in work[i][0]])
        pos = torch.cat([torch.arange(len(work[i][0])) for i in group])
        slots = torch.cat([tables[i].long().repeat_interleave(bs)[: len(work[i][0])] * bs
                           + torch.arange(len(work[i][0])) % bs for i in group])
        lens = torch.tensor([len(work[i][0]) for i in group], dtype=torch.int32)
        meta = AttentionMetadata(slots, 0, empty_tables, empty_i32, 0, tables[group], lens,
                                 torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).int()]))
        hidden = model(ids, pos, runner.kv_caches, meta)
        last = (lens.cumsum(0) - 1).long()
        toks = model.compute_logits(hidden[last]).argmax(-1).tolist()
        for i, t in zip(group, toks):
            last_tok[i], outputs[i] = t, 1
    # decode: every live sequence advances one token per forward
    live = [i for i in range(len(work)) if outputs[i] < work[i][1]]
    while live:
        idx = torch.tensor(live)
        seq_lens = torch.tensor([len(work[i][0]) + outputs[i] for i in live], dtype=torch.int32)
        pos = (seq_lens - 1).long()
        slots = tables[idx].long().gather(1, (pos // bs).view(-1, 1)).view(-1) * bs + pos % bs
        width = (int(seq_lens.max()) + bs - 1) // bs
        meta = AttentionMetadata(slots, len(live), tables[idx, :width], seq_lens, int(seq_lens.max()),
                                 empty_tables, empty_i32, torch.zeros(1, dtype=torch.int32))
        hidden = model(torch.tensor([last_tok[i] for i in live]), pos, runner.kv_caches, meta)
        toks = model.compute_logits(hidden).argmax(-1).tolist()
        for i, t in zip(live, toks):
            last_tok[i] = t
            outputs[i] += 1
        live = [i for i in live if outputs[i] < work[i][1]]
    elapsed = time.perf_counter() - start
    useful = sum(outputs)
    return {"seconds": elapsed, "output_tokens": useful, "output_tok_s": useful / elapsed}


def run_engine(llm: LLM, work: list[tuple[list[int], int]]) -> dict:
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in work]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params)
    elapsed = time.perf_counter() - start
    useful = sum(len(o.outputs[0].token_ids) for o in outs)
    assert useful == sum(o for _, o in work)
    return {"seconds": elapsed, "output_tokens": useful, "output_tok_s": useful / elapsed}


def time_scheduler_ticks(num_seqs: int = 256, prompt_len: int = 128, ticks: int = 200) -> dict:
    """Scheduler + block manager CPU time per decode tick with a null model."""
    bm = BlockManager(num_seqs * 32, 16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=1 << 20), bm)
    rng = random.Random(0)
    for i in range(num_seqs):
        prompt = [rng.randrange(1000) for _ in range(prompt_len)]
        sched.add_request(Request(str(i), prompt, SamplingParams(max_tokens=10_000), 1 << 20))
    out = sched.schedule()  # admission + prefill allocation, not timed
    sched.update_after_forward(out)
    for s in out.scheduled:
        s.request.append_token(7)
    samples = []
    for _ in range(ticks):
        t = time.perf_counter()
        out = sched.schedule()
        sched.update_after_forward(out)
        for s in out.scheduled:
            s.request.append_token(7)
        samples.append(time.perf_counter() - t)
    assert len(out.decodes) == num_seqs
    return {"num_running": num_seqs, "median_ms": statistics.median(samples) * 1e3,
            "p90_ms": sorted(samples)[int(0.9 * len(samples))] * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", default="64:512")
    ap.add_argument("--output-len", default="32:256")
    ap.add_argument("--dtype", default="auto", help="auto: what the engine chooses on this CPU")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-batch", type=int, default=None, help="static batch size (default: all)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--repeat", type=int, default=1, help="interleaved rounds of (c), (b), (a); medians reported")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lo_p, hi_p = map(int, args.prompt_len.split(":"))
    lo_o, hi_o = map(int, args.output_len.split(":"))

    llm = LLM(dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=max(args.num_requests, 1), kv_cache_memory_gib=4.0)
    work = make_workload(args.num_requests, args.seed, (lo_p, hi_p), (lo_o, hi_o), llm.engine.vocab_size)
    llm.generate([[5] * 16], SamplingParams(max_tokens=4))  # warm-up
    results = {"tick": time_scheduler_ticks()}
    print(f"scheduler+block manager per tick at 256 running: {results['tick']['median_ms']:.3f} ms median")
    # Rounds interleave (c), (b), (a) so slow spells of this shared machine hit all three alike;
    # each figure is the median over rounds and the ratios are taken per round, then the median.
    dtype = llm.engine.model.dtype  # HF in the dtype the engine resolved (auto)
    rounds: list[dict] = []
    for i in range(args.repeat):
        r = {"engine": run_engine(llm, work)}
        print(f"[round {i + 1}/{args.repeat}] (c) engine: {r['engine']['output_tok_s']:.1f} output tok/s")
        llm.engine.block_manager.reset_prefix_cache()
        r["raw_loop"] = run_raw_loop(llm, work, args.max_num_batched_tokens)
        print(f"[round {i + 1}/{args.repeat}] (b) raw forward loop: {r['raw_loop']['output_tok_s']:.1f} output tok/s")
        llm.engine.block_manager.reset_prefix_cache()
        if not args.skip_hf:
            r["hf_generate"] = run_hf(llm.model_path, dtype, work, args.hf_batch or args.num_requests)
            print(f"[round {i + 1}/{args.repeat}] (a) HF generate static batch: "
                  f"{r['hf_generate']['output_tok_s']:.1f} output tok/s")
            r["c_over_a"] = r["engine"]["output_tok_s"] / r["hf_generate"]["output_tok_s"]
        r["c_over_b"] = r["engine"]["output_tok_s"] / r["raw_loop"]["output_tok_s"]
        rounds.append(r)
    for key in ("engine", "raw_loop", "hf_generate"):
        if key in rounds[0]:
            per_round = [r[key]["output_tok_s"] for r in rounds]
            results[key] = {"output_tokens": rounds[0][key]["output_tokens"],
                            "output_tok_s": statistics.median(per_round), "output_tok_s_rounds": per_round}
    for key in ("c_over_a", "c_over_b"):
        if key in rounds[0]:
            results[key] = statistics.median(r[key] for r in rounds)
            results[f"{key}_rounds"] = [r[key] for r in rounds]
    results["config"] = {**vars(args), "date": date.today().isoformat(), "machine": platform.processor()
                         or platform.machine(), "cores": torch.get_num_threads(), "torch": torch.__version__,
                         "model": llm.model_path.name, "command": " ".join(sys.argv)}
    print(json.dumps({k: v for k, v in results.items() if k.startswith("c_over")}, indent=2))
    print(" ".join(f"{k}={results[k]['output_tok_s']:.1f}" for k in ("engine", "raw_loop", "hf_generate")
                   if k in results) + " tok/s (median round)")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
