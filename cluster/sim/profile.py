"""A latency profile: how long the engine's steps and KV shipments take on one kind of hardware,
as ``baton plan profile`` measures it (or the GPU check script, or a person from published figures).

The simulator asks it for one engine step's time (``step_s``: the step's prompt chunks, each with
the context it attends over, and its decodes) and one shipment's (``transfer_s``). Steps are
read off two measured grids, interpolated bilinearly and extrapolated linearly:

- ``prefill``: a step computing ONE prompt chunk of ``new_tokens`` over ``cached_tokens`` of
  context already in the cache;
- ``decode``: a decode-only step of ``batch`` sequences, each attending ``context_per_seq``
  tokens on average.

A step that mixes several chunks and decodes is composed from them by ``mixed.rule`` (chosen by
the profiler on held-out mixed steps, whose error it records in ``mixed.validation``):

- ``sum``: the parts' times added, less the step overhead each part beyond the first repeats;
- ``rows``: one prefill of all the step's rows (the linear layers see them together), plus what
  each chunk's cached context and the decodes' context add over a context-free step.

``host`` (optional, zero when absent) is the serving path's time that the engine step itself
does not show: around each step (the worker loop, output delivery, and on shared cores the front
and client taking core time from the workers) ``per_step_s`` plus ``per_token_s`` per token the
step samples; before the front routes a request (the HTTP hop, its own work) ``per_request_s``. ``baton plan sim --calibrate RESULT.json`` fits it to a measured run
and records which in ``host.calibrated_against``.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "baton-latency-profile"
VERSION = 1
SOURCES = ("measured", "gpu_check", "published")
RULES = ("sum", "rows")
_MIN_S = 1e-6
_TOP = ("format", "version", "created", "source", "note", "machine", "model", "step_overhead_s", "prefill",
        "decode", "mixed", "kv_transfer", "host")


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the field."""


