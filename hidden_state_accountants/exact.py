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
        """Independent contributions to ``S`` (an epoch for ``reshuffle``, a step for
        ``without_replacement`` / ``poisson``): ``(values, probabilities)``, 0 included where
        it has mass."""
        run = self.run
        T, n, b = run.steps, run.dataset_size, run.batch_size
        out = []
        if run.sampling == RESHUFFLE:
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
        if self.c < 0:
            raise v.ParameterError("learning_rate", "the grid bracket needs c = 1 - lr m >= 0 (a monotone pair)")
        parts = self.contributions()
        h = sum(float(np.max(pv)) for pv, _ in parts) / (points - 8)
        laws = []
        for up in (False, True):
            acc = np.full(points + 2, -np.inf)
            acc[0] = 0.0
            fixed = 0.0
            for pv, pp in parts:
                if float(np.max(pv)) < h:  # too small for the grid: dropped / always taken
                    fixed += float(np.max(pv)) if up else 0.0
                    continue
                idx = np.ceil(pv / h - 1e-12).astype(int) if up else np.floor(pv / h).astype(int)
                new = np.full(acc.size, -np.inf)
                with np.errstate(divide="ignore"):
                    lp = np.log(pp)
                for k in np.unique(idx):
                    lk = special.logsumexp(lp[idx == k])
                    if k < acc.size:
                        new[k:] = np.logaddexp(new[k:], acc[: acc.size - k] + lk)
                acc = new
            shift = math.ceil(fixed / h - 1e-12) if up else 0
            keep = np.isfinite(acc)
            laws.append(Law(((np.arange(acc.size) + shift) * h)[keep], acc[keep]))
        return laws[0], laws[1]

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
    for ``full``, ``cyclic`` (a fixed divisor: the added record moves its steps by ``lr C/b``) and
    ``poisson`` (the others' random count is an independent translation of both outputs)."""
    if relation == "ADD_OR_REMOVE_ONE":
        if sampling not in (FULL, CYCLIC, POISSON):
            raise v.ParameterError("neighboring_relation", f"no exact ADD_OR_REMOVE_ONE pair for sampling={sampling!r}"
                                   " (the package's fixed-size samplers place records by position)")
        return ("half",)
    return ("mirror", "half") if sampling == POISSON else ("worst",)


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
    ``poisson`` the L2 term ``m`` is applied once per step (Opacus' ``weight_decay``), the
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


# ------------------------------------- the best known lower bound of a Poisson run, fast (issue 18)
LOWER_BOUND_DIRECT_TERMS = 20_000_000  # (steps convolved term by term) x (frequencies) allowed: about a second


def _poisson_log_cf(theta: np.ndarray, q: float, c: float, steps: int) -> np.ndarray:
    """``log E exp(i theta S)``, ``S = sum_{j < steps} I_j c^j``, ``I_j ~ Bern(q)`` i.i.d.

    Term by term while ``|theta| c^j > 1e-4``; the rest by the first three cumulants of a Bernoulli
    (``q``, ``q(1-q)``, ``q(1-q)(1-2q)``) with the geometric power sums in closed form (the next term is
    below ``1e-16`` of the sum). ``c = 1``: ``steps log(1 - q + q e^{i theta})``."""
    theta = np.asarray(theta, dtype=float)
    one = lambda u: np.log1p(q * np.expm1(1j * u))
    if c == 1.0:
        return steps * one(theta)
    if c == 0.0:
        return one(theta)
    top = float(np.max(np.abs(theta))) if theta.size else 0.0
    direct = steps if top <= 0 else min(steps, max(0, int(math.ceil(math.log(top * 1e4) / -math.log(c)))))
    if direct * theta.size > LOWER_BOUND_DIRECT_TERMS:
        raise v.ParameterError("steps", f"too long a run with too weak a contraction (c = {c:.9g}) for the fast "
                               "lower bound; use exact_pair")
    out = np.zeros(theta.shape, dtype=complex)
    for start in range(0, direct, 4096):
        j = np.arange(start, min(direct, start + 4096))
        out += np.sum(one(theta[:, None] * c ** j[None, :]), axis=1)
    if direct < steps:
        rest = steps - direct
        power = lambda n: c ** (direct * n) * -math.expm1(rest * n * math.log(c)) / -math.expm1(n * math.log(c))
        kappas = (q, q * (1 - q), q * (1 - q) * (1 - 2 * q))
        for n, kappa in enumerate(kappas, start=1):
            out += kappa * (1j * theta) ** n / math.factorial(n) * power(n)
    return out


def s_max_of(c: float, steps: int) -> float:
    """``sum_{j < steps} c^j``."""
    if c == 1.0:
        return float(steps)
    if c == 0.0:
        return 1.0
    return -math.expm1(steps * math.log(c)) / (1 - c)


class _FourierLaw:
    """The law of ``X = a S + N(0, 1)`` (``sign = -1``: of ``-a S + N(0, 1)``) from its characteristic
    function: density and survival function by Fourier sums (Gil-Pelaez) on a midpoint grid of
    frequencies wide enough that the aliased mass is negligible."""

    def __init__(self, a: float, q: float, c: float, steps: int, sign: float = 1.0) -> None:
        s_max = s_max_of(c, steps)
        mean = a * q * s_max
        sd = math.sqrt(1.0 + a * a * q * (1 - q) * (s_max if c == 1.0 else (1 - c ** (2 * min(steps, 10**9)))
                                                     / max(1 - c * c, 1e-300)))
        reach = min(a * s_max, mean + 25 * sd + 25 * a) + 15.0  # the mass beyond is below 1e-40
        self.dw = math.pi / reach
        self.w = (np.arange(int(math.ceil(12.0 / self.dw))) + 0.5) * self.dw  # e^{-w^2/2} < 1e-31 beyond
        self.phi = np.exp(_poisson_log_cf(sign * a * self.w, q, c, steps) - self.w ** 2 / 2)

    def _both(self, t: np.ndarray):
        """Density and survival function at ``t`` (the last grid asked for is remembered)."""
        t = np.asarray(t, dtype=float)
        if getattr(self, "_t", None) is not None and self._t.shape == t.shape and np.array_equal(self._t, t):
            return self._vals
        e = np.exp(-1j * np.multiply.outer(t, self.w))
        dens = np.maximum(np.real(e @ self.phi) * self.dw / math.pi, 0.0)
        sf = np.clip(0.5 + np.imag(e @ (self.phi / self.w)) * self.dw / math.pi, 0.0, 1.0)
        self._t, self._vals = t.copy(), (dens, sf)
        return dens, sf

    def density(self, t):
        return self._both(t)[0]

    def sf(self, t):
        return self._both(t)[1]


def poisson_lower_bound(run: TrainingRunDpEvent, delta: float, relation="REPLACE_ONE") -> float:
    """The best known lower bound on the epsilon of a Poisson run (shown beside a reported bound, never as
    the guarantee): the exact epsilon of the affine construction with the worst known pair, computed from
    the characteristic function of the last iterate (a mixture over the secret inclusions), fast at any
    length (docs/derivations.md section 17).

    The construction: every per-example gradient constant (``v_i``, ``||v_i|| <= C``, data curvature 0),
    the run's L2 term ``m_reg`` once per step, so every step contracts by ``c = 1 - lr m_reg``; an instance
    of the declared class when ``m <= m_reg <= M``. The pairs are those of :func:`exact_pair`
    (:func:`constructions_for`): ``half`` (the record ``+C`` against absent / ``0``) and, under
    REPLACE_ONE, ``mirror`` (``+C`` against ``-C``); it equals ``exact_pair(run, relation=...).epsilon``
    up to the Fourier inversion's accuracy (about 1e-6 relative at ``delta >= 1e-9``).

    >>> from hidden_state_accountants import LossGeometry, TrainingRunDpEvent
    >>> run = TrainingRunDpEvent(dataset_size=20, batch_size=6, steps=4, noise_multiplier=1.0, clip_norm=1.0,
    ...     learning_rate=0.5, sampling="poisson", sampling_probability=0.3, l2_regularization=0.2,
    ...     geometry=LossGeometry(strong_convexity=0.2, smoothness=1.0))
    >>> round(poisson_lower_bound(run, 1e-5, "ADD_OR_REMOVE_ONE"), 4) == round(
    ...     exact_pair(run, relation="ADD_OR_REMOVE_ONE").epsilon(1e-5), 4)
    True
    """
    relation = getattr(relation, "name", relation)
    if relation not in ("REPLACE_ONE", "ADD_OR_REMOVE_ONE"):
        raise v.ParameterError("relation", f"must be REPLACE_ONE or ADD_OR_REMOVE_ONE, got {relation!r}")
    v.probability("delta", delta)
    if run.sampling != POISSON:
        raise v.ParameterError("sampling", f"the fast lower bound is for sampling='poisson', not {run.sampling!r}")
    if not run.is_constant:
        raise v.ParameterError("learning_rate", "the lower bound needs a constant learning rate and noise")
    g = run.geometry
    m_reg = run.l2_regularization
    if g is None or m_reg is None:
        raise v.ParameterError("l2_regularization", "the construction needs the loss geometry and the L2 strength")
    if g.diameter is not None:
        raise v.ParameterError("geometry", "with a projection the affine construction leaves the domain; "
                               "see poisson_projected_epsilon")
    if not g.strong_convexity <= m_reg <= g.smoothness:
        raise v.ParameterError("l2_regularization", f"the affine construction (data curvature 0) is in the declared "
                               f"class only when strong_convexity <= l2_regularization <= smoothness, got "
                               f"{g.strong_convexity:g} <= {m_reg:g} <= {g.smoothness:g}")
    lr, z = float(run.learning_rate), float(run.noise_multiplier)
    c = 1.0 - lr * m_reg
    if not 0.0 <= c <= 1.0:
        raise v.ParameterError("learning_rate", f"the construction's contraction 1 - lr m_reg = {c:g} must lie in [0, 1]")
    T, q = run.steps, run.sampling_rate
    c2 = c * c
    variance = float(T) if c2 == 1.0 else (1.0 if c2 == 0.0 else -math.expm1(T * math.log(c2)) / (1 - c2))
    a = (1.0 / z) / math.sqrt(variance)  # one use's shift of the last iterate, in units of its noise
    law = _FourierLaw(a, q, c, T)
    reach = 12.0 + a * q * s_max_of(c, T) + 12.0 * a * math.sqrt(q * s_max_of(c, T))
    grid = np.arange(-reach, reach + 0.01, 0.02)

    def log_p(t):
        return np.log(np.maximum(law.density(t), 1e-300))

    def threshold_epsilon(log_ratio, gap, densities) -> float:
        """The Neyman-Pearson half-line traced by its threshold ``t``: ``eps = log_ratio(t)`` where ``gap(t) =
        H(t) - delta`` turns negative beyond ``log_ratio = 0``, located on the grid where both densities are
        resolved (above 1e-12), then refined. Where the crossing lies beyond them, the ratio at the last
        resolved point with a positive gap: a smaller value, still a lower bound."""
        ok = np.flatnonzero(np.minimum(*densities) > 1e-12)
        if not ok.size:
            return 0.0
        lo, hi = int(ok[0]), int(ok[-1]) + 1
        r, g = log_ratio(grid[lo:hi]), gap(grid[lo:hi])
        start = np.flatnonzero(r >= 0)
        if not start.size:
            return 0.0
        i0 = int(start[0])
        if g[i0] <= 0:
            return 0.0
        below = np.flatnonzero(g[i0:] <= 0)
        if not below.size:
            return max(0.0, float(r[-1]))
        j = lo + i0 + int(below[0])
        t = optimize.brentq(lambda x: float(gap(np.array([x]))[0]), grid[j - 1], grid[j], xtol=1e-13)
        return max(0.0, float(log_ratio(np.array([t]))[0]))

    ex = lambda x: np.exp(np.minimum(x, 700.0))
    log_gauss = lambda t: -0.5 * t * t - 0.5 * math.log(2 * math.pi)
    # half: X = a S + N(0,1) against N(0,1); forward on {x > t}, reverse on {x < -t}
    lr_half = lambda t: log_p(t) - log_gauss(t)
    fwd = lambda t: law.sf(t) - ex(lr_half(t)) * special.ndtr(-t) - delta
    rev = lambda t: special.ndtr(-t) - ex(-lr_half(-t)) * (1.0 - law.sf(-t)) - delta
    p_grid, p_flip = law.density(grid), law.density(-grid)
    gauss = np.exp(log_gauss(grid))
    best = max(threshold_epsilon(lr_half, fwd, (p_grid, gauss)),
               threshold_epsilon(lambda t: -lr_half(-t), rev, (p_flip, gauss)))
    if relation == "REPLACE_ONE":  # mirror: a S + N against -a S' + N (symmetric)
        lr_mirror = lambda t: log_p(t) - log_p(-t)
        gap = lambda t: law.sf(t) - ex(lr_mirror(t)) * (1.0 - law.sf(-t)) - delta
        best = max(best, threshold_epsilon(lr_mirror, gap, (p_grid, p_flip)))
    return best + EPS_PAD if best > 0 else 0.0


__all__ += ["poisson_lower_bound"]
