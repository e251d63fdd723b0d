"""The ``baton`` command line."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from baton_serve.cluster.config import ClusterConfig


def _cmd_convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from baton_serve.workers.checkpoint.default_model import default_model_path, resolve_model
    from baton_serve.workers.checkpoint.gguf_convert import convert_gguf
    from baton_serve.workers.errors import ModelLoadError

    try:
        if args.quantize is not None:
            from baton_serve.workers.checkpoint.quantize import quantize_folder

            src = resolve_model(args.gguf, progress=True)
            path = quantize_folder(src, args.out, args.quantize, args.group_size, args.lm_head, args.activations)
        elif args.gguf is None:
            path = default_model_path(progress=True)
        elif args.out is not None:
            path = convert_gguf(Path(args.gguf), Path(args.out), progress=True)
        else:
            path = resolve_model(args.gguf)
    except (ModelLoadError, ValueError) as exc:
        print(f"baton convert: error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from baton_serve.cluster.status_view import fetch_status, format_status

    try:
        status = fetch_status(args.url, args.api_key)
    except Exception as exc:  # refused, timed out or an error reply: one line, not a traceback
        print(f"baton status: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        import json

        print(json.dumps(status, indent=2))
    else:
        print(format_status(status))
    return 0 if status["ready"] else 1


def _threads_arg(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 'auto' or a positive integer, got {value!r}")
    return n


def _gib_arg(value: str) -> float:
    try:
        gib = float(value)
    except ValueError:
        gib = 0.0
    if not 0 < gib < float("inf"):  # NaN fails the comparison too
        raise argparse.ArgumentTypeError(f"must be a positive number of GiB, got {value!r}")
    return gib


def _cmd_generate(args: argparse.Namespace) -> int:
    from baton_serve.workers import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, num_threads=args.threads,
              deterministic=args.deterministic)
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
    from baton_serve.cluster.serve import serve

    return serve(serve_config(args))


def serve_config(args: argparse.Namespace) -> ClusterConfig:
    """The config ``baton serve`` runs: the file (or the defaults) with the flags that were given on top."""
    from baton_serve.cluster.config import POOL_ROLES, ConfigError, load_config

    config = load_config(args.config).with_overrides(**{
        "engine.model": args.model, "engine.dtype": args.dtype, "engine.device": args.device,
        "server.host": args.host,
        "server.port": args.port, "pools.prefill": args.prefill, "pools.decode": args.decode,
        "pools.colocated": args.colocated, "ray.address": args.address,
        "engine.threads_per_worker": args.threads_per_worker, "server.model_name": args.served_model_name,
        "server.log_format": args.log_format, "engine.deterministic": args.deterministic or None,
        "engine.kv_cache_memory_gib": args.kv_cache_memory_gib, "router.policy": args.routing_policy,
        "server.api_key": args.api_key,
        "server.tenants": str(Path(args.tenants).resolve()) if args.tenants else None,
        **{f"pools.{role}_options.tensor_parallel_size": getattr(args, f"{role}_tp") for role in POOL_ROLES},
    })
    if config.server.tenants and not Path(config.server.tenants).is_absolute():
        # A relative tenants path in a config file is read beside the file, wherever serve runs.
        base = Path(args.config).resolve().parent if args.config else Path.cwd()
        config = config.with_overrides(**{"server.tenants": str(base / config.server.tenants)})
    for role in POOL_ROLES:  # a flag for a pool that does not start would be ignored without a word
        if getattr(args, f"{role}_tp") is not None and role not in config.pools.replica_roles():
            how = "--colocated N replaces the prefill and decode pools" if config.colocated else "see --colocated N"
            raise ConfigError(f"--{role}-tp: this deployment starts no {role} workers ({how})")
    return config


def _cmd_keys_hash(args: argparse.Namespace) -> int:
    from baton_serve.cluster.admission.tenants import hash_key, key_id

    key = args.key if args.key != "-" else sys.stdin.readline().strip()
    digest = hash_key(key)
    print(f"{digest}  # {key_id(digest)}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from baton_serve.cluster.bench.cli_args import run_from_args

    return run_from_args(args)


def _plan_result_path(args: argparse.Namespace) -> Path | None:
    if args.result_file is None and args.result_dir is None:
        return None
    return Path(args.result_dir or ".") / (args.result_file or f"plan_live_{args.workers}w.json")


def _cmd_plan_live(args: argparse.Namespace) -> int:
    from baton_serve.cluster.bench.cli_args import bench_config
    from baton_serve.cluster.bench.plan import (
        parse_ratios,
        plan_json,
        plan_layouts,
        plan_markdown,
        plot_plan,
        run_plan,
    )
    from baton_serve.cluster.bench.report import write_plan_outputs
    from baton_serve.cluster.bench.workload import WorkloadError
    from baton_serve.cluster.config import load_config

    try:  # ConfigError and WorkloadError are ValueErrors: every bad option ends here, before Ray starts
        if args.address and args.address.startswith("ray://"):
            raise ValueError("--address: the HTTP front runs on this node's loopback, so run plan live on a "
                             "node of the cluster with --address auto or HOST:PORT, not ray://")
        if not args.request_rate > 0 or (args.num_prompts or 1) < 1 or (args.max_concurrency or 1) < 1:
            raise ValueError("--request-rate must be positive, --num-prompts and --max-concurrency at least 1")
        layouts = plan_layouts(args.workers, parse_ratios(args.ratios) if args.ratios else None, args.colocated)
        bench = bench_config(args)
        base = load_config(args.config).with_overrides(**{
            "engine.model": args.model, "engine.dtype": args.dtype, "ray.address": args.address,
            "engine.threads_per_worker": args.threads_per_worker})
    except ValueError as e:
        print(f"baton plan: error: {e}", file=sys.stderr)
        return 2
    try:
        pr = run_plan(base, layouts, bench, args.port, command=shlex.join(["baton", *args.argv]))
    except WorkloadError as e:
        print(f"baton plan: error: {e}", file=sys.stderr)
        return 2
    md = plan_markdown(pr)
    print(md)
    path = _plan_result_path(args)
    if path is not None:
        plot = None if args.no_plot else (lambda png: plot_plan(pr, png))
        written = write_plan_outputs(plan_json(pr), md, path, plot)
        print(f"baton plan: wrote {', '.join(map(str, written))}", file=sys.stderr)
    return 0 if any(r.ok for r in pr.results) else 1


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    from baton_serve.cluster.bench.cli_args import add_workload_arguments

    plan = sub.add_parser("plan", help="find the prefill:decode split for a number of workers")
    plan_sub = plan.add_subparsers(dest="plan_command", required=True)
    live = plan_sub.add_parser(
        "live", help="start each prefill:decode layout in turn, run one workload, rank by goodput per worker",
        description="For a fixed number of workers, start the cluster at each prefill:decode ratio (and "
        "colocated), run the same workload (same seed, same prompts), and report goodput per worker.")
    g = live.add_argument_group("layouts")
    g.add_argument("--workers", type=int, default=2, help="total workers in every layout (default 2)")
    g.add_argument("--ratios", default=None, metavar="P:D,...",
                   help="prefill:decode ratios, e.g. 1:3,1:1,3:1; P+D must divide --workers "
                   "(default: every split of the workers)")
    g.add_argument("--colocated", action=argparse.BooleanOptionalAction, default=True,
                   help="also run --workers colocated workers as the baseline (default on)")
    g = live.add_argument_group("cluster")
    g.add_argument("--config", default=None, help="TOML config (its [pools] are replaced by each layout)")
    g.add_argument("--model", default=None, help="model folder or .gguf (default: embedded model)")
    g.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--threads-per-worker", type=_threads_arg, default=None,
                   help="threads per worker, or auto (default): fill the cores each worker is given")
    g.add_argument("--address", default=None,
                   help="Ray address to join ('auto' or HOST:PORT; run on a cluster node) instead of a local Ray")
    g.add_argument("--port", type=int, default=0, help="loopback port of the HTTP front (default: a free one)")
    add_workload_arguments(live)
    live.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                      help="SLOs, e.g. ttft:2000 tpot:200 (without: goodput = completed requests/s)")
    g = live.add_argument_group("results")
    g.add_argument("--result-dir", default=None, help="folder for the JSON, Markdown and PNG")
    g.add_argument("--result-file", default=None,
                   help="JSON file name or path (default plan_live_<workers>w.json); .md and .png beside it")
    g.add_argument("--no-plot", action="store_true", help="skip the PNG")
    live.set_defaults(func=_cmd_plan_live)
    from baton_serve.cluster.sim.cli import add_profile_parser, add_sim_parser

    add_sim_parser(plan_sub)
    add_profile_parser(plan_sub)


def build_parser() -> argparse.ArgumentParser:
    from baton_serve import __version__

    parser = argparse.ArgumentParser(prog="baton", description="Disaggregated LLM serving on Ray")
    parser.add_argument("--version", action="version", version=f"baton {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API from prefill/decode pools on Ray")
    srv.add_argument("--config", default=None, help="TOML config (default: the embedded model, 1P + 1D)")
    srv.add_argument("--model", default=None, help="model folder or .gguf (default: embedded model)")
    srv.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    srv.add_argument("--device", default=None, help="auto (default): CUDA where the worker has a GPU, else the CPU")
    srv.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=None, help="port (default 8000)")
    srv.add_argument("--prefill", type=int, default=None, help="prefill workers")
    srv.add_argument("--decode", type=int, default=None, help="decode workers")
    srv.add_argument("--colocated", type=int, default=None,
                     help="N colocated workers (prefill and decode in one) instead of the pools")
    for role in ("prefill", "decode", "colocated"):
        srv.add_argument(f"--{role}-tp", type=int, default=None, metavar="N",
                         help=f"tensor-parallel ranks per {role} worker ([pools.{role}] tensor_parallel_size)")
    srv.add_argument("--log-format", choices=["text", "json"], default=None,
                     help="text (default) or json: one object per line with the request id (X-Request-Id)")
    srv.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                     help="the model's name(s) in the API; requests may use any, responses carry the first "
                     "(default: the model's own name)")
    srv.add_argument("--deterministic", action="store_true", default=None,
                     help="batch-invariant numerics: the same greedy text whatever the batch, and recovered "
                     "streams equal to undisturbed ones in bf16 too ([engine] deterministic)")
    srv.add_argument("--threads-per-worker", type=_threads_arg, default=None,
                     help="threads per worker, or auto (default): fill the cores each worker is given")
    srv.add_argument("--kv-cache-memory-gib", type=_gib_arg, default=None, metavar="GIB",
                     help="KV cache per CPU worker (default 1; vLLM-CPU's VLLM_CPU_KVCACHE_SPACE)")
    srv.add_argument("--address", default=None, help="Ray address to join ('auto' for a running cluster)")
    srv.add_argument("--routing-policy", default=None, metavar="NAME",
                     help="how requests pick workers: cost (default), prefix, least_loaded, round_robin")
    srv.add_argument("--api-key", default=None, metavar="KEY",
                     help="require 'Authorization: Bearer KEY' (one key, one tenant; also $BATON_API_KEY)")
    srv.add_argument("--tenants", default=None, metavar="FILE",
                     help="a tenants file (TOML): hashed keys, rates, budgets and priority classes")
    srv.set_defaults(func=_cmd_serve)

    st = sub.add_parser("status", help="a running deployment's workers: alive, restarts, quarantined, load "
                        "(exit 1 when it is not ready)")
    st.add_argument("--url", default="http://127.0.0.1:8000", help="a front's address (default %(default)s)")
    st.add_argument("--api-key", default=None, metavar="KEY",
                    help="an admin key, where /status needs one (also $BATON_API_KEY)")
    st.add_argument("--json", action="store_true", help="print the raw /status JSON")
    st.set_defaults(func=_cmd_status)

    keys = sub.add_parser("keys", help="API key helpers")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    khash = keys_sub.add_parser("hash", help="print the sha256:<hex> digest a tenants file stores for KEY")
    khash.add_argument("key", help="the key, or - to read it from standard input (keeps it out of the history)")
    khash.set_defaults(func=_cmd_keys_hash)

    conv = sub.add_parser("convert", help="convert a GGUF (default: the embedded model) to a HF folder, "
                          "or write a weight-only quantised copy of a model (--quantize)")
    conv.add_argument("gguf", nargs="?", default=None, help="a .gguf file or an HF model folder")
    conv.add_argument("--out", default=None, help="output folder (default: the cache, or beside the source "
                      "folder for --quantize)")
    conv.add_argument("--quantize", default=None, choices=["int8", "int4"],
                      help="write a quantised copy: int8 per output channel, or int4 group-wise")
    conv.add_argument("--group-size", type=int, default=32, choices=[0, 32, 64, 128],
                      help="input features per scale (default 32, as llama.cpp's Q8_0/Q4_1 blocks); "
                      "int8 also takes 0: one scale per output channel")
    conv.add_argument("--lm-head", default="int8", choices=["int8", "full"],
                      help="--quantize: the output projection's precision")
    conv.add_argument("--activations", default="float", choices=["float", "int8"],
                      help="--quantize int8 --group-size 0: int8 also quantises each row of activations on "
                      "the fly and multiplies in int8 (W8A8: VNNI / AMX-INT8 where the CPU has them)")
    conv.set_defaults(func=_cmd_convert)

    gen = sub.add_parser("generate", help="offline completion(s) from the engine")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    gen.add_argument("--model", default=None, help="model folder or .gguf (default: embedded model)")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    gen.add_argument("--device", default="auto", help="auto (default): CUDA where the worker has a GPU, else the CPU")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None)
    gen.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    gen.add_argument("--deterministic", action="store_true",
                     help="batch-invariant numerics (see baton serve --deterministic)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.set_defaults(func=_cmd_generate)

    from baton_serve.cluster.bench.cli_args import add_arguments as add_bench_arguments

    bench = sub.add_parser(
        "bench", help="load-test an OpenAI-compatible server: latency, throughput, goodput",
        description="Load-test an OpenAI-compatible server (open or closed loop) and report TTFT/TPOT/ITL/E2E "
        "percentiles, throughput and goodput; 'baton bench sweep --rates ...' finds the knee.")
    add_bench_arguments(bench)
    bench.set_defaults(func=_cmd_bench)
    _add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the CLI prints a clean one-line error for our typed errors
        from baton_serve.cluster.config import ConfigError
        from baton_serve.kernels.device import DeviceUnavailableError
        from baton_serve.workers.errors import BatonError
        from pydantic import ValidationError

        if isinstance(exc, (BatonError, ConfigError, DeviceUnavailableError, ValidationError)):
            print(f"baton: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
