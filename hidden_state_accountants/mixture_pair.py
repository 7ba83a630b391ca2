"""Two mixtures of unit-variance Gaussians on the real line, compared exactly: ``delta(eps)``,
``epsilon(delta)``, Renyi divergences and the tradeoff curve of the symmetric relation.

The ground truth (:mod:`hidden_state_accountants.exact`) builds its worst known pairs from it and
the balls-in-bins bound (:class:`~hidden_state_accountants.analyses.balls_in_bins.GaussianMixturePairBound`)
evaluates its mixture with it; it lives here, on its own and tested against numerical integration
(``tests/core/test_schedule_laws.py``), so that neither imports the other.

``delta(eps)`` follows the Neyman-Pearson sets of the privacy loss (a half-line for a monotone
loss, the complement of an interval for a convex one), with ``log_ndtr`` tails in log space;
``epsilon(delta)`` is root-found along the threshold and moved up by :data:`EPS_PAD`.

>>> pair = MixturePair([0.0, 2.0], np.log([0.5, 0.5]), [0.0], [0.0])  # (N(0,1) + N(2,1))/2 vs N(0,1)
>>> round(pair.delta(0.5), 4), pair.monotone
(0.2701, True)
"""

from __future__ import annotations

import math
from typing import Sequence, Tuple

import numpy as np
from scipy import optimize, special

from hidden_state_accountants import fdp

EPS_PAD = 1e-9
"""Root-finding margin: an epsilon is moved by this much towards its conservative side."""


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
            lp = (
                _lse(self.lwp[None, :] + self.mp[None, :] * x[:, None] - 0.5 * self.mp[None, :] ** 2, axis=1)
                - 0.5 * x * x
            )
            lq = (
                _lse(self.lwq[None, :] + self.mq[None, :] * x[:, None] - 0.5 * self.mq[None, :] ** 2, axis=1)
                - 0.5 * x * x
            )
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
            return orders * self.mu**2 / 2
        return np.array(
            [max(self._log_integral(a, True) / (a - 1), self._log_integral(a, False) / (a - 1), 0.0) for a in orders]
        )

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


__all__ = ["MixturePair", "EPS_PAD"]
