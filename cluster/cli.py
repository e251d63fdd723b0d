"""The ``baton`` command line."""

from __future__ import annotations

import argparse
import sys
import time


def _cmd_convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from workers.default_model import default_model_path, resolve_model
    from workers.gguf_convert import convert_gguf

    if args.gguf is None:
        path = default_model_path(progress=True)
    elif args.out is not None:
        path = convert_gguf(Path(args.gguf), Path(args.out), progress=True)
    else:
        path = resolve_model(args.gguf)
    print(path)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from workers import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed, stop=args.stop or [])
    start = time.perf_counter()
    if args.raw:
        outputs = llm.generate(args.prompt, params)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    elapsed = time.perf_counter() - start
    n_out = 0
    for out in outputs:
        for c in out.outputs:
            n_out += len(c.token_ids)
            print(c.text)
            print(f"[finish_reason={c.finish_reason} tokens={len(c.token_ids)}]", file=sys.stderr)
    print(f"[{n_out} tokens in {elapsed:.2f}s, {n_out / max(elapsed, 1e-9):.1f} tok/s]", file=sys.stderr)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from cluster.config import load_config
    from cluster.serve import serve

    config = load_config(args.config).with_overrides(**{
        "engine.model": args.model, "engine.dtype": args.dtype, "server.host": args.host,
        "server.port": args.port, "pools.prefill": args.prefill, "pools.decode": args.decode,
        "pools.colocated": args.colocated, "ray.address": args.address,
        "engine.threads_per_worker": args.threads_per_worker, "server.model_name": args.served_model_name,
    })
    return serve(config)


def _cmd_bench(args: argparse.Namespace) -> int:
    from cluster.bench.cli_args import run_from_args

    return run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="Disaggregated LLM serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API from prefill/decode pools on Ray")
    srv.add_argument("--config", default=None, help="TOML config (default: the embedded model, 1P + 1D)")
    srv.add_argument("--model", default=None, help="model folder or .gguf (default: embedded model)")
    srv.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    srv.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=None, help="port (default 8000)")
    srv.add_argument("--prefill", type=int, default=None, help="prefill workers")
    srv.add_argument("--decode", type=int, default=None, help="decode workers")
    srv.add_argument("--colocated", type=int, default=None,
                     help="N colocated workers (prefill and decode in one) instead of the pools")
    srv.add_argument("--served-model-name", default=None, help="model name in the API (default: folder name)")
    srv.add_argument("--threads-per-worker", type=int, default=None)
    srv.add_argument("--address", default=None, help="Ray address to join ('auto' for a running cluster)")
    srv.set_defaults(func=_cmd_serve)

    conv = sub.add_parser("convert", help="convert a GGUF (default: the embedded model) to a HF folder")
    conv.add_argument("gguf", nargs="?", default=None, help="path to a .gguf file")
    conv.add_argument("--out", default=None, help="output folder (default: the cache)")
    conv.set_defaults(func=_cmd_convert)

    gen = sub.add_parser("generate", help="offline completion(s) from the engine")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    gen.add_argument("--model", default=None, help="model folder or .gguf (default: embedded model)")
    gen.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None)
    gen.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.set_defaults(func=_cmd_generate)

    from cluster.bench.cli_args import add_arguments as add_bench_arguments

    bench = sub.add_parser(
        "bench", help="load-test an OpenAI-compatible server: latency, throughput, goodput",
        description="Load-test an OpenAI-compatible server (open or closed loop) and report TTFT/TPOT/ITL/E2E "
        "percentiles, throughput and goodput; 'baton bench sweep --rates ...' finds the knee.")
    add_bench_arguments(bench)
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the CLI prints a clean one-line error for our typed errors
        from cluster.config import ConfigError
        from workers.errors import BatonError

        if isinstance(exc, (BatonError, ConfigError)):
            print(f"baton: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
