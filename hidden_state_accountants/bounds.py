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
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import special

from hidden_state_accountants import fdp
from hidden_state_accountants import rdp as rdp_tools


MONOTONE_RTOL = 1e-9
"""Relative accuracy to which the computed values of a bound flagged ``monotone_in_steps`` are
non-decreasing in the number of steps (the root finds' tolerance; the bound itself is exactly so)."""


@dataclass
class Bound:
    """Base class. ``name`` is a stable identifier, ``citation`` says paper/theorem/equation.

    Analyses declared with :func:`hidden_state_accountants.analyses.analysis_info.analysis`
    leave these three to the decorator, which fills them in from the analysis' entry.
    """

    name: str = ""
    citation: str = ""
    hidden_state: bool = True
    # True when the bound never decreases as the run gets longer, so its value after T steps bounds
    # every run of at most T steps and its value for an unbounded run every run (used to certify
    # "unlimited" epochs and by the epoch budget's bisection). Exact for the bound itself; a value found
    # by a root find is never below it and within MONOTONE_RTOL of it, so computed values may dip by that
    # much, not more (tests/core/test_properties.py checks every flagged analysis step by step).
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

    def __post_init__(self):
        # a NaN (an overflow inside the analysis) says nothing at its order: inf, never 0
        self.values = rdp_tools.sanitized(self.values)

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
class MixtureGdpBound(Bound):
    """``sum_i p_i G(mu_i)`` as a profile: the pair "reveal ``i`` (with probability ``p_i``),
    then ``N(mu_i, 1)`` vs ``N(0, 1)``", whose ``delta(eps)`` is ``sum_i p_i delta_{G(mu_i)}(eps)``.

    It dominates every mixture, with the same weights, of pairs whose ``i``-th component is
    ``mu_i``-GDP: the hockey-stick divergence is jointly convex (Balle, Barthe & Gaboardi,
    "Privacy Amplification by Subsampling", NeurIPS 2018), at every ``eps`` and in both
    directions. The pair is symmetric (``x -> mu_i - x`` given ``i`` swaps its two laws), so its
    profile extends to negative ``eps`` by the symmetric identity and its pessimistic PLD
    composes with other events. RDP: Ye & Shokri (NeurIPS 2022) Lemma 4.1, the joint convexity
    of ``exp((a-1) D_a)``, over the components' ``(a, a mu_i^2 / 2)``-RDP.

    >>> b = MixtureGdpBound(probs=(0.5, 0.5), mus=(1.0, 2.0))
    >>> round(b.delta(1.0), 6) == round(0.5 * fdp.gdp_delta(1.0, 1.0) + 0.5 * fdp.gdp_delta(2.0, 1.0), 6)
    True
    """

    probs: Tuple[float, ...] = ()
    mus: Tuple[float, ...] = ()
    note: str = ""
    kind = "mixture"

    def __post_init__(self):
        probs = np.asarray(self.probs, dtype=float)
        mus = np.asarray(self.mus, dtype=float)
        if (
            probs.shape != mus.shape
            or probs.size == 0
            or np.any(probs < 0)
            or np.any(np.isnan(mus))
            or np.any(mus < 0)
            or not abs(float(np.sum(probs)) - 1.0) <= 1e-9
        ):
            raise ValueError("MixtureGdpBound: probabilities summing to 1 and one mu >= 0 each")
        self.probs, self.mus = tuple(probs.tolist()), tuple(mus.tolist())

    def _log_delta(self, eps) -> np.ndarray:
        with np.errstate(divide="ignore"):
            return fdp.mixture_gdp_log_delta(np.log(np.asarray(self.probs)), np.asarray(self.mus), eps)

    def delta(self, epsilon: float) -> float:
        return float(min(1.0, math.exp(self._log_delta(epsilon)[0])))

    def epsilon(self, delta: float) -> float:
        if delta >= 1:
            return 0.0
        probs, mus = np.asarray(self.probs), np.asarray(self.mus)
        infinite = float(np.sum(probs[np.isinf(mus)]))
        if delta <= infinite or delta <= 0:
            return math.inf
        log_target = math.log(delta)
        f = lambda e: float(self._log_delta(e)[0]) - log_target
        if f(0.0) <= 0:
            return 0.0
        # at e = max_i eps_i(delta - infinite) every finite component is within delta - infinite
        hi = fdp.gdp_epsilon(float(np.max(mus[np.isfinite(mus)])), delta - infinite) + 1e-9  # grows with mu
        if not math.isfinite(hi):
            return math.inf
        return fdp.conservative_root(f, 0.0, hi)

    def rdp(self, orders: Sequence[float]) -> Optional[np.ndarray]:
        a = np.asarray(orders, dtype=float)[:, None]
        mus = np.asarray(self.mus)[None, :]
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            terms = np.log(np.asarray(self.probs))[None, :] + (a - 1) * a * mus * mus / 2.0
            out = special.logsumexp(terms, axis=1) / (a[:, 0] - 1)
        return np.maximum(np.nan_to_num(out, nan=math.inf, posinf=math.inf), 0.0)  # a rounding -1e-16 is 0

    def pld(self, delta: float, discretization: float) -> Optional[fdp.PLD]:
        # the profile is evaluated on the whole grid: fewer components (mu rounded up) keep it quick
        probs, mus = mixture_components(self.probs, self.mus, PLD_COMPONENTS, floor=1e-2)
        log_p, mus = np.log(np.asarray(probs)), np.asarray(mus)
        profile = fdp.symmetric_extension(lambda eps: np.exp(fdp.mixture_gdp_log_delta(log_p, mus, eps)))
        try:
            return fdp.pld_from_profile(profile, discretization)
        except fdp.VacuousBound:
            return None

    def detail(self, delta: float) -> str:
        text = f"{len(self.mus)} components, mu in [{min(self.mus):.4g}, {max(self.mus):.4g}]"
        return "; ".join(s for s in (text, self.note) if s)


