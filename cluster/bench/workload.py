"""Workload shapes: how long each prompt and output is, which system prompt it shares, and
trace replay. Prompts themselves are built by :mod:`cluster.bench.prompts`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


class WorkloadError(ValueError):
    """A workload option or trace file that cannot be used; the message names the culprit."""


@dataclass(frozen=True)
class RequestSpec:
    """One request to send. ``prefix_group`` >= 0 marks a shared system prompt of ``prefix_len``
    tokens, included in ``prompt_len``; ``arrival_s`` is set by traces; ``text`` by traces that
    carry literal prompts."""

    prompt_len: int
    output_len: int
    prefix_group: int = -1
    prefix_len: int = 0
    arrival_s: float | None = None
    text: str | None = None


@dataclass(frozen=True)
class LengthDist:
    """Token lengths: ``uniform`` in ``[mean*(1-r), mean*(1+r)]`` (vLLM's ``--random-range-ratio``;
    r = 0 is a fixed length) or ``lognormal`` with the given mean and log-space ``sigma``.
    Samples are clipped to ``[1, max_len]``."""

    mean: int
    kind: str = "uniform"
    range_ratio: float = 0.0
    sigma: float = 0.5
    max_len: int | None = None

    def __post_init__(self) -> None:
        if self.mean < 1:
            raise WorkloadError(f"length must be at least 1, got {self.mean}")
        if self.kind not in ("uniform", "lognormal"):
            raise WorkloadError(f"length distribution must be uniform or lognormal, got {self.kind!r}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise WorkloadError(f"range ratio must be in [0, 1), got {self.range_ratio}")
        if not self.sigma > 0:
            raise WorkloadError(f"lognormal sigma must be positive, got {self.sigma}")

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        """``n`` lengths drawn from ``rng``."""
        if self.kind == "uniform":
            low = max(1, math.floor(self.mean * (1 - self.range_ratio)))
            high = max(low, math.ceil(self.mean * (1 + self.range_ratio)))
            values = rng.integers(low, high + 1, size=n)
        else:
            # mu chosen so that the mean, not the median, is ``mean``.
            mu = math.log(self.mean) - self.sigma**2 / 2
            values = np.rint(rng.lognormal(mu, self.sigma, size=n))
        hi = self.max_len if self.max_len is not None else np.iinfo(np.int64).max
        return [int(v) for v in np.clip(values, 1, hi)]


def random_workload(n: int, input_len: LengthDist, output_len: LengthDist, seed: int = 0) -> list[RequestSpec]:
    """``n`` independent requests with lengths from the two distributions."""
    rng = np.random.default_rng(seed)
    ins, outs = input_len.sample(rng, n), output_len.sample(rng, n)
    return [RequestSpec(prompt_len=i, output_len=o) for i, o in zip(ins, outs)]


def shared_prefix_workload(n: int, num_prefixes: int, prefix_len: int, suffix_len: LengthDist,
                           output_len: LengthDist, seed: int = 0, hot_fraction: float = 0.0) -> list[RequestSpec]:
    """``n`` requests over ``num_prefixes`` system prompts of ``prefix_len`` tokens, each turn a
    fresh suffix, in shuffled order. ``hot_fraction`` 0 spreads them evenly (N prefixes x about n/N
    turns); F > 0 gives ``round(F*n)`` to group 0 (the hot prefix) and spreads the rest evenly over
    groups 1..N-1, so it needs N >= 2."""
    if num_prefixes < 1 or prefix_len < 1:
        raise WorkloadError("a shared-prefix workload needs at least one prefix of at least one token")
    _check_hot_fraction(hot_fraction, num_prefixes)
    rng = np.random.default_rng(seed)
    if hot_fraction > 0:
        n_hot = min(n, math.floor(hot_fraction * n + 0.5))  # half up, not Python's half-to-even
        labels = np.concatenate([np.zeros(n_hot, dtype=int), 1 + np.arange(n - n_hot) % (num_prefixes - 1)])
    else:
        labels = np.arange(n) % num_prefixes
    groups = rng.permutation(labels)
    sufs, outs = suffix_len.sample(rng, n), output_len.sample(rng, n)
    return [RequestSpec(prompt_len=prefix_len + s, output_len=o, prefix_group=int(g), prefix_len=prefix_len)
            for g, s, o in zip(groups, sufs, outs)]


def _check_hot_fraction(hot_fraction: float, num_prefixes: int) -> None:
    if not 0.0 <= hot_fraction < 1.0:
        raise WorkloadError(f"--prefix-repetition-hot-fraction must be in [0, 1), got {hot_fraction}")
    if hot_fraction > 0 and num_prefixes < 2:
        raise WorkloadError(f"--prefix-repetition-hot-fraction {hot_fraction:g} needs at least 2 prefixes "
                            f"(one hot, the rest cold), got --prefix-repetition-num-prefixes {num_prefixes}")


_TIME_KEYS = ("timestamp", "arrival_time")
_PROMPT_LEN_KEYS = ("prompt_len", "input_len")
_OUTPUT_KEYS = ("output_len", "max_tokens")


def _first(row: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((row[k] for k in keys if k in row), None)


def load_trace(path: str | Path) -> list[RequestSpec]:
    """Read a JSONL trace: one object a line with ``timestamp`` (or ``arrival_time``, seconds),
    ``prompt`` (text) or ``prompt_len`` (or ``input_len``), and ``output_len`` (or ``max_tokens``).

    Rows keep the file's order; a missing timestamp means "no timing", and then every row must
    lack it. Raises WorkloadError naming the line of the first bad row.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise WorkloadError(f"cannot read trace {path}: {e}") from e
    specs: list[RequestSpec] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except ValueError as e:
            raise WorkloadError(f"{where}: not JSON ({e})") from None
        if not isinstance(row, dict):
            raise WorkloadError(f"{where}: each line must be a JSON object")
        ts, text, plen, olen = (_first(row, _TIME_KEYS), row.get("prompt"),
                                _first(row, _PROMPT_LEN_KEYS), _first(row, _OUTPUT_KEYS))
        if ts is not None and (not isinstance(ts, (int, float)) or ts < 0):
            raise WorkloadError(f"{where}: timestamp must be a non-negative number of seconds")
        if text is not None and not isinstance(text, str):
            raise WorkloadError(f"{where}: prompt must be a string")
        if text is None and not (isinstance(plen, int) and plen >= 1):
            raise WorkloadError(f"{where}: needs prompt (text) or prompt_len (a positive integer)")
        if not (isinstance(olen, int) and olen >= 1):
            raise WorkloadError(f"{where}: needs output_len (a positive integer)")
        specs.append(RequestSpec(prompt_len=int(plen) if plen is not None else 0, output_len=olen,
                                 arrival_s=None if ts is None else float(ts), text=text))
    if not specs:
        raise WorkloadError(f"trace {path} holds no requests")
    timed = {s.arrival_s is not None for s in specs}
    if len(timed) > 1:
        raise WorkloadError(f"trace {path}: either every row has a timestamp or none does")
    return specs


