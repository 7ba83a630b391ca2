"""The law of a record's weighted visit count ``S`` under each batch schedule, for the linear model.

Both the ground truth (:mod:`hidden_state_accountants.exact`) and one analysis
(``affine_exact_average`` in :mod:`hidden_state_accountants.analyses.shifted_interpolation`) need
this law; it lives here, on its own, with its own brute-force test (every draw of a tiny
schedule enumerated, ``tests/core/test_schedule_laws.py``), so that a bound and the oracle that tests
it do not share an untested piece.

**The model.** Per-example maps ``g_i(theta) = v_i + m theta`` with ``||v_i|| <= C``:
unconstrained DP-SGD from ``theta_0 = 0`` is linear, and along ``e_1``::

    theta_T = drift + (lr 2C / b) S + N(0, nu^2 V),     nu = lr z C / b,
    S = sum_t c^{T-1-t} s_t 1{record in B_t},          V = sum_t c^{2(T-1-t)} nu_t^2,     c = 1 - lr m,

with ``s_t = nu_t = 1`` except for a kept short batch divided by its own size ``r`` (both
``b / r``). Normalised by the noise the shift is ``kappa S`` with ``kappa = (2/z) / sqrt(V)``
(:attr:`Linear.kappa`).

**The law.** :meth:`Linear.exact_law` enumerates the law of ``S`` (the random position of the
record: the partition's batch, each epoch's permutation, each step's draw) up to
:data:`MAX_ENUM` atoms; beyond, :meth:`Linear.grid_laws` puts every independent contribution on a
grid rounded down and up, so that ``S_lo <= S <= S_hi`` pointwise.

>>> from hidden_state_accountants import TrainingRunDpEvent
>>> run = TrainingRunDpEvent(dataset_size=6, batch_size=2, steps=3, noise_multiplier=1.0, clip_norm=1.0,
...     learning_rate=0.5, sampling="cyclic")
>>> Linear(run, 0.5).positions().tolist()  # S of a record in batch 0, 1, 2: used once, 2, 1, 0 steps before the end
[0.25, 0.5, 1.0]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from hidden_state_accountants.errors import ParameterError
from hidden_state_accountants.events import TrainingRunDpEvent
from hidden_state_accountants.schedules import (
    BALLS_IN_BINS,
    CYCLIC,
    DROPPED,
    FULL,
    KEPT_OWN_SIZE,
    POISSON,
    RESHUFFLE,
    SHUFFLE_PARTITION,
    WITHOUT_REPLACEMENT,
)

MAX_ENUM = 200_000
"""The law of ``S`` is enumerated up to this many atoms, else bracketed on a grid."""
GRID_POINTS = 1 << 15
"""Default grid size of the bracket."""


@dataclass(frozen=True)
class Law:
    """A law of ``S``: ``values`` with log-probabilities ``log_w`` (atoms may repeat)."""

    values: np.ndarray
    log_w: np.ndarray

    def merged(self) -> "Law":
        uniq, first, inverse = np.unique(np.round(self.values, 14), return_index=True, return_inverse=True)
        out = np.full(uniq.size, -np.inf)
        np.logaddexp.at(out, inverse.ravel(), self.log_w)
        return Law(self.values[first], out)


@dataclass(frozen=True)
class Linear:
    """The linear model of a run: contraction ``c = 1 - lr m`` and, per step (``d`` steps
    before the end), the shift ``s_d`` and noise ``nu_d`` of a use (1 except a kept short
    batch divided by its own size)."""

    run: TrainingRunDpEvent
    c: float
    init_variance: float = 0.0

    @property
    def spe(self) -> int:
        return self.run.steps_per_epoch

    def short(self) -> Tuple[int, float]:
        """``(r, b/r)``: the kept short batch's size and its scale (1 unless divided by ``r``)."""
        n, b = self.run.dataset_size, self.run.batch_size
        r = n % b
        if self.run.last_batch == DROPPED or r == 0:
            return 0, 1.0
        return r, (b / r if self.run.last_batch == KEPT_OWN_SIZE else 1.0)

    def power(self, k) -> np.ndarray:
        k = np.asarray(k, dtype=float)
        if self.c == 0:
            return (k == 0).astype(float)
        with np.errstate(under="ignore"):
            return np.sign(self.c) ** k * np.exp(k * math.log(abs(self.c)))

    def scale(self, d) -> np.ndarray:
        """``s_d = nu_d`` of the step ``d`` steps before the end."""
        d = np.asarray(d)
        r, scale = self.short()
        if scale == 1.0:
            return np.ones(d.shape)
        T, spe = self.run.steps, self.spe
        return np.where((d % spe) == (T % spe), scale, 1.0)  # the last step of every whole epoch

    def variance(self) -> float:
        """``V = sum_d c^{2d} nu_d^2`` (+ the initial variance in units of ``nu^2``)."""
        T = self.run.steps
        c2 = self.c * self.c
        if c2 == 1.0:
            base = float(T)
        elif c2 == 0.0:
            base = 1.0
        else:
            base = float(-math.expm1(T * math.log(c2)) / -math.expm1(math.log(c2)))
        r, scale = self.short()
        if scale != 1.0:  # the short batches' extra noise
            T, spe = self.run.steps, self.spe
            d = np.arange(T % spe, T, spe) if T % spe else np.arange(0, T, spe)
            d = d[d <= T - spe] if T % spe else d
            base += (scale * scale - 1.0) * float(np.sum(self.power(2 * d)))
        if self.init_variance:
            base += float(self.power(2 * T)) * self.init_variance
        return base

    @property
    def kappa(self) -> float:
        return (2.0 / float(self.run.noise_multiplier)) / math.sqrt(self.variance())

    def contributions(self) -> List[Tuple[np.ndarray, np.ndarray]]:
        """Independent contributions to ``S`` (an epoch for ``reshuffle`` and ``balls_in_bins``, a
        step for ``without_replacement`` / ``poisson``): ``(values, probabilities)``, 0 included
        where it has mass."""
        run = self.run
        T, n, b = run.steps, run.dataset_size, run.batch_size
        out = []
        if run.sampling == BALLS_IN_BINS:  # one uniform step of each epoch; a partial epoch may miss it
            spe = self.spe
            for e in range(-(-T // spe)):
                here = min(spe, T - e * spe)
                vals = self.power(T - 1 - (e * spe + np.arange(here)))
                probs = np.full(here, 1.0 / spe)
                if here < spe:
                    vals, probs = np.append(vals, 0.0), np.append(probs, 1.0 - here / spe)
                out.append((vals, probs))
        elif run.sampling == RESHUFFLE:
            spe = self.spe
            r, _ = self.short()
            for e in range(-(-T // spe)):
                here = min(spe, T - e * spe)
                d = T - 1 - (e * spe + np.arange(here))
                vals = self.power(d) * self.scale(d)
                probs = np.full(here, b / n)
                if r and here == spe:  # the kept short batch holds r of the n records
                    probs[-1] = r / n
                rest = 1.0 - float(np.sum(probs))
                if rest > 1e-15:
                    vals, probs = np.append(vals, 0.0), np.append(probs, rest)
                out.append((vals, probs))
        elif run.sampling in (WITHOUT_REPLACEMENT, POISSON):
            q = run.sampling_rate
            for t in range(T):
                vals = self.power(T - 1 - t)
                out.append(
                    (np.array([float(vals)]), np.array([1.0]))
                    if q >= 1.0
                    else (np.array([float(vals), 0.0]), np.array([q, 1.0 - q]))
                )
        else:
            raise ValueError(run.sampling)
        return out

    def geometric(self, ratio_power: int, count) -> np.ndarray:
        """``sum_{i<count} c^{i ratio_power}`` (elementwise in ``count``)."""
        count = np.asarray(count, dtype=float)
        r = float(self.power(ratio_power))
        if r == 1.0:
            return count
        return (1.0 - self.power(ratio_power * count)) / (1.0 - r)

    def positions(self) -> np.ndarray:
        """``S`` of the record in each batch of a fixed partition (``cyclic``/``shuffle_partition``):
        uses ``l`` steps apart, the last ``m`` steps before the end, ``S = c^m sum_{i<V} c^{l i}``."""
        T, l = self.run.steps, self.spe
        j = np.arange(l)
        full, rest = divmod(T, l)
        visits = full + (j < rest)
        last = np.where(j < rest, rest - 1 - j, rest - 1 - j + l)
        return np.where(visits > 0, self.power(last) * self.geometric(l, visits), 0.0)

    def exact_law(self, position: Optional[int] = None) -> Optional[Law]:
        """The law of ``S`` (``None`` beyond :data:`MAX_ENUM` atoms). ``cyclic``: the worst
        position (largest ``|S|``), or ``position`` (0-based batch)."""
        run = self.run
        n, b = run.dataset_size, run.batch_size
        if run.sampling == FULL:
            return Law(np.array([float(self.geometric(1, run.steps))]), np.zeros(1))
        if run.sampling in (CYCLIC, SHUFFLE_PARTITION):
            per = self.positions()
            if run.sampling == CYCLIC or position is not None:
                j = int(np.argmax(np.abs(per))) if position is None else int(position)
                return Law(per[j : j + 1], np.zeros(1))
            lw = np.full(per.size, math.log(b / n))
            if n - per.size * b:  # records never used: S = 0
                per, lw = np.append(per, 0.0), np.append(lw, math.log((n - per.size * b) / n))
            return Law(per, lw).merged()
        if position is not None:
            raise ParameterError("position", f"applies to cyclic and shuffle_partition, not {run.sampling}")
        parts = self.contributions()
        count = 1
        for vals, _ in parts:
            count *= len(vals)
            if count > MAX_ENUM:
                return None
        vals, lw = np.zeros(1), np.zeros(1)
        for pv, pp in parts:
            with np.errstate(divide="ignore"):
                vals = (vals[:, None] + pv[None, :]).ravel()
                lw = (lw[:, None] + np.log(pp)[None, :]).ravel()
            if vals.size > 4096:
                law = Law(vals, lw).merged()
                vals, lw = law.values, law.log_w
        return Law(vals, lw).merged()

    def grid_laws(self, points: int) -> Tuple[Law, Law]:
        """Laws ``S_lo <= S <= S_hi`` on a grid (see the module docstring)."""
        return self.grid_law(points, up=False), self.grid_law(points, up=True)

    def grid_law(self, points: int, up: bool) -> Law:
        """The law ``S_lo`` (``up=False``) or ``S_hi`` (``up=True``) on a grid of ``points``."""
        if self.c < 0:
            raise ParameterError("learning_rate", "the grid bracket needs c = 1 - lr m >= 0 (a monotone pair)")
        parts = self.contributions()
        h = sum(float(np.max(pv)) for pv, _ in parts) / (points - 8)
        acc = np.full(points + 2, -np.inf)
        acc[0] = 0.0
        fixed = 0.0
        for pv, pp in parts:
            if float(np.max(pv)) < h:  # too small for the grid: dropped / always taken
                fixed += float(np.max(pv)) if up else 0.0
                continue
            idx = np.ceil(pv / h - 1e-12).astype(int) if up else np.floor(pv / h).astype(int)
            new = np.full(acc.size, -np.inf)
            uniq, inverse = np.unique(idx, return_inverse=True)
            lks = np.full(uniq.size, -np.inf)
            with np.errstate(divide="ignore"):
                np.logaddexp.at(lks, inverse.ravel(), np.log(pp))  # the mass of each grid cell
            for k, lk in zip(uniq, lks):
                if k < acc.size:
                    new[k:] = np.logaddexp(new[k:], acc[: acc.size - k] + lk)
            acc = new
        shift = math.ceil(fixed / h - 1e-12) if up else 0
        keep = np.isfinite(acc)
        return Law(((np.arange(acc.size) + shift) * h)[keep], acc[keep])

    def laws(self, position: Optional[int], grid_points: int) -> Tuple[Law, Law, bool]:
        law = self.exact_law(position)
        if law is not None:
            return law, law, True
        lo, hi = self.grid_laws(grid_points)
        return lo, hi, False


def schedule_law(run: TrainingRunDpEvent, grid_points: int = GRID_POINTS) -> Tuple[Law, float]:
    """``(law of S rounded up, kappa)``: the exact law, or the grid's upper law (a law that
    dominates it pointwise), for analyses that average ``G(kappa |S|)`` over it."""
    m = run.geometry.strong_convexity if run.geometry is not None else 0.0
    model = Linear(run, 1.0 - float(run.learning_rate) * m)
    law = model.exact_law()
    if law is None:
        law = model.grid_laws(grid_points)[1]
    return law, model.kappa


__all__ = ["Law", "Linear", "schedule_law", "MAX_ENUM", "GRID_POINTS"]
