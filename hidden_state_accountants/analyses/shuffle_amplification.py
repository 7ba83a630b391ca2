"""Amplification by the shuffle: the record's random position pairs the mixture components.

Derived in docs/derivations.md, section 5a. For ``reshuffle`` (a fresh secret permutation every
epoch) and ``shuffle_partition`` (one secret partition), the outputs are mixtures over the
record's batch ``j``: ``P = sum_j w_j P_j`` (dataset D) and ``Q = sum_i w_i Q_i`` (D'). The
per-position analyses average ``delta`` over ``j`` (joint convexity), which keeps none of the
amplification a mixture has. Here every pair ``(P_j, Q_i)``, not only ``i = j``, gets a
Gaussian bound: swapping the record with the record at the other position couples the two
conditional runs, which then differ at both positions, so Bok, Su & Altschuler's
shifted-interpolation argument (*Shifted Interpolation for Differential Privacy*, ICML 2024,
arXiv:2403.00278, Lemma 3.2 / Thm 3.3, re-derived for any visit pattern in docs/derivations.md
section 2) gives ``T(Q_i, P_j) >= G(mu_ij)``. Then for any *plan* (masses ``alpha_ji`` and
ratios ``rho_ji`` with ``sum_i alpha_ji = w_j`` and ``sum_j alpha_ji rho_ji <= e^eps w_i``)

    H_{e^eps}(P || Q) <= sum_{j,i} alpha_ji delta_{G(mu_ij)}(log rho_ji)            (Lemma 5a.1)

which is joint convexity for the diagonal plan and Balle, Barthe & Gaboardi's advanced joint
convexity (*Privacy Amplification by Subsampling*, NeurIPS 2018, arXiv:1807.01647, Thm 2) when
one component is common to both mixtures. The positions far from the end have small ``mu_ii``
and use only part of their capacity ``e^eps w_i``; the rest (the *pool*) takes the recent
positions' mass at a better ratio: the amplification of a mixture, paid with the pairs'
divergences instead of a common part.

Every plan is a valid bound (the lemma holds for each), so the search over plans
(:func:`plan_log_delta`) affects tightness only; each value reported is the exact cost of a
plan checked feasible in floating point with a relative margin.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
from scipy import optimize, special

from hidden_state_accountants import fdp
from hidden_state_accountants.analyses import _common as cm
from hidden_state_accountants.analyses import shifted_interpolation as si
from hidden_state_accountants.analyses.analysis_info import analysis
from hidden_state_accountants.bounds import Bound, NotApplicable
from hidden_state_accountants.events import TrainingRunDpEvent
from hidden_state_accountants.schedules import RESHUFFLE, SHUFFLE_PARTITION

MARGIN = 1e-9
"""Relative slack: a plan's demand on the pool stays below its supply by this much, and each
reported delta is raised by it (floating-point rounding of the sums is far smaller)."""
POOL_CANDIDATES = 16
"""Pool thresholds tried (every one is a valid plan; the best few are kept)."""
KEPT_CANDIDATES = 3
"""Pool thresholds kept for the root find of epsilon after the first screening."""
KEEP_USES = 48
"""``shuffle_partition``: uses per chain kept explicit in a pair's energy; older ones start the
interpolation (a restriction of the schedules: docs/derivations.md 2.2, never optimistic)."""
PLD_POINTS = 128
"""Profile evaluations a PLD of this bound is built from (a step function between them)."""
EXACT_POSITIONS, POSITIONS = 256, 512
"""Positions evaluated one by one, and in all (far-back ones grouped: docs/derivations.md 5a.4);
the pairs cost one hull per position and pool threshold."""


# ======================================================================= the plan (5a.4)
def _log_hockey(mu: np.ndarray, log_ratio: np.ndarray) -> np.ndarray:
    """Elementwise ``log delta_{G(mu)}(log_ratio) = log H_ratio(N(mu, 1) || N(0, 1))`` (Dong, Roth &
    Su, Gaussian DP, JRSS-B 2022, Cor. 2.13), for any real ``log_ratio`` and ``mu >= 0``."""
    mu, lr = np.broadcast_arrays(np.asarray(mu, dtype=float), np.asarray(log_ratio, dtype=float))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        safe = np.where(mu > 0, mu, 1.0)
        a = special.log_ndtr(-lr / safe + safe / 2.0)
        b = lr + special.log_ndtr(-lr / safe - safe / 2.0)
        gauss = np.where(b >= a, -np.inf, a + np.log(-np.expm1(np.minimum(b - a, 0.0))))
        same = np.where(lr >= 0, -np.inf, np.log(-np.expm1(np.minimum(lr, 0.0))))  # mu = 0: (1 - ratio)+
    return np.where(mu > 0, gauss, same)


def _lse(x: np.ndarray) -> float:
    """``log sum exp(x)`` (scipy's logsumexp costs more than the rest of a plan here)."""
    top = float(np.max(x)) if np.size(x) else -math.inf
    if not math.isfinite(top):
        return top
    return top + math.log(float(np.sum(np.exp(x - top))))


def _log1mexp(x: np.ndarray) -> np.ndarray:
    """``log(1 - e^x)`` for ``x <= 0`` (``-inf`` at 0)."""
    with np.errstate(divide="ignore"):
        return np.log(-np.expm1(np.minimum(x, 0.0)))


@dataclass(frozen=True)
class Pool:
    """One plan shape: the components in the pool and, for the others, the pairwise bound with
    any pool member (``mu_cross``; the pool's most recent member gives it, docs/derivations.md 5a.4)."""

    in_pool: np.ndarray
    mu_cross: np.ndarray
    threshold: int  # the pool's most recent distance (for the report)


@dataclass(frozen=True)
class Split:
    """A plan shape's arrays, split once into the pool (``p``) and the others (``o``)."""

    lw_p: np.ndarray
    mu_p: np.ndarray
    lw_o: np.ndarray
    mu_o: np.ndarray
    cross_o: np.ndarray

    @classmethod
    def of(cls, lw: np.ndarray, mu_self: np.ndarray, pool: Pool) -> "Split":
        p, o = pool.in_pool, ~pool.in_pool
        return cls(lw[p], mu_self[p], lw[o], mu_self[o], pool.mu_cross[o])


def plan_terms(log_c: float, tau: float, split: Split, cost: bool = True):
    """``(log cost, log demand, log supply)`` of the plan with capacity ``C = e^log_c`` and pool
    price ``tau`` (docs/derivations.md 5a.4; the cost is ``nan`` with ``cost=False``):

    * a pool member ``i`` pairs with itself at ratio ``gamma_i = min(C, exp(mu_ii tau - mu_ii^2/2))``
      (the likelihood ratio of ``G(mu_ii)`` at the threshold ``tau``); it supplies
      ``(C - gamma_i) w_i`` of its capacity to the pool;
    * another component ``j`` pairs with itself at ratio ``rho_j = max(C, exp(mu_jj tau_j - mu_jj^2/2))``,
      ``tau_j = tau - (mu_cross_j - mu_jj)`` (equal power against both partners), mass
      ``C w_j / rho_j`` (its whole capacity), and sends the rest to the pool at ratio
      ``exp(mu_cross_j tau - mu_cross_j^2/2)``, demanding that much capacity.
    """
    mp, ms, mx = split.mu_p, split.mu_o, split.cross_o
    lg = np.minimum(log_c, mp * (tau - mp / 2.0))
    log_supply = _lse(split.lw_p + log_c + _log1mexp(lg - log_c))
    l_rho = np.maximum(log_c, ms * (tau - (mx - ms) - ms / 2.0))
    l_rest = split.lw_o + _log1mexp(log_c - l_rho)
    l_cross = mx * (tau - mx / 2.0)
    log_demand = _lse(l_rest + l_cross)
    if not cost:
        return math.nan, log_demand, log_supply
    terms = np.concatenate(
        [
            split.lw_p + _log_hockey(mp, lg),
            split.lw_o + log_c - l_rho + _log_hockey(ms, l_rho),
            l_rest + _log_hockey(mx, l_cross),
        ]
    )
    return _lse(terms), log_demand, log_supply


def plan_log_delta(log_c: float, split: Split, tau_guess: Optional[float] = None) -> Tuple[float, float]:
    """``(log delta, tau)`` of the best plan of this shape at ``eps = log_c``: the price ``tau`` where
    the non-pool components' demand meets the pool's supply (with :data:`MARGIN`), the plan's
    exact cost there (``inf`` if no price is feasible). Any ``tau`` with demand below supply is a
    valid plan; the search (from ``tau_guess`` when given) only picks one."""

    def gap(tau):
        _, dem, sup = plan_terms(log_c, tau, split, cost=False)
        if sup == -math.inf:
            return 1e3
        return float(np.clip(dem - sup - math.log1p(-MARGIN), -1e3, 1e3))

    centre = 0.0 if tau_guess is None or not math.isfinite(tau_guess) else tau_guess
    first = 0.25 if tau_guess is not None else 8.0
    lo, hi, step = centre - first, centre + first, first
    while gap(lo) > 0:  # the gap grows with tau: move down to a feasible price
        lo, hi, step = lo - step, lo, 2 * step
        if lo < -1e4:
            return math.inf, math.nan  # no feasible price (an empty pool with demand): not this shape
    step = first
    while gap(hi) <= 0:
        if hi > 1e4:
            return plan_terms(log_c, hi, split)[0], hi
        lo, hi, step = hi, hi + step, 2 * step
    tau = optimize.brentq(gap, lo, hi, xtol=1e-12, rtol=1e-12, maxiter=200)  # any feasible tau is valid
    step = 1e-9 * max(1.0, abs(tau))
    while gap(tau) > 0:  # the feasible side of the root
        tau -= step
        step *= 2
    return plan_terms(log_c, tau, split)[0], tau


def diagonal_log_delta(log_c: float, lw: np.ndarray, mu_self: np.ndarray) -> float:
    """The diagonal plan (every component with itself at ratio ``C``): joint convexity."""
    return _lse(lw + _log_hockey(mu_self, np.full(mu_self.shape, log_c)))


# ================================================================================ the bound
@dataclass
class PairedMixtureBound(Bound):
    """``delta(eps)`` = the cheapest of the evaluated plans of Lemma 5a.1 (docs/derivations.md 5a)
    over the mixture components ``weights`` with self bounds ``mu_self`` and the plan shapes
    ``pools``. Each value is the cost of one feasible plan, so it is valid at every ``eps >= 0``
    in both directions (the pairwise bounds are symmetric); negative ``eps`` follow from the
    symmetric tradeoff function this profile defines (``fdp.symmetric_extension``). No RDP curve."""

    weights: Tuple[float, ...] = ()
    mu_self: Tuple[float, ...] = ()
    pools: Tuple[Pool, ...] = ()
    note: str = ""
    kind = "profile"

    def __post_init__(self):
        w = np.asarray(self.weights, dtype=float)
        if w.size == 0 or np.any(w < 0) or abs(float(np.sum(w)) - 1.0) > 1e-9:
            raise ValueError("PairedMixtureBound: weights summing to 1")
        keep = w > 0
        self._lw = np.log(w[keep])
        self._mu = np.asarray(self.mu_self, dtype=float)[keep]
        self._pools = tuple(
            Pool(p.in_pool[keep], p.mu_cross[keep], p.threshold)
            for p in self.pools
            if np.any(p.in_pool[keep]) and np.any(~p.in_pool[keep])
        )
        self._splits = {p.threshold: Split.of(self._lw, self._mu, p) for p in self._pools}
        self._tau, self._epsilons = {}, {}

    def _log_delta(
        self, eps: float, pools: Sequence[Pool], taus: Optional[dict] = None
    ) -> Tuple[float, Optional[Pool]]:
        """The cheapest plan at ``eps``; each shape's price searched from ``taus`` (kept fixed, so that
        a root find sees one function) or else from the last price found (and remembered)."""
        best, arg = diagonal_log_delta(eps, self._lw, self._mu), None
        for pool in pools:
            start = (self._tau if taus is None else taus).get(pool.threshold)
            v, tau = plan_log_delta(eps, self._splits[pool.threshold], start)
            if taus is None:
                self._tau[pool.threshold] = tau  # the next call starts there
            if v < best:
                best, arg = v, pool
        return best + math.log1p(MARGIN), arg

    def _candidates(self, eps_guess: float) -> Tuple[Pool, ...]:
        """The pool shapes that do best at ``eps_guess`` (kept for the root find of epsilon)."""
        scored = []
        for i, p in enumerate(self._pools):
            v, tau = plan_log_delta(eps_guess, self._splits[p.threshold])
            self._tau[p.threshold] = tau
            scored.append((v, i))
        return tuple(self._pools[i] for _, i in sorted(scored)[:KEPT_CANDIDATES])

    def _log_delta_pos(self, eps: float) -> float:
        return min(0.0, self._log_delta(max(eps, 0.0), self._pools)[0])

    def delta(self, epsilon: float) -> float:
        if epsilon < 0:  # the symmetric tradeoff function's profile (fdp.symmetric_extension)
            return -math.expm1(epsilon) + math.exp(epsilon) * math.exp(self._log_delta_pos(-epsilon))
        return math.exp(self._log_delta_pos(epsilon))

    def _diagonal_epsilon(self, delta: float) -> float:
        f = lambda e: diagonal_log_delta(e, self._lw, self._mu) + math.log1p(MARGIN) - math.log(delta)
        if f(0.0) <= 0:
            return 0.0
        hi = fdp.gdp_epsilon(float(np.max(self._mu)), delta / (1 + 2 * MARGIN)) + 1e-9
        return fdp.conservative_root(f, 0.0, hi) if math.isfinite(hi) else math.inf

    def epsilon(self, delta: float) -> float:
        if delta >= 1:
            return 0.0
        if delta <= 0:
            return math.inf
        if delta not in self._epsilons:  # explain() asks for the epsilon and the detail
            self._epsilons[delta] = self._epsilon(delta)
        return self._epsilons[delta]

    def _epsilon(self, delta: float) -> float:
        hi = self._diagonal_epsilon(delta)
        if hi == 0.0 or not math.isfinite(hi) or not self._pools:
            return hi
        # the best shapes at a guess, then again at the epsilon they give (each root is a valid bound)
        guess, tried = 0.5 * hi, set()
        for _ in range(2):
            pools = self._candidates(guess)
            key = tuple(p.threshold for p in pools)
            if key in tried:
                break
            tried.add(key)
            taus = dict(self._tau)  # the prices' starting points, fixed during the root find
            f = lambda e: self._log_delta(e, pools, taus)[0] - math.log(delta)
            if f(0.0) <= 0:
                return 0.0
            if f(hi) <= 0:  # else the diagonal plan at hi already is below delta: keep hi
                hi = fdp.conservative_root(f, 0.0, hi)
            guess = hi
        return hi

    def pld(self, delta: float, discretization: float) -> Optional[fdp.PLD]:
        """A pessimistic PLD from the profile at :data:`PLD_POINTS` values of ``eps``, held
        constant up to the next one (``delta(eps)`` does not increase, so the steps lie above it)."""
        top = self._diagonal_epsilon(fdp.TAIL_MASS)  # beyond it every plan is below TAIL_MASS
        if not math.isfinite(top) or top > fdp.MAX_LOSS:
            top = fdp.MAX_LOSS
        knots = np.linspace(0.0, top, PLD_POINTS)
        pools = self._candidates(max(self.epsilon(delta), 1e-3))  # the shapes best near delta (any is valid)
        values = np.array([min(1.0, math.exp(self._log_delta(e, pools)[0])) for e in knots])

        def positive(eps):
            idx = np.searchsorted(knots, np.asarray(eps, dtype=float), side="right") - 1
            return values[np.clip(idx, 0, len(knots) - 1)]

        try:
            return fdp.pld_from_profile(fdp.symmetric_extension(positive), discretization)
        except fdp.VacuousBound:
            return None

    def detail(self, delta: float) -> str:
        eps = self.epsilon(delta)
        _, pool = self._log_delta(eps, self._pools) if math.isfinite(eps) and eps > 0 else (0, None)
        text = (
            f"{self._mu.size} components; pool threshold {pool.threshold} steps before the end"
            if pool is not None
            else f"{self._mu.size} components; diagonal plan (joint convexity)"
        )
        return "; ".join(s for s in (text, self.note) if s)


# ============================================================== the pairs (5a.2, 5a.3)
def _thresholds(distances: Sequence[int]) -> List[int]:
    """Pool thresholds: about :data:`POOL_CANDIDATES` distances spaced geometrically from the
    second most recent to the oldest (never the most recent, which would leave nothing outside
    the pool), and one past the oldest (a pool of the unused slots alone: Balle et al.'s common
    part)."""
    ds = np.array(sorted(set(distances)))
    if ds.size == 0:
        return []
    out = [int(ds[-1]) + 1]
    if ds.size > 1:
        targets = np.geomspace(max(ds[1], 1), max(ds[-1], 1), POOL_CANDIDATES)
        idx = np.clip(np.searchsorted(ds, targets), 1, ds.size - 1)
        out = sorted({int(ds[i]) for i in idx}) + out
    return out


@dataclass(frozen=True)
class Energies:
    """Energies (``mu = (2/z) sqrt(E)``) of the components and of the plan shapes; they do not
    depend on the noise, so a calibration computes them once."""

    weights: Tuple[float, ...]
    self_energy: Tuple[float, ...]
    pools: Tuple[Tuple[Tuple[bool, ...], Tuple[float, ...], int], ...]


_CACHE: "OrderedDict[tuple, Energies]" = OrderedDict()
CACHE_SIZE = 16


def _cached(build, run: TrainingRunDpEvent) -> Energies:
    """``build(run)``, remembered for the run without its noise (what the energies depend on)."""
    g = run.geometry
    key = (
        build.__name__,
        run.sampling,
        run.dataset_size,
        run.batch_size,
        run.steps,
        float(run.learning_rate),
        g.strong_convexity,
        g.smoothness,
        run.last_batch,
    )
    if key not in _CACHE:
        _CACHE[key] = build(run)
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    _CACHE.move_to_end(key)
    return _CACHE[key]


def _reshuffle_energies(run: TrainingRunDpEvent) -> Energies:
    """docs/derivations.md 5a.2: components = the record's batch in the last epoch (or a slot the
    last epoch does not reach), the earlier epochs at their worst position (their last step:
    2.3); pair ``(j, i)`` = uses at both positions."""
    model = si._model(run, si._log_c(run))
    T, spe = run.steps, model.spe
    epochs = -(-T // spe)
    prefix = si.chain(model, T - (epochs - 1) * spe, epochs - 1, spe)
    options = si._epoch_options(run, model, epochs - 1, EXACT_POSITIONS, POSITIONS)
    use = lambda d: [] if d is None else [(d, model.log_injection(d))]
    energy = lambda *ds: si.corner_energy(model, prefix + [c for d in ds for c in use(d)])
    self_e = [energy(d) for _, d in options]
    short = None
    if run.last_batch != si.DROPPED and T - (epochs - 1) * spe == spe:
        short = options[0][1]  # the kept short batch: its own shift (it may not be moved later)
    reachable = {d for _, d in options if d is not None}
    pools = []
    for k in _thresholds(reachable):
        in_pool = tuple(d is None or d >= k for _, d in options)
        partners = [x for x in (k, short) if x is not None and x >= k and x in reachable] or [None]
        cross = tuple(max(energy(d, x) for x in partners) if not p else 0.0 for (_, d), p in zip(options, in_pool))
        pools.append((in_pool, cross, k))
    return Energies(tuple(p for p, _ in options), tuple(self_e), tuple(pools))


def _two_chains(model: si.StepModel, first: Tuple[int, int], second: Tuple[int, int], period: int) -> float:
    """Energy of the uses of two chains ``(m, visits)`` with the same period (a partition's pair
    of batches every epoch): the last :data:`KEEP_USES` uses of each explicit, the older ones
    lumped into one start of the interpolation at the most recent of them, carrying their
    discounted shifts (a restriction: never below the exact energy)."""
    corners, lumped = [], []
    for m, visits in (first, second):
        shown = min(visits, KEEP_USES)
        corners += [(m + t * period, model.log_injection(m + t * period)) for t in range(shown)]
        if visits > shown:
            older = si.chain(model, m + shown * period, visits - shown, period)  # two corners, exact sums
            lumped.append((older[-1][0], float(np.logaddexp.reduce([li for _, li in older]))))
    if lumped:
        corners.append((min(d for d, _ in lumped), float(np.logaddexp.reduce([li for _, li in lumped]))))
    return si.corner_energy(model, corners)


def _partition_energies(run: TrainingRunDpEvent) -> Energies:
    """docs/derivations.md 5a.3: components = the record's batch (the same every epoch) or a
    never-used slot (identical outputs); pair ``(j, i)`` = both batches' uses in every epoch."""
    model = si._model(run, si._log_c(run))
    n, b, l = run.dataset_size, run.batch_size, run.steps_per_epoch
    options = si.partition_options(run, EXACT_POSITIONS, POSITIONS)
    self_e = [si.corner_energy(model, si.chain(model, m, v, l)) if v else 0.0 for _, m, v in options]
    weights = [p for p, _, _ in options]
    if n - l * b:
        weights.append((n - l * b) / n)
        self_e.append(0.0)
    never = [False] * len(options) + ([True] if n - l * b else [])
    visits = {m: v for _, m, v in options}
    pools = []
    for k in _thresholds([m for _, m, v in options if v]):
        in_pool = tuple(x or (j < len(options) and options[j][1] >= k) for j, x in enumerate(never))
        partner = (k, visits[k]) if k in visits else (0, 0)  # past every used batch: only the never-used slots
        cross = tuple(0.0 if p else _two_chains(model, options[j][1:], partner, l) for j, p in enumerate(in_pool))
        pools.append((in_pool, cross, k))
    return Energies(tuple(weights), tuple(self_e), tuple(pools))


def _bound(energies: Energies, z: float, note: str) -> PairedMixtureBound:
    scale = lambda e: (2.0 / z) * np.sqrt(np.asarray(e, dtype=float))
    pools = tuple(Pool(np.asarray(mask, dtype=bool), scale(cross), k) for mask, cross, k in energies.pools)
    return PairedMixtureBound(
        weights=energies.weights, mu_self=tuple(scale(energies.self_energy).tolist()), pools=pools, note=note
    )


BOK = si.BOK
BBG = "Balle, Barthe & Gaboardi (2018)"


@analysis(
    "si_reshuffle_amplified",
    f"{BOK}, Lemma 3.2/Thm 3.3 per pair of positions (re-derived: docs/derivations.md 2.2, 5a); the last "
    f"epoch's mixture paired by Lemma 5a.1 (generalises {BBG}, Thm 2)",
    (RESHUFFLE,),
    needs="m > 0, lr < 2/M, secret batches",
)
def reshuffle_amplified(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """Reshuffling (a fresh secret permutation every epoch), amplified by the last epoch's shuffle.

    Ingredients (docs/derivations.md 5a): given the earlier epochs (joint convexity; put at their
    worst position, 2.3), the output is a mixture over the record's batch ``j`` in the last epoch;
    swapping the record with the record in batch ``i`` couples the D-run given ``j`` with the
    D'-run given ``i``, which then differ at both batches: Bok et al.'s Lemma 3.2 / Thm 3.3 for
    that visit pattern (:func:`~hidden_state_accountants.analyses.shifted_interpolation.corner_energy`)
    bounds every pair; Lemma 5a.1 turns the pairs into ``delta(eps)`` through a plan
    (:func:`plan_log_delta`). Conditions as Bok Thm 4.5 (``m > 0``, ``0 < lr < 2/M``, constant rate
    and noise), permutations uniform, independent of the data and secret; any last-batch mode and
    any number of steps. REPLACE_ONE only. Not monotone in the steps.
    """
    reason = si._strongly_convex(run) or cm.need_secret_batches(run)
    if reason:
        return NotApplicable(reason=reason)
    return _bound(
        _cached(_reshuffle_energies, run),
        float(run.noise_multiplier),
        "the last epoch's positions paired, earlier epochs at the worst",
    )


@analysis(
    "si_position_amplified",
    f"{BOK}, Lemma 3.2/Thm 3.3 per pair of batch positions (re-derived: docs/derivations.md 2.2, 5a); the "
    f"partition's mixture paired by Lemma 5a.1 (generalises {BBG}, Thm 2)",
    (SHUFFLE_PARTITION,),
    needs="m > 0, lr < 2/M, secret batches",
)
def position_amplified(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """Shuffle-and-partition (one secret partition, visited in order every epoch), amplified by
    the partition's randomness: as :func:`reshuffle_amplified` with the record's batch the same
    in every epoch, so a pair of positions is a pair of chains (docs/derivations.md 5a.3); the
    never-used slots give identical outputs (a common component, as in Balle et al.'s Thm 2).
    Conditions as Bok Thm 4.5 and secret batches. REPLACE_ONE only.

    Not flagged ``monotone_in_steps``: each pair's uses only gain earlier members as the run gets
    longer, so the best plan's cost never decreases, but the plans searched depend on the length and
    the value found can (7e-4 relative from 21 to 22 steps at n = 27, b = 1, z = 0.5, lr = 0.3, m = 0.5,
    M = 1, delta = 1e-3); the epoch budget's limit and bisection use the flagged bounds only."""
    reason = si._strongly_convex(run) or cm.need_secret_batches(run)
    if reason:
        return NotApplicable(reason=reason)
    return _bound(_cached(_partition_energies, run), float(run.noise_multiplier), "the partition's positions paired")


__all__ = [
    "PairedMixtureBound",
    "Pool",
    "Split",
    "plan_terms",
    "plan_log_delta",
    "diagonal_log_delta",
    "reshuffle_amplified",
    "position_amplified",
]
