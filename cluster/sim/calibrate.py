"""Fit a profile's ``host`` cost (the serving path's time the engine step does not show) to
measured runs: the (per step, per sampled token, per request) times whose simulation of the runs'
layouts comes closest to their measured p50 and p99 TTFT and TPOT, by mean squared log error,
searched one coordinate at a time over a grid."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from baton_serve.cluster.config import ClusterConfig
from baton_serve.cluster.sim.against import Measured, compare
from baton_serve.cluster.sim.profile import HostCost, LatencyProfile
from baton_serve.cluster.sim.run import SimHardware

GRID_MS = {"per_step_s": (0.0, 1.0, 2.0, 4.0, 6.0, 8.0, 12.0, 16.0, 20.0, 24.0, 32.0),
           "per_token_s": (0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0),
           "per_request_s": (0.0, 10.0, 25.0, 50.0, 75.0, 100.0, 150.0)}
FIT_METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


def loss(rows: list[dict[str, Any]]) -> float:
    """Mean squared log ratio of simulated to measured, over the fitted metrics of every row."""
    errs = [math.log(c["sim"] / c["live"]) ** 2 for r in rows for key in FIT_METRICS
            for c in [r["metrics"][key]] if c["live"] and c["sim"]]
    return sum(errs) / len(errs) if errs else math.inf


def calibrate(measured: list[Measured], base: ClusterConfig, profile: LatencyProfile, hardware: SimHardware,
              source: str, seed: int = 0, rounds: int = 2) -> tuple[LatencyProfile, float, float]:
    """``profile`` with the fitted ``host`` (``calibrated_against`` = ``source``), its loss, and
    the loss with no host cost."""
    def trial(host: HostCost) -> float:
        return loss(compare(measured, base, dataclasses.replace(profile, host=host), hardware, seed=seed))

    host = HostCost(calibrated_against=source)
    before = best = trial(host)
    for _ in range(rounds):
        moved = False
        for name, grid in GRID_MS.items():
            for ms in grid:
                candidate = dataclasses.replace(host, **{name: ms / 1e3})
                if candidate == host:
                    continue
                value = trial(candidate)
                if value < best - 1e-9:
                    best, host, moved = value, candidate, True
        if not moved:
            break
    return dataclasses.replace(profile, host=host), best, before
