"""Arrival schedules for open-loop runs: offsets in seconds from the start of the run.

Inter-arrival gaps are gamma-distributed with mean ``1 / rate`` and shape ``burstiness``
(vLLM's convention): burstiness 1 is a Poisson process, below 1 burstier (coefficient of
variation ``1 / sqrt(burstiness)``), above 1 smoother, and infinity evenly spaced. A rate of
infinity sends everything at once.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """``n`` non-decreasing offsets, the first at 0; ValueError for a non-positive rate or burstiness."""
    if n <= 0:
        return []
    if not rate > 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n - 1, 1.0 / rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    # The first request goes at once, so the run's duration is not padded by a random lead-in.
    return [0.0, *np.cumsum(gaps).tolist()]


def trace_offsets(timestamps: list[float], speedup: float = 1.0) -> list[float]:
    """A trace's timestamps shifted to start at 0 and divided by ``speedup``, in the trace's order."""
    if not speedup > 0:
        raise ValueError(f"trace speed-up must be positive, got {speedup}")
    if not timestamps:
        return []
    start = min(timestamps)
    return [(t - start) / speedup for t in timestamps]