PLD_COMPONENTS = 256
"""Components a mixture's pessimistic PLD is built from (``mu`` rounded up beyond that)."""


def mixture_components(
    probs: Sequence[float], mus: Sequence[float], max_components: int = 16384, floor: float = 1e-6
) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    """``(probs, mus)`` with equal parameters merged, zero weights dropped and the weights
    normalised; beyond ``max_components`` distinct values every ``mu`` is rounded *up* onto a
    geometric grid from ``floor`` times the largest (``delta_{G(mu)}`` grows with ``mu``, so the
    mixture only gets larger)."""
    p = np.asarray(probs, dtype=float)
    m = np.asarray(mus, dtype=float)
    keep = p > 0
    p, m = p[keep], m[keep]
    values, inverse = np.unique(m, return_inverse=True)
    if values.size > max_components:
        finite = values[np.isfinite(values) & (values > 0)]
        top = float(finite.max()) if finite.size else 1.0
        floor = top * floor  # rounded up to it: sound, and what is below barely shows
        ratio = (top / floor) ** (1.0 / (max_components - 2))
        with np.errstate(divide="ignore", invalid="ignore"):
            k = np.ceil(np.log(np.maximum(m, floor) / floor) / math.log(ratio) - 1e-12)
            rounded = np.where(np.isfinite(m), np.minimum(floor * ratio**k, top), m)
        rounded = np.where(np.isfinite(m), np.maximum(rounded, m), m)  # never below the value
        values, inverse = np.unique(rounded, return_inverse=True)
    weights = np.bincount(inverse.ravel(), weights=p, minlength=values.size)
    keep = weights > 0
    weights, values = weights[keep], values[keep]
    return tuple((weights / weights.sum()).tolist()), tuple(values.tolist())


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


