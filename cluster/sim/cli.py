"""``baton plan sim``: its options and what it runs (``cluster.sim.plan``, ``cluster.sim.against``)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_sim_parser(plan_sub: Any) -> None:
    """Register ``baton plan sim`` under ``baton plan``."""
    from baton_serve.cluster.bench.cli_args import add_workload_arguments

    sim = plan_sub.add_parser(
        "sim", help="simulate layouts on a latency profile (our scheduler, block manager and router on a "
        "virtual clock) and rank them by goodput per worker",
        description="Run the workload baton bench would send against each layout of a search space on a "
        "virtual clock: Baton's own scheduler, block manager, prefix cache, routing and admission, with "
        "the forward pass and KV transfers timed by a latency profile (baton plan profile).")
    g = sim.add_argument_group("simulated hardware")
    g.add_argument("--profile", required=True, help="latency profile JSON (baton plan profile)")
    g.add_argument("--shared-cores", type=int, default=None,
                   help="workers take turns at this many cores, as local workers on one machine do "
                   "(default: the profile's cores for a CPU profile, 0 for a GPU one: each worker its own)")
    g.add_argument("--threads", type=int, default=None, help="threads a step asks for (default: the profile's)")
    g.add_argument("--workers-per-node", type=int, default=8,
                   help="workers per node without --shared-cores (KV between nodes goes over collective)")
    g = sim.add_argument_group("search space")
    g.add_argument("--workers", type=_ints, default=[2], metavar="N,...", help="total workers (default 2)")
    g.add_argument("--ratios", default=None, metavar="P:D,...", help="prefill:decode ratios (default: every split)")
    g.add_argument("--colocated", action=argparse.BooleanOptionalAction, default=True,
                   help="also the colocated layout of each worker count (default on)")
    g.add_argument("--policies", default=None, metavar="NAME,...",
                   help="routing policies (default: the config's, cost unless set)")
    g.add_argument("--max-num-batched-tokens", type=_ints, default=None, metavar="N,...",
                   help="step token budgets (default: the config's)")
    g.add_argument("--config", default=None, help="TOML config (as baton serve takes it; [pools] per layout)")
    g.add_argument("--jobs", type=int, default=None, help="layouts simulated at once (default: one per core)")
    add_workload_arguments(sim)
    sim.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                     help="SLOs, e.g. ttft:2000 tpot:200 (without: goodput = completed requests/s)")
    g = sim.add_argument_group("check against a measured run")
    g.add_argument("--against", default=None, metavar="RESULT.json",
                   help="a baton plan live (or baton bench) result: simulate its layouts with its workload "
                   "and print the error of each figure")
    g.add_argument("--layout", default=None, help="with a baton bench result: the layout it ran on (2P+1D)")
    g.add_argument("--calibrate", nargs="+", default=None, metavar="RESULT.json",
                   help="fit the profile's host cost (serving-path time around each step) to a measured "
                   "run, write the profile with it (--write-profile) and print the error table it gives")
    g.add_argument("--write-profile", default=None, metavar="OUT.json",
                   help="with --calibrate: where the calibrated profile goes (default: PROFILE_calibrated.json)")
    g = sim.add_argument_group("results")
    g.add_argument("--result-dir", default=None, help="folder for the JSON, Markdown and PNG")
    g.add_argument("--result-file", default=None, help="JSON file name or path (default plan_sim.json)")
    g.add_argument("--no-plot", action="store_true", help="skip the PNG")
    sim.set_defaults(func=run_sim_command)


def add_profile_parser(plan_sub: Any) -> None:
    """Register ``baton plan profile`` under ``baton plan``."""
    prof = plan_sub.add_parser(
        "profile", help="measure this machine's latency profile for baton plan sim",
        description="Run the real engine on crafted steps (prompt chunks over cached context, decode "
        "batches over context, mixed steps) and KV copies/sends, and write the step and transfer times "
        "baton plan sim reads.")
    prof.add_argument("--model", default=None, help="model folder or .gguf (default: embedded model)")
    prof.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                      help="as baton serve resolves it (default auto)")
    prof.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    prof.add_argument("--threads", type=int, default=None, help="threads per step (default: every core)")
    prof.add_argument("--block-size", type=int, default=16)
    prof.add_argument("--max-num-batched-tokens", type=int, default=2048,
                      help="the largest prompt chunk measured (default 2048)")
    prof.add_argument("--connectors", default="shared_memory,collective",
                      help="KV connectors to time (default shared_memory,collective)")
    prof.add_argument("--quick", action="store_true", help="a few points only (tests, a first look)")
    prof.add_argument("--out", default=None, help="JSON path (default profile_<cpu>_<dtype>.json)")
    prof.set_defaults(func=run_profile_command)


def _slug(text: str) -> str:
    out = "".join(c.lower() if c.isalnum() else "-" for c in text).strip("-")
    while "--" in out:
        out = out.replace("--", "-")
    return out[:40] or "machine"


def run_profile_command(args: argparse.Namespace) -> int:
    """Measure and write a profile; 2 with a one-line error for bad options."""
    import os

    from baton_serve.cluster.sim.profiler import measure_profile

    connectors = [c.strip() for c in args.connectors.split(",") if c.strip()]
    unknown = [c for c in connectors if c not in ("shared_memory", "collective")]
    if unknown or args.block_size not in (8, 16, 32, 64, 128) or args.max_num_batched_tokens < 1:
        print("baton plan: error: --connectors takes shared_memory and collective; --block-size 8..128; "
              "--max-num-batched-tokens >= 1", file=sys.stderr)
        return 2
    try:
        profile = measure_profile(args.model, args.dtype, args.threads or os.cpu_count() or 1, args.block_size,
                                  args.max_num_batched_tokens, args.quick, args.device, connectors,
                                  log=lambda msg: print(f"baton plan profile: {msg}", file=sys.stderr, flush=True))
    except ValueError as e:
        print(f"baton plan: error: {e}", file=sys.stderr)
        return 2
    m = profile.machine
    name = m["cpu_model"] if m.get("device") == "cpu" else m["device"]
    path = Path(args.out or f"profile_{_slug(name)}_{profile.model['dtype']}.json")
    profile.dump(path)
    v = profile.mixed["validation"]
    print(f"{name}, {profile.model['name']} {profile.model['dtype']}, {m['threads']} threads: overhead "
          f"{profile.step_overhead_s * 1e3:.1f} ms a step; mixed steps by rule {profile.mixed['rule']}: "
          f"median error {v['median_error']:.1%}, max {v['max_error']:.1%}")
    print(f"baton plan profile: wrote {path}", file=sys.stderr)
    return 0


def _hardware(args: argparse.Namespace, profile: Any) -> Any:
    from baton_serve.cluster.sim.run import SimHardware

    cpu = str(profile.machine.get("device", "cpu")) == "cpu"
    shared = args.shared_cores if args.shared_cores is not None else (int(profile.machine.get("cores", 1)) if cpu else 0)
    threads = args.threads or int(profile.machine.get("threads", 1))
    return SimHardware(shared_cores=shared, threads=min(threads, shared) if shared else threads,
                       workers_per_node=args.workers_per_node)


def run_sim_command(args: argparse.Namespace) -> int:
    """0 when a layout ran; 2 with a one-line error for bad options, profile or workload."""
    from baton_serve.cluster.bench.cli_args import bench_config
    from baton_serve.cluster.bench.plan import parse_ratios
    from baton_serve.cluster.bench.report import write_plan_outputs
    from baton_serve.cluster.config import load_config
    from baton_serve.cluster.sim.plan import (
        plot_sim_plan,
        run_sim_plan,
        search_space,
        sim_plan_json,
        sim_plan_markdown,
    )
    from baton_serve.cluster.sim.profile import LatencyProfile

    try:
        profile = LatencyProfile.load(args.profile)
        hardware = _hardware(args, profile)
        base = load_config(args.config)
        if args.calibrate:
            return _calibrate(args, base, profile, hardware)
        if args.against:
            return _against(args, base, profile, hardware)
        bench = bench_config(args)
        policies = [p.strip() for p in (args.policies or base.router.policy).split(",") if p.strip()]
        budgets = args.max_num_batched_tokens or [base.engine.max_num_batched_tokens]
        cases = search_space(args.workers, parse_ratios(args.ratios) if args.ratios else None, args.colocated,
                             policies, budgets)
        for p in policies:
            base.with_overrides(**{"router.policy": p})  # an unknown policy fails here, naming the known ones
        bench.workload.build(bench.num_prompts, bench.seed)  # a bad workload fails before any process starts
    except (ValueError, OSError) as e:  # ProfileError, ConfigError and WorkloadError are ValueErrors
        print(f"baton plan: error: {e}", file=sys.stderr)
        return 2
    pr = run_sim_plan(base, cases, bench, profile, hardware, seed=bench.seed, jobs=args.jobs,
                      command=shlex.join(["baton", *getattr(args, "argv", [])]), progress=not args.disable_tqdm)
    md = sim_plan_markdown(pr)
    print(md)
    if args.result_file or args.result_dir:
        path = Path(args.result_dir or ".") / (args.result_file or "plan_sim.json")
        plot = None if args.no_plot else (lambda png: plot_sim_plan(pr, png))
        written = write_plan_outputs(sim_plan_json(pr), md, path, plot)
        print(f"baton plan: wrote {', '.join(map(str, written))}", file=sys.stderr)
    return 0 if any(r.ok for r in pr.results) else 1


def _calibrate(args: argparse.Namespace, base: Any, profile: Any, hardware: Any) -> int:
    from baton_serve.cluster.sim.against import compare, error_markdown, load_measured
    from baton_serve.cluster.sim.calibrate import calibrate

    measured = [m for path in args.calibrate for m in load_measured(path, args.layout)]
    if not measured:
        raise ValueError(f"{' '.join(args.calibrate)}: no completed layout to calibrate on")
    names = ", ".join(Path(p).name for p in args.calibrate)
    fitted, after, before = calibrate(measured, base, profile, hardware, names, seed=measured[0].bench.seed)
    out = Path(args.write_profile or Path(args.profile).with_name(Path(args.profile).stem + "_calibrated.json"))
    fitted.dump(out)
    print(error_markdown(compare(measured, base, fitted, hardware, seed=measured[0].bench.seed), names))
    h = fitted.host
    print(f"host cost fitted to {names}: {h.per_step_s * 1e3:g} ms a step + {h.per_token_s * 1e3:g} ms a "
          f"sampled token, {h.per_request_s * 1e3:g} ms a request before routing (mean squared log error "
          f"of p50/p99 TTFT and TPOT {before:.3f} -> {after:.3f})")
    print(f"baton plan: wrote {out}", file=sys.stderr)
    return 0


def _against(args: argparse.Namespace, base: Any, profile: Any, hardware: Any) -> int:
    from baton_serve.cluster.bench.report import write_json
    from baton_serve.cluster.sim.against import compare, error_markdown, load_measured

    measured = load_measured(args.against, args.layout)
    if not measured:
        raise ValueError(f"{args.against} holds no completed layout to compare with")
    rows = compare(measured, base, profile, hardware, seed=measured[0].bench.seed)
    md = error_markdown(rows, Path(args.against).name)
    print(md)
    if args.result_file or args.result_dir:
        path = Path(args.result_dir or ".") / (args.result_file or "plan_sim_against.json")
        write_json({"against": str(args.against), "profile": args.profile, "rows": rows}, path)
        path.with_suffix(".md").write_text(md, encoding="utf-8")
        print(f"baton plan: wrote {path}, {path.with_suffix('.md')}", file=sys.stderr)
    return 0
