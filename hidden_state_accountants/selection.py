"""Which bound a run reports: the one rule shared by the accountant and calibration.

Among a run's analyses the reported epsilon is the smallest of

* each applicable analysis' own epsilon at ``delta`` (an analysis whose epsilon is NaN, an
  overflow inside it, counts as ``inf``: it says nothing and never wins), and
* ``rdp_pointwise_min``: the RDP curves of every applicable RDP/GDP analysis, their pointwise
  minimum taken per order, converted once (when at least two curves exist; a pointwise minimum
  of valid RDP curves is a valid RDP curve, and it can beat every curve alone).

Ties go to a named analysis before ``rdp_pointwise_min``, then to the smaller name.
:class:`~hidden_state_accountants.HiddenStateAccountant` reports this choice and
:func:`~hidden_state_accountants.calibrate_noise_multiplier` searches for the noise at which it
meets a target, so the two cannot disagree about which analyses count.

>>> from hidden_state_accountants.bounds import GdpBound, NotApplicable
>>> bounds = [GdpBound(name="a", mu=1.0), GdpBound(name="b", mu=1.0), NotApplicable(name="c", reason="no")]
>>> best = select_best(bounds, 1e-5, orders=(2.0, 4.0, 8.0))
>>> best.analysis, round(best.epsilon, 4), best.epsilons[2]
('a', 4.3772, None)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np

from hidden_state_accountants import rdp as rdp_tools
from hidden_state_accountants.bounds import Bound

RDP_POINTWISE_MIN = "rdp_pointwise_min"
RDP_POINTWISE_MIN_CITATION = "pointwise minimum of the RDP curves above, then converted"
NONE = "none"
"""The analysis named when nothing applies (epsilon ``inf``)."""


def bound_epsilon(bound: Bound, delta: float) -> float:
    """``bound``'s epsilon at ``delta`` as a candidate: ``inf`` when it does not apply or is NaN."""
    if not bound.applicable:
        return math.inf
    eps = bound.epsilon(delta)
    return math.inf if math.isnan(eps) else eps


@dataclass(frozen=True)
class PointwiseRdpMinimum:
    """``rdp_pointwise_min``: its epsilon, the order that gives it, the analysis whose curve is
    smallest there (the first in the bounds' order on ties) and whether that one is a
    hidden-state bound; ``monotone_in_steps`` when every RDP/GDP bound taken is."""

    epsilon: float
    order: float
    winner: str
    hidden_state: bool
    monotone_in_steps: bool


def pointwise_rdp_minimum(
    bounds: Sequence[Bound], orders: Sequence[float], delta: float
) -> Optional[PointwiseRdpMinimum]:
    """The pointwise minimum of the applicable bounds' RDP curves at ``orders``, converted at
    ``delta``; ``None`` with fewer than two curves or when no order gives a finite epsilon."""
    rdp_bounds = [b for b in bounds if b.applicable and b.kind in ("rdp", "gdp")]
    curves = [(b, b.rdp(orders)) for b in rdp_bounds]
    curves = [(b, rdp_tools.sanitized(c)) for b, c in curves if c is not None]
    if len(curves) < 2:
        return None
    stack = np.vstack([c for _, c in curves])
    eps, order = rdp_tools.rdp_to_epsilon(orders, np.min(stack, axis=0), delta)
    if not math.isfinite(order):
        return None
    i = int(np.argmin(np.abs(np.asarray(orders) - order)))
    winner = curves[int(np.argmin(stack[:, i]))][0]
    # a pointwise minimum of curves that never decrease with the length never does
    return PointwiseRdpMinimum(
        eps, order, winner.name, winner.hidden_state, all(b.monotone_in_steps for b in rdp_bounds)
    )


@dataclass(frozen=True)
class Selection:
    """The reported epsilon and its analysis; ``epsilons``: each bound's candidate epsilon in the
    bounds' order (``None`` where it does not apply); ``pointwise``: ``rdp_pointwise_min`` when
    it was a candidate."""

    epsilon: float
    analysis: str
    epsilons: Tuple[Optional[float], ...]
    pointwise: Optional[PointwiseRdpMinimum]


def select_best(bounds: Sequence[Bound], delta: float, orders: Sequence[float], *, pointwise: bool = True) -> Selection:
    """The smallest valid epsilon among ``bounds`` and their pointwise RDP minimum (module
    docstring). ``pointwise=False`` leaves the pointwise minimum out (calibration, before every
    analysis has been evaluated at a noise). ``(inf, "none")`` when no bound applies."""
    epsilons = tuple(bound_epsilon(b, delta) if b.applicable else None for b in bounds)
    candidates = [(eps, 0, b.name) for b, eps in zip(bounds, epsilons) if eps is not None]
    best_rdp = pointwise_rdp_minimum(bounds, orders, delta) if pointwise else None
    if best_rdp is not None:
        candidates.append((best_rdp.epsilon, 1, RDP_POINTWISE_MIN))  # a named analysis wins a tie
    eps, _, name = min(candidates, default=(math.inf, 0, NONE))
    return Selection(eps, name, epsilons, best_rdp)


__all__ = [
    "select_best",
    "Selection",
    "bound_epsilon",
    "pointwise_rdp_minimum",
    "PointwiseRdpMinimum",
    "RDP_POINTWISE_MIN",
    "NONE",
]