@dataclass(frozen=True)
class WorkloadConfig:
    """Which workload to build: ``random`` (independent lengths), ``shared-prefix`` (``num_prefixes``
    system prompts of ``prefix_len`` tokens, each request adding an ``input_len`` suffix; a
    ``hot_fraction`` of them on prefix 0, see :func:`shared_prefix_workload`) or ``trace``
    (``trace_path``, a JSONL file; see :func:`load_trace`). The hot fraction is checked here."""

    name: str = "random"
    input_len: LengthDist = LengthDist(1024)
    output_len: LengthDist = LengthDist(128)
    num_prefixes: int = 4
    prefix_len: int = 256
    trace_path: str | None = None
    hot_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.hot_fraction and self.name != "shared-prefix":
            raise WorkloadError("--prefix-repetition-hot-fraction applies to --dataset-name shared-prefix only")
        _check_hot_fraction(self.hot_fraction, self.num_prefixes)

    def build(self, n: int | None, seed: int) -> list[RequestSpec]:
        """The measured requests: ``n`` of them (a trace's first ``n``; all of it when None)."""
        if self.name == "trace":
            if self.trace_path is None:
                raise WorkloadError("the trace workload needs --dataset-path FILE.jsonl")
            rows = load_trace(self.trace_path)
            return rows if n is None else rows[:n]
        if n is None or n < 1:
            raise WorkloadError("--num-prompts must be at least 1")
        if self.name == "random":
            return random_workload(n, self.input_len, self.output_len, seed)
        if self.name == "shared-prefix":
            return shared_prefix_workload(n, self.num_prefixes, self.prefix_len, self.input_len,
                                          self.output_len, seed, self.hot_fraction)
        raise WorkloadError(f"unknown dataset {self.name!r}: use random, shared-prefix or trace")

    def warmups(self, n: int, seed: int) -> list[RequestSpec]:
        """``n`` warm-up requests shaped like the workload but not among the measured ones
        (a trace's first rows without their timestamps, so they do not share its timing)."""
        if n <= 0:
            return []
        if self.name == "trace":
            rows = self.build(n, seed)
            return [RequestSpec(r.prompt_len, r.output_len, text=r.text) for r in rows]
        # Fresh lengths (and, for shared-prefix, fresh prefixes) from another seed, so warm-ups
        # cannot pre-fill the prefix cache for the measured requests.
        return random_workload(n, self.input_len, self.output_len, seed + 1_000_003)
