"""Projections and clips onto L2 balls, as the analyses count them: one rule for every adapter.

A hidden-state bound uses the diameter ``D`` of the set the parameters are projected onto after
every step, and the bound ``R`` of every input's norm. Both hold only if the rescaled point lies
*inside* the ball after float rounding. So every adapter rescales onto a ball a hair inside the
declared one (:func:`inside_factor`, a margin larger than the rounding of the norm, the scale and
the product in the tensor's dtype) and reports the declared ball itself: the diameter of the
declared set is exact, never inflated (:func:`ball_product_diameter`).

>>> inside_factor(2.0 ** -23)  # float32: the 1e-6 margin
0.999999
>>> inside_factor(2.0 ** -10) == 1 - 4 * 2.0 ** -10  # float16: four of its roundings
True
>>> ball_product_diameter([3.0, 4.0])  # the product of two balls, one per tensor
10.0
"""

from __future__ import annotations

import math
from typing import Iterable

from hidden_state_accountants import validation as v

MARGIN = 1e-6
"""The least relative margin inside the ball (float32 and float64 round the norm far less)."""


def inside_factor(eps: float) -> float:
    """The factor of the declared radius to rescale onto, for a dtype whose machine epsilon is
    ``eps``: ``1 - max(1e-6, 4 eps)`` (the norm, the scale and the product each round by at most
    ``eps`` relative; one more for slack)."""
    return 1.0 - max(MARGIN, 4.0 * v.nonnegative_float("eps", eps))


def ball_product_diameter(radii: Iterable[float]) -> float:
    """The diameter ``2 sqrt(sum r_j^2)`` of the product of L2 balls of radii ``r_j`` (one per
    parameter tensor; one ball of radius ``R`` has diameter ``2R``), the convex set the parameters
    stay in when each tensor is projected onto its ball."""
    radii = [v.positive_float("radius", r) for r in radii]
    if not radii:
        raise v.ParameterError("radii", "needs at least one ball")
    if len(radii) == 1:
        return 2.0 * radii[0]  # exactly
    return 2.0 * math.sqrt(math.fsum(r * r for r in radii))


__all__ = ["MARGIN", "inside_factor", "ball_product_diameter"]
