"""Renyi-DP helpers: the order grid, dp_accounting's sampled-Gaussian RDP, conversions."""

from __future__ import annotations

import math
import numbers
from functools import lru_cache
from typing import Any, Iterable, Optional, Sequence, Tuple

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant as _rdp

from hidden_state_accountants import validation as v

DEFAULT_ORDERS: Tuple[float, ...] = tuple(float(a) for a in _rdp.DEFAULT_RDP_ORDERS)
"""dp_accounting's default order grid (1.1 ... 1024)."""


# Orders above this cannot improve an epsilon by more than 7e-6 (the conversion's
# log(1/delta)/(alpha - 1) term for any delta >= 1e-300) and only invite overflow in the
# analyses' (alpha - 1) * value products.
MAX_ORDER = 1e8


def check_orders(orders: Optional[Iterable[Any]], *, as_given: bool = False) -> Tuple[float, ...]:
    """A validated order grid: ``DEFAULT_ORDERS`` for ``None``; otherwise a non-empty iterable of
    real numbers in ``(1, MAX_ORDER]``, returned sorted without duplicates (``as_given``: in the
    order given, duplicates kept, for a curve evaluated at the caller's orders). Anything else
    raises :class:`~hidden_state_accountants.ParameterError` naming ``orders``.

    >>> check_orders([4, 2, 2.0]), check_orders([4, 2, 2.0], as_given=True)
    ((2.0, 4.0), (4.0, 2.0, 2.0))
    """
    if orders is None:
        return DEFAULT_ORDERS
    if isinstance(orders, (str, bytes)) or not isinstance(orders, Iterable):
        raise v.ParameterError("orders", f"must be a sequence of RDP orders (numbers > 1), got {orders!r}")
    values = []
    for a in orders:
        if isinstance(a, bool) or not isinstance(a, numbers.Real) or not 1 < float(a) <= MAX_ORDER:
            raise v.ParameterError("orders", f"every RDP order must be a number in (1, {MAX_ORDER:g}], got {a!r}")
        values.append(float(a))
    if not values:
        raise v.ParameterError("orders", "must hold at least one RDP order")
    return tuple(values) if as_given else tuple(sorted(set(values)))


def rdp_to_epsilon(orders: Sequence[float], rdp: Sequence[float], delta: float) -> Tuple[float, float]:
    """(epsilon, best order) via dp_accounting's conversion (Canonne et al. 2020, Prop. 12).

    A NaN value never reaches dp_accounting (whose conversion turns it into epsilon 0): it
    counts as ``inf`` at its order (:func:`sanitized`)."""
    rdp = sanitized(rdp)
    if not np.any(np.isfinite(rdp)):
        return math.inf, float("nan")
    eps, order = _rdp.compute_epsilon(list(orders), list(rdp), delta)
    return max(0.0, float(eps)), float(order)


def sanitized(rdp: Sequence[float]) -> np.ndarray:
    """An RDP curve safe to convert or take minima of, never below the curve it stands for:

    * NaN (an overflow inside an analysis, ``inf - inf``) becomes ``inf``: the analysis says
      nothing at that order. dp_accounting's ``compute_epsilon`` would read a NaN as 0 and
      report epsilon 0, and ``min`` over curves would propagate it;
    * Renyi divergences are >= 0; a bound that rounds a vanishing value to ``-4e-15`` is
      raised to 0 (a larger value is still a valid bound; dp_accounting refuses negatives).
    """
    values = np.asarray(rdp, dtype=float)
    return np.maximum(np.where(np.isnan(values), math.inf, values), 0.0)


def rdp_to_delta(orders: Sequence[float], rdp: Sequence[float], epsilon: float) -> float:
    rdp = sanitized(rdp)
    if not np.any(np.isfinite(rdp)):
        return 1.0
    delta, _ = _rdp.compute_delta(list(orders), list(rdp), epsilon)
    return float(min(1.0, delta))


