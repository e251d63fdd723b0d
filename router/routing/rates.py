"""Online estimates of how long work takes on a worker, from its cumulative step statistics.

Every estimate is ``seconds = fixed * count + per_unit * units``: a per-step (or per-shipment)
overhead plus a per-token (or per-byte) cost, fitted by exponentially weighted least squares
over the increments between two stats snapshots. Nothing is configured: until a worker has done
some of the work, ``fitted`` is False and callers use the pool's other workers (or a prior).
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_SPREAD = 0.02  # how unlike (1 - r^2) the intervals' units per step must be to fit two terms


@dataclass
class LinearCost:
    """Fits ``seconds = fixed * count + per_unit * units`` to interval totals.

    ``observe`` takes *cumulative* counters; a counter that went down (the worker restarted)
    starts a new baseline. ``decay`` weighs older intervals down, so the fit follows a worker
    whose speed changes (a co-located neighbour got busy).
    """

    decay: float = 0.8
    min_units: float = 1.0
    # Where the time goes while the intervals are too alike to tell the two terms apart: a decode
    # step's cost is mostly fixed (the weights are read once whatever the batch), a prefill's
    # and a shipment's mostly per token or byte.
    fallback: str = "per_unit"
    fixed: float = 0.0
    per_unit: float = 0.0
    fitted: bool = False
    _last: tuple[float, float, float] | None = None
    _sums: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)  # nn, nu, uu, ns, us

    def observe(self, count: float, units: float, seconds: float) -> None:
        last, self._last = self._last, (count, units, seconds)
        if last is None:
            return
        dn, du, ds = count - last[0], units - last[1], seconds - last[2]
        if dn < 0 or du < 0 or ds < 0:  # restarted: this snapshot is the new baseline
            return
        if du < self.min_units or ds <= 0:
            return
        k = self.decay
        nn, nu, uu, ns, us = self._sums
        self._sums = (k * nn + dn * dn, k * nu + dn * du, k * uu + du * du, k * ns + dn * ds, k * us + du * ds)
        self._solve()

    def _solve(self) -> None:
        nn, nu, uu, ns, us = self._sums
        det = nn * uu - nu * nu
        # det / (nn * uu) is 1 - r^2 of count against units: intervals that all take about as many
        # units per step (a worker fed only short turns) cannot tell overhead from per-unit cost,
        # and a two-term solve of them turns a few percent of timing noise into a rate 10x off
        if det > MIN_SPREAD * max(nn * uu, 1e-30):
            fixed, per_unit = (uu * ns - nu * us) / det, (nn * us - nu * ns) / det
            if fixed >= 0 and per_unit >= 0 and fixed + per_unit > 0:
                self.fixed, self.per_unit, self.fitted = fixed, per_unit, True
                return
        if self.fallback == "fixed" and nn > 0:
            self.fixed, self.per_unit, self.fitted = ns / nn, 0.0, True
        elif uu > 0:
            self.fixed, self.per_unit, self.fitted = 0.0, us / uu, True

    def seconds(self, units: float, count: float = 1.0) -> float:
        return self.fixed * count + self.per_unit * units

    @property
    def units_per_second(self) -> float | None:
        """The marginal rate (units per second of work), or None before a fit or without a per-unit term."""
        return 1.0 / self.per_unit if self.fitted and self.per_unit > 0 else None
