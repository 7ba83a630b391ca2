"""Exact last-iterate privacy of DP-SGD on a loss with linear gradients (ground truth).

Per-example map ``g_i(theta) = c_i + m theta`` (a quadratic loss with L2 strength ``m``;
``m``-strongly convex and ``M``-smooth for every ``M >= m``). All records have
``c_i = 0`` except the differing one: ``+C e_1`` in D and ``-C e_1`` in D', a replacement
with the largest allowed change ``2C``. Unconstrained DP-SGD from ``theta_0 = 0`` gives,
along ``e_1`` (the other coordinates have identical laws)::

    theta_T = -/+ (lr C / b) S + N(0, v),   S = sum_t c^{T-1-t} 1{record in B_t},
    c = 1 - lr m,   v = (lr z C / b)^2 sum_{k<T} c^{2k}

so the pair is ``P = sum_s w_s N(a s, v)`` vs ``Q = sum_s w_s N(-a s, v)`` with ``a = lr C/b``
and ``w`` the law of ``S`` under the batch schedule: a point mass (full; cyclic for a
fixed batch position), uniform over positions (shuffle_partition) or the law of
independent inclusions with probability ``b/n`` (without_replacement, poisson). Every
valid bound must be at least these values; Bok et al. Thm 4.2 must equal them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
from scipy import optimize, special

from hidden_state_accountants import fdp
from hidden_state_accountants.events import TrainingRunDpEvent


@dataclass(frozen=True)
class MixturePair:
    """``P = sum_i w_i N(shift_i, sd^2)`` against its mirror image ``Q`` (shifts negated)."""

    shifts: np.ndarray
    weights: np.ndarray
    sd: float
    _cache: Optional[tuple] = field(default=None, repr=False, compare=False)

    @property
    def is_gaussian(self) -> bool:
        return self.shifts.size == 1

    @property
    def mu(self) -> float:
        """GDP parameter when ``P`` and ``Q`` are single Gaussians."""
        if not self.is_gaussian:
            raise ValueError("mu is defined for a single Gaussian pair only")
        return float(2 * abs(self.shifts[0]) / self.sd)

    def _grid(self, order: float = 1.0, points: int = 20001):
        reach = (2 * order + 1) * float(np.max(np.abs(self.shifts))) + 16 * self.sd
        return np.linspace(-reach, reach, points)

    def _log_densities(self, x):
        """``log p(x)``, ``log q(x)``; components in chunks to bound memory."""
        lw = np.log(self.weights)
        const = -0.5 * math.log(2 * math.pi) - math.log(self.sd)
        lp = np.full(x.size, -np.inf)
        lq = np.full(x.size, -np.inf)
        for start in range(0, self.shifts.size, 256):
            sh, w = self.shifts[start:start + 256], lw[start:start + 256]
            z = (x[:, None] - sh[None, :]) / self.sd
            lp = np.logaddexp(lp, special.logsumexp(w[None, :] - 0.5 * z * z, axis=1))
            z = (x[:, None] + sh[None, :]) / self.sd
            lq = np.logaddexp(lq, special.logsumexp(w[None, :] - 0.5 * z * z, axis=1))
        return lp + const, lq + const

    def renyi(self, orders: Sequence[float]) -> np.ndarray:
        """``D_alpha(P || Q)`` for each order (closed form for a Gaussian pair)."""
        orders = np.asarray(orders, dtype=float)
        if self.is_gaussian:
            return orders * self.mu**2 / 2
        x = self._grid(float(np.max(orders)))
        lp, lq = self._log_densities(x)
        log_dx = math.log(x[1] - x[0])
        return np.array([(special.logsumexp(a * lp + (1 - a) * lq) + log_dx) / (a - 1) for a in orders])

    def delta(self, epsilon: float) -> float:
        """Hockey-stick divergence ``H_{e^eps}(P || Q)`` (= delta(eps) of the pair)."""
        if self.is_gaussian:
            return float(fdp.gdp_delta(self.mu, epsilon))  # log space: finite for epsilon > 709
        if self._cache is None:
            x = self._grid()
            object.__setattr__(self, "_cache", (x, *self._log_densities(x)))
        x, lp, lq = self._cache
        integrand = np.exp(lp) * -np.expm1(np.minimum(epsilon + lq - lp, 0.0))
        return float(np.sum(integrand) * (x[1] - x[0]))

    def tradeoff(self, alpha: np.ndarray) -> np.ndarray:
        """Exact tradeoff ``T(P, Q)(alpha)`` (Neyman-Pearson: reject P where ``q/p`` is largest)."""
        alpha = np.clip(np.asarray(alpha, dtype=float), 0.0, 1.0)
        if self.is_gaussian:
            return special.ndtr(special.ndtri(1.0 - alpha) - self.mu)
        x = self._grid(points=40001)
        lp, lq = self._log_densities(x)
        order = np.argsort(lp - lq)  # ascending p/q = descending q/p
        dx = x[1] - x[0]
        p_mass = np.concatenate([[0.0], np.cumsum(np.exp(lp[order]) * dx)])
        q_mass = np.concatenate([[0.0], np.cumsum(np.exp(lq[order]) * dx)])
        p_mass, q_mass = p_mass / p_mass[-1], q_mass / q_mass[-1]
        return np.clip(1.0 - np.interp(alpha, p_mass, q_mass), 0.0, 1.0)

    def epsilon(self, delta: float) -> float:
        """Smallest ``eps >= 0`` with ``delta(eps) <= delta``."""
        f = lambda e: self.delta(e) - delta
        if f(0.0) <= 0:
            return 0.0
        if self.is_gaussian:
            return fdp.gdp_epsilon(self.mu, delta)
        hi = 1.0
        while f(hi) > 0:
            hi *= 2
        return optimize.brentq(f, 0.0, hi, xtol=1e-10)


def _schedule_law(run: TrainingRunDpEvent, c: float, position: Optional[int]):
    T = run.steps
    if run.sampling == "full":
        return np.array([sum(c ** (T - 1 - t) for t in range(T))]), np.array([1.0])
    if run.sampling in ("cyclic", "shuffle_partition"):
        l = run.steps_per_epoch
        positions = [position] if (position is not None or run.sampling == "cyclic") else range(l)
        if run.sampling == "cyclic" and position is None:
            positions = range(l)  # caller takes the worst position
        values = [sum(c ** (T - 1 - t) for t in range(j, T, l)) for j in positions]
        return np.array(values), np.full(len(values), 1.0 / len(values))
    # independent inclusions with probability q = b/n at every step
    q = run.sampling_rate
    if T > 16:
        raise ValueError("steps: the exact law is enumerated over 2^T schedules; use T <= 16")
    weights_c = c ** (T - 1 - np.arange(T))
    values, probs = [], []
    for bits in itertools.product((0, 1), repeat=T):
        k = sum(bits)
        values.append(float(np.dot(bits, weights_c)))
        probs.append(q**k * (1 - q) ** (T - k))
    values, probs = np.array(values), np.array(probs)
    order = np.argsort(values)
    values, probs = values[order], probs[order]
    # merge identical shifts (e.g. the all-zero schedule)
    uniq, idx = np.unique(np.round(values, 15), return_index=True)
    merged = np.add.reduceat(probs, idx)
    return values[idx], merged


def exact_pair(run: TrainingRunDpEvent, *, position: Optional[int] = None,
               init_variance: float = 0.0) -> MixturePair:
    """The exact pair for ``run`` under the linear construction above.

    The strong convexity ``m`` is taken from ``run.geometry``. For ``cyclic`` give the
    0-based batch ``position``; without it the worst position is returned. With
    ``init_variance`` the start is ``N(0, init_variance)`` instead of 0 (Chourasia Cor. 1).
    """
    m = run.geometry.strong_convexity if run.geometry is not None else 0.0
    lr, C, b, z, T = run.learning_rate, run.clip_norm, run.batch_size, run.noise_multiplier, run.steps
    c = 1.0 - lr * m
    a = lr * C / b
    var = (lr * z * C / b) ** 2 * sum(c ** (2 * k) for k in range(T)) + c ** (2 * T) * init_variance
    values, probs = _schedule_law(run, c, position)
    if run.sampling == "cyclic" and position is None:
        j = int(np.argmax(values))
        values, probs = values[j:j + 1], np.array([1.0])
    return MixturePair(shifts=a * values, weights=probs / probs.sum(), sd=math.sqrt(var))
