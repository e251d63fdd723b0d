"""Kernel choice measured on the CPU at hand, not assumed from the CPUs developers had.

For each matmul shape a model runs, the candidate weight layouts (oneDNN's blocked layout packed
for 1, 64 or 512 rows; the plain weight through ``F.linear``, MKL/oneDNN with AMX where the CPU has
it; Baton's own panel kernel, ``kernels.invariant_linear``, which sums in one order) are timed at the engine's decode and prefill row counts; for its attention geometry, the
native C flash kernel against torch's SDPA (``kernels.sdpa_attention``). Each op keeps the
candidate with the lowest summed slowdown against the best at each row count, so a layout that is
fastest at prefill but 3x slower at decode does not win (rows: 1, the decode batch, the prefill
chunk; on Zen 4 in bf16 the panel kernel won at 1 row by 15-35% and lost at 2048 by 4-10%). Verdicts are cached per CPU model, flags,
torch version and thread count (workers starting together on one machine agree: the first measures
under a lock, the others read its table).

Overrides: ``BATON_KERNEL_TUNING=0`` takes the built-in defaults without measuring;
``BATON_LINEAR_KERNEL`` / ``BATON_PREFILL_ATTENTION`` force one candidate; ``BATON_PACKED_LINEAR=0``
and ``BATON_KERNEL_BACKEND`` keep their meaning (no packing; one kernel backend for everything).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from baton_serve.kernels import (
    backend,
    capabilities,
    cpu_ops,
    invariant_linear,
    packed_linear,
    sdpa_attention,
)

log = logging.getLogger("baton.kernels")

LINEAR_KERNELS = ("packed:1", "packed:64", "packed:512", "plain", "invariant")
PREFILL_ATTENTION_KERNELS = ("native", "sdpa")
_PREFILL_IMPLS: dict[str, Callable[..., torch.Tensor]] = {
    "native": cpu_ops.paged_prefill_attention, "sdpa": sdpa_attention.paged_prefill_attention}
_REPEATS = 5
_SAMPLE_MS = 2.0  # each sample repeats a fast call up to about this long
_SHAPE_BUDGET_S = 3.0  # per op: a large model's shapes stop repeating once this is spent
_BLOCK = 16
_PROMPT_TOKENS = 512  # attention is timed on one prompt of this many tokens, fresh and after as many cached
TIE_TOLERANCE = 0.03  # a default within 3% of the fastest keeps its place


class KernelChoiceError(ValueError):
    """A ``BATON_*`` kernel override names no candidate."""


@dataclass(frozen=True)
class Workload:
    """Row counts the engine's steps run: a decode batch and a prefill chunk (capped: the choice
    is the same beyond them and the measurement would only take longer)."""

    decode_rows: int = 32
    prefill_rows: int = 2048  # a chunked-prefill step: its decode and prefill tokens in one call

    def linear_rows(self, decode_only: bool) -> list[int]:
        """The row counts a linear layer is timed at: one stream (what TPOT at low load is made
        of), the decode batch, and unless only decode rows reach it (the LM head) the prefill chunk."""
        rows = [1, self.decode_rows] + ([] if decode_only else [self.prefill_rows])
        return sorted(set(rows))

    @classmethod
    def for_engine(cls, max_num_seqs: int, max_num_batched_tokens: int) -> Workload:
        return cls(_pow2(min(max_num_seqs, 64)), _pow2(min(max_num_batched_tokens, 2048)))


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass(frozen=True)
class Choice:
    """One op's verdict: the candidate taken, why, and each candidate's ms per row count."""

    op: str  # "linear" or "prefill_attention"
    shape: str  # "960x576 bfloat16", "hq9 hkv3 d64 bfloat16"
    kernel: str
    reason: str  # "measured", "cached", "forced by BATON_...", "default (...)"
    ms: dict[str, list[float]] = field(default_factory=dict)
    rows: list[int] = field(default_factory=list)  # linear: batch rows; attention: context tokens of a prompt chunk


@dataclass
class KernelPlan:
    """The kernels a model runs on this CPU: a layout per linear weight shape, a prefill attention kernel."""

    linear: dict[tuple[int, int], Choice] = field(default_factory=dict)
    prefill_attention: Choice | None = None

    def linear_kernel(self, weight: torch.Tensor) -> str | None:
        """The layout for ``weight`` (None: the default)."""
        choice = self.linear.get((int(weight.shape[0]), int(weight.shape[1])))
        return None if choice is None else choice.kernel

    def prefill_attention_impl(self) -> Callable[..., torch.Tensor] | None:
        choice = self.prefill_attention
        return None if choice is None else _PREFILL_IMPLS[choice.kernel]

    def choices(self) -> list[Choice]:
        return [*self.linear.values(), *([self.prefill_attention] if self.prefill_attention else [])]

    def table(self) -> str:
        """One line per op: the kernel taken and every candidate's time, for the start-up log."""
        lines = []
        for c in self.choices():
            times = "; ".join(f"{name} " + "/".join(f"{t:.3f}" for t in ts) for name, ts in c.ms.items())
            rows = "/".join(str(r) for r in c.rows)
            unit = "rows" if c.op == "linear" else "context tokens"
            lines.append(f"{c.op} {c.shape}: {c.kernel} ({c.reason}"
                         f"{f'; ms at {rows} {unit}: {times}' if times else ''})")
        return "\n".join(lines)


