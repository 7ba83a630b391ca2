"""Gaussian DP, privacy profiles and pessimistic privacy-loss distributions.

Conventions: a privacy *profile* is ``delta(eps)`` for every real ``eps``, the
hockey-stick divergence ``H_{e^eps}`` of a dominating pair. All profiles here belong to
*symmetric* tradeoff functions (REPLACE_ONE is a symmetric relation), so the same
privacy-loss distribution (PLD) serves both directions.

The discretisation is dp_accounting's pessimistic Connect-the-Dots (Doroshenko et al.
2022), fed with profile values that are *upper bounds* and made convex in ``e^eps``
first; the resulting discrete PLD dominates the true one at every ``eps``, and
dp_accounting composes it.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import optimize, special

PLD = pld_lib.PrivacyLossDistribution


class VacuousBound(ValueError):
    """The profile puts at least half its mass at losses beyond ``MAX_LOSS``: no useful PLD."""


# Per-step probability mass we allow to move to +infinity when building a PLD; it adds
# to delta after composition (T * TAIL_MASS), far below any delta worth reporting.
TAIL_MASS = 1e-20
# Privacy losses beyond this are treated as infinite (pessimistic); keeps grids finite
# for vanishing noise, where only the RDP analyses give informative numbers anyway.
MAX_LOSS = 60.0


# --------------------------------------------------------------------------- GDP
def gdp_log_delta(mu: float, eps: np.ndarray | float) -> np.ndarray:
    """``log delta(eps)`` of ``G(mu)``: ``Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``.

    Dong, Roth & Su (2022) Cor. 2.13, in log space so that huge ``mu`` or ``eps`` stay finite.
    """
    eps = np.asarray(eps, dtype=float)
    if mu <= 0:
        return np.where(eps >= 0, -np.inf, np.log(-np.expm1(eps)))
    if math.isinf(mu) or math.isnan(mu):  # perfectly distinguishable (NaN: nothing known): delta = 1
        return np.where(np.isinf(eps) & (eps > 0), -np.inf, 0.0)
    a = special.log_ndtr(-eps / mu + mu / 2.0)
    b = eps + special.log_ndtr(-eps / mu - mu / 2.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = a + np.log(-np.expm1(np.minimum(b - a, 0.0)))
    return np.where(b >= a, -np.inf, out)


def gdp_delta(mu: float, eps: np.ndarray | float) -> np.ndarray | float:
    """Exact ``delta(eps)`` of ``mu``-GDP (vectorised)."""
    out = np.exp(gdp_log_delta(mu, eps))
    return float(out) if np.ndim(out) == 0 else out


def mixture_gdp_log_delta(log_probs: np.ndarray, mus: np.ndarray, eps: np.ndarray | float) -> np.ndarray:
    """``log sum_i p_i delta_{G(mu_i)}(eps)``: the profile of the pair "reveal ``i``, then
    ``N(mu_i, 1)`` vs ``N(0, 1)``", in log space (vectorised over components and ``eps``;
    the same closed form as :func:`gdp_log_delta`)."""
    eps = np.atleast_1d(np.asarray(eps, dtype=float))[None, :]
    mus = np.asarray(mus, dtype=float)[:, None]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        safe = np.where((mus > 0) & np.isfinite(mus), mus, 1.0)
        a = special.log_ndtr(-eps / safe + safe / 2.0)
        b = eps + special.log_ndtr(-eps / safe - safe / 2.0)
        gauss = np.where(b >= a, -np.inf, a + np.log(-np.expm1(np.minimum(b - a, 0.0))))
        zero = np.where(eps >= 0, -np.inf, np.log(-np.expm1(np.minimum(eps, 0.0))))
        infinite = np.where(np.isinf(eps) & (eps > 0), -np.inf, 0.0)
        terms = np.where(mus <= 0, zero, np.where(np.isinf(mus), infinite, gauss))
        return special.logsumexp(np.asarray(log_probs, dtype=float)[:, None] + terms, axis=0)


def gdp_epsilon(mu: float, delta: float) -> float:
    """Smallest ``eps >= 0`` with ``delta_{G(mu)}(eps) <= delta`` (closed form, root-found);
    ``inf`` for a NaN ``mu`` (an overflow upstream says nothing)."""
    if math.isnan(mu):
        return math.inf
    if mu <= 0:
        return 0.0
    if delta >= 1:
        return 0.0
    if delta <= 0 or math.isinf(mu):
        return math.inf
    log_target = math.log(delta)
    f = lambda e: float(gdp_log_delta(mu, e)) - log_target
    if f(0.0) <= 0:
        return 0.0
    # delta(eps) <= Phi(-eps/mu + mu/2) <= delta once eps >= mu^2/2 + mu*sqrt(2 log(1/delta)).
    hi = mu * mu / 2.0 + mu * math.sqrt(2.0 * max(-log_target, 1.0)) + 1.0
    while math.isfinite(hi) and f(hi) > 0:
        hi *= 2.0
    if not math.isfinite(hi):  # epsilon beyond the floating-point range: infinity bounds it
        return math.inf
    return conservative_root(f, 0.0, hi)


def conservative_root(f: Callable[[float], float], lo: float, hi: float) -> float:
    """A root of the decreasing function ``f`` on ``[lo, hi]`` (``f(lo) > 0 >= f(hi)``), taken
    on the safe side: the returned ``x`` has ``f(x) <= 0``. Brent's method can stop a hair
    before the root; for ``f = log delta(eps) - log target`` that would be an epsilon whose
    delta exceeds the target."""
    x = optimize.brentq(f, lo, hi, xtol=1e-12, rtol=1e-10)
    step = max(1e-15, 1e-12 * abs(x))
    while f(x) > 0 and x < hi:
        x = min(hi, x + step)
        step *= 2.0
    return x


def gdp_tradeoff(mu: float, alpha: np.ndarray) -> np.ndarray:
    """``G(mu)(alpha) = Phi(Phi^{-1}(1 - alpha) - mu)``."""
    alpha = np.clip(np.asarray(alpha, dtype=float), 0.0, 1.0)
    return special.ndtr(special.ndtri(1.0 - alpha) - mu)


def gdp_rdp(mu: float, orders: np.ndarray) -> np.ndarray:
    """``mu``-GDP implies ``(alpha, alpha mu^2 / 2)``-RDP."""
    return np.asarray(orders, dtype=float) * mu * mu / 2.0


# ----------------------------------------------------------------------- profiles
def symmetric_extension(delta_pos: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    """Extends a profile given for ``eps >= 0`` to all ``eps`` by symmetry.

    For a symmetric tradeoff function, ``H_{1/g}(P||Q) = 1 - 1/g + H_g(P||Q)/g``, i.e.
    ``delta(-e) = 1 - e^{-e} + e^{-e} delta(e)``.
    """

    def profile(eps):
        eps = np.asarray(eps, dtype=float)
        a = np.abs(eps)
        d = np.asarray(delta_pos(a), dtype=float)
        neg = -np.expm1(-a) + np.exp(-a) * d
        return np.where(eps >= 0, d, neg)

    return profile


def _amplified(eps: np.ndarray, p: float) -> np.ndarray:
    """``log(1 + (e^eps - 1)/p)`` for ``eps > log(1-p)``, without overflow for huge ``eps``."""
    eps = np.asarray(eps, dtype=float)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        small = np.log1p(np.expm1(np.minimum(eps, 0.0)) / p)
        large = eps - math.log(p) + np.log1p(-(1 - p) * np.exp(-np.maximum(eps, 0.0)))
    return np.where(eps <= 0, small, large)


def subsampled_gaussian_profile(mu: float, p: float) -> Callable[[np.ndarray], np.ndarray]:
    """Profile of ``C_p(G(mu))``, Bok et al. (2024) Def. 4.7 / Dong, Roth & Su Def. 6.

    ``C_p(f) = min{f_p, f_p^{-1}}**`` with ``f_p = p f + (1-p) Id``; conjugation turns the
    convex hull of a minimum into the maximum of the two profiles:
    ``delta_C(eps) = max(H(A||B), H(B||A))`` with ``A = (1-p)N(0,1) + p N(mu,1)``,
    ``B = N(0,1)``. ``H(A||B)(eps) = p * delta_{G(mu)}(log(1 + (e^eps - 1)/p))`` and the
    reverse direction follows from the identity in :func:`symmetric_extension`. This is
    the *symmetrised* operator; composing the add and remove directions separately (what
    dp_accounting does for ADD_OR_REMOVE_ONE) is a smaller object and not valid here.
    """
    if p >= 1.0:
        return lambda eps: gdp_delta(mu, eps)
    log_keep = math.log1p(-p)

    def forward(eps):
        # H(A||B)(eps); for eps <= log(1-p), A > e^eps B everywhere and H = 1 - e^eps
        eps = np.asarray(eps, dtype=float)
        above = eps > log_keep
        inner = _amplified(np.where(above, eps, 0.0), p)
        return np.where(above, p * np.exp(gdp_log_delta(mu, inner)), -np.expm1(np.minimum(eps, 0.0)))

    def positive(eps):
        # H(B||A)(eps) = 1 - e^eps + e^eps H(A||B)(-eps), which vanishes once eps >= -log(1-p)
        eps = np.asarray(eps, dtype=float)
        near = np.minimum(eps, -log_keep)
        backward = np.where(eps >= -log_keep, 0.0, -np.expm1(near) + np.exp(near) * forward(-near))
        return np.clip(np.maximum(forward(eps), backward), 0.0, 1.0)

    return symmetric_extension(positive)


def _log_abs_sinh(x: np.ndarray) -> np.ndarray:
    """``log |sinh(x)|`` without overflow (``-inf`` at 0)."""
    a = np.abs(np.asarray(x, dtype=float))
    with np.errstate(divide="ignore"):
        return a + np.log(-np.expm1(-2.0 * a)) - math.log(2.0)


def antipodal_threshold(r: float, q: float, eps: np.ndarray) -> np.ndarray:
    """The Neyman-Pearson threshold ``t`` of the antipodal pair: the root of
    ``((1-q) + q e^{r t - r^2/2}) / ((1-q) + q e^{-r t - r^2/2}) = e^eps``.

    With ``u = e^{r t}`` the equation is a quadratic in ``u``; its positive root is
    ``r t = eps/2 + asinh(((1-q)/q) e^{r^2/2} sinh(eps/2))`` (docs/derivations.md section 13),
    evaluated in log space where the argument overflows."""
    eps = np.asarray(eps, dtype=float)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        log_arg = math.log1p(-q) - math.log(q) + r * r / 2.0 + _log_abs_sinh(eps / 2.0)
        small = np.sign(eps) * np.arcsinh(np.exp(np.minimum(log_arg, 300.0)))
        big = np.sign(eps) * (math.log(2.0) + log_arg)  # asinh(y) = log(2y) + O(1/y^2)
        ash = np.where(log_arg < 300.0, small, big)
    return (eps / 2.0 + np.where(eps == 0, 0.0, ash)) / r


def antipodal_delta(r: float, q: float, eps: np.ndarray) -> np.ndarray:
    """Exact profile ``H_{e^eps}(P || Q)`` of the antipodal pair ``P = (1-q)N(0,1) + q N(r,1)``,
    ``Q = (1-q)N(0,1) + q N(-r,1)``, for every real ``eps`` (the pair is symmetric).

    The likelihood ratio grows with ``x``, so the optimal set is ``{x > t}`` with ``t`` from
    :func:`antipodal_threshold`, and ``delta = (1-q)(1-e^eps) Phi(-t) + q Phi(r-t) - q e^eps Phi(-r-t)``
    (the terms with ``e^eps`` in log space). Cancellation leaves an absolute error of a few ulps of the
    largest term; that much is added, so the values are upper bounds (what a pessimistic PLD needs).

    >>> round(float(antipodal_delta(1.0, 0.3, 2.0)), 8)
    0.00106937
    """
    eps = np.asarray(eps, dtype=float)
    t = antipodal_threshold(r, q, eps)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        pos = np.maximum(eps, 0.0)
        log_expm1 = pos + np.log(-np.expm1(-np.where(eps > 0, pos, 1.0)))  # log(e^eps - 1), eps > 0
        a = np.where(
            eps > 0,
            -(1.0 - q) * np.exp(log_expm1 + special.log_ndtr(-t)),
            (1.0 - q) * -np.expm1(np.minimum(eps, 0.0)) * special.ndtr(-t),
        )
        b = q * special.ndtr(r - t)
        c = np.exp(math.log(q) + eps + special.log_ndtr(-r - t))
        out = a + b - c + 8e-16 * (np.abs(a) + b + c)
    return np.clip(np.nan_to_num(out, nan=1.0), 0.0, 1.0)


def poisson_replace_one_profile(noise_multiplier: float, q: float) -> Callable[[np.ndarray], np.ndarray]:
    """Exact profile of one Poisson-subsampled Gaussian step under REPLACE_ONE.

    The record's contribution is ``g`` or ``g'`` with ``||g||, ||g'|| <= C`` and noise ``z C``: the
    outputs are ``(1-q) N(0) + q N(g)`` and ``(1-q) N(0) + q N(g')``. In noise units the antipodal
    pair ``((1-q) N(0) + q N(1/z), (1-q) N(0) + q N(-1/z))`` on the real line is a **dominating
    pair** of every such ``(g, g')`` in any dimension, and it is attained (``g' = -g``): for a set
    ``A`` with ``N(0)(A) = Phi(-t)``, ``N(g)(A) <= Phi(|g| - t)`` and ``N(g')(A) >= Phi(-|g'| - t)``
    (Neyman-Pearson for a Gaussian shift), and the half-line ``{x > t}`` attains both bounds for the
    antipodal pair (docs/derivations.md section 13). The profile is :func:`antipodal_delta`.
    (It replaces the advanced-joint-convexity bound of Balle, Barthe & Gaboardi, NeurIPS 2018, Thm. 2,
    which at ``q = 0.3``, ``z = 1`` gave ``eps(1e-3) = 4.72`` against the exact ``2.02``.)
    """
    if q >= 1.0:
        return lambda eps: gdp_delta(2.0 / noise_multiplier, eps)
    r = 1.0 / noise_multiplier
    return lambda eps: antipodal_delta(r, q, eps)


def poisson_add_remove_deltas(r: float, q: float, eps: np.ndarray):
    """Exact profiles of the Poisson-subsampled Gaussian under ADD_OR_REMOVE_ONE, both directions:
    ``(H_{e^eps}(P || Q), H_{e^eps}(Q || P))`` with ``P = (1-q) N(0,1) + q N(r,1)``, ``Q = N(0,1)``.

    ``H(P||Q)(eps) = q delta_{G(r)}(log(1 + (e^eps - 1)/q))`` for ``e^eps > 1 - q`` (else ``1 - e^eps``);
    ``H(Q||P)(eps) = (1 - (1-q) e^eps) delta_{G(r)}(-log((e^-eps - (1-q))/q))`` for ``e^-eps > 1 - q``
    (else 0): the half-lines of the monotone likelihood ratio, in log space (the same object as
    dp_accounting's ``from_gaussian_mechanism(sampling_prob=q)``; docs/derivations.md section 13)."""
    eps = np.asarray(eps, dtype=float)
    log_keep = math.log1p(-q)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        above = eps > log_keep
        inner = _amplified(np.where(above, eps, 0.0), q)  # log(1 + (e^eps - 1)/q)
        forward = np.where(above, q * np.exp(gdp_log_delta(r, inner)), -np.expm1(np.minimum(eps, 0.0)))
        below = -eps > log_keep
        inner_r = _amplified(np.where(below, -eps, 0.0), q)
        weight = -np.expm1(log_keep + eps)  # 1 - (1-q) e^eps
        backward = np.where(below, weight * np.exp(gdp_log_delta(r, -inner_r)), 0.0)
    return np.clip(forward, 0.0, 1.0), np.clip(backward, 0.0, 1.0)


def rdp_profile(orders: Sequence[float], rdp: Sequence[float]) -> Callable[[np.ndarray], np.ndarray]:
    """Profile implied by an RDP curve (valid in both directions for a symmetric relation).

    Canonne, Kamath & Steinke (2020) Prop. 12 / Asoodeh et al.: for each order ``a``,
    ``delta(eps) <= exp((a-1)(rdp_a - eps)) / a * (1 - 1/a)^(a-1)`` for ``eps >= 0``.
    """
    orders = np.asarray(orders, dtype=float)
    rdp = np.asarray(rdp, dtype=float)
    keep = np.isfinite(rdp) & (orders > 1)
    orders, rdp = orders[keep], rdp[keep]

    def positive(eps):
        eps = np.asarray(eps, dtype=float)
        if orders.size == 0:
            return np.ones_like(eps)
        log_terms = (
            (orders[:, None] - 1) * (rdp[:, None] - eps[None, :])
            - np.log(orders)[:, None]
            + (orders[:, None] - 1) * np.log1p(-1 / orders)[:, None]
        )
        return np.minimum(1.0, np.exp(np.min(log_terms, axis=0)))

    return symmetric_extension(positive)


def subsampled_gaussian_clt_mu(mu: float, p: float, k) -> np.ndarray:
    """CLT approximation of ``C_p(G(mu))^{(x) k}`` as ``G(mu_k)`` (Bok Lemma A.5, Dong et al.
    Thm 6): ``mu_k = sqrt(2) p sqrt(k) sqrt(e^{mu^2} Phi(1.5 mu) + 3 Phi(-0.5 mu) - 2)``.

    An *approximation*, not a bound: this package uses it only to choose analysis
    parameters and grid sizes, never as a reported number.
    """
    with np.errstate(over="ignore"):
        h = np.exp(mu * mu) * special.ndtr(1.5 * mu) + 3 * special.ndtr(-0.5 * mu) - 2
    return math.sqrt(2.0) * p * np.sqrt(np.asarray(k, dtype=float)) * math.sqrt(max(float(h), 0.0))


# ---------------------------------------------------------------------------- PLDs
def lower_hull(x: Sequence[float], y: Sequence[float], keep_within: float = 0.0) -> list:
    """Indices of the vertices of the lower convex hull of the points ``(x_i, y_i)``, ``x``
    non-decreasing (Andrew's monotone chain; points on a hull edge are dropped). With
    ``keep_within > 0`` a point is dropped only when it lies above an edge by more than that
    relative margin, so rounding never drops a true vertex (extra points only make a path
    through them longer)."""
    hull: list = []
    for i in range(len(x)):
        while len(hull) >= 2:
            i0, i1 = hull[-2], hull[-1]
            # drop i1 if it lies on or above the segment i0 -> i
            above = (y[i1] - y[i0]) * (x[i] - x[i0])
            chord = (y[i] - y[i0]) * (x[i1] - x[i0])
            if above >= chord + keep_within * (abs(above) + abs(chord)):
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


def _lower_convex_envelope(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Values at ``x`` of the largest convex function below the points ``(x_i, y_i)``, ``x`` increasing.

    Vectorised rounds drop every point on or above the chord of its two neighbours (:func:`lower_hull`'s
    test; no such point is a hull vertex). Once no point is dropped, every consecutive triple turns left:
    the points left are the lower hull (:func:`lower_hull` would keep them all). After
    :data:`PRUNING_ROUNDS` rounds :func:`lower_hull` finishes on what is left. A PLD's profile has tens of
    thousands of points, which the loop alone takes tens of milliseconds for."""
    idx = np.arange(len(x))
    for _ in range(PRUNING_ROUNDS):
        if idx.size < 3:
            return np.interp(x, x[idx], y[idx])
        x0, x1, x2 = x[idx[:-2]], x[idx[1:-1]], x[idx[2:]]
        y0, y1, y2 = y[idx[:-2]], y[idx[1:-1]], y[idx[2:]]
        above = (y1 - y0) * (x2 - x0) >= (y2 - y0) * (x1 - x0)
        if not np.any(above):
            return np.interp(x, x[idx], y[idx])
        keep = np.ones(idx.size, dtype=bool)
        keep[1:-1] = ~above
        idx = idx[keep]
    hull = idx[lower_hull(x[idx], y[idx])]
    return np.interp(x, x[hull], y[hull])


PRUNING_ROUNDS = 64  # vectorised rounds of :func:`_lower_convex_envelope` before the exact loop finishes


def _upper_loss(profile: Callable[[np.ndarray], np.ndarray], floor: float = TAIL_MASS) -> float:
    """Smallest grid end ``eps`` with ``delta(eps) <= floor``, capped at ``MAX_LOSS``."""
    f = lambda e: float(profile(np.array([e]))[0])
    if f(MAX_LOSS) > floor:
        return MAX_LOSS
    lo, hi = 0.0, 1e-3
    while f(hi) > floor:
        lo, hi = hi, min(2 * hi, MAX_LOSS)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if f(mid) > floor:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-3 * hi:
            break
    return hi


def pld_from_profile(profile: Callable[[np.ndarray], np.ndarray], discretization: float) -> PLD:
    """Pessimistic PLD of a symmetric tradeoff function from (upper bounds on) its profile.

    The grid runs over ``[-E, E]`` with ``delta(E) <= TAIL_MASS`` (mass beyond moves to
    +infinity, mass below ``-E`` rounds up to ``-E``; both pessimistic). Profile values
    are replaced by their lower convex envelope in ``e^eps``, which still dominates the
    true (convex) profile and keeps every Connect-the-Dots mass non-negative.
    """
    return PLD(pmf_from_profile(profile, discretization))


def pmf_from_profile(
    profile: Callable[[np.ndarray], np.ndarray], discretization: float, floor: float = TAIL_MASS
) -> pld_pmf.PLDPmf:
    """The pessimistic Connect-the-Dots PMF of one direction (:func:`pld_from_profile`); ``profile`` gives
    ``H_{e^eps}`` of that direction for every real ``eps``. The grid ends where the profile is at most
    ``floor`` (a profile with mass at infinite loss never gets below that mass)."""
    upper = _upper_loss(profile, max(floor, TAIL_MASS))
    if float(profile(np.array([MAX_LOSS]))[0]) >= 0.5:
        raise VacuousBound("delta(MAX_LOSS) >= 1/2")
    k = max(1, int(math.ceil(upper / discretization)))
    grid = np.arange(-k, k + 1)
    eps = grid * discretization
    deltas = np.clip(np.asarray(profile(eps), dtype=float), 0.0, 1.0)
    deltas = np.minimum.accumulate(deltas)  # a profile is non-increasing
    x = np.concatenate([[0.0], np.exp(eps)])
    y = np.concatenate([[1.0], deltas])
    deltas = np.clip(_lower_convex_envelope(x, y)[1:], 0.0, 1.0)
    return pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(discretization, int(grid[0]), int(grid[-1]), deltas)


# Compositions whose CLT estimate exceeds this GDP parameter (epsilon in the tens of
# thousands) are not built as PLDs: the grid would not fit in memory, the RDP bounds cover them.
MU_MAX_PLD = 200.0


def discretization_for(mu_estimate: float, base: float, max_points: float = 1e6) -> Optional[float]:
    """A discretisation keeping a composed PLD near ``G(mu_estimate)`` under ``max_points``,
    or ``None`` when ``mu_estimate > MU_MAX_PLD`` (too large to build).

    ``mu_estimate`` is a (CLT) guess of the composed GDP parameter; its loss range is about
    ``mu^2/2 + 12 mu``. Only run time depends on this: every discretisation is pessimistic.
    """
    if not mu_estimate <= MU_MAX_PLD:  # also catches nan/inf
        return None
    span = mu_estimate * mu_estimate / 2.0 + 12.0 * mu_estimate + 1.0
    return max(base, 2.0 * span / max_points)


TOO_LARGE = (
    f"not computed as a PLD: the composition's CLT estimate exceeds mu = {MU_MAX_PLD:g} "
    "(epsilon in the tens of thousands); the RDP bounds cover this run"
)


def gaussian_pld(mu: float, discretization: float) -> PLD:
    """Pessimistic PLD of ``G(mu)`` from its exact profile (robust for tiny and huge ``mu``)."""
    if mu <= 0:
        return pld_lib.identity(value_discretization_interval=discretization)
    return pld_from_profile(lambda eps: gdp_delta(mu, eps), discretization)


def pld_epsilon(pld: PLD, delta: float) -> float:
    """``epsilon(delta)`` of a PLD; ``inf`` for a vacuous bound (``None``) or a NaN (never 0)."""
    if pld is None:  # a vacuous bound
        return math.inf
    eps = float(pld.get_epsilon_for_delta(delta))
    return math.inf if math.isnan(eps) else max(0.0, eps)


def pld_delta(pld: PLD, epsilon: float) -> float:
    """``delta(epsilon)`` of a PLD; 1 for a vacuous bound (``None``) or a NaN."""
    if pld is None:
        return 1.0
    d = float(pld.get_delta_for_epsilon(epsilon))
    return 1.0 if math.isnan(d) else min(1.0, max(0.0, d))


def profile_tradeoff(profile_values: np.ndarray, eps: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Tradeoff curve implied by a symmetric profile sampled at ``eps`` (Dong et al. Prop. 2.12).

    ``f(alpha) = sup_eps max(0, 1 - delta(eps) - e^eps alpha, e^{-eps}(1 - delta(eps) - alpha))``.
    """
    alpha = np.asarray(alpha, dtype=float)[:, None]
    d = np.asarray(profile_values, dtype=float)[None, :]
    e = np.asarray(eps, dtype=float)[None, :]
    a = 1 - d - np.exp(e) * alpha
    b = np.exp(-e) * (1 - d - alpha)
    return np.clip(np.max(np.maximum(a, b), axis=1), 0.0, 1.0)
