"""``baton bench`` and ``baton bench sweep``: options (vLLM's ``bench serve`` names where they
overlap) and the command itself. Importing this module is cheap: the parser is built at start-up.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from baton_serve.extras import install_hint

DEFAULT_URL = "http://127.0.0.1:8000"


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r} (a number of req/s or 'inf')") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"rates must be positive, got {text}")
    return value


def _rates(text: str) -> list[float]:
    return [_rate(t) for t in text.split(",") if t]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add every ``bench`` option to ``p``."""
    p.add_argument("action", nargs="?", default="run", choices=["run", "sweep"],
                   help="run (default): one load level; sweep: each of --rates, and the knee")
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=DEFAULT_URL, help=f"server root (default {DEFAULT_URL})")
    g.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    g.add_argument("--model", default=None,
                   help="model name or local folder (default: the server's first model); "
                   "also finds the tokenizer")
    g.add_argument("--served-model-name", default=None, help="name to send, when it differs from --model")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder for exact prompt lengths")
    add_workload_arguments(p)
    g = p.add_argument_group("results")
    g.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (also e2el:MS)")
    g.add_argument("--metric-percentiles", default="50,90,99", help="comma-separated percentiles")
    g.add_argument("--result-file", default=None,
                   help="write JSON here, and a Markdown table (.md) and plot (.png) beside it")
    g.add_argument("--no-plot", action="store_true", help="skip the PNG")
    g = p.add_argument_group("sweep")
    g.add_argument("--rates", nargs="+", type=_rates, default=None, help="offered rates (req/s), e.g. 1 2 4 8 inf")
    g.add_argument("--sweep-stop-after", type=int, default=0,
                   help="stop after this many consecutive rates miss the SLO (0: run every rate)")


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The workload and load options ``baton bench``, ``plan live`` and ``plan sim`` share: the same
    options build the same requests (``bench_config``)."""
    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", default="random", choices=["random", "shared-prefix", "trace"])
    g.add_argument("--dataset-path", default=None,
                   help="JSONL trace (timestamp, prompt or prompt_len, output_len)")
    g.add_argument("--num-prompts", type=int, default=None, help="measured requests (default 100; a trace: all)")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="uniform lengths in [len*(1-r), len*(1+r)]; 0 = fixed")
    g.add_argument("--length-dist", default="uniform", choices=["uniform", "lognormal"],
                   help="prompt/output length distribution (lognormal: mean = the given length)")
    g.add_argument("--lognormal-sigma", type=float, default=0.5)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10, help="shared-prefix: system prompts")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256, help="shared-prefix: user turn tokens")
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)
    g.add_argument("--prefix-repetition-hot-fraction", type=float, default=0.0, metavar="F",
                   help="shared-prefix: send this fraction of requests to prefix 0, the rest evenly over the "
                   "others (in [0, 1); default 0: all prefixes even)")
    g.add_argument("--text-prompts", action="store_true", help="send completions prompts as text, not token ids")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the workload's output lengths (default on)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="req/s, open loop (default inf: all at once)")
    g.add_argument("--burstiness", type=_rate, default=1.0,
                   help="gamma shape of inter-arrival gaps: 1 Poisson, <1 burstier, inf evenly spaced")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="cap on requests in flight; with rate inf this is a closed loop of N users")
    g.add_argument("--trace-speedup", type=_rate, default=1.0, help="divide a trace's timestamps by this")
    g.add_argument("--num-warmups", type=int, default=1,
                   help="unmeasured requests first, one at a time; the first is reported as the cold start")
    g.add_argument("--warmup-prefixes", action="store_true",
                   help="shared-prefix: send each system prompt once (fresh suffix, unmeasured) before the run, "
                        "so it measures caches in steady state rather than each prefix's first touch")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--max-client-lag-ms", type=float, default=25.0, help="warn when the client lags more (p99)")
    g.add_argument("--disable-tqdm", action="store_true")


def bench_config(args: argparse.Namespace):  # -> BenchConfig (imported late: start-up stays fast)
    """The BenchConfig the options in ``args`` describe (server options default where ``args`` has none)."""
    from baton_serve.cluster.bench.metrics import parse_goodput
    from baton_serve.cluster.bench.runner import BenchConfig
    from baton_serve.cluster.bench.workload import LengthDist, WorkloadConfig

    goodput = getattr(args, "goodput", None)
    if goodput and any(g in ("sweep", "run") for g in goodput):
        raise ValueError("put 'sweep' right after 'bench': baton bench sweep --rates ... --goodput ...")
    shared = args.dataset_name == "shared-prefix"
    if args.warmup_prefixes and not shared:
        raise ValueError("--warmup-prefixes needs --dataset-name shared-prefix")

    def dist(n: int) -> LengthDist:
        return LengthDist(n, kind=args.length_dist, range_ratio=args.random_range_ratio,
                          sigma=args.lognormal_sigma)

    workload = WorkloadConfig(
        name=args.dataset_name,
        input_len=dist(args.prefix_repetition_suffix_len if shared else args.random_input_len),
        output_len=dist(args.prefix_repetition_output_len if shared else args.random_output_len),
        num_prefixes=args.prefix_repetition_num_prefixes, prefix_len=args.prefix_repetition_prefix_len,
        trace_path=args.dataset_path, hot_fraction=args.prefix_repetition_hot_fraction)
    num_prompts = args.num_prompts
    if num_prompts is None:
        num_prompts = None if args.dataset_name == "trace" else 100
    model = getattr(args, "model", None)
    # Baton serves a folder under the model's own name (the folder's, less a cache digest).
    from baton_serve.workers.checkpoint.default_model import served_name

    is_dir = model is not None and Path(model).expanduser().is_dir()
    api_name = getattr(args, "served_model_name", None) or (served_name(Path(model).expanduser()) if is_dir
                                                            else model)
    spec = getattr(args, "metric_percentiles", "50,90,99")
    percentiles = tuple(float(x) for x in spec.split(",") if x.strip())
    if any(not 0 < q <= 100 for q in percentiles):
        raise ValueError(f"--metric-percentiles must lie in (0, 100], got {spec}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    return BenchConfig(
        base_url=getattr(args, "base_url", DEFAULT_URL), model=api_name, tokenizer_source=model,
        tokenizer=getattr(args, "tokenizer", None), endpoint=getattr(args, "endpoint", "/v1/completions"), workload=workload, num_prompts=num_prompts, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, trace_speedup=args.trace_speedup,
        seed=args.seed, slo=parse_goodput(goodput), percentiles=percentiles, num_warmups=args.num_warmups,
        warmup_prefixes=args.warmup_prefixes,
        ignore_eos=args.ignore_eos, temperature=args.temperature, token_ids=not args.text_prompts,
        request_timeout_s=args.request_timeout, max_client_lag_ms=args.max_client_lag_ms,
        disable_tqdm=args.disable_tqdm)


def _write(args: argparse.Namespace, data: dict, md: str, plot) -> None:
    """JSON to --result-file, the Markdown and the PNG beside it; the Markdown to stdout always."""
    from baton_serve.cluster.bench.report import write_json

    print(md)
    if args.result_file is None:
        return
    path = write_json(data, args.result_file)
    path.with_suffix(".md").write_text(md, encoding="utf-8")
    written = [str(path), str(path.with_suffix(".md"))]
    if not args.no_plot:
        try:
            written.append(str(plot(path.with_suffix(".png"))))
        except ImportError:
            print(f"baton bench: warning: no matplotlib, no plot ({install_hint('matplotlib')})", file=sys.stderr)
    print(f"baton bench: wrote {', '.join(written)}", file=sys.stderr)


def run_from_args(args: argparse.Namespace) -> int:
    """The ``bench`` command: 0 on success, 2 with a one-line error for bad options, a bad
    workload or an unreachable server (request failures are results, not errors)."""
    from baton_serve.cluster.bench.workload import WorkloadError

    try:
        cfg = bench_config(args)
        rates = sorted({r for group in args.rates or [] for r in group})
        if args.action == "sweep":
            if not rates:
                raise ValueError("sweep needs --rates, e.g. --rates 1 2 4 8 inf")
            if cfg.slo is None or cfg.slo.ttft_ms is None or cfg.slo.tpot_ms is None:
                raise ValueError("sweep needs SLOs to find the knee: --goodput ttft:MS tpot:MS")
        elif rates:
            raise ValueError("--rates is for 'baton bench sweep'; a single run takes --request-rate")
    except ValueError as e:
        print(f"baton bench: error: {e}", file=sys.stderr)
        return 2
    try:
        if args.action == "sweep":
            from baton_serve.cluster.bench.sweep import plot_sweep, run_sweep, sweep_json, sweep_markdown

            sw = run_sweep(cfg, rates, args.sweep_stop_after)
            _write(args, sweep_json(sw), sweep_markdown(sw), lambda p: plot_sweep(sw, p))
        else:
            from baton_serve.cluster.bench.report import markdown, plot_run, result_json
            from baton_serve.cluster.bench.runner import run

            res = run(cfg)
            _write(args, result_json(res), markdown(res), lambda p: plot_run(res, p))
    except (WorkloadError, ConnectionError) as e:
        print(f"baton bench: error: {e}", file=sys.stderr)
        return 2
    return 0