def prepare_weight(weight: torch.Tensor, kernel: str | None,
                   invariant: bool = False) -> torch.Tensor | invariant_linear.InvariantWeight | None:
    """``weight`` in the layout ``kernel`` names (None: the default packing; ``invariant``: the
    deterministic mode's panels whatever the plan): a oneDNN-packed tensor, the invariant kernel's
    panels, or None where the plain weight runs through ``F.linear``."""
    if invariant or kernel == "invariant":
        return invariant_linear.pack(weight)
    if kernel == "plain":
        return None
    return packed_linear.pack(weight, None if kernel is None else int(kernel.split(":")[1]))


def tuning_enabled() -> bool:
    return os.environ.get("BATON_KERNEL_TUNING", "1").strip().lower() not in ("0", "false", "no", "off")


def _forced(var: str, allowed: tuple[str, ...]) -> str | None:
    value = os.environ.get(var, "").strip()
    if value in ("", "auto"):
        return None
    if value not in allowed:
        raise KernelChoiceError(f"{var} must be 'auto' or one of {', '.join(allowed)}, got {value!r}")
    return value


def pick(ms: dict[str, list[float]], prefer: str | None = None, tolerance: float = TIE_TOLERANCE) -> str:
    """The candidate with the lowest sum over row counts of its time over the best time there;
    ``prefer`` (the default) wins while within ``tolerance`` of that, so that timing noise between
    layouts that run alike does not flip a machine's choice from one start to the next."""
    best = [min(ts[i] for ts in ms.values()) for i in range(len(next(iter(ms.values()))))]
    score = {name: sum(t / max(b, 1e-9) for t, b in zip(ts, best)) for name, ts in ms.items()}
    winner = min(score, key=lambda name: (score[name], name))
    if prefer in score and score[prefer] <= score[winner] * (1 + tolerance):
        return prefer
    return winner


# -- the store -----------------------------------------------------------------------------------

