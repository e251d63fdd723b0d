"""What structured output costs: decode step time with every row of a batch constrained by a
mid-size JSON schema vs the same batch unconstrained, grammar compile time (first and cached),
and memory per matcher. Offline engine on the default model, side by side in one process.

    .venv/bin/python benchmarks/structured_output.py --out benchmarks/results/structured_output.json

The schema's strings have fixed lengths, so every constrained row emits about the same number of
tokens and the batch stays full; the unconstrained batch runs with ``ignore_eos`` for as many
tokens. Step times are compared over the steps where every row of the batch decodes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from datetime import date
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after site-packages: see tests/conftest.py

FIXED = {"type": "string", "minLength": 8, "maxLength": 8}
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1000, "maximum": 9999},
        "name": FIXED, "city": FIXED, "country": FIXED,
        "status": {"enum": ["active", "inactive", "pending"]},
        "verified": {"type": "boolean"},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": FIXED, "minItems": 3, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"street": FIXED, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "zip"], "additionalProperties": False},
    },
    "required": ["id", "name", "city", "country", "status", "verified", "score", "tags", "address"],
    "additionalProperties": False,
}


class _Timed:
    """Wraps a function and adds up the seconds spent in it."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def _decode_steps(engine, prompts: list[list[int]], params: list) -> tuple[list[float], int]:
    """Step durations with every row decoding, and the tokens emitted."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", p, sp)
    full, tokens = [], 0
    while engine.has_unfinished_requests():
        out_running = engine.num_running
        t0 = time.perf_counter()
        deltas = engine.step()
        dt = time.perf_counter() - t0
        tokens += sum(len(d.token_ids) for d in deltas)
        if out_running == len(prompts) and len(deltas) == len(prompts) and not engine.num_waiting:
            full.append(dt)
    return full, tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="constrained and unconstrained batches, alternating")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from baton_serve.workers import LLM, SamplingParams
    from baton_serve.workers.sampling.structured import StructuredSpec

    llm = LLM(dtype=args.dtype, num_kv_blocks=2048, max_num_seqs=max(args.batch, 32))
    engine = llm.engine
    tok = llm.tokenizer
    prompts = [tok.encode(f"Record {i} as JSON:") for i in range(args.batch)]
    spec = StructuredSpec.json_schema(SCHEMA)

    # compile time: the first compile, then the cache
    structured = engine.structured
    t0 = time.perf_counter()
    backend = structured.backend
    backend_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = backend.compile(spec)
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(100):
        backend.compile(spec)
    cached_s = (time.perf_counter() - t0) / 100

    # memory per matcher: RSS growth over many matchers that have each followed a few tokens
    def rss_kib() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    text = json.dumps({"id": 1234, "name": "abcdefgh"})[:-1]
    warm = tok.encode(text, add_special_tokens=False)
    keep = [backend.matcher(compiled) for _ in range(10)]
    for m in keep:
        m.accept_many(warm)
    before = rss_kib()
    many = []
    for _ in range(2000):
        m = backend.matcher(compiled)
        m.accept_many(warm)
        many.append(m)
    per_matcher_kib = (rss_kib() - before) / len(many)
    del many, keep

    # a constrained batch's length, so the unconstrained one runs as many tokens
    probe = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=200,
                                                      structured_outputs=spec.to_dict()))[0].outputs[0]
    if probe.finish_reason != "stop":
        raise SystemExit(f"the constrained output did not finish in 200 tokens: {probe.text!r}")
    n_tokens = len(probe.token_ids)
    constrained = [SamplingParams(temperature=0, max_tokens=200, structured_outputs=spec.to_dict())
                   for _ in prompts]
    free = [SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True) for _ in prompts]
    # The mask work itself, timed inside the steps: filling the bitmasks (the matchers) and
    # applying them to the logits (the sampler). Unlike a step-time difference it does not drown
    # in the noise of a shared machine.
    import baton_serve.workers.sampling.sampler as sampler_mod

    fill = _Timed(engine.structured.fill)
    apply = _Timed(sampler_mod.apply_bitmask_)
    engine.structured.fill, sampler_mod.apply_bitmask_ = fill, apply
    rounds = []
    for _ in range(args.rounds):
        fill.seconds = apply.seconds = 0.0
        c_steps, c_tok = _decode_steps(engine, prompts, constrained)
        mask_s = (fill.seconds + apply.seconds) / max(len(c_steps), 1)
        u_steps, u_tok = _decode_steps(engine, prompts, free)
        c, u = statistics.median(c_steps), statistics.median(u_steps)
        rounds.append({"constrained_step_ms": c * 1e3, "unconstrained_step_ms": u * 1e3,
                       "mask_ms_per_step": mask_s * 1e3, "mask_share_of_unconstrained_step": mask_s / u,
                       "constrained_full_steps": len(c_steps), "unconstrained_full_steps": len(u_steps),
                       "constrained_tokens": c_tok, "unconstrained_tokens": u_tok, "overhead": c / u - 1})
    overhead = statistics.median(r["overhead"] for r in rounds)
    mask_share = statistics.median(r["mask_share_of_unconstrained_step"] for r in rounds)
    doc = {
        "date": date.today().isoformat(), "cpu": _cpu(), "cores": os.cpu_count(), "dtype": engine.config.dtype,
        "command": " ".join([sys.executable, *sys.argv]), "batch": args.batch, "schema": SCHEMA,
        "tokens_per_constrained_output": n_tokens, "probe_output": probe.text,
        "backend_build_s": backend_s, "compile_first_ms": first_s * 1e3, "compile_cached_us": cached_s * 1e6,
        "matcher_memory_kib": per_matcher_kib, "rounds": rounds, "tpot_overhead_median": overhead,
        "mask_share_median": mask_share,
    }
    print(json.dumps({k: v for k, v in doc.items() if k not in ("schema", "rounds")}, indent=1))
    print(f"TPOT at batch {args.batch}, every row constrained: {overhead * 100:+.1f}% step time "
          f"(median of {args.rounds} rounds), of which the mask work is {mask_share * 100:.1f}% of an "
          "unconstrained step; target <= 10%")
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def _cpu() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        name = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        return f"{name} ({'AVX512' if 'avx512f' in info else 'AVX2' if 'avx2' in info else 'baseline'})"
    except (OSError, StopIteration):
        return platform.machine()


if __name__ == "__main__":
    sys.exit(main())