def _number(value: Any, where: str, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProfileError(f"{where}: must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ProfileError(f"{where}: must be a positive number, got {value!r}")
    if value < 0:
        raise ProfileError(f"{where}: must not be negative, got {value!r}")
    return float(value)


def _field(data: dict[str, Any], key: str, where: str) -> Any:
    if key not in data:
        raise ProfileError(f"{where}{key}: missing")
    return data[key]


def _axis(values: Any, where: str, minimum: int) -> list[int]:
    if not isinstance(values, list) or len(values) < 1:
        raise ProfileError(f"{where}: must be a non-empty list of integers")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ProfileError(f"{where}[{i}]: must be an integer >= {minimum}, got {v!r}")
        if out and v <= out[-1]:
            raise ProfileError(f"{where}[{i}]: the axis must be ascending, got {v} after {out[-1]}")
        out.append(v)
    return out


def _interp1(xs: list[int], ys: list[float], x: float) -> float:
    """Linear in ``xs`` (ascending), extrapolated from the two nearest end points."""
    if len(xs) == 1:
        return ys[0]
    i = bisect.bisect_right(xs, x) - 1
    i = min(max(i, 0), len(xs) - 2)
    x0, x1 = xs[i], xs[i + 1]
    return ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)


@dataclass
class Grid:
    """Seconds measured at each (row, column) point: ``seconds[i][j]`` at ``rows[i]``, ``cols[j]``."""

    row_name: str
    col_name: str
    rows: list[int]
    cols: list[int]
    seconds: list[list[float]]

    @classmethod
    def from_dict(cls, data: Any, where: str, row_name: str, col_name: str, col_min: int) -> Grid:
        if not isinstance(data, dict):
            raise ProfileError(f"{where}: must be an object with {row_name}, {col_name} and seconds")
        extra = set(data) - {row_name, col_name, "seconds"}
        if extra:
            raise ProfileError(f"{where}.{sorted(extra)[0]}: unknown field")
        rows = _axis(_field(data, row_name, f"{where}."), f"{where}.{row_name}", 1)
        cols = _axis(_field(data, col_name, f"{where}."), f"{where}.{col_name}", col_min)
        table = _field(data, "seconds", f"{where}.")
        if not isinstance(table, list) or len(table) != len(rows):
            raise ProfileError(f"{where}.seconds: must have one row per {row_name} ({len(rows)})")
        seconds = []
        for i, row in enumerate(table):
            if not isinstance(row, list) or len(row) != len(cols):
                raise ProfileError(f"{where}.seconds[{i}]: must have one value per {col_name} ({len(cols)})")
            seconds.append([_number(v, f"{where}.seconds[{i}][{j}]") for j, v in enumerate(row)])
        return cls(row_name, col_name, rows, cols, seconds)

    def to_dict(self) -> dict[str, Any]:
        return {self.row_name: list(self.rows), self.col_name: list(self.cols),
                "seconds": [list(r) for r in self.seconds]}

    def at(self, row: float, col: float) -> float:
        """Bilinear inside the grid, linear beyond its edges; never below a microsecond."""
        rows = self.rows
        if len(rows) == 1:
            return max(_interp1(self.cols, self.seconds[0], col), _MIN_S)
        # only the two rows around ``row`` (the nearest two beyond the edges) take part
        i = min(max(bisect.bisect_right(rows, row) - 1, 0), len(rows) - 2)
        pair = [_interp1(self.cols, self.seconds[i + k], col) for k in (0, 1)]
        return max(_interp1(rows[i:i + 2], pair, row), _MIN_S)


@dataclass
class TransferCost:
    """Shipping ``n`` blocks takes ``fixed_s + n * per_block_s``."""

    fixed_s: float
    per_block_s: float


@dataclass
class HostCost:
    """Serving-path time around a step (``per_step_s + tokens * per_token_s``, on the worker's
    cores) and before a request is routed (``per_request_s``, at the front)."""

    per_step_s: float = 0.0
    per_token_s: float = 0.0
    per_request_s: float = 0.0  # before the front routes a request (the HTTP hop, the front's work)
    calibrated_against: str = ""

    @classmethod
    def from_dict(cls, data: Any) -> HostCost:
        if not isinstance(data, dict):
            raise ProfileError("host: must be an object with per_step_s and per_token_s")
        extra = set(data) - {"per_step_s", "per_token_s", "per_request_s", "calibrated_against"}
        if extra:
            raise ProfileError(f"host.{sorted(extra)[0]}: unknown field")
        where = data.get("calibrated_against", "")
        if not isinstance(where, str):
            raise ProfileError("host.calibrated_against: must be a string")
        return cls(_number(_field(data, "per_step_s", "host."), "host.per_step_s", False),
                   _number(_field(data, "per_token_s", "host."), "host.per_token_s", False),
                   _number(data.get("per_request_s", 0.0), "host.per_request_s", False), where)

    def to_dict(self) -> dict[str, Any]:
        return {"per_step_s": self.per_step_s, "per_token_s": self.per_token_s, "per_request_s": self.per_request_s,
                "calibrated_against": self.calibrated_against}


@dataclass
class LatencyProfile:
    """Step and shipment times of one kind of hardware running one model (see the module docstring)."""

    source: str
    machine: dict[str, Any]
    model: dict[str, Any]
    step_overhead_s: float
    prefill: Grid
    decode: Grid
    mixed: dict[str, Any] = field(default_factory=lambda: {"rule": "sum", "validation": None})
    kv_transfer: dict[str, TransferCost] = field(default_factory=dict)
    note: str = ""
    created: str = ""
    host: HostCost = field(default_factory=HostCost)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ProfileError(f"source: must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if self.source == "published" and not self.note.strip():
            raise ProfileError("note: a published profile must cite the figures it was written from")
        for key in ("dtype", "kv_block_bytes", "block_size"):
            if key not in self.model:
                raise ProfileError(f"model.{key}: missing")
        _number(self.model["kv_block_bytes"], "model.kv_block_bytes")
        _number(self.model["block_size"], "model.block_size")
        _number(self.step_overhead_s, "step_overhead_s", positive=False)
        rule = self.mixed.get("rule") if isinstance(self.mixed, dict) else None
        if rule not in RULES:
            raise ProfileError(f"mixed.rule: must be one of {', '.join(RULES)}, got {rule!r}")
        self._rule_rows = rule == "rows"

    # ------------------------------------------------------------------ times
    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        """One step computing one prompt chunk of ``new_tokens`` over ``cached_tokens`` of cached context."""
        return self.prefill.at(new_tokens, cached_tokens)

    def decode_s(self, batch: int, context_tokens: int) -> float:
        """One decode-only step of ``batch`` sequences attending ``context_tokens`` in all."""
        return self.decode.at(batch, context_tokens / max(batch, 1))

    def step_s(self, chunks: Sequence[tuple[int, int]], decode_batch: int, decode_context: int) -> float:
        """One step of prompt ``chunks`` ((new, cached) each) and ``decode_batch`` decodes attending
        ``decode_context`` tokens in all; 0.0 for an empty step."""
        if not chunks:
            return self.decode_s(decode_batch, decode_context) if decode_batch else 0.0
        if len(chunks) == 1 and not decode_batch:
            return self.prefill_s(*chunks[0])
        grid = self.prefill
        if self._rule_rows:
            rows = sum(n for n, _ in chunks) + decode_batch
            t = grid.at(rows, 0)
            for n, c in chunks:
                if c:
                    t += grid.at(n, c) - grid.at(n, 0)
            if decode_batch:
                # the decodes' context beyond one token each, and their sampled rows
                t += self.decode_s(decode_batch, decode_context) - grid.at(decode_batch, 0)
            return max(t, _MIN_S)
        parts = [grid.at(n, c) for n, c in chunks]
        if decode_batch:
            parts.append(self.decode_s(decode_batch, decode_context))
        return max(sum(parts) - self.step_overhead_s * (len(parts) - 1), _MIN_S)

    def host_s(self, sampled_tokens: int) -> float:
        """The serving path's time around a step that samples ``sampled_tokens`` tokens."""
        return self.host.per_step_s + sampled_tokens * self.host.per_token_s

    def transfer_s(self, connector: str, blocks: int) -> float:
        """Shipping ``blocks`` KV blocks over ``connector`` (a name in ``kv_transfer``)."""
        cost = self.kv_transfer.get(connector)
        if cost is None:
            have = ", ".join(sorted(self.kv_transfer)) or "none"
            raise ProfileError(f"kv_transfer.{connector}: not in this profile (it has: {have}); "
                               "measure it with baton plan profile --connectors")
        return cost.fixed_s + blocks * cost.per_block_s

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict[str, Any]:
        out = {"format": FORMAT, "version": VERSION, "created": self.created, "source": self.source,
               "note": self.note, "machine": dict(self.machine), "model": dict(self.model),
               "step_overhead_s": self.step_overhead_s, "prefill": self.prefill.to_dict(),
               "decode": self.decode.to_dict(), "mixed": dict(self.mixed),
               "kv_transfer": {k: {"fixed_s": v.fixed_s, "per_block_s": v.per_block_s}
                               for k, v in sorted(self.kv_transfer.items())}}
        if self.host != HostCost():
            out["host"] = self.host.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Any) -> LatencyProfile:
        """Validate and build; ProfileError names the first field that is wrong."""
        if not isinstance(data, dict):
            raise ProfileError("a profile is a JSON object")
        extra = set(data) - set(_TOP)
        if extra:
            raise ProfileError(f"{sorted(extra)[0]}: unknown field")
        if _field(data, "format", "") != FORMAT:
            raise ProfileError(f"format: must be {FORMAT!r}, got {data['format']!r}")
        if _field(data, "version", "") != VERSION:
            raise ProfileError(f"version: this baton reads version {VERSION}, got {data['version']!r}")
        for key in ("machine", "model", "mixed", "kv_transfer"):
            if not isinstance(_field(data, key, ""), dict):
                raise ProfileError(f"{key}: must be an object")
        for key in ("source", "note", "created"):
            if not isinstance(data.get(key, ""), str):
                raise ProfileError(f"{key}: must be a string")
        transfers = {}
        for name, cost in data["kv_transfer"].items():
            where = f"kv_transfer.{name}"
            if not isinstance(cost, dict):
                raise ProfileError(f"{where}: must be an object with fixed_s and per_block_s")
            transfers[name] = TransferCost(_number(_field(cost, "fixed_s", f"{where}."), f"{where}.fixed_s", False),
                                           _number(_field(cost, "per_block_s", f"{where}."), f"{where}.per_block_s"))
        return cls(source=_field(data, "source", ""), machine=data["machine"], model=data["model"],
                   step_overhead_s=_number(_field(data, "step_overhead_s", ""), "step_overhead_s", False),
                   prefill=Grid.from_dict(_field(data, "prefill", ""), "prefill", "new_tokens", "cached_tokens", 0),
                   decode=Grid.from_dict(_field(data, "decode", ""), "decode", "batch", "context_per_seq", 1),
                   mixed=data["mixed"], kv_transfer=transfers, note=data.get("note", ""),
                   created=data.get("created", ""),
                   host=HostCost.from_dict(data["host"]) if "host" in data else HostCost())

    def dump(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> LatencyProfile:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ProfileError(f"cannot read profile {path}: {exc}") from None
        except ValueError as exc:
            raise ProfileError(f"profile {path} is not JSON: {exc}") from None
        return cls.from_dict(data)