def _gaussian_fallback(values, noise_multiplier: float, orders) -> Tuple[float, ...]:
    """Replaces failed or underflowed (NaN, <= 0) subsampled values by the unsampled Gaussian's
    ``a / (2 sigma^2)``: sampling never hurts (joint convexity of ``exp((a-1) D_a)`` over the
    inclusion event), and the true value is positive."""
    out = []
    for a, value in zip(orders, values):
        value = float(value)
        if math.isnan(value) or value <= 0:
            # inf, not 0/0, when the noise underflows (e.g. z/2 for z = 5e-324)
            value = a / 2.0 / noise_multiplier / noise_multiplier if noise_multiplier > 0 else math.inf
        out.append(value)
    return tuple(out)


# Below this noise multiplier 1/(2 sigma^2) overflows inside dp_accounting, whose series for
# fractional orders then never terminates; the unsampled Gaussian's value (inf) is used instead.
MIN_SUBSAMPLED_NOISE = 1e-140


@lru_cache(maxsize=4096)
def _sgm_rdp_cached(q: float, noise_multiplier: float, orders: Tuple[float, ...]) -> Tuple[float, ...]:
    if noise_multiplier < MIN_SUBSAMPLED_NOISE:
        return _gaussian_fallback([math.nan] * len(orders), noise_multiplier, orders)
    fn = getattr(_rdp, "_compute_rdp_poisson_subsampled_gaussian", None)
    try:
        if fn is not None:
            out = fn(q=q, noise_multiplier=noise_multiplier, orders=np.array(orders))
        else:  # pragma: no cover - fallback through the public accountant
            from dp_accounting import dp_event

            acc = _rdp.RdpAccountant(list(orders))
            acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(noise_multiplier)))
            out = acc._rdp  # noqa: SLF001
    except (ValueError, OverflowError, ZeroDivisionError):
        out = [math.nan] * len(orders)
    return _gaussian_fallback(np.atleast_1d(out), noise_multiplier, orders)


# dp_accounting's subsampled-Gaussian RDP takes seconds at orders in the millions; beyond this
# order we report infinity (a valid, uninformative value: such orders never give the best epsilon).
MAX_SUBSAMPLED_ORDER = 4096.0


def _limited(fn, q: float, noise_multiplier: float, orders: Sequence[float]) -> np.ndarray:
    orders = np.asarray(orders, dtype=float)
    out = np.full(orders.shape, np.inf)
    small = orders <= MAX_SUBSAMPLED_ORDER
    if np.any(small):
        out[small] = fn(float(q), float(noise_multiplier), tuple(float(a) for a in orders[small]))
    return out


def sampled_gaussian_rdp(q: float, noise_multiplier: float, orders: Sequence[float]) -> np.ndarray:
    """RDP of the sampled Gaussian mechanism with sensitivity 1 (dp_accounting, Mironov et al. 2019).

    dp_accounting evaluates ``D_a(mix || N(0)) >= D_a(N(0) || mix)`` (Mironov et al. Thm 4/5),
    so the value bounds both directions and is valid at every order, integer or not.
    """
    return _limited(_sgm_rdp_cached, q, noise_multiplier, orders)


@lru_cache(maxsize=1024)
def _wor_rdp_cached(q: float, noise_multiplier: float, orders: Tuple[float, ...]) -> Tuple[float, ...]:
    if noise_multiplier < MIN_SUBSAMPLED_NOISE:
        return _gaussian_fallback([math.nan] * len(orders), noise_multiplier, orders)
    values = []
    for a in orders:
        try:
            values.append(float(_rdp._compute_rdp_sample_wor_gaussian_scalar(q, noise_multiplier, a)))  # noqa: SLF001
        except (ValueError, OverflowError, ZeroDivisionError):
            values.append(math.nan)  # dp_accounting fails for vanishing RDP (log1p(-1) at huge noise)
    return _gaussian_fallback(values, noise_multiplier, orders)


def without_replacement_gaussian_rdp(q: float, noise_multiplier: float, orders: Sequence[float]) -> np.ndarray:
    """RDP of one Gaussian step on a fixed-size sample without replacement, REPLACE_ONE.

    Wang, Balle & Kasiviswanathan (2019) Thm. 27 as implemented in dp_accounting;
    ``noise_multiplier`` is relative to the replace-one sensitivity of the base query.
    """
    return _limited(_wor_rdp_cached, q, noise_multiplier, orders)
