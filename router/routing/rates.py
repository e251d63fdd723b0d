"""Online estimates of how long work takes on a worker, from its cumulative step statistics.

Every estimate is ``seconds = fixed * count + per_unit * units``: a per-step (or per-shipment)
overhead plus a per-token (or per-byte) cost, fitted by exponentially weighted least squares
over the increments between two stats snapshots (``LinearCost``), or, for a step, over the steps
themselves from the moments the engine sums (``StepFit``: overhead + prompt tokens + decoding
sequences). Nothing is configured: until a worker has done some of the work, ``fitted`` is False
and callers use the pool's other workers (or a prior).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
    version: int = 0  # counts the changes of ``sums``: a pooled fit of them is cached until it moves
    _last: tuple[float, float, float] | None = None
    _sums: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)  # nn, nu, uu, ns, us

    @classmethod
    def of_sums(cls, sums: tuple[float, ...] | list[float], fallback: str = "per_unit") -> LinearCost:
        """The fit to the intervals these (decayed) sums describe: several workers' summed."""
        cost = cls(fallback=fallback, _sums=tuple(float(s) for s in sums))  # type: ignore[arg-type]
        cost._solve()
        return cost

    @property
    def sums(self) -> tuple[float, float, float, float, float]:
        """The decayed least-squares sums the fit solves (nn, nu, uu, ns, us)."""
        return self._sums

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
        self.version += 1
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


# The engine's per-step moments, summed since start: n, P, D, PP, PD, DD, t, tP, tD for steps of t
# seconds computing P prompt tokens and D decode tokens (``EngineCore.step_moments``).
MOMENTS = 9


@dataclass
class StepFit:
    """Fits one step's ``seconds = overhead + per_prefill_token * P + per_decode_seq * D`` to the
    steps themselves, from the moments the engine sums over them.

    Interval totals cannot tell these apart on a worker whose steps all mix a short prompt tail
    with decodes (the holder of a hot prefix): ``LinearCost`` then puts a whole step's time on its
    prompt tokens, several times their real cost. Step by step, the mix varies (a step with no
    prompt, one with a tail, one with a whole prompt), and least squares over the steps separates
    the three. A term is fitted only where the steps tell it apart from the others (the uncentred
    1 - R^2 of its column against the rest at least ``MIN_SPREAD``, as ``LinearCost`` asks), and
    only with every term non-negative; the others stay unfitted and callers use ``LinearCost``.
    """

    decay: float = 0.8
    overhead: float = 0.0
    per_prefill_token: float = 0.0
    per_decode_seq: float = 0.0
    prefill_fitted: bool = False
    decode_fitted: bool = False
    version: int = 0  # counts the changes of ``sums``: a pooled fit of them is cached until it moves
    _last: tuple[float, ...] | None = None
    _sums: tuple[float, ...] = (0.0,) * MOMENTS

    @classmethod
    def of_sums(cls, sums: list[float] | tuple[float, ...]) -> StepFit:
        """The fit to the steps these (decayed) moment sums describe: several workers' summed."""
        fit = cls(_sums=tuple(float(s) for s in sums))
        fit._solve()
        return fit

    @property
    def sums(self) -> tuple[float, ...]:
        """The decayed moment sums the fit solves (n, P, D, PP, PD, DD, t, tP, tD)."""
        return self._sums

    def observe(self, moments: list[float] | tuple[float, ...] | None) -> None:
        """Take the engine's cumulative moments; a step count that went down (a restarted worker)
        starts a new baseline."""
        if not moments or len(moments) != MOMENTS:
            return
        last, self._last = self._last, tuple(float(m) for m in moments)
        if last is None:
            return
        inc = [m - prev for m, prev in zip(self._last, last)]
        if inc[0] < 0:
            self._sums = (0.0,) * MOMENTS  # restarted: the old steps were another process's
            self.version += 1
            return
        if inc[0] == 0:
            return
        self._sums = tuple(self.decay * s + i for s, i in zip(self._sums, inc))
        self.version += 1
        self._solve()

    def _solve(self) -> None:
        n, p, d, pp, pd, dd, t, tp, td = self._sums
        gram = {("1", "1"): n, ("1", "P"): p, ("1", "D"): d, ("P", "P"): pp, ("P", "D"): pd, ("D", "D"): dd}
        rhs = {"1": t, "P": tp, "D": td}
        active = [c for c, sq in (("P", pp), ("D", dd)) if sq > 0]
        while True:
            cols = ["1", *active]
            a = np.array([[gram.get((r, c), gram.get((c, r), 0.0)) for c in cols] for r in cols])
            try:
                inv = np.linalg.inv(a)
            except np.linalg.LinAlgError:
                inv = None
            if inv is not None:
                # uncentred 1 - R^2 of each column against the others: 1 / (G_jj * (G^-1)_jj)
                spread = {c: 1.0 / (a[j, j] * inv[j, j]) if a[j, j] * inv[j, j] > 0 else 0.0
                          for j, c in enumerate(cols) if c != "1"}
                coef = dict(zip(cols, inv @ np.array([rhs[c] for c in cols])))
                weak = [c for c in active if spread[c] < MIN_SPREAD or coef[c] < 0]
                if not weak and coef["1"] >= 0:
                    break
            if not active:
                self.prefill_fitted = self.decode_fitted = False
                return
            # drop a term the steps do not tell apart (or that came out negative), the least
            # distinct first, and solve again without it
            if inv is None:
                active.pop()
            else:
                active.remove(min(weak or active, key=lambda c: spread[c]))
        self.overhead = float(coef["1"])
        self.per_prefill_token = float(coef.get("P", 0.0))
        self.per_decode_seq = float(coef.get("D", 0.0))
        self.prefill_fitted, self.decode_fitted = "P" in active, "D" in active
