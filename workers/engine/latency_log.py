"""Each request's latency as the engine that served it saw it, for the controller's rebalancer:
time to first token where the first token was made, time per output token where the last was.

Numbered, so a reader pulls what is new since its cursor (``since``); bounded, so an engine nobody
reads keeps only the latest. A disaggregated request leaves its TTFT on the prefill worker and its
TPOT on the decode worker; the TPOT divides the time from the first token this engine made for it
to its last by its output tokens less one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class LatencySample:
    """One request's TTFT (``kind`` "ttft") or TPOT ("tpot"), in seconds, with its shape."""

    seq: int
    kind: str
    seconds: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


class LatencyLog:
    """The last ``maxlen`` samples, numbered from 1."""

    def __init__(self, maxlen: int = 8192) -> None:
        self._samples: deque[LatencySample] = deque(maxlen=maxlen)
        self.seq = 0

    def add(self, kind: str, seconds: float, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> None:
        self.seq += 1
        self._samples.append(LatencySample(self.seq, kind, max(seconds, 0.0), prompt_tokens, cached_tokens,
                                           output_tokens))

    def since(self, seq: int) -> tuple[int, list[LatencySample]]:
        """The samples after ``seq`` still kept, and the cursor to pass next time."""
        new: list[LatencySample] = []
        for s in reversed(self._samples):  # newest first: stop at the cursor
            if s.seq <= seq:
                break
            new.append(s)
        return self.seq, new[::-1]
