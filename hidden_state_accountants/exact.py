"""Ground truth: the exact last-iterate privacy of the worst known neighbouring pair.

Every valid bound must be at least these values; the soundness tests, ``hsa audit`` and the
tightness benchmark compare against them (docs/derivations.md, section 1).

**The model.** Per-example maps ``g_i(theta) = v_i + m theta`` with ``||v_i|| <= C``: a
quadratic loss whose curvature is the L2 term, ``m``-strongly convex and ``M``-smooth for
every ``M >= m``. Unconstrained DP-SGD from ``theta_0 = 0`` (docs/design.md, section 1) is
linear, and along ``e_1`` (the other coordinates have the same law under both datasets)::

    theta_T = drift + (lr 2C / b) S + N(0, nu^2 V),     nu = lr z C / b,
    S = sum_t c^{T-1-t} s_t 1{record in B_t},          V = sum_t c^{2(T-1-t)} nu_t^2,     c = 1 - lr m,

with ``s_t = nu_t = 1`` except for a kept short batch divided by its own size ``r`` (both
``b / r``). Normalised by the noise, the pair is ``(E_S N(kappa S, 1), N(0, 1))`` with
``kappa = (2/z) / sqrt(V)``.

**The pairs.** *Worst* (fixed-size batches): in D' every record has ``v = -C e_1``, in D one
of them is replaced by ``+C e_1``. Under D' the record is like every other, so D' is ONE
Gaussian whatever the batches, while D is a mixture with doubled shifts. At ``T = 1`` it is
exactly ``C_p(G(2/z))`` (Bok, Su & Altschuler, ICML 2024, arXiv:2403.00278, Def. 4.7).
*Mirror* (the other records 0, the record ``+C`` vs ``-C``) and *half* (``+C`` vs 0): for
``poisson`` with the divisor ``b`` the others' random count adds the same independent noise to
both outputs, so the others are best at 0, and the worse of mirror and half is used; the worst
pair above is not valid for Poisson. A deterministic ``S`` (full, cyclic at a position) makes
every pair the Gaussian pair ``G(kappa |S|)``.

**Accuracy.** ``delta(eps)`` follows the Neyman-Pearson sets of the (convex, for ``c >= 0``
monotone) privacy loss, with ``log_ndtr`` tails in log space; ``epsilon(delta)`` is root-found
along the threshold. Where the law of ``S`` has more than :data:`MAX_ENUM` atoms it is put on
a grid: every independent contribution rounded down (``lower``) and up (``upper``), so that
``S_lo <= S <= S_hi`` pointwise; every quantity here grows with ``S`` (docs/derivations.md 1.2),
so ``[value(lower), value(upper)]`` is a certified bracket. The plain methods
(``epsilon``, ``delta``, ``renyi``, ``tradeoff``) return the LOWER end: a bound below it is
refuted. RDP is a numerical integral (not certified); compare it with a relative margin.

>>> from hidden_state_accountants import LossGeometry, TrainingRunDpEvent
>>> run = TrainingRunDpEvent(dataset_size=60, batch_size=6, steps=40, noise_multiplier=2.0, clip_norm=1.0,
...     learning_rate=0.5, sampling="shuffle_partition", geometry=LossGeometry(strong_convexity=0.5, smoothness=0.5))
>>> round(exact_pair(run).epsilon(1e-5), 3)
1.36
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
from scipy import optimize, special

from hidden_state_accountants import fdp
from hidden_state_accountants import validation as v
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
EPS_PAD = 1e-9
"""Root-finding margin: an epsilon is moved by this much towards its conservative side."""
CONSTRUCTIONS = ("worst", "mirror", "half")


# ----------------------------------------------------------------------------- the law of S
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
                out.append((np.array([float(vals)]), np.array([1.0])) if q >= 1.0 else
                           (np.array([float(vals), 0.0]), np.array([q, 1.0 - q])))
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
                return Law(per[j:j + 1], np.zeros(1))
            lw = np.full(per.size, math.log(b / n))
            if n - per.size * b:  # records never used: S = 0
                per, lw = np.append(per, 0.0), np.append(lw, math.log((n - per.size * b) / n))
            return Law(per, lw).merged()
        if position is not None:
            raise v.ParameterError("position", f"applies to cyclic and shuffle_partition, not {run.sampling}")
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
            raise v.ParameterError("learning_rate", "the grid bracket needs c = 1 - lr m >= 0 (a monotone pair)")
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


# --------------------------------------------------------------------------------- the pair
def _lse(a, axis=None):
    with np.errstate(divide="ignore"):
        return special.logsumexp(a, axis=axis)


class MixturePair:
    """``P = sum_i w_i N(mp_i, 1)`` against ``Q = sum_j u_j N(mq_j, 1)`` on the real line;
    every quantity is for the symmetric relation (the larger of the two directions)."""

    def __init__(self, mp, lwp, mq, lwq) -> None:
        self.mp, self.lwp = np.asarray(mp, dtype=float), np.asarray(lwp, dtype=float)
        self.mq, self.lwq = np.asarray(mq, dtype=float), np.asarray(lwq, dtype=float)
        self.q_is_gaussian = self.mq.size == 1
        self.monotone = bool(np.all(self.mp >= 0) and np.all(self.mq <= 0))

    @property
    def is_gaussian(self) -> bool:
        return self.mp.size == 1 and self.q_is_gaussian

    @property
    def mu(self) -> float:
        """GDP parameter of a pair of single Gaussians."""
        if not self.is_gaussian:
            raise ValueError("mu is defined for a single Gaussian pair only")
        return float(abs(self.mp[0] - self.mq[0]))

    def log_ratio(self, x) -> np.ndarray:
        x = np.atleast_1d(np.asarray(x, dtype=float))
        lp = _lse(self.lwp[None, :] + self.mp[None, :] * x[:, None] - 0.5 * self.mp[None, :] ** 2, axis=1)
        lq = _lse(self.lwq[None, :] + self.mq[None, :] * x[:, None] - 0.5 * self.mq[None, :] ** 2, axis=1)
        return lp - lq

    @staticmethod
    def _log_sf(means, lw, t):  # log P(X > t)
        return float(_lse(lw + special.log_ndtr(means - t)))

    @staticmethod
    def _log_cdf(means, lw, t):  # log P(X < t)
        return float(_lse(lw + special.log_ndtr(t - means)))

    def _span(self) -> Tuple[float, float]:
        m = np.concatenate([self.mp, self.mq])
        return float(np.min(m)) - 40.0, float(np.max(m)) + 40.0

    def _root(self, target: float) -> float:
        """The threshold ``t`` with ``L(t) = target`` (monotone ``L``), ``+-inf`` if none."""
        lo, hi = self._span()
        f = lambda x: float(self.log_ratio(x)[0]) - target
        while f(lo) > 0:
            lo = lo * 2 - 1
            if lo < -1e8:
                return -math.inf
        while f(hi) < 0:
            hi = hi * 2 + 1
            if hi > 1e8:
                return math.inf
        return optimize.brentq(f, lo, hi, xtol=1e-14, rtol=1e-15, maxiter=400)

    @staticmethod
    def _log_hockey(log_a: float, log_b: float) -> float:
        """``log(e^a - e^b)``, ``-inf`` when ``b >= a``."""
        return -math.inf if log_b >= log_a else log_a + math.log(-math.expm1(log_b - log_a))

    def _log_forward(self, eps: float) -> float:
        """``log H_{e^eps}(P || Q)``."""
        if not self.monotone:
            return self._log_convex(eps, forward=True)
        t = self._root(eps)
        if t == math.inf:
            return -math.inf
        if t == -math.inf:
            return math.log(max(-math.expm1(eps), 1e-300))
        return self._log_hockey(self._log_sf(self.mp, self.lwp, t), eps + self._log_sf(self.mq, self.lwq, t))

    def _log_reverse(self, eps: float) -> float:
        """``log H_{e^eps}(Q || P)``."""
        if not self.monotone:
            return self._log_convex(eps, forward=False)
        t = self._root(-eps)
        if t == -math.inf:
            return -math.inf
        return self._log_hockey(self._log_cdf(self.mq, self.lwq, t), eps + self._log_cdf(self.mp, self.lwp, t))

    def _log_convex(self, eps: float, forward: bool) -> float:
        """``Q`` one Gaussian, shifts of any sign: ``L`` is convex (a log-sum-exp of affine
        maps), so ``{L > eps}`` is the complement of an interval and ``{L < -eps}`` an interval."""
        if not self.q_is_gaussian:
            raise NotImplementedError("a non-monotone loss needs Q to be one Gaussian")
        lo, hi = self._span()
        g = lambda x: float(self.log_ratio(x)[0])
        xm = optimize.minimize_scalar(g, bounds=(lo, hi), method="bounded", options={"xatol": 1e-12}).x
        level = eps if forward else -eps
        if g(xm) >= level:
            return (math.log(max(-math.expm1(eps), 1e-300)) if eps < 0 else -math.inf) if forward else -math.inf
        f = lambda x: g(x) - level
        a, b = lo, hi
        while f(a) < 0:
            a = a * 2 - 1
        while f(b) < 0:
            b = b * 2 + 1
        t1, t2 = optimize.brentq(f, a, xm, xtol=1e-14), optimize.brentq(f, xm, b, xtol=1e-14)

        def inside(means, lw):
            upper, lower = lw + special.log_ndtr(t2 - means), lw + special.log_ndtr(t1 - means)
            with np.errstate(divide="ignore"):
                return float(_lse(upper + np.log(-np.expm1(np.minimum(lower - upper, -1e-300)))))

        def outside(means, lw):
            return float(np.logaddexp(_lse(lw + special.log_ndtr(t1 - means)), _lse(lw + special.log_ndtr(means - t2))))

        if forward:
            return self._log_hockey(outside(self.mp, self.lwp), eps + outside(self.mq, self.lwq))
        return self._log_hockey(inside(self.mq, self.lwq), eps + inside(self.mp, self.lwp))

    def delta(self, epsilon: float) -> float:
        """``max(H_{e^eps}(P||Q), H_{e^eps}(Q||P))``."""
        if self.is_gaussian:
            return float(fdp.gdp_delta(self.mu, epsilon))
        return math.exp(max(self._log_forward(epsilon), self._log_reverse(epsilon)))

    def epsilon(self, delta: float) -> float:
        """Smallest ``eps >= 0`` with ``delta(eps) <= delta``, up to :data:`EPS_PAD` (upward)."""
        if delta >= 1:
            return 0.0
        if self.is_gaussian:
            return fdp.gdp_epsilon(self.mu, delta)
        ld = math.log(delta)
        if self.monotone:
            out = self._epsilon_by_threshold(ld)
        else:
            out = 0.0
            for fn in (self._log_forward, self._log_reverse):
                f = lambda e: fn(e) - ld
                if f(0.0) <= 0:
                    continue
                lo, hi = 0.0, 1.0
                while f(hi) > 0:
                    lo, hi = hi, hi * 2
                out = max(out, optimize.brentq(f, lo, hi, xtol=1e-11, rtol=1e-12))
        return out + EPS_PAD if out > 0 else 0.0

    def _epsilon_by_threshold(self, ld: float) -> float:
        """Monotone loss: the profile is traced by the threshold ``t`` of the Neyman-Pearson
        half-line (``eps = L(t)`` forward, ``-L(t)`` reverse): one root find per direction."""
        L = lambda t: float(self.log_ratio(t)[0])

        def fwd(t):
            return self._log_hockey(self._log_sf(self.mp, self.lwp, t), L(t) + self._log_sf(self.mq, self.lwq, t))

        def rev(t):
            return self._log_hockey(self._log_cdf(self.mq, self.lwq, t), -L(t) + self._log_cdf(self.mp, self.lwp, t))

        lo, hi = self._span()
        out = 0.0
        t0 = self._root(0.0)
        if not math.isfinite(t0):
            return 0.0
        if fwd(t0) > ld:
            a, b = t0, max(t0 + 1.0, hi)
            while fwd(b) > ld:
                a, b = b, b + 2 * (b - a)
            t = optimize.brentq(lambda t: fwd(t) - ld, a, b, xtol=1e-13, rtol=1e-15, maxiter=500)
            out = max(out, L(t))
        if rev(t0) > ld:
            a, b = t0, min(t0 - 1.0, lo)
            while rev(b) > ld and L(b) > -700:
                a, b = b, b - 2 * (a - b)
            if rev(b) <= ld:
                t = optimize.brentq(lambda t: rev(t) - ld, b, a, xtol=1e-13, rtol=1e-15, maxiter=500)
                out = max(out, -L(t))
            else:  # the reverse loss is bounded: delta never gets that small
                out = math.inf
        return out

    def _log_integral(self, a: float, forward: bool) -> float:
        """``log int p^a q^(1-a)`` (or with ``p``, ``q`` swapped), trapezoid on an adaptive grid."""
        const = -0.5 * math.log(2 * math.pi)

        def log_f(x):
            x = np.asarray(x, dtype=float)
            lp = _lse(self.lwp[None, :] + self.mp[None, :] * x[:, None] - 0.5 * self.mp[None, :] ** 2, axis=1) - 0.5 * x * x
            lq = _lse(self.lwq[None, :] + self.mq[None, :] * x[:, None] - 0.5 * self.mq[None, :] ** 2, axis=1) - 0.5 * x * x
            return (a * lp + (1 - a) * lq if forward else a * lq + (1 - a) * lp) + const

        m = np.concatenate([self.mp, self.mq])
        reach = a * float(np.max(np.abs(m))) + 40.0
        coarse = np.linspace(-reach, reach, 4001)
        vals = log_f(coarse)
        keep = coarse[vals > float(np.max(vals)) - 80.0]
        width = coarse[1] - coarse[0]
        lo, hi = float(keep[0]) - 2 * width, float(keep[-1]) + 2 * width
        step = min(0.05, 0.5 / (1.0 + float(np.max(m) - np.min(m)) * max(a, 1.0)))
        prev = None
        for _ in range(8):
            out = float(_lse(log_f(np.arange(lo, hi + step, step)))) + math.log(step)
            if prev is not None and abs(out - prev) <= 1e-10 * max(1.0, abs(out)):
                return out
            prev, step = out, step / 2
        return out

    def renyi(self, orders: Sequence[float]) -> np.ndarray:
        """``max(D_a(P||Q), D_a(Q||P))`` per order ``a > 1`` (numerical)."""
        orders = np.asarray(orders, dtype=float)
        if self.is_gaussian:
            return orders * self.mu ** 2 / 2
        return np.array([max(self._log_integral(a, True) / (a - 1), self._log_integral(a, False) / (a - 1), 0.0)
                         for a in orders])

    def tradeoff(self, alpha) -> np.ndarray:
        """``min(T(P, Q), T(Q, P))`` at ``alpha`` (Neyman-Pearson on a fine grid: reject the
        null where the other density is relatively largest). A valid f-DP bound of the
        symmetric relation lies below both."""
        alpha = np.clip(np.asarray(alpha, dtype=float), 0.0, 1.0)
        if self.is_gaussian:
            return fdp.gdp_tradeoff(self.mu, alpha)
        m = np.concatenate([self.mp, self.mq])
        x = np.linspace(float(np.min(m)) - 12.0, float(np.max(m)) + 12.0, 40001)
        lp = _lse(self.lwp[None, :] - 0.5 * (x[:, None] - self.mp[None, :]) ** 2, axis=1)
        lq = _lse(self.lwq[None, :] - 0.5 * (x[:, None] - self.mq[None, :]) ** 2, axis=1)
        out = np.ones_like(alpha)
        for null, alt in ((lp, lq), (lq, lp)):
            order = np.argsort(null - alt)  # ascending null/alt: reject the null there first
            a = np.concatenate([[0.0], np.cumsum(np.exp(null[order] - null.max()))])
            b = np.concatenate([[0.0], np.cumsum(np.exp(alt[order] - alt.max()))])
            out = np.minimum(out, 1.0 - np.interp(alpha, a / a[-1], b / b[-1]))
        return np.clip(out, 0.0, 1.0)


def pair_for(law: Law, kappa: float, construction: str) -> MixturePair:
    """The pair of ``construction`` (:data:`CONSTRUCTIONS`) for a law of ``S``."""
    if construction == "worst":
        return MixturePair(kappa * law.values, law.log_w, [0.0], [0.0])
    if construction == "half":
        return MixturePair(0.5 * kappa * law.values, law.log_w, [0.0], [0.0])
    if construction == "mirror":
        return MixturePair(0.5 * kappa * law.values, law.log_w, -0.5 * kappa * law.values, law.log_w)
    raise v.ParameterError("construction", f"must be one of {', '.join(CONSTRUCTIONS)}, got {construction!r}")


def constructions_for(sampling: str, relation: str = "REPLACE_ONE") -> Tuple[str, ...]:
    """The worst known pairs of a schedule (module docstring). Under ADD_OR_REMOVE_ONE the pair is
    *half* (a record at ``+C`` present vs absent, the others at 0; the larger of both directions)
    for ``full``, ``cyclic`` (a fixed divisor: the added record moves its steps by ``lr C/b``),
    ``poisson`` and ``balls_in_bins`` (the others' random counts are an independent translation
    of both outputs, so the others are best at 0, and the ``worst`` pair, which needs fixed batch
    sums, is not valid for them)."""
    if relation == "ADD_OR_REMOVE_ONE":
        if sampling not in (FULL, CYCLIC, POISSON, BALLS_IN_BINS):
            raise v.ParameterError("neighboring_relation", f"no exact ADD_OR_REMOVE_ONE pair for sampling={sampling!r}"
                                   " (the package's fixed-size samplers place records by position)")
        return ("half",)
    return ("mirror", "half") if sampling in (POISSON, BALLS_IN_BINS) else ("worst",)


# ------------------------------------------------------------------------------- the result
class ExactPair:
    """The worst known pair of a run: ``lower`` and ``upper`` (the pairs of the laws
    ``S_lo <= S <= S_hi``; the same pair when the law is enumerated, ``exact`` True).

    ``delta``, ``epsilon``, ``renyi``, ``tradeoff`` are the lower end (what refutes a bound);
    :meth:`epsilon_bracket` gives both ends. For ``poisson`` the worse of the candidate pairs.
    """

    def __init__(self, lower: List[MixturePair], upper: List[MixturePair], exact: bool) -> None:
        self._lower, self._upper, self.exact = lower, upper, exact

    @property
    def is_gaussian(self) -> bool:
        return len(self._lower) == 1 and self._lower[0].is_gaussian

    @property
    def mu(self) -> float:
        if not self.is_gaussian or not self.exact:
            raise ValueError("mu is defined for a single Gaussian pair only")
        return self._lower[0].mu

    def delta(self, epsilon: float) -> float:
        return max(p.delta(epsilon) for p in self._lower)

    def epsilon(self, delta: float) -> float:
        """The lower end: below the true epsilon of the worst known pair (a bound under it is wrong)."""
        e = max(p.epsilon(delta) for p in self._lower)
        return max(0.0, e - 2 * EPS_PAD) if math.isfinite(e) and not self.is_gaussian else e

    def epsilon_bracket(self, delta: float) -> Tuple[float, float]:
        return self.epsilon(delta), max(p.epsilon(delta) for p in self._upper)

    def renyi(self, orders: Sequence[float]) -> np.ndarray:
        return np.max([p.renyi(orders) for p in self._lower], axis=0)

    def tradeoff(self, alpha) -> np.ndarray:
        return np.min([p.tradeoff(alpha) for p in self._lower], axis=0)


def exact_pair(run: TrainingRunDpEvent, *, position: Optional[int] = None, init_variance: float = 0.0,
               construction: Optional[str] = None, grid_points: int = GRID_POINTS,
               relation: str = "REPLACE_ONE") -> ExactPair:
    """The worst known neighbouring pair of ``run`` under the linear model (module docstring).

    ``m`` is the run's declared ``strong_convexity`` (0 without a geometry), the contraction
    ``c = 1 - lr m``. ``position``: the 0-based batch of ``cyclic`` / ``shuffle_partition``
    (default: the worst for ``cyclic``, the random one for ``shuffle_partition``).
    ``init_variance``: the start is ``N(0, init_variance I)`` (Chourasia et al. Cor. 1).
    ``construction``: one pair (:data:`CONSTRUCTIONS`) instead of the worst known ones.
    ``relation``: ``"REPLACE_ONE"`` or ``"ADD_OR_REMOVE_ONE"`` (:func:`constructions_for`). For
    ``poisson`` and ``balls_in_bins`` the L2 term ``m`` is applied once per step (Opacus' ``weight_decay``), the
    divisor is ``b`` and the rate ``run.sampling_rate``.

    >>> from hidden_state_accountants import LossGeometry, TrainingRunDpEvent
    >>> one = TrainingRunDpEvent(dataset_size=20, batch_size=6, steps=1, noise_multiplier=1.0, clip_norm=1.0,
    ...     learning_rate=0.5, sampling="poisson", sampling_probability=0.3)
    >>> add_remove = exact_pair(one, relation="ADD_OR_REMOVE_ONE").epsilon(1e-3)  # the sampled Gaussian
    >>> replace = exact_pair(one).epsilon(1e-3)
    >>> round(add_remove, 3), add_remove < replace
    (1.672, True)
    """
    relation = getattr(relation, "name", relation)
    if relation not in ("REPLACE_ONE", "ADD_OR_REMOVE_ONE"):
        raise v.ParameterError("relation", f"must be REPLACE_ONE or ADD_OR_REMOVE_ONE, got {relation!r}")
    if not run.is_constant:
        raise v.ParameterError("learning_rate", "the exact pair needs a constant learning rate and noise")
    m = run.geometry.strong_convexity if run.geometry is not None else 0.0
    model = Linear(run, 1.0 - float(run.learning_rate) * m,
                   float(init_variance) / (float(run.learning_rate) * float(run.noise_multiplier) * run.clip_norm
                                           / run.batch_size) ** 2 if init_variance else 0.0)
    lo, hi, enumerated = model.laws(position, grid_points)
    kinds = (construction,) if construction else constructions_for(run.sampling, relation)
    kappa = model.kappa
    return ExactPair([pair_for(lo, kappa, k) for k in kinds], [pair_for(hi, kappa, k) for k in kinds], enumerated)


def schedule_law(run: TrainingRunDpEvent, grid_points: int = GRID_POINTS) -> Tuple[Law, float]:
    """``(law of S rounded up, kappa)``: the exact law, or the grid's upper law (a law that
    dominates it pointwise), for analyses that average ``G(kappa |S|)`` over it."""
    m = run.geometry.strong_convexity if run.geometry is not None else 0.0
    model = Linear(run, 1.0 - float(run.learning_rate) * m)
    law = model.exact_law()
    if law is None:
        law = model.grid_laws(grid_points)[1]
    return law, model.kappa


__all__ = ["ExactPair", "MixturePair", "Law", "exact_pair", "schedule_law", "pair_for", "constructions_for",
           "CONSTRUCTIONS", "MAX_ENUM", "GRID_POINTS"]


# ------------------------------------------------- brute force for Poisson sampling (issue 12)
def _grid_epsilon(p: np.ndarray, qd: np.ndarray, delta: float) -> float:
    """``epsilon(delta)`` of two discrete laws on the same grid, the larger direction."""
    def one(a, b):
        f = lambda e: float(np.sum(np.maximum(a - math.exp(e) * b, 0.0))) - delta
        if f(0.0) <= 0:
            return 0.0
        hi = 1.0
        while f(hi) > 0:
            hi *= 2
            if hi > 1e3:
                return math.inf
        return optimize.brentq(f, 0.0, hi, xtol=1e-9)
    return max(one(p, qd), one(qd, p))


def poisson_huber_epsilon(*, n_others: int, q: float, b: float, steps: int, z: float, C: float, lr: float,
                          m_reg: float, h: float, relation: str, delta: float, grid: int = 1601) -> float:
    """Brute-force last-iterate epsilon of Poisson DP-SGD on a 1-D *non-linear* loss whose step
    contraction depends on the batch size (ground truth where the batch-size cap binds, docs/derivations.md section 12).

    Data part ``d_i(theta) = clip_C(h (theta - x_i))`` (Huber: convex, ``h``-smooth, ``|d_i| <= C``), the
    others at ``x = 0``, the differing record at ``x = 5C/h`` in D and ``-5C/h`` in D' (REPLACE_ONE) or
    absent (ADD_OR_REMOVE_ONE); L2 ``m_reg`` once per step, divisor ``b``. A batch of ``k`` records near 0
    has slope ``1 - lr (m_reg + k h/b)``: expansive once that exceeds 2. The laws are propagated on a
    grid with a Gaussian kernel (accuracy ~1e-6, not certified: compare with a tolerance).
    """
    from scipy import stats

    s = lr * z * C / b
    width = 12 * s / math.sqrt(max(1 - (1 - lr * m_reg) ** 2, 1e-3)) + 4 * lr * (n_others + 1) * C / b
    x = np.linspace(-width, width, grid)
    dx = x[1] - x[0]
    pk = stats.binom.pmf(np.arange(n_others + 1), n_others, q)

    def kernel(mean):
        zz = (x[:, None] - mean[None, :]) / s
        return np.exp(-0.5 * zz * zz) / (s * math.sqrt(2 * math.pi)) * dx

    def propagate(xs):
        p = np.zeros(grid)
        p[np.argmin(np.abs(x))] = 1.0
        mix = np.zeros((grid, grid))
        for k in range(n_others + 1):
            for inc in ((0, 1) if xs is not None else (0,)):
                drift = m_reg * x + (k * np.clip(h * x, -C, C) + (np.clip(h * (x - xs), -C, C) if inc else 0.0)) / b
                w = pk[k] * ((q if inc else 1 - q) if xs is not None else 1.0)
                mix += w * kernel(x - lr * drift)
        for _ in range(steps):
            p = mix @ p
        return p / p.sum()

    far = 5 * C / h
    other = -far if relation == "REPLACE_ONE" else None
    return _grid_epsilon(propagate(far), propagate(other), delta)


def poisson_projected_epsilon(*, q: float, b: float, steps: int, z: float, C: float, lr: float, m_reg: float,
                              diameter: float, relation: str, delta: float, grid: int = 1201) -> float:
    """Brute-force epsilon of projected Poisson DP-SGD on ``K = [-D/2, D/2]`` with a linear loss (the
    construction of Altschuler & Talwar's lower bound, NeurIPS 2022, arXiv:2205.13710, Thm 4.1): the
    differing record's gradient ``+C`` vs ``-C`` (REPLACE_ONE) or ``+C`` vs absent, the others 0. Each
    step maps node ``x_j`` to ``N(F(x_j), s^2)`` and gives node ``i`` its cell's mass (the end cells reach
    to infinity: the projection's atoms). Accuracy ~1e-4 relative (grid)."""
    s = lr * z * C / b
    x = np.linspace(-diameter / 2, diameter / 2, grid)
    edges = np.concatenate([[-np.inf], 0.5 * (x[1:] + x[:-1]), [np.inf]])

    def kernel(mean):
        return np.diff(special.ndtr((edges[:, None] - mean[None, :]) / s), axis=0)

    def propagate(g_star):
        p = np.zeros(grid)
        p[np.argmin(np.abs(x))] = 1.0
        k0 = kernel(x - lr * m_reg * x)
        k1 = kernel(x - lr * (m_reg * x + g_star / b)) if g_star is not None else k0
        for _ in range(steps):
            p = (1 - q) * (k0 @ p) + q * (k1 @ p)
        return p / p.sum()

    if relation == "REPLACE_ONE":
        return _grid_epsilon(propagate(+C), propagate(-C), delta)
    return _grid_epsilon(propagate(None), propagate(+C), delta)


__all__ += ["poisson_huber_epsilon", "poisson_projected_epsilon"]


# -------------------------------------------- brute force for balls-in-bins sampling (issue 19)
def balls_in_bins_huber_epsilon(*, n_others: int, b: float, steps_per_epoch: int, steps: int, z: float, C: float,
                                lr: float, m_reg: float, h: float, relation: str, delta: float,
                                grid: int = 401) -> float:
    """Brute-force last-iterate epsilon of balls-in-bins DP-SGD on :func:`poisson_huber_epsilon`'s 1-D
    Huber loss (the others at 0, the record at ``5C/h`` against ``-5C/h`` or absent), ground truth where
    the batch-size cap binds (docs/derivations.md, "Balls-in-bins sampling", B.2).

    Every epoch each of the ``n_others`` records and the differing one draws a uniform step among
    ``steps_per_epoch``; the divisor is ``b``, the L2 term ``m_reg`` once per step. The others' counts
    are followed exactly: before step ``j`` of an epoch, ``r`` of them are still unplaced and the step
    takes ``Bin(r, 1/(t - j))`` of them, the record (if still unplaced) with probability ``1/(t - j)``.
    The laws are propagated on a grid with a Gaussian kernel (accuracy ~1e-6, not certified: compare
    with a tolerance)."""
    s = lr * z * C / b
    t = int(steps_per_epoch)
    width = 12 * s / math.sqrt(max(1 - (1 - lr * m_reg) ** 2, 1e-3)) + 4 * lr * (n_others + 1) * C / b
    x = np.linspace(-width, width, grid)
    dx = x[1] - x[0]
    from scipy import stats

    def propagate(xs):
        kernels = {}

        def kernel(k, inc):
            if (k, inc) not in kernels:
                drift = m_reg * x + (k * np.clip(h * x, -C, C) + (np.clip(h * (x - xs), -C, C) if inc else 0.0)) / b
                zz = (x[:, None] - (x - lr * drift)[None, :]) / s
                kernels[(k, inc)] = np.exp(-0.5 * zz * zz) / (s * math.sqrt(2 * math.pi)) * dx
            return kernels[(k, inc)]

        start = np.zeros(grid)
        start[np.argmin(np.abs(x))] = 1.0
        laws = {(n_others, False): start}  # (others not yet placed this epoch, record placed) -> law
        for step in range(steps):
            j = step % t
            if j == 0:  # a new epoch: everyone is unplaced again
                total = sum(laws.values())
                laws = {(n_others, False): total}
            left = t - j
            new: dict = {}
            for (r, placed), p in laws.items():
                ks = np.arange(r + 1)
                pk = stats.binom.pmf(ks, r, 1.0 / left)
                for inc in ((False, True) if (xs is not None and not placed) else (False,)):
                    w_inc = (1.0 / left if inc else 1.0 - 1.0 / left) if (xs is not None and not placed) else 1.0
                    for k in ks:
                        w = pk[k] * w_inc
                        if w <= 1e-300:
                            continue
                        key = (r - int(k), placed or inc)
                        new[key] = new.get(key, 0.0) + w * (kernel(int(k), inc) @ p)
            laws = new
        out = sum(laws.values())
        return out / out.sum()

    far = 5 * C / h
    other = -far if relation == "REPLACE_ONE" else None
    return _grid_epsilon(propagate(far), propagate(other), delta)


__all__ += ["balls_in_bins_huber_epsilon"]


# ----------------------------------------- the best known lower bound for fixed-size batches (issue 19)
LOWER_BOUND_GRID = 1 << 12
"""Grid of the lower law used by :func:`shuffled_lower_bound` (its lower end is certified at any size)."""


def _worst_shift(model: Linear) -> float:
    """``kappa S`` of the record's worst visit pattern (public batches): for ``reshuffle`` the
    largest contribution of every (independent) epoch, for a partition the worst batch."""
    if model.run.sampling == RESHUFFLE:
        return model.kappa * sum(float(np.max(vals)) for vals, _ in model.contributions())
    return model.kappa * float(np.max(np.abs(model.positions())))


def shuffled_lower_bound(run: TrainingRunDpEvent, delta: float, *, relation: str = "REPLACE_ONE",
                         curvature: Optional[float] = None, grid_points: int = LOWER_BOUND_GRID) -> float:
    """The best known LOWER bound on the epsilon of ``run`` (``cyclic``, ``shuffle_partition``,
    ``reshuffle``): no valid analysis can report less. Not a privacy guarantee.

    The affine construction of :func:`exact_pair` (the worst known pair: the other records at
    ``-C e_1``, the record ``+C e_1`` against ``-C e_1``; ``half`` for ``cyclic`` under
    ADD_OR_REMOVE_ONE) with the curvature ``kappa`` anywhere in ``[m, M]`` (contraction
    ``1 - lr kappa >= 0``: ``kappa <= 1/lr``), the largest value over the endpoints and a few
    interior points; for secret ``shuffle_partition`` / ``reshuffle`` batches the mixture over the
    draws (exactly, or the certified lower end of its grid bracket), for public batches the
    worst visit pattern's Gaussian. At ``kappa = m`` with ``m`` the L2 strength the construction is
    an instance of the declared class; at larger ``kappa`` the curvature must come from the
    clipped gradients, which are affine only near the point the run converges to, so it is an
    instance in the limit of long runs whose iterates stay there (docs/derivations.md 5a.6);
    ``curvature=m`` keeps the exact instance only (``curvature`` fixes ``kappa``). With a
    projection the construction is not an instance and the function refuses.

    >>> from hidden_state_accountants import LossGeometry, TrainingRunDpEvent
    >>> run = TrainingRunDpEvent(dataset_size=60, batch_size=6, steps=40, noise_multiplier=2.0, clip_norm=1.0,
    ...     learning_rate=0.5, sampling="reshuffle", geometry=LossGeometry(strong_convexity=0.5, smoothness=0.5))
    >>> round(shuffled_lower_bound(run, 1e-5), 3)
    1.317
    """
    relation = getattr(relation, "name", relation)
    if run.sampling not in (CYCLIC, SHUFFLE_PARTITION, RESHUFFLE):
        raise v.ParameterError("sampling", f"the shuffled lower bound covers cyclic, shuffle_partition and reshuffle, "
                               f"not {run.sampling!r}")
    constructions_for(run.sampling, relation)  # names the relation a schedule is not covered by
    delta = v.probability("delta", delta)
    if run.geometry is None:
        raise v.ParameterError("geometry", "the lower bound is over the declared class: declare a geometry")
    if run.geometry.diameter is not None:
        raise v.ParameterError("geometry", "with a projection (diameter) the affine construction is not an instance")
    if not run.is_constant:
        raise v.ParameterError("learning_rate", "the lower bound needs a constant learning rate and noise")
    lr = float(run.learning_rate)
    lo, hi = run.geometry.strong_convexity, min(run.geometry.smoothness, 1.0 / lr)
    if hi < lo:  # every allowed curvature makes the step expansive or sign-alternating; not searched
        raise v.ParameterError("learning_rate", f"needs a curvature in [m, M] with 1 - lr*kappa >= 0, got lr*m = {lr * lo:g}")
    kappas = sorted({lo, hi} | ({math.sqrt(lo * hi), (lo + hi) / 2} if lo > 0 else {hi / 2}))
    if curvature is not None:
        kappa = v.nonnegative_float("curvature", curvature)
        if not lo * (1 - 1e-12) <= kappa <= hi * (1 + 1e-12):
            raise v.ParameterError("curvature", f"must lie in [m, min(M, 1/lr)] = [{lo:g}, {hi:g}], got {kappa:g}")
        kappas, lo, hi = [kappa], kappa, kappa

    def value(kappa: float) -> float:
        model = Linear(run, 1.0 - lr * kappa)
        if not run.secret_batches and run.sampling != CYCLIC:
            return fdp.gdp_epsilon(_worst_shift(model) * (0.5 if relation == "ADD_OR_REMOVE_ONE" else 1.0), delta)
        # interior curvatures rarely win: a coarser grid (its lower end is still certified) keeps this quick
        law = model.exact_law() or model.grid_law(grid_points if kappa in (lo, hi) else max(256, grid_points // 8), up=False)
        kappa_model = model.kappa
        return max(pair_for(law, kappa_model, k).epsilon(delta) for k in constructions_for(run.sampling, relation))

    best = max(value(k) for k in kappas)
    return max(0.0, best - 2 * EPS_PAD)


__all__ += ["shuffled_lower_bound"]