def with_failure(pld: fdp.PLD, p: float) -> fdp.PLD:
    """The PLD of ``((1-p) A + p a*, (1-p) B + p b*)`` with atoms ``a*``, ``b*`` on disjoint points:
    every finite loss's mass scaled by ``1 - p`` and mass ``p`` moved to ``+infinity``, in both
    directions. Its ``delta(eps)`` is ``(1 - p) delta_{A,B}(eps) + p`` (docs/derivations.md section 7).

    >>> g = fdp.gaussian_pld(1.0, 1e-3)
    >>> abs(fdp.pld_delta(with_failure(g, 1e-3), 1.0) - (0.999 * fdp.pld_delta(g, 1.0) + 1e-3)) < 1e-12
    True
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"with_failure: p must lie in [0, 1], got {p!r}")
    if p == 0.0:
        return pld

    # dp_accounting has no public constructor for a scaled PMF; its PMF classes are rebuilt field by field
    def scale(pmf):
        inf_mass = pmf._infinity_mass * (1 - p) + p  # noqa: SLF001
        if isinstance(pmf, pld_pmf.DensePLDPmf):
            return pld_pmf.DensePLDPmf(
                pmf._discretization,
                pmf._lower_loss,
                pmf._probs * (1 - p),  # noqa: SLF001
                inf_mass,
                pmf._pessimistic_estimate,
            )  # noqa: SLF001
        return pld_pmf.SparsePLDPmf(
            {k: w * (1 - p) for k, w in pmf._loss_probs.items()},  # noqa: SLF001
            pmf._discretization,
            inf_mass,
            pmf._pessimistic_estimate,
        )  # noqa: SLF001

    remove = scale(pld._pmf_remove)  # noqa: SLF001
    if pld._symmetric:  # noqa: SLF001
        return pld_lib.PrivacyLossDistribution(remove)
    return pld_lib.PrivacyLossDistribution(remove, scale(pld._pmf_add))  # noqa: SLF001


@dataclass(frozen=True)
class Cap:
    """A cap ``K`` on the other records' batch size, ``log P(some batch exceeds it)``, and the log
    Lipschitz constant of every step map given it (docs/derivations.md section 7)."""

    cap: int
    log_p: float
    log_c: float

    @property
    def p(self) -> float:
        return math.exp(self.log_p)


@dataclass
class CappedBound(Bound):
    """A bound for the run conditioned on ``G_K = {every batch holds at most K other records}``,
    plus ``p_K = P(not G_K)``, per candidate cap: ``delta(eps) <= (1 - p_K) delta_K(eps) + p_K``
    (joint convexity of the hockey-stick divergence; docs/derivations.md section 7).

    There is no unconditional RDP curve unless a candidate has ``p_K = 0`` (the bad event can
    carry expansive steps): :meth:`rdp` returns ``None`` otherwise, so the accountant's pointwise
    RDP minimum cannot pick a conditional curve up. The PLD is the candidate's PLD with mass
    ``p_K`` at ``+infinity`` (:func:`with_failure`), which composes with other events.
    ``estimates`` (CLT guesses of each candidate's GDP parameter) only decide which candidate is
    composed exactly; every candidate is a valid bound.
    """

    candidates: Tuple[Tuple[Cap, Bound], ...] = ()
    relation: str = "REPLACE_ONE"
    estimates: Tuple[Optional[float], ...] = ()
    kind = "capped"

    def _each(self, delta: float):
        est = list(self.estimates) + [None] * (len(self.candidates) - len(self.estimates))
        items = []
        for (cap, inner), mu in zip(self.candidates, est):
            p = cap.p
            if p < delta and inner.applicable:
                d = (delta - p) / (1.0 - p)
                guess = fdp.gdp_epsilon(mu, d) if mu is not None else None
                items.append((cap, inner, d, guess))
        guessed = [it for it in items if it[3] is not None]
        if guessed:  # compose exactly only the candidate with the best estimate (any one is valid)
            best = min(guessed, key=lambda it: (it[3], -it[0].cap))
            items = [it for it in items if it[3] is None] + [best]
        for cap, inner, d, _ in items:
            yield cap, inner, d

    def _best(self, delta: float):
        return min(self._each(delta), key=lambda t: t[1].epsilon(t[2]), default=None)

    def epsilon(self, delta: float) -> float:
        best = self._best(delta)
        return math.inf if best is None else best[1].epsilon(best[2])

    def delta(self, epsilon: float) -> float:
        return min([(1 - c.p) * inner.delta(epsilon) + c.p for c, inner in self.candidates if inner.applicable] + [1.0])

    def rdp(self, orders: Sequence[float]) -> Optional[np.ndarray]:
        exact = [inner.rdp(orders) for c, inner in self.candidates if c.p == 0.0 and inner.applicable]
        exact = [r for r in exact if r is not None]
        return np.min(np.vstack(exact), axis=0) if exact else None

    def pld(self, delta: float, discretization: float) -> Optional[fdp.PLD]:
        best = self._best(delta)
        if best is None:
            return None
        cap, inner, d = best
        base = inner.pld(d, discretization)
        return None if base is None else with_failure(base, cap.p)

    def detail(self, delta: float) -> str:
        best = self._best(delta)
        if best is None:
            return "no batch-size cap leaves a failure probability below delta"
        cap, inner, d = best
        text = (
            f"cap {cap.cap} other records per batch (P(exceeded) = {cap.p:.3g}, step Lipschitz "
            f"{math.exp(cap.log_c):.6g})"
        )
        return "; ".join(s for s in (text, inner.detail(d), self.relation) if s)


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
