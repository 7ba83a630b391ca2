"""Balls-in-bins accounted as random allocation: the amplified composition (every iterate released).

One epoch of balls-in-bins puts the record in one of its ``t`` steps, uniformly and independently of
everything else: random 1-out-of-``t`` allocation (Feldman & Shenfeld, *Privacy Amplification by Random
Allocation*, arXiv:2502.08202). For adaptive Gaussian steps of sensitivity ``C`` and noise ``z C`` (DP-SGD
with the fixed divisor ``b``), Chua et al., *Balls-and-Bins Sampling for DP-SGD* (AISTATS 2025,
arXiv:2412.16802, section 3) prove that one epoch is dominated, under ADD_OR_REMOVE_ONE, by the pair

    P = (1/t) sum_j N(mu e_j, I_t),    Q = N(0, I_t),    mu = 1/z,

in both orders; Feldman & Shenfeld, *Efficient Privacy Loss Accounting for Subsampling and Random
Allocation* (ICML 2026, arXiv:2602.17284) compute its privacy loss distribution (the package
``PLD_accounting``). Epochs compose adaptively (Zhu, Dong & Wang, AISTATS 2022, Thm 10), and a partial last
epoch is a prefix of a whole one (post-processing), so ``E = ceil(T/t)`` epochs are composed.

This module computes the pair's PLD its own way, fast enough for calibration (docs/derivations.md B.7):
the likelihood ratio ``W = dP/dQ = (1/t) sum_j V_j``, ``V_j = exp(mu x_j - mu^2/2)``, is a sufficient
statistic, and both hockey-stick divergences are expectations under ``Q`` of *convex* functions of it,
``H_g(P||Q) = E_Q (W - g)_+`` and ``H_g(Q||P) = E_Q (1 - g W)_+``. Each term ``U = V/t`` below a threshold
``a`` is put on a lattice by a mean-preserving spread (its mass in every cell split between the cell's ends,
the cell's mean kept), which makes the lattice law larger in the convex order, and the sum of ``t``
independent terms too (Shaked & Shanthikumar, *Stochastic Orders*, 2007, Thm 3.A.12): every hockey-stick
value computed is an upper bound. The rare terms above ``a`` are kept exact (one of them: a closed form;
two or more: probability below ``1e-14``, counted as infinite loss). ``PLD_accounting`` is the reference
the tests and benchmarks check against (:func:`reference_epsilon_range`): at the MNIST scale (``t = 234``,
``z = 1``, 20 epochs) it brackets the value in [1.4840, 1.5475] in 23 s with numba; this gives 1.5145 in 1 s
(its own pessimistic PLD at the step it takes 10 s for gives 1.583, above Poisson's 1.571).

REPLACE_ONE goes through the dataset without the record (docs/derivations.md B.4, B.7): the remove and the
add direction of the composed add/remove pair, joined by the hockey-stick triangle inequality.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import special, stats

from hidden_state_accountants import fdp
from hidden_state_accountants.analyses import _common as cm
from hidden_state_accountants.analyses import long_composition as lc
from hidden_state_accountants.analyses.analysis_info import analysis
from hidden_state_accountants.analyses.balls_in_bins import ReplaceTriangleBound
from hidden_state_accountants.bounds import Bound, NotApplicable, PldBound
from hidden_state_accountants.events import TrainingRunDpEvent
from hidden_state_accountants.relations import ADD_OR_REMOVE_ONE
from hidden_state_accountants.schedules import BALLS_IN_BINS

CITATION = (
    "Chua et al. (AISTATS 2025, arXiv:2412.16802) sec. 3: the dominating pair of one balls-and-bins epoch of adaptive "
    "Gaussian steps, ADD_OR_REMOVE_ONE (random 1-out-of-t allocation: Feldman & Shenfeld, arXiv:2502.08202, "
    "arXiv:2602.17284); its PLD computed with convex-order upper bounds and composed over the epochs "
    "(docs/derivations.md B.7); REPLACE_ONE through the dataset without the record (B.4)"
)

SPREAD = 0.05
"""Lattice step in units of one term's standard deviation: the spread adds at most ``SPREAD^2/4`` of the sum's
variance (0.06%)."""
BIG = 1e-7
"""``t P(U > a)``: the chance that some term is above the lattice threshold ``a``."""
TAIL = 1e-18
"""Mass of a lattice sum allowed beyond the lattice (bounded by Chernoff, counted pessimistically)."""
MAX_POINTS = 1 << 20
"""Largest lattice; beyond it the step grows (coarser, still an upper bound)."""
CHEAP_POINTS = 1 << 17
"""A lattice this size is cheap: the step may go down to :data:`FINE` within it."""
FINE = 0.005
"""The finest step sought, in units of one term's mean ``1/t`` (the add direction's small ratios)."""
FLOOR = 1e-20
"""Profile values this far above the infinite-loss mass end the PLD's grid."""


