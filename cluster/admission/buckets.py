"""Token buckets for per-tenant request and token rates."""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    """``rate`` units per second up to ``burst``; a charge may overdraw it (a debt paid back by time).

    Requests are charged one unit at the ingress gate (``try_take``); tokens are charged at stage 2,
    when the prompt length is known, and may overdraw the bucket, because a single request larger
    than the burst must still be servable. The gate refuses while the bucket is in debt.
    """

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"rate and burst must be > 0, got {rate} and {burst}")
        self.rate, self.burst, self._clock = rate, burst, clock
        self._level = burst
        self._at = clock()

    @property
    def level(self) -> float:
        """Units available now (negative: in debt)."""
        self._refill()
        return self._level

    def try_take(self, amount: float = 1.0) -> bool:
        """Take ``amount`` if the bucket holds it; False (nothing taken) otherwise."""
        self._refill()
        if self._level < amount:
            return False
        self._level -= amount
        return True

    def charge(self, amount: float) -> None:
        """Take ``amount`` whatever the level (it may go negative)."""
        self._refill()
        self._level -= amount

    def refund(self, amount: float) -> None:
        """Give back what a charge over-estimated (never above the burst)."""
        self._refill()
        self._level = min(self.burst, self._level + amount)

    def seconds_until(self, amount: float = 1.0) -> float:
        """How long until ``amount`` can be taken (0: now); for Retry-After."""
        self._refill()
        if amount > self.burst:
            amount = self.burst
        return max(0.0, (amount - self._level) / self.rate)

    def _refill(self) -> None:
        now = self._clock()
        if now > self._at:
            self._level = min(self.burst, self._level + (now - self._at) * self.rate)
            self._at = now
