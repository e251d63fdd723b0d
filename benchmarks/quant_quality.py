"""Quality of the quantised weights against the full-precision model: perplexity on a fixed public
domain passage (``benchmarks/data/public_domain.txt``: the US Declaration of Independence and two
addresses by Lincoln) and greedy agreement (share of a fixed prompt set whose first 32 greedy tokens
are identical). The gate fails loudly (exit 1) if int8 as ``baton convert --quantize int8`` writes it
(one scale per 32 input features) loses more than 1% relative perplexity; per-output-channel int8
(``--group-size 0``) is reported beside it.

    .venv/bin/python benchmarks/quant_quality.py --out benchmarks/results/quant_quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # after site-packages: see tests/conftest.py

PASSAGE = ROOT / "benchmarks" / "data" / "public_domain.txt"
INT8_MAX_PPL_LOSS = 0.01  # relative
GATED = "int8-g32"  # what `baton convert --quantize int8` writes
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Who wrote Romeo and Juliet?",
    "Give me a tip for learning to cook.",
    "What does a CPU do?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Name a famous painting.",
    "How many legs does a spider have?",
    "Suggest a name for a pet cat.",
    "What is 12 times 11?",
    "Describe a rainy day in two sentences.",
    "What is the boiling point of water?",
    "Tell me a fun fact about octopuses.",
)
AGREEMENT_TOKENS = 32


def perplexity(llm: Any, ids: list[int], window: int = 512) -> tuple[float, int]:
    """exp(mean next-token NLL) of ``ids`` read in non-overlapping windows (each a fresh context),
    computed by the engine's own model and kernels; returns (perplexity, tokens scored)."""
    from baton_serve.workers.model.attention import AttentionMetadata

    runner = llm.engine.runner
    model, bs = runner.model, runner.block_size
    per_seq = (window + bs - 1) // bs
    assert per_seq <= runner.num_blocks, "KV cache too small for one window"
    table = torch.arange(per_seq, dtype=torch.int32).view(1, per_seq)
    empty_tables, empty_i32 = torch.zeros((0, per_seq), dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            break
        n = len(chunk)
        pos = torch.arange(n)
        slots = table[0].long().repeat_interleave(bs)[:n] * bs + pos % bs
        lens = torch.tensor([n], dtype=torch.int32)
        meta = AttentionMetadata(slots, 0, empty_tables, empty_i32, 0, table, lens,
                                 torch.tensor([0, n], dtype=torch.int32))
        with torch.inference_mode():
            hidden = model(torch.tensor(chunk), pos, runner.kv_caches, meta)
            logp = torch.log_softmax(model.compute_logits(hidden[:-1]).double(), dim=-1)
        target = torch.tensor(chunk[1:])
        nll -= logp[torch.arange(n - 1), target].sum().item()
        count += n - 1
    return math.exp(nll / count), count


def greedy_tokens(llm: Any) -> list[list[int]]:
    from baton_serve.workers import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=AGREEMENT_TOKENS, ignore_eos=True)
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def evaluate(model: str, dtype: str, threads: int) -> dict[str, Any]:
    from baton_serve.workers import LLM

    torch.set_num_threads(threads)
    llm = LLM(model=model, dtype=dtype, num_kv_blocks=256)
    ids = llm.tokenizer.encode(PASSAGE.read_text())
    started = time.perf_counter()
    ppl, scored = perplexity(llm, ids)
    greedy = greedy_tokens(llm)
    return {"model": Path(llm.model_path).name, "dtype": llm.config.dtype, "perplexity": ppl,
            "tokens_scored": scored, "greedy": greedy, "seconds": time.perf_counter() - started}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF folder (default: the embedded model)")
    ap.add_argument("--dtype", default="float32", help="activations' dtype for every variant")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default="int8-g0,int8-g32,int8-g64,int4-g32,int4-g64",
                    help="METHOD-gGROUP[-a8], comma-separated (g0: int8 per output channel; -a8: int8 "
                    "activations too, W8A8, int8-g0 only)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from baton_serve.workers.checkpoint.default_model import resolve_model
    from baton_serve.workers.checkpoint.quantize import quantize_folder

    source = resolve_model(args.model)
    results = {"full": evaluate(str(source), args.dtype, args.threads)}
    base = results["full"]
    print(f"full precision: perplexity {base['perplexity']:.4f} over {base['tokens_scored']} tokens")
    for variant in filter(None, args.variants.split(",")):
        activations = "int8" if variant.endswith("-a8") else "float"  # W8A8
        method, _, group = variant.removesuffix("-a8").partition("-g")
        folder = quantize_folder(source, None, method, int(group or 32), activations=activations)
        r = evaluate(str(folder), args.dtype, args.threads)
        r["perplexity_loss"] = r["perplexity"] / base["perplexity"] - 1
        r["greedy_agreement"] = sum(a == b for a, b in zip(r["greedy"], base["greedy"])) / len(PROMPTS)
        results[variant] = r
        print(f"{variant}: perplexity {r['perplexity']:.4f} ({100 * r['perplexity_loss']:+.2f}%), "
              f"greedy agreement {r['greedy_agreement']:.2f} (first {AGREEMENT_TOKENS} tokens, "
              f"{len(PROMPTS)} prompts)")
    gate_ok = GATED not in results or results[GATED]["perplexity_loss"] <= INT8_MAX_PPL_LOSS
    if args.out:
        for r in results.values():
            r.pop("greedy")
        Path(args.out).write_text(json.dumps({
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.processor()
            or platform.machine(), "command": " ".join(["python", *sys.argv]), "passage": PASSAGE.name,
            "int8_max_perplexity_loss": INT8_MAX_PPL_LOSS, "gate_passed": gate_ok, "results": results},
            indent=2) + "\n")
    if not gate_ok:
        print(f"QUALITY GATE FAILED: {GATED} perplexity loss {100 * results[GATED]['perplexity_loss']:.2f}% > "
              f"{100 * INT8_MAX_PPL_LOSS:.0f}%", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