def _cache_file(threads: int) -> Path:
    info = capabilities.cpu()
    key = "\0".join([info.arch, info.model_name, *sorted(info.flags), torch.__version__, str(threads),
                     os.environ.get("BATON_CPU_TARGET", "")])
    root = os.environ.get("BATON_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "baton")
    return Path(root) / "capabilities" / f"kernels_{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


@contextmanager
def _locked_store(threads: int) -> Iterator[tuple[dict[str, Any], Callable[[], None]]]:
    """The cached verdicts and a ``save`` that writes them back atomically, under the machine's lock."""
    path = _cache_file(threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = _read(path)

        def save() -> None:
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
                json.dump(entries, f, indent=1, sort_keys=True)
            os.replace(f.name, path)

        yield entries, save


# -- measuring -----------------------------------------------------------------------------------

def _calls_per_sample(fn: Callable[[], Any]) -> int:
    """How many calls of ``fn`` make a sample of ~``_SAMPLE_MS``: a one-row matmul takes
    microseconds, and a single call's time is mostly timer and scheduler noise."""
    started = time.perf_counter()
    fn()
    once = (time.perf_counter() - started) * 1e3
    return max(1, min(1000, int(_SAMPLE_MS / max(once, 1e-4))))


def _timed(fn: Callable[[], Any], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) * 1e3 / calls


def _measure(calls: dict[str, list[Callable[[], Any]]]) -> dict[str, list[float]]:
    """ms per call of each candidate at each row count: the fastest of up to ``_REPEATS`` samples,
    candidates taking turns so that a neighbour's burst of load lands on all of them (a slowdown,
    never a speed-up, which the minimum discards)."""
    for fns in calls.values():  # warm-up: oneDNN builds its kernels on the first call of a shape
        for fn in fns:
            fn()
    counts = {name: [_calls_per_sample(fn) for fn in fns] for name, fns in calls.items()}
    times = {name: [float("inf")] * len(fns) for name, fns in calls.items()}
    deadline = time.monotonic() + _SHAPE_BUDGET_S
    for round_ in range(_REPEATS):
        for name, fns in calls.items():
            for i, fn in enumerate(fns):
                times[name][i] = min(times[name][i], _timed(fn, counts[name][i]))
        if round_ >= 1 and time.monotonic() > deadline:
            break
    return {name: [round(t, 4) for t in ts] for name, ts in times.items()}


def _linear_calls(out_features: int, in_features: int, dtype: torch.dtype,
                  rows: list[int]) -> dict[str, list[Callable[[], Any]]]:
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5).to(dtype)
    inputs = [torch.randn(r, in_features, generator=gen).to(dtype) for r in rows]
    calls: dict[str, list[Callable[[], Any]]] = {}
    if cpu_ops.available() and dtype in (torch.bfloat16, torch.float32):
        panels = invariant_linear.pack(weight)
        calls["invariant"] = [lambda x=x: invariant_linear.linear(x, panels) for x in inputs]
    for name in LINEAR_KERNELS:
        packed = None
        if name == "invariant":
            continue
        if name != "plain":
            packed = packed_linear.pack(weight, int(name.split(":")[1]))
            if packed is None:  # oneDNN refuses this dtype or CPU: not a candidate here
                continue
        calls[name] = [lambda x=x, p=packed: packed_linear.linear(x, weight, p) for x in inputs]
    return calls


def _prefill_calls(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   tokens: int) -> dict[str, list[Callable[[], Any]]]:
    """A fresh prompt of ``tokens`` and a chunk of ``tokens`` after as many cached ones."""
    gen = torch.Generator().manual_seed(0)
    blocks = 2 * tokens // _BLOCK + 1
    k_cache = torch.randn(blocks, _BLOCK, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, _BLOCK, num_kv_heads, head_dim, generator=gen).to(dtype)
    query = torch.randn(tokens, num_heads, head_dim, generator=gen).to(dtype)
    table = torch.arange(blocks, dtype=torch.int32).view(1, -1)
    start_loc = torch.tensor([0, tokens], dtype=torch.int32)
    cases = [torch.tensor([tokens], dtype=torch.int32), torch.tensor([2 * tokens], dtype=torch.int32)]
    scale = head_dim ** -0.5
    names = ["native", "sdpa"] if cpu_ops.available() else ["sdpa"]
    return {name: [lambda lens=lens, f=_PREFILL_IMPLS[name]: f(query, k_cache, v_cache, table, lens, start_loc, scale)
                   for lens in cases] for name in names}


# -- choosing ------------------------------------------------------------------------------------

def runnable(kernel: str, dtype: torch.dtype) -> bool:
    """Whether ``kernel`` can run here at all: Baton's own kernels need the native library (a cache
    written where it built may be read where it does not), the panel kernel bf16 or fp32."""
    if kernel == "invariant":
        return cpu_ops.available() and dtype in (torch.bfloat16, torch.float32)
    if kernel == "native":
        return cpu_ops.available()
    return True


def _decide(entries: dict[str, Any], key: str, op: str, shape: str, rows: list[int], default: str,
            dtype: torch.dtype, calls: Callable[[], dict[str, list[Callable[[], Any]]]]) -> tuple[Choice, bool]:
    cached = entries.get(key)
    if (isinstance(cached, dict) and cached.get("kernel") in cached.get("ms", {})
            and runnable(cached["kernel"], dtype)):
        return Choice(op, shape, cached["kernel"], "cached", cached["ms"], rows), False
    candidates = calls()
    ms = _measure(candidates) if len(candidates) > 1 else {name: [] for name in candidates}
    kernel = pick(ms, default) if len(candidates) > 1 else next(iter(candidates))
    entries[key] = {"kernel": kernel, "ms": ms, "rows": rows}
    return Choice(op, shape, kernel, "measured", ms, rows), True


def plan_for(linear_shapes: dict[tuple[int, int], bool], attention: tuple[int, int, int] | None,
             dtype: torch.dtype, workload: Workload | None = None) -> KernelPlan | None:
    """The kernels for a CPU model with these linear weight shapes (``(out, in)`` -> whether only
    decode-sized batches reach it, as the LM head) and attention geometry ``(hq, hkv, d)`` (None:
    keep the default), measured or read from the cache; None under a forced kernel backend."""
    if backend.forced() is not None:
        return None
    forced_linear = _forced("BATON_LINEAR_KERNEL", LINEAR_KERNELS)
    forced_attention = _forced("BATON_PREFILL_ATTENTION", PREFILL_ATTENTION_KERNELS)
    if not packed_linear.enabled():
        forced_linear = forced_linear or "plain"
    for var, kernel in (("BATON_LINEAR_KERNEL", forced_linear), ("BATON_PREFILL_ATTENTION", forced_attention)):
        if kernel is not None and not runnable(kernel, dtype):
            raise KernelChoiceError(f"{var}={kernel} cannot run here: it needs Baton's native CPU kernels"
                                    f"{' and bf16 or fp32' if kernel == 'invariant' else ''} ({cpu_ops.describe()})")
    workload = workload or Workload()
    tune = tuning_enabled()
    measure_linear = tune and forced_linear is None
    measure_attention = tune and forced_attention is None and attention is not None
    plan = _fixed_plan({} if measure_linear else linear_shapes, None if measure_attention else attention, dtype,
                       forced_linear, forced_attention)
    if measure_linear or measure_attention:
        _measured_into(plan, linear_shapes if measure_linear else {}, attention if measure_attention else None,
                       dtype, workload)
    log.info("kernel choice (%s threads, decode %d rows, prefill %d rows):\n%s", torch.get_num_threads(),
             workload.decode_rows, workload.prefill_rows, plan.table())
    return plan


def _fixed_plan(shapes: dict[tuple[int, int], bool], attention: tuple[int, int, int] | None, dtype: torch.dtype,
                forced_linear: str | None, forced_attention: str | None) -> KernelPlan:
    plan = KernelPlan()
    default_linear = _default_linear(dtype)
    for out_features, in_features in shapes:
        kernel, reason = ((forced_linear, "forced by BATON_LINEAR_KERNEL or BATON_PACKED_LINEAR") if forced_linear
                          else (default_linear, "default: BATON_KERNEL_TUNING=0"))
        plan.linear[(out_features, in_features)] = Choice("linear", f"{out_features}x{in_features} {_name(dtype)}",
                                                          kernel, reason)
    if attention is not None:
        kernel, reason = ((forced_attention, "forced by BATON_PREFILL_ATTENTION") if forced_attention
                          else (_default_attention(), "default: BATON_KERNEL_TUNING=0"))
        plan.prefill_attention = Choice("prefill_attention", _geometry_name(attention, dtype), kernel, reason)
    return plan


def _default_linear(dtype: torch.dtype) -> str:
    hint = packed_linear.default_hint(dtype)
    return "plain" if hint is None else f"packed:{hint}"


def _default_attention() -> str:
    return "native" if cpu_ops.available() else "sdpa"


def _measured_into(plan: KernelPlan, shapes: dict[tuple[int, int], bool], attention: tuple[int, int, int] | None,
                   dtype: torch.dtype, workload: Workload) -> None:
    dtype_name = _name(dtype)
    with _locked_store(torch.get_num_threads()) as (entries, save):
        changed = False
        for (out_features, in_features), decode_only in shapes.items():
            rows = workload.linear_rows(decode_only)
            key = f"linear {out_features}x{in_features} {dtype_name} rows {'/'.join(map(str, rows))}"
            choice, new = _decide(entries, key, "linear", f"{out_features}x{in_features} {dtype_name}", rows,
                                  _default_linear(dtype), dtype,
                                  lambda o=out_features, i=in_features, r=rows: _linear_calls(o, i, dtype, r))
            plan.linear[(out_features, in_features)] = choice
            changed |= new
        if attention is not None:
            hq, hkv, d = attention
            tokens = min(workload.prefill_rows, _PROMPT_TOKENS)
            key = f"prefill_attention {_geometry_name(attention, dtype)} tokens {tokens}"
            choice, new = _decide(entries, key, "prefill_attention", _geometry_name(attention, dtype),
                                  [tokens, 2 * tokens], _default_attention(), dtype,
                                  lambda: _prefill_calls(hq, hkv, d, dtype, tokens))
            plan.prefill_attention = choice
            changed |= new
        if changed:
            save()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _geometry_name(attention: tuple[int, int, int], dtype: torch.dtype) -> str:
    hq, hkv, d = attention
    return f"hq{hq} hkv{hkv} d{d} {_name(dtype)}"


def as_dict(plan: KernelPlan) -> list[dict[str, Any]]:
    """The plan as plain data (benchmarks write it next to their figures)."""
    return [asdict(c) for c in plan.choices()]


__all__ = ["LINEAR_KERNELS", "PREFILL_ATTENTION_KERNELS", "Choice", "KernelChoiceError", "KernelPlan", "Workload",
           "as_dict", "pick", "plan_for", "prepare_weight", "runnable", "tuning_enabled"]
