"""Privacy bounds in the three forms the papers give them: RDP curves, GDP, f-DP (PLD).

Every analysis returns a list of :class:`Bound` objects, or :class:`NotApplicable` with
the reason its theorem's conditions fail. A bound converts itself to (epsilon, delta),
exposes an RDP curve where it has one, and a pessimistic PLD for composition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from hidden_state_accountants import fdp
from hidden_state_accountants import rdp as rdp_tools


@dataclass
class Bound:
    """Base class. ``name`` is a stable identifier, ``citation`` says paper/theorem/equation.

    Analyses registered with :func:`hidden_state_accountants.analyses.registry.analysis`
    leave these three to the registry, which fills them in from the analysis' entry.
    """

    name: str = ""
    citation: str = ""
    hidden_state: bool = True
    # True when the bound never decreases as the run gets longer, so its value for an
    # unbounded run bounds every shorter one (used to certify "unlimited" epochs).
    monotone_in_steps: bool = field(default=False, kw_only=True)

    kind = "none"

    @property
    def applicable(self) -> bool:
        return True

    def epsilon(self, delta: float) -> float:
        raise NotImplementedError

    def delta(self, epsilon: float) -> float:
        raise NotImplementedError

    def rdp(self, orders: Sequence[float]) -> Optional[np.ndarray]:
        """RDP curve over ``orders`` or ``None`` when this bound has none."""
        return None

    def pld(self, delta: float, discretization: float) -> Optional[fdp.PLD]:
        """A pessimistic PLD dominating this bound (tuned for ``delta`` where it matters)."""
        return None

    def detail(self, delta: float) -> str:
        return ""


@dataclass
class NotApplicable(Bound):
    """An analysis whose theorem does not apply; ``reason`` says which condition fails."""

    reason: str = ""
    kind = "none"

    @property
    def applicable(self) -> bool:
        return False

    def epsilon(self, delta: float) -> float:
        return math.inf

    def delta(self, epsilon: float) -> float:
        return 1.0


@dataclass
class RdpBound(Bound):
    """An RDP curve ``values`` over ``orders`` (``inf`` where the bound says nothing)."""

    orders: Tuple[float, ...] = ()
    values: np.ndarray = field(default_factory=lambda: np.zeros(0))
    note: str = ""
    kind = "rdp"

    def epsilon(self, delta: float) -> float:
        return rdp_tools.rdp_to_epsilon(self.orders, self.values, delta)[0]

    def delta(self, epsilon: float) -> float:
        return rdp_tools.rdp_to_delta(self.orders, self.values, epsilon)

    def rdp(self, orders: Sequence[float]) -> Optional[np.ndarray]:
        return _on_orders(self.orders, self.values, orders)

    def pld(self, delta: float, discretization: float) -> Optional[fdp.PLD]:
        try:
            return fdp.pld_from_profile(fdp.rdp_profile(self.orders, self.values), discretization)
        except fdp.VacuousBound:
            return None

    def detail(self, delta: float) -> str:
        _, order = rdp_tools.rdp_to_epsilon(self.orders, self.values, delta)
        text = f"best order {order:g}" if math.isfinite(order) else ""
        return "; ".join(s for s in (text, self.note) if s)


@dataclass
class GdpBound(Bound):
    """``mu``-GDP; converted to (epsilon, delta) with the exact closed form."""

    mu: float = 0.0
    note: str = ""
    kind = "gdp"

    def epsilon(self, delta: float) -> float:
        return fdp.gdp_epsilon(self.mu, delta)

    def delta(self, epsilon: float) -> float:
        return float(fdp.gdp_delta(self.mu, epsilon))

    def rdp(self, orders: Sequence[float]) -> Optional[np.ndarray]:
        return fdp.gdp_rdp(self.mu, np.asarray(orders, dtype=float))

    def pld(self, delta: float, discretization: float) -> Optional[fdp.PLD]:
        return fdp.gaussian_pld(self.mu, discretization)

    def detail(self, delta: float) -> str:
        return "; ".join(s for s in (f"mu = {self.mu:.6g}", self.note) if s)


@dataclass
class PldBound(Bound):
    """An f-DP bound held as a PLD, possibly a family indexed by an analysis parameter.

    ``build(delta, discretization)`` returns ``(pld, detail)``; for theorems with a free
    parameter (``tau``) the builder chooses it for the requested ``delta``. Any choice is
    a valid bound, so the choice only affects tightness. Results are cached per
    ``(delta, discretization)``. ``discretization`` is the finest grid this bound is built
    on (coarser for long compositions, to bound run time; any grid is pessimistic).
    """

    build: Callable[[float, float], Tuple[fdp.PLD, str]] = None
    discretization: float = 1e-3
    kind = "fdp"
    _cache: Dict[Tuple[float, float], Tuple[fdp.PLD, str]] = field(default_factory=dict, repr=False)

    def _get(self, delta: float, discretization: float) -> Tuple[fdp.PLD, str]:
        discretization = max(discretization, self.discretization)
        key = (float(delta), float(discretization))
        if key not in self._cache:
            try:
                self._cache[key] = self.build(delta, discretization)
            except fdp.VacuousBound:
                self._cache[key] = (None, "vacuous: most mass at infinite privacy loss")
        return self._cache[key]

    def epsilon(self, delta: float) -> float:
        return fdp.pld_epsilon(self._get(delta, self.discretization)[0], delta)

    def delta(self, epsilon: float) -> float:
        # the free parameter is tuned for a typical delta; any choice is valid
        return fdp.pld_delta(self._get(1e-5, self.discretization)[0], epsilon)

    def pld(self, delta: float, discretization: float) -> Optional[fdp.PLD]:
        return self._get(delta, discretization)[0]

    def detail(self, delta: float) -> str:
        return self._get(delta, self.discretization)[1]


def _on_orders(src_orders, values, orders) -> np.ndarray:
    """Re-expresses an RDP curve on another order grid, never optimistically.

    RDP is non-decreasing in the order, so the value at ``a`` is bounded by the value at
    the smallest grid order ``>= a`` (``inf`` above the grid).
    """
    src = np.asarray(src_orders, dtype=float)
    vals = np.asarray(values, dtype=float)
    out = np.empty(len(orders))
    for i, a in enumerate(np.asarray(orders, dtype=float)):
        j = np.searchsorted(src, a - 1e-12)
        out[i] = vals[j] if j < len(src) else math.inf
    return out