# =========================================================================== one term, on a lattice
def _phi_between(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``Phi(hi) - Phi(lo)`` without cancellation in either tail."""
    upper = lo > 0
    return np.where(upper, special.ndtr(-lo) - special.ndtr(-hi), special.ndtr(hi) - special.ndtr(lo))


def _z_of(u: np.ndarray, mu: float, t: int) -> np.ndarray:
    """The standard normal quantile at which ``U = exp(mu x - mu^2/2)/t`` equals ``u``."""
    with np.errstate(divide="ignore"):
        return (np.log(t * np.asarray(u, dtype=float)) + mu * mu / 2.0) / mu


def spread_lattice(mu: float, t: int, h: float, top: int) -> np.ndarray:
    """The law of ``U`` on ``[0, top h]`` (a sub-probability) spread onto the lattice ``0, h, .., top h``: each
    cell's mass split between its two ends so that the cell's mean is kept (``Q``-law, ``U = V/t``)."""
    edges = np.arange(top + 1, dtype=float) * h
    z = _z_of(edges, mu, t)
    mass = _phi_between(z[:-1], z[1:])
    first = _phi_between(z[:-1] - mu, z[1:] - mu) / t  # E[U; cell]
    upper = np.clip((first - edges[:-1] * mass) / h, 0.0, mass)  # the mass moved to the cell's right end
    out = np.zeros(top + 1)
    out[:-1] += mass - upper
    out[1:] += upper
    return out


LOWER_SHIFT = 1.0 / 32.0
"""The lower bound's cells sit this fraction of a step right of their lattice points."""


def lower_lattice(mu: float, t: int, h: float, top: int) -> np.ndarray:
    """A law below ``U`` in the convex order's increasing sense, on the lattice ``0, h, .., top h`` (for lower
    bounds): ``U`` on ``[0, (top + 1/2) h)`` replaced by its conditional mean in its cell
    ``[(k - 1/2 + s) h, (k + 1/2 + s) h)`` (Jensen: ``E (W - g)_+`` can only decrease, the sum of the
    conditional means being ``E[W | cells]``), rounded down to the lattice: to ``k h`` when the mean is at
    least that (it is, ``s h`` above, but where the density falls steeply), else to ``(k - 1) h``."""
    edges = (np.arange(top + 2, dtype=float) - 0.5 + LOWER_SHIFT) * h
    edges[0] = 0.0
    z = _z_of(edges, mu, t)
    mass = _phi_between(z[:-1], z[1:])
    first = _phi_between(z[:-1] - mu, z[1:] - mu) / t
    k = np.arange(top + 1)
    low = first < k * h * mass  # the conditional mean below k h
    out = np.bincount(np.maximum(k - low, 0), weights=mass, minlength=top + 1)
    return out[: top + 1]


# =========================================================================== sums of t terms
def _log_mgf(p: np.ndarray, h: float, lam: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """``log sum_k p_k e^{lam k h}`` and ``log sum_k p_k k h e^{lam k h}`` for each ``lam``."""
    k = np.flatnonzero(p > 0)
    x = k * h
    lp = np.log(p[k])
    a = lp[None, :] + lam[:, None] * x[None, :]
    with np.errstate(divide="ignore"):
        return special.logsumexp(a, axis=1), special.logsumexp(a + np.log(np.maximum(x, 1e-300))[None, :], axis=1)


def chernoff_tail(p: np.ndarray, h: float, n: int, limit: float, points: int = 141) -> Tuple[float, float]:
    """Upper bounds on ``P(S >= limit)`` and ``E[S; S >= limit]`` for ``S`` the sum of ``n`` independent draws
    of the lattice law ``p`` (sub-probabilities allowed): ``e^{-lam limit} M(lam)^n`` and
    ``n e^{-lam limit} M(lam)^{n-1} M'(lam)``, the best ``lam`` on a grid of ``points``."""
    lam = np.geomspace(1e-3, 1e4, points) / max(limit, h)
    log_m, log_m1 = _log_mgf(p, h, lam)
    log_p = n * log_m - lam * limit
    log_e = math.log(n) + (n - 1) * log_m + log_m1 - lam * limit
    return float(np.exp(min(np.min(log_p), 0.0))), float(np.exp(min(np.min(log_e), 700.0)))


TILTS = 6
"""Exponential tilts of the lattice law whose powers are computed (each one accurate in its own region)."""
ALIAS = 1e-12
"""The most tilted mass a tilted power may wrap around (relative to the tilted law's total)."""
ROUNDOFF = 64 * np.finfo(float).eps
"""The least round-off assumed of an FFT power, relative to its largest value."""


def powers(p: np.ndarray, h: float, ns: Tuple[int, ...], size: int) -> Tuple[np.ndarray, ...]:
    """Upper bounds, bin by bin, on the ``n``-fold convolutions of ``p`` (each ``n`` in ``ns``) on ``size``
    lattice points (mass beyond ``size`` wraps around onto the lattice: it only adds, and its amount is
    bounded by :func:`chernoff_tail`).

    An FFT's round-off is about ``1e-17`` of the largest value, far above the true values in the tails. So the
    powers are computed for the law tilted by ``e^{lam x}`` at several ``lam`` (the tilt commutes with
    convolution: ``(p e^{lam x})^{*n} = p^{*n} e^{lam x}``) and untilted: each bin takes the ``lam`` with the
    smallest round-off there, measured as the largest negative value of that power (negative values are pure
    round-off, and at least :data:`ROUNDOFF` of its largest value) times the untilting factor, and that round-off
    is added to the bin. A tilt is used only where its sum stays on the lattice (its tilted mass beyond, which
    would wrap around, at most :data:`ALIAS` by Chernoff) and its untilting factor is finite."""
    x = np.arange(p.size) * h
    nonzero = p > 0
    lp = np.where(nonzero, np.log(np.where(nonzero, p, 1.0)), -np.inf)
    top = float(x[nonzero].max())
    lams = np.concatenate([[0.0], np.geomspace(1.0, 60.0, TILTS - 1) / max(top, h)])
    grid = np.arange(size) * h
    best = [np.full(size, np.inf) for _ in ns]
    value = [np.zeros(size) for _ in ns]
    for lam in lams:
        log_m = float(special.logsumexp(lp + lam * x))
        tilted = np.exp(lp + lam * x - log_m)
        if lam > 0 and chernoff_tail(tilted, h, max(ns), size * h, points=41)[0] > ALIAS:
            continue
        f = np.fft.rfft(tilted, size)
        for i, n in enumerate(ns):
            out = np.fft.irfft(f**n, size)
            noise = max(float(-out.min()), ROUNDOFF * float(out.max()))
            scale = n * log_m - lam * grid  # log of the untilting factor
            finite = scale < 700.0
            factor = np.exp(np.where(finite, scale, 0.0))
            err = np.where(finite, noise * factor, np.inf)
            better = err < best[i]
            best[i] = np.where(better, err, best[i])
            value[i] = np.where(better, np.maximum(out, 0.0) * factor, value[i])
    return tuple(v + e for v, e in zip(value, best))


@dataclass(frozen=True)
class EpochProfile:
    """Upper bounds on both hockey-stick divergences of one allocated epoch (``remove``: ``H(P||Q)``,
    ``add``: ``H(Q||P)``) as functions of ``eps``; ``infinite_remove``/``infinite_add`` their limits at
    ``eps -> inf`` (mass counted as infinite loss)."""

    remove: Callable[[np.ndarray], np.ndarray]
    add: Callable[[np.ndarray], np.ndarray]
    infinite_remove: float
    infinite_add: float
    lattice_step: float
    lattice_points: int


def _gaussian_profile(mu: float) -> EpochProfile:
    """``t = 1``: the record is in the only step, the Gaussian mechanism (symmetric)."""
    f = lambda eps: np.asarray(fdp.gdp_delta(mu, np.asarray(eps, dtype=float)), dtype=float)
    return EpochProfile(f, f, 0.0, 0.0, 0.0, 0)


ZERO = 1e-18
"""The chance, at most, that the lattice puts all ``t`` terms at 0: ``W = 0`` is an infinite loss of the add
direction (it matters for small ``t`` only, where the first cell holds much of a term's mass)."""


def _lattice_step(mu: float, t: int, top_value: float) -> float:
    """:data:`SPREAD` of one term's standard deviation, finer (down to :data:`FINE` of its mean, which the add
    direction's small likelihood ratios need) while the lattice stays within :data:`CHEAP_POINTS`, and below the
    ``(ZERO^(1/t))``-quantile of a term (so that all ``t`` land at 0 with probability about ``ZERO``), never finer
    than :data:`MAX_POINTS` allow."""
    sd = math.sqrt(math.expm1(mu * mu)) / t
    h = min(SPREAD * sd, max(FINE / t, top_value / CHEAP_POINTS))
    zero = math.exp(mu * float(special.ndtri(ZERO ** (1.0 / t))) - mu * mu / 2.0) / t
    return max(min(h, zero), top_value / MAX_POINTS)


def epoch_profile(mu: float, t: int) -> EpochProfile:
    """Upper bounds on the profiles of one epoch of random 1-out-of-``t`` allocation of ``G(mu)`` steps
    (module docstring; docs/derivations.md B.7)."""
    if t == 1:
        return _gaussian_profile(mu)
    # the threshold a: P(U > a) = BIG / t
    z_a = -float(special.ndtri(BIG / t))
    a_value = math.exp(mu * z_a - mu * mu / 2.0) / t
    h = _lattice_step(mu, t, 4.0 * a_value + 4.0)
    top = max(2, int(math.ceil(a_value / h)))
    a_value = top * h  # the threshold on the lattice
    small = spread_lattice(mu, t, h, top)
    z_top = float(_z_of(a_value, mu, t))
    pi = float(special.ndtr(-z_top))  # P(U > a)
    e_big = float(special.ndtr(mu - z_top)) / t  # E[U; U > a]
    e_small = 1.0 / t - e_big  # E[U; U <= a]
    # the lattice must hold the sums of t and t - 1 small terms up to a Chernoff tail of TAIL
    limit = max(2.0 * a_value, 2.0)
    while True:
        p_t, m_t = chernoff_tail(small, h, t, limit)
        if max(p_t, m_t) <= TAIL or limit / h > MAX_POINTS:
            break
        limit *= 1.5
    p_t1, m_t1 = chernoff_tail(small, h, t - 1, limit)  # the tails of t - 1 terms at the limit that holds t
    size = max(1024, int(2 ** math.ceil(math.log2(limit / h + 1))))
    law_t, law_t1 = powers(small, h, (t, t - 1), size)
    x = np.arange(size) * h

    # K = 1 (one term above a, the others small): t E[(B + S_{t-1} - g)_+], B exact via
    # G(y) = E[(U - y)_+; U > a] = e_big - y pi for y <= a, and delta_{G(mu)}(log(t y))/t beyond
    def big_stop_loss(y: np.ndarray) -> np.ndarray:
        y = np.asarray(y, dtype=float)
        beyond = y > a_value
        safe = np.where(beyond, y, 2.0 * a_value)
        tail = np.asarray(fdp.gdp_delta(mu, np.log(t * safe)), dtype=float) / t
        return np.where(beyond, tail, e_big - y * pi)

    offsets = np.arange(-(size - 1), size) * h
    kernel = big_stop_loss(offsets)
    conv = np.fft.irfft(np.fft.rfft(law_t1, 4 * size) * np.fft.rfft(kernel, 4 * size), 4 * size)
    roundoff = max(float(-conv.min()), ROUNDOFF * float(conv.max()))  # negative values are round-off
    one_big = t * (np.maximum(conv[size - 1 : 2 * size - 1], 0.0) + roundoff)  # at g = 0, h, .., (size - 1) h
    # beyond the lattice: s <= s_hi in each of 256 bins bounds G(g - s) by G(g - s_hi) (G decreases)
    bins = np.linspace(0.0, size * h, 257)
    bin_mass = np.add.reduceat(law_t1, np.searchsorted(x, bins[:-1]))
    # atoms: two or more terms above a (W <= its mean there), round-off, the lattice sums' Chernoff tails
    k_others = float(stats.binom.sf(0, t - 1, pi))  # P(Bin(t - 1, pi) >= 1)
    k2_others = float(stats.binom.sf(1, t - 1, pi))  # P(Bin(t - 1, pi) >= 2)
    p_two = float(stats.binom.sf(1, t, pi))
    e_two = t * (e_big * k_others + e_small * k2_others)
    inf_remove = min(1.0, e_two + m_t + t * (pi * m_t1 + e_big * p_t1))
    inf_add = min(1.0, p_two + p_t + t * pi * p_t1)

    # the lattice law's two stop-loss transforms, exact (piecewise linear) between lattice points
    cdf = np.cumsum(law_t)
    mass_t, mean_t = float(cdf[-1]), float(np.dot(law_t, x))
    tail_mass = np.concatenate([np.cumsum(law_t[::-1])[::-1][1:], [0.0]])  # P(S > x_i), summed from the top
    above = h * np.cumsum(tail_mass[::-1])[::-1]  # E(S - x_i)_+ = h sum_{j >= i} P(S > x_j)
    below = np.concatenate([[0.0], h * np.cumsum(cdf[:-1])])  # E(x_i - S)_+
    cdf1 = np.cumsum(law_t1)
    mass_t1, mean_t1 = float(cdf1[-1]), float(np.dot(law_t1, x))
    below1 = np.concatenate([[0.0], h * np.cumsum(cdf1[:-1])])  # E(x_i - S_{t-1})_+

    def lower_stop_loss(c, lower, mass, mean):
        """``E (c - S)_+`` of a lattice law from its values at the lattice points (0 below 0)."""
        c = np.maximum(c, 0.0)
        return np.where(c <= x[-1], np.interp(c, x, lower), c * mass - mean)

    def remove(eps):
        g = np.exp(np.asarray(eps, dtype=float))
        inside = g <= x[-1]
        lat = np.interp(g, x, above, right=0.0) + np.interp(g, x, one_big)
        far = (bin_mass[None, :] * big_stop_loss(g[:, None] - bins[None, 1:])).sum(axis=1) * t
        return np.clip(np.where(inside, lat, far) + inf_remove, 0.0, 1.0)

    def add(eps):
        g = np.exp(np.asarray(eps, dtype=float))
        c = 1.0 / g
        lat = g * lower_stop_loss(c, below, mass_t, mean_t)
        # K = 1: W = B + S_{t-1} > a + S_{t-1}, and (1 - g w)_+ decreases in w
        big = t * pi * g * lower_stop_loss(c - a_value, below1, mass_t1, mean_t1)
        return np.clip(lat + big + inf_add, 0.0, 1.0)

    return EpochProfile(remove, add, inf_remove, inf_add, h, size)


# =========================================================================== PLDs
def _pmf(profile: Callable[[np.ndarray], np.ndarray], infinite: float, discretization: float) -> pld_pmf.PLDPmf:
    """dp_accounting's pessimistic Connect-the-Dots PMF of one direction from (upper bounds on) its profile,
    made convex in ``e^eps`` first (:func:`fdp.pmf_from_profile`), on ``[-E, E]`` with ``E`` where the profile
    comes within :data:`FLOOR` of its infinite-loss mass."""
    return fdp.pmf_from_profile(profile, discretization, floor=infinite + FLOOR)


@functools.lru_cache(maxsize=64)
def epoch_pld(noise_multiplier: float, steps_per_epoch: int, discretization: float) -> fdp.PLD:
    """The pessimistic add/remove PLD of one allocated epoch (both directions), cached per
    ``(noise, steps per epoch, discretisation)``."""
    prof = epoch_profile(1.0 / noise_multiplier, steps_per_epoch)
    return pld_lib.PrivacyLossDistribution(
        _pmf(prof.remove, prof.infinite_remove, discretization), _pmf(prof.add, prof.infinite_add, discretization)
    )


def _clt_mu(noise_multiplier: float, spe: int, epochs: int) -> float:
    """A CLT guess of ``epochs`` epochs' GDP parameter (Poisson at rate ``1/t``: sizes grids only)."""
    return float(fdp.subsampled_gaussian_clt_mu(1.0 / noise_multiplier, 1.0 / spe, epochs * spe))


def epoch_noises(run: TrainingRunDpEvent) -> Dict[float, int]:
    """Noise multiplier -> number of epochs charged at it: each epoch (a partial last one included) at the
    smallest noise of its steps (a step with more noise is a post-processing of one with less)."""
    spe = run.steps_per_epoch
    if not isinstance(run.noise_multiplier, tuple):
        return {float(run.noise_multiplier): -(-run.steps // spe)}
    z = np.asarray(run.noise_multiplier, dtype=float)
    epochs = -(-z.size // spe)
    padded = np.concatenate([z, np.full(epochs * spe - z.size, np.inf)]).reshape(epochs, spe)
    values, counts = np.unique(padded.min(axis=1), return_counts=True)
    return {float(v): int(c) for v, c in zip(values, counts)}


def _grid(counts: Dict[float, int], spe: int, base: float) -> float:
    """The composition grid for the epochs in ``counts`` (noise -> epochs): sized to their CLT width."""
    mu = math.sqrt(sum(_clt_mu(z, spe, k) ** 2 for z, k in counts.items()))
    return lc.grid_for(mu, base)


def allocation_pld(counts: Dict[float, int], spe: int, discretization: float) -> Tuple[fdp.PLD, float]:
    """The add/remove PLD of the epochs in ``counts`` (noise -> epochs), composed on a grid sized to their
    width (:mod:`.long_composition`); and that grid."""
    d = _grid(counts, spe, discretization)
    total = None
    for z, k in counts.items():
        part = lc.compose_steps(
            lambda grid, z=z: epoch_pld(z, spe, grid), k, lambda j, z=z: _clt_mu(z, spe, j), d, discretization
        )
        total = part if total is None else total.compose(part, tail_mass_truncation=1e-15)
    return total, d


# =========================================================================== the authors' package
def reference_epsilon_range(
    noise_multiplier: float, steps_per_epoch: int, epochs: int, delta: float, epsilon_accuracy: float = -1.0
) -> Tuple[float, float]:
    """``(upper, lower)`` epsilon of ``epochs`` epochs of random 1-out-of-``steps_per_epoch`` allocation of
    Gaussian steps under ADD_OR_REMOVE_ONE by ``PLD_accounting.gaussian_allocation_epsilon_range`` (Feldman &
    Shenfeld's package, arXiv:2602.17284: its dominating and dominated PLDs, refined until they are close): the
    reference this module is checked against (tests, ``benchmarks/bench_balls_in_bins.py``). Seconds with
    ``numba`` (``pip install "hidden-state-accountants[fast]"``), minutes without for a few hundred steps per
    epoch.

    >>> upper, lower = reference_epsilon_range(1.0, 10, 1, 1e-5)  # doctest: +SKIP
    """
    import warnings

    with warnings.catch_warnings():  # its ImportWarning when numba is absent
        warnings.simplefilter("ignore", ImportWarning)
        from PLD_accounting import gaussian_allocation_epsilon_range

    upper, lower = gaussian_allocation_epsilon_range(
        delta=float(delta),
        sigma=float(noise_multiplier),
        num_steps=int(steps_per_epoch),
        num_epochs=int(epochs),
        epsilon_accuracy=float(epsilon_accuracy),
    )
    return float(upper), float(lower)


# =========================================================================== lower bound
LOWER_POINTS = 1 << 20
"""Lattice points of the lower bound's law (its rounding down costs at most ``t h`` per epoch)."""


def lower_epoch_pmf(mu: float, t: int, discretization: float) -> pld_pmf.PLDPmf:
    """An optimistic PMF of the remove direction of one allocated epoch, a LOWER bound: every term replaced by
    :func:`lower_lattice` (``E_Q (W - g)_+`` only decreases), sums beyond the lattice and
    the FFT's round-off (its largest negative value) dropped, every loss ``log W`` rounded down to the grid.
    Its masses are ``P``-masses ``w q(w)`` (``q`` the lattice law of ``W`` under ``Q``): composing them bounds
    ``E_Q (W_1 .. W_E - g)_+`` from below, the composed remove direction's profile."""
    if t == 1:
        pld = pld_lib.from_gaussian_mechanism(
            1.0 / mu, value_discretization_interval=discretization, pessimistic_estimate=False
        )
        return pld._pmf_remove  # noqa: SLF001
    sd_w = math.sqrt(math.expm1(mu * mu) / t)
    top_value = 1.0 + 40.0 * sd_w + math.exp(mu * mu / 2.0 + 6.0 * mu) / t
    h = top_value / LOWER_POINTS
    law = lower_lattice(mu, t, h, LOWER_POINTS - 1)
    out = np.fft.irfft(np.fft.rfft(law, 2 * LOWER_POINTS) ** t, 2 * LOWER_POINTS)
    noise = max(float(-out.min()), ROUNDOFF * float(out.max()))
    q = np.maximum(out[:LOWER_POINTS] - noise, 0.0)  # beyond the lattice: dropped (wrapped mass is there too)
    w = np.arange(LOWER_POINTS) * h
    keep = (q > 0) & (w > 0)
    idx = np.floor(np.log(w[keep]) / discretization).astype(np.int64)
    lower = int(idx.min())
    probs = np.bincount(idx - lower, weights=w[keep] * q[keep])
    return pld_pmf.DensePLDPmf(discretization, lower, probs, 0.0, False)


def lower_epsilon(noise_multiplier: float, spe: int, epochs: int, delta: float, discretization: float = 1e-3) -> float:
    """A LOWER bound on the epsilon of ``epochs`` epochs of random 1-out-of-``spe`` allocation of Gaussian steps
    (noise ``noise_multiplier``), ADD_OR_REMOVE_ONE remove direction: the epsilon of the exact pair is at least
    this, and so is every REPLACE_ONE one (a record whose clipped gradient is always 0 replaces one by its
    absence)."""
    pmf = lower_epoch_pmf(1.0 / noise_multiplier, spe, discretization)
    if epochs > 1:
        pmf = pmf.self_compose(epochs, tail_mass_truncation=0.0)
    return max(0.0, float(pmf.get_epsilon_for_delta(delta)))


# =========================================================================== the analysis
NOT_SECRET = (
    "the batches' randomness is public (secret_batches=False): the amplification rests on each record's step being "
    "secret; composition_balls_in_bins (one unamplified Gaussian per epoch) holds"
)


TRIANGLE_STEP = 1e-3
"""The fixed grid of ``eps`` on which the triangle's two legs are evaluated (its rounding: at most one step)."""


def triangle_legs(pld: Optional[fdp.PLD]) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The two directions' profiles of an add/remove PLD on a common grid of ``eps`` (each an upper bound at
    its points): the legs of :class:`~.balls_in_bins.ReplaceTriangleBound`. The grid is the multiples of
    :data:`TRIANGLE_STEP` from -1 to where both directions are down to their infinite-loss mass, so that the
    bound does not jitter with the noise."""
    if pld is None:  # the composition is vacuous (most of its mass at infinite loss): so is the triangle
        eps, one = np.array([0.0]), np.ones(1)
        return eps, one, eps, one
    remove, add = pld._pmf_remove, pld._pmf_add  # noqa: SLF001
    ends = [float(p.get_epsilon_for_delta(max(1e-15, 2.0 * p._infinity_mass))) for p in (remove, add)]  # noqa: SLF001
    top = min(max(ends + [1e-3]), fdp.MAX_LOSS)
    eps = np.arange(-round(1.0 / TRIANGLE_STEP), math.ceil(top / TRIANGLE_STEP) + 1) * TRIANGLE_STEP
    dr = np.clip(np.asarray(remove.get_delta_for_epsilon(eps), dtype=float), 0.0, 1.0)
    da = np.clip(np.asarray(add.get_delta_for_epsilon(eps), dtype=float), 0.0, 1.0)
    return eps, dr, eps, da


@analysis(
    "composition_allocation_pld",
    CITATION,
    (BALLS_IN_BINS,),
    hidden_state=False,
    needs="secret draws",
    add_or_remove="native",
)
def allocation_composition(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """Balls-in-bins, every iterate released, amplified by the secret step of each record in each epoch
    (module docstring; docs/derivations.md B.7). ADD_OR_REMOVE_ONE: the pessimistic PLD of the dominating pair of
    Chua et al. (sec. 3) for one epoch, composed over ``ceil(T/t)`` epochs, each epoch at the smallest noise of
    its steps. REPLACE_ONE: its remove and add directions joined through the dataset without the record
    (:class:`~.balls_in_bins.ReplaceTriangleBound`, B.4). Needs secret draws; the steps per epoch ``t`` are a
    public constant (B.1). Never decreases with the number of steps."""
    if not run.secret_batches:
        return NotApplicable(reason=NOT_SECRET)
    counts, spe = epoch_noises(run), run.steps_per_epoch
    d = _grid(counts, spe, ctx.discretization)
    if not d <= lc.MAX_DISCRETIZATION:
        return NotApplicable(reason=lc.TOO_COARSE)
    epochs = sum(counts.values())
    detail = f"{epochs} epoch{'s' if epochs > 1 else ''} of random 1-out-of-{spe} allocation"
    bound = PldBound(
        build=lambda delta, disc: (allocation_pld(counts, spe, disc)[0], detail),
        discretization=d,
        monotone_in_steps=True,
    )
    if ctx.neighboring_relation == ADD_OR_REMOVE_ONE:
        return bound
    return ReplaceTriangleBound(legs=lambda: triangle_legs(bound.pld(1e-5, d)), note=detail, monotone_in_steps=True)


__all__ = [
    "allocation_composition",
    "reference_epsilon_range",
    "lower_epsilon",
    "lower_epoch_pmf",
    "EpochProfile",
    "epoch_profile",
    "epoch_pld",
    "allocation_pld",
    "epoch_noises",
    "spread_lattice",
    "lower_lattice",
    "chernoff_tail",
]
