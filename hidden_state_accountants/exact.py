"""Ground truth: the exact last-iterate privacy of the worst known neighbouring pair.

Every valid bound must be at least these values; the soundness tests, ``hsa audit`` and the
tightness benchmark compare against them (docs/derivations.md, section 1).

**The model.** Per-example maps ``g_i(theta) = v_i + m theta`` with ``||v_i|| <= C``: a
quadratic loss whose curvature is the L2 term, ``m``-strongly convex and ``M``-smooth for
every ``M >= m``. Unconstrained DP-SGD from ``theta_0 = 0`` (docs/design.md, section 1) is
linear, and along ``e_1`` (the other coordinates have the same law under both datasets)::

    theta_T = drift + (lr 2C / b) S + N(0, nu^2 V),     nu = lr z C / b,
    S = sum_t c^{T-1-t} s_t 1{record in B_t},          V = sum_t c^{2(T-1-t)} nu_t^2,     c = 1 - lr m,

with ``s_t = nu_t = 1`` except for a kept short batch divided by its own size ``r`` (both
``b / r``). Normalised by the noise, the pair is ``(E_S N(kappa S, 1), N(0, 1))`` with
``kappa = (2/z) / sqrt(V)``.

**The pairs.** *Worst* (fixed-size batches): in D' every record has ``v = -C e_1``, in D one
of them is replaced by ``+C e_1``. Under D' the record is like every other, so D' is ONE
Gaussian whatever the batches, while D is a mixture with doubled shifts. At ``T = 1`` it is
exactly ``C_p(G(2/z))`` (Bok, Su & Altschuler, ICML 2024, arXiv:2403.00278, Def. 4.7).
*Mirror* (the other records 0, the record ``+C`` vs ``-C``) and *half* (``+C`` vs 0): for
``poisson`` with the divisor ``b`` the others' random count adds the same independent noise to
both outputs, so the others are best at 0, and the worse of mirror and half is used; the worst
pair above is not valid for Poisson. A deterministic ``S`` (full, cyclic at a position) makes
every pair the Gaussian pair ``G(kappa |S|)``.

**Accuracy.** ``delta(eps)`` follows the Neyman-Pearson sets of the (convex, for ``c >= 0``
monotone) privacy loss, with ``log_ndtr`` tails in log space; ``epsilon(delta)`` is root-found
along the threshold. Where the law of ``S`` has more than :data:`MAX_ENUM` atoms it is put on
a grid: every independent contribution rounded down (``lower``) and up (``upper``), so that
``S_lo <= S <= S_hi`` pointwise; every quantity here grows with ``S`` (docs/derivations.md 1.2),
so ``[value(lower), value(upper)]`` is a certified bracket. The plain methods
(``epsilon``, ``delta``, ``renyi``, ``tradeoff``) return the LOWER end: a bound below it is
refuted. RDP is a numerical integral (not certified); compare it with a relative margin.

>>> from hidden_state_accountants import LossGeometry, TrainingRunDpEvent
>>> run = TrainingRunDpEvent(dataset_size=60, batch_size=6, steps=40, noise_multiplier=2.0, clip_norm=1.0,
...     learning_rate=0.5, sampling="shuffle_partition", geometry=LossGeometry(strong_convexity=0.5, smoothness=0.5))
>>> round(exact_pair(run).epsilon(1e-5), 3)
1.36
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import numpy as np
from scipy import optimize, special

from hidden_state_accountants import fdp
from hidden_state_accountants import validation as v
from hidden_state_accountants.events import TrainingRunDpEvent
from hidden_state_accountants.mixture_pair import EPS_PAD, MixturePair
from hidden_state_accountants.schedule_laws import GRID_POINTS, MAX_ENUM, Law, Linear, schedule_law
from hidden_state_accountants.schedules import (
    BALLS_IN_BINS,
    CYCLIC,
    FULL,
    POISSON,
    RESHUFFLE,
    SHUFFLE_PARTITION,
    WITHOUT_REPLACEMENT,
)

CONSTRUCTIONS = ("worst", "mirror", "half")


def pair_for(law: Law, kappa: float, construction: str) -> MixturePair:
    """The pair of ``construction`` (:data:`CONSTRUCTIONS`) for a law of ``S``."""
    if construction == "worst":
        return MixturePair(kappa * law.values, law.log_w, [0.0], [0.0])
    if construction == "half":
        return MixturePair(0.5 * kappa * law.values, law.log_w, [0.0], [0.0])
    if construction == "mirror":
        return MixturePair(0.5 * kappa * law.values, law.log_w, -0.5 * kappa * law.values, law.log_w)
    raise v.ParameterError("construction", f"must be one of {', '.join(CONSTRUCTIONS)}, got {construction!r}")


def constructions_for(sampling: str, relation: str = "REPLACE_ONE") -> Tuple[str, ...]:
    """The worst known pairs of a schedule (module docstring). Under ADD_OR_REMOVE_ONE the pair is
    *half* (a record at ``+C`` present vs absent, the others at 0; the larger of both directions)
    for ``full``, ``cyclic`` (a fixed divisor: the added record moves its steps by ``lr C/b``),
    ``poisson`` and ``balls_in_bins`` (the others' random counts are an independent translation
    of both outputs, so the others are best at 0, and the ``worst`` pair, which needs fixed batch
    sums, is not valid for them)."""
    if relation == "ADD_OR_REMOVE_ONE":
        if sampling not in (FULL, CYCLIC, POISSON, BALLS_IN_BINS):
            raise v.ParameterError(
                "neighboring_relation",
                f"no exact ADD_OR_REMOVE_ONE pair for sampling={sampling!r}"
                " (the package's fixed-size samplers place records by position)",
            )
        return ("half",)
    return ("mirror", "half") if sampling in (POISSON, BALLS_IN_BINS) else ("worst",)


# ------------------------------------------------------------------------------- the result
class ExactPair:
    """The worst known pair of a run: ``lower`` and ``upper`` (the pairs of the laws
    ``S_lo <= S <= S_hi``; the same pair when the law is enumerated, ``exact`` True).

    ``delta``, ``epsilon``, ``renyi``, ``tradeoff`` are the lower end (what refutes a bound);
    :meth:`epsilon_bracket` gives both ends. For ``poisson`` the worse of the candidate pairs.
    """

    def __init__(self, lower: List[MixturePair], upper: List[MixturePair], exact: bool) -> None:
        self._lower, self._upper, self.exact = lower, upper, exact

    @property
    def is_gaussian(self) -> bool:
        return len(self._lower) == 1 and self._lower[0].is_gaussian

    @property
    def mu(self) -> float:
        if not self.is_gaussian or not self.exact:
            raise ValueError("mu is defined for a single Gaussian pair only")
        return self._lower[0].mu

    def delta(self, epsilon: float) -> float:
        return max(p.delta(epsilon) for p in self._lower)

    def epsilon(self, delta: float) -> float:
        """The lower end: below the true epsilon of the worst known pair (a bound under it is wrong)."""
        e = max(p.epsilon(delta) for p in self._lower)
        return max(0.0, e - 2 * EPS_PAD) if math.isfinite(e) and not self.is_gaussian else e

    def epsilon_bracket(self, delta: float) -> Tuple[float, float]:
        return self.epsilon(delta), max(p.epsilon(delta) for p in self._upper)

    def renyi(self, orders: Sequence[float]) -> np.ndarray:
        return np.max([p.renyi(orders) for p in self._lower], axis=0)

    def tradeoff(self, alpha) -> np.ndarray:
        return np.min([p.tradeoff(alpha) for p in self._lower], axis=0)


def _in_noise_units(run: TrainingRunDpEvent, init_variance: float) -> float:
    """An initial variance in units of one step's noise variance ``nu^2``, ``nu = lr z C / b``."""
    if not init_variance:
        return 0.0
    return (
        float(init_variance)
        / (float(run.learning_rate) * float(run.noise_multiplier) * run.clip_norm / run.batch_size) ** 2
    )


def exact_pair(
    run: TrainingRunDpEvent,
    *,
    position: Optional[int] = None,
    init_variance: float = 0.0,
    construction: Optional[str] = None,
    grid_points: int = GRID_POINTS,
    relation: str = "REPLACE_ONE",
) -> ExactPair:
    """The worst known neighbouring pair of ``run`` under the linear model (module docstring).

    ``m`` is the run's declared ``strong_convexity`` (0 without a geometry), the contraction
    ``c = 1 - lr m``. ``position``: the 0-based batch of ``cyclic`` / ``shuffle_partition``
    (default: the worst for ``cyclic``, the random one for ``shuffle_partition``).
    ``init_variance``: the start is ``N(0, init_variance I)`` (Chourasia et al. Cor. 1).
    ``construction``: one pair (:data:`CONSTRUCTIONS`) instead of the worst known ones.
    ``relation``: ``"REPLACE_ONE"`` or ``"ADD_OR_REMOVE_ONE"`` (:func:`constructions_for`). For
    ``poisson`` and ``balls_in_bins`` the L2 term ``m`` is applied once per step (Opacus' ``weight_decay``), the
    divisor is ``b`` and the rate ``run.sampling_rate``.

    >>> from hidden_state_accountants import LossGeometry, TrainingRunDpEvent
    >>> one = TrainingRunDpEvent(dataset_size=20, batch_size=6, steps=1, noise_multiplier=1.0, clip_norm=1.0,
    ...     learning_rate=0.5, sampling="poisson", sampling_probability=0.3)
    >>> add_remove = exact_pair(one, relation="ADD_OR_REMOVE_ONE").epsilon(1e-3)  # the sampled Gaussian
    >>> replace = exact_pair(one).epsilon(1e-3)
    >>> round(add_remove, 3), add_remove < replace
    (1.672, True)
    """
    relation = getattr(relation, "name", relation)
    if relation not in ("REPLACE_ONE", "ADD_OR_REMOVE_ONE"):
        raise v.ParameterError("relation", f"must be REPLACE_ONE or ADD_OR_REMOVE_ONE, got {relation!r}")
    if not run.is_constant:
        raise v.ParameterError("learning_rate", "the exact pair needs a constant learning rate and noise")
    m = run.geometry.strong_convexity if run.geometry is not None else 0.0
    model = Linear(run, 1.0 - float(run.learning_rate) * m, _in_noise_units(run, init_variance))
    lo, hi, enumerated = model.laws(position, grid_points)
    kinds = (construction,) if construction else constructions_for(run.sampling, relation)
    kappa = model.kappa
    return ExactPair([pair_for(lo, kappa, k) for k in kinds], [pair_for(hi, kappa, k) for k in kinds], enumerated)


__all__ = [
    "ExactPair",
    "MixturePair",
    "Law",
    "exact_pair",
    "schedule_law",
    "pair_for",
    "constructions_for",
    "CONSTRUCTIONS",
    "MAX_ENUM",
    "GRID_POINTS",
]


# ------------------------------------------------- brute force for Poisson sampling (issue 12)
def _grid_epsilon(p: np.ndarray, qd: np.ndarray, delta: float) -> float:
    """``epsilon(delta)`` of two discrete laws on the same grid, the larger direction."""

    def one(a, b):
        f = lambda e: float(np.sum(np.maximum(a - math.exp(e) * b, 0.0))) - delta
        if f(0.0) <= 0:
            return 0.0
        hi = 1.0
        while f(hi) > 0:
            hi *= 2
            if hi > 1e3:
                return math.inf
        return optimize.brentq(f, 0.0, hi, xtol=1e-9)

    return max(one(p, qd), one(qd, p))


def poisson_huber_epsilon(
    *,
    n_others: int,
    q: float,
    b: float,
    steps: int,
    z: float,
    C: float,
    lr: float,
    m_reg: float,
    h: float,
    relation: str,
    delta: float,
    grid: int = 1601,
) -> float:
    """Brute-force last-iterate epsilon of Poisson DP-SGD on a 1-D *non-linear* loss whose step
    contraction depends on the batch size (ground truth where the batch-size cap binds, docs/derivations.md section 12).

    Data part ``d_i(theta) = clip_C(h (theta - x_i))`` (Huber: convex, ``h``-smooth, ``|d_i| <= C``), the
    others at ``x = 0``, the differing record at ``x = 5C/h`` in D and ``-5C/h`` in D' (REPLACE_ONE) or
    absent (ADD_OR_REMOVE_ONE); L2 ``m_reg`` once per step, divisor ``b``. A batch of ``k`` records near 0
    has slope ``1 - lr (m_reg + k h/b)``: expansive once that exceeds 2. The laws are propagated on a
    grid with a Gaussian kernel (accuracy ~1e-6, not certified: compare with a tolerance).
    """
    from scipy import stats

    s = lr * z * C / b
    width = 12 * s / math.sqrt(max(1 - (1 - lr * m_reg) ** 2, 1e-3)) + 4 * lr * (n_others + 1) * C / b
    x = np.linspace(-width, width, grid)
    dx = x[1] - x[0]
    pk = stats.binom.pmf(np.arange(n_others + 1), n_others, q)

    def kernel(mean):
        zz = (x[:, None] - mean[None, :]) / s
        return np.exp(-0.5 * zz * zz) / (s * math.sqrt(2 * math.pi)) * dx

    def propagate(xs):
        p = np.zeros(grid)
        p[np.argmin(np.abs(x))] = 1.0
        mix = np.zeros((grid, grid))
        for k in range(n_others + 1):
            for inc in (0, 1) if xs is not None else (0,):
                drift = m_reg * x + (k * np.clip(h * x, -C, C) + (np.clip(h * (x - xs), -C, C) if inc else 0.0)) / b
                w = pk[k] * ((q if inc else 1 - q) if xs is not None else 1.0)
                mix += w * kernel(x - lr * drift)
        for _ in range(steps):
            p = mix @ p
        return p / p.sum()

    far = 5 * C / h
    other = -far if relation == "REPLACE_ONE" else None
    return _grid_epsilon(propagate(far), propagate(other), delta)


def poisson_projected_epsilon(
    *,
    q: float,
    b: float,
    steps: int,
    z: float,
    C: float,
    lr: float,
    m_reg: float,
    diameter: float,
    relation: str,
    delta: float,
    grid: int = 1201,
) -> float:
    """Brute-force epsilon of projected Poisson DP-SGD on ``K = [-D/2, D/2]`` with a linear loss (the
    construction of Altschuler & Talwar's lower bound, NeurIPS 2022, arXiv:2205.13710, Thm 4.1): the
    differing record's gradient ``+C`` vs ``-C`` (REPLACE_ONE) or ``+C`` vs absent, the others 0. Each
    step maps node ``x_j`` to ``N(F(x_j), s^2)`` and gives node ``i`` its cell's mass (the end cells reach
    to infinity: the projection's atoms). Accuracy ~1e-4 relative (grid)."""
    s = lr * z * C / b
    x = np.linspace(-diameter / 2, diameter / 2, grid)
    edges = np.concatenate([[-np.inf], 0.5 * (x[1:] + x[:-1]), [np.inf]])

    def kernel(mean):
        return np.diff(special.ndtr((edges[:, None] - mean[None, :]) / s), axis=0)

    def propagate(g_star):
        p = np.zeros(grid)
        p[np.argmin(np.abs(x))] = 1.0
        k0 = kernel(x - lr * m_reg * x)
        k1 = kernel(x - lr * (m_reg * x + g_star / b)) if g_star is not None else k0
        for _ in range(steps):
            p = (1 - q) * (k0 @ p) + q * (k1 @ p)
        return p / p.sum()

    if relation == "REPLACE_ONE":
        return _grid_epsilon(propagate(+C), propagate(-C), delta)
    return _grid_epsilon(propagate(None), propagate(+C), delta)


__all__ += ["poisson_huber_epsilon", "poisson_projected_epsilon"]


# -------------------------------------------- brute force for balls-in-bins sampling (issue 19)
def balls_in_bins_huber_epsilon(
    *,
    n_others: int,
    b: float,
    steps_per_epoch: int,
    steps: int,
    z: float,
    C: float,
    lr: float,
    m_reg: float,
    h: float,
    relation: str,
    delta: float,
    grid: int = 401,
) -> float:
    """Brute-force last-iterate epsilon of balls-in-bins DP-SGD on :func:`poisson_huber_epsilon`'s 1-D
    Huber loss (the others at 0, the record at ``5C/h`` against ``-5C/h`` or absent), ground truth where
    the batch-size cap binds (docs/derivations.md, "Balls-in-bins sampling", B.2).

    Every epoch each of the ``n_others`` records and the differing one draws a uniform step among
    ``steps_per_epoch``; the divisor is ``b``, the L2 term ``m_reg`` once per step. The others' counts
    are followed exactly: before step ``j`` of an epoch, ``r`` of them are still unplaced and the step
    takes ``Bin(r, 1/(t - j))`` of them, the record (if still unplaced) with probability ``1/(t - j)``.
    The laws are propagated on a grid with a Gaussian kernel (accuracy ~1e-6, not certified: compare
    with a tolerance)."""
    s = lr * z * C / b
    t = int(steps_per_epoch)
    width = 12 * s / math.sqrt(max(1 - (1 - lr * m_reg) ** 2, 1e-3)) + 4 * lr * (n_others + 1) * C / b
    x = np.linspace(-width, width, grid)
    dx = x[1] - x[0]
    from scipy import stats

    def propagate(xs):
        kernels = {}

        def kernel(k, inc):
            if (k, inc) not in kernels:
                drift = m_reg * x + (k * np.clip(h * x, -C, C) + (np.clip(h * (x - xs), -C, C) if inc else 0.0)) / b
                zz = (x[:, None] - (x - lr * drift)[None, :]) / s
                kernels[(k, inc)] = np.exp(-0.5 * zz * zz) / (s * math.sqrt(2 * math.pi)) * dx
            return kernels[(k, inc)]

        start = np.zeros(grid)
        start[np.argmin(np.abs(x))] = 1.0
        laws = {(n_others, False): start}  # (others not yet placed this epoch, record placed) -> law
        for step in range(steps):
            j = step % t
            if j == 0:  # a new epoch: everyone is unplaced again
                total = sum(laws.values())
                laws = {(n_others, False): total}
            left = t - j
            new: dict = {}
            for (r, placed), p in laws.items():
                ks = np.arange(r + 1)
                pk = stats.binom.pmf(ks, r, 1.0 / left)
                for inc in (False, True) if (xs is not None and not placed) else (False,):
                    w_inc = (1.0 / left if inc else 1.0 - 1.0 / left) if (xs is not None and not placed) else 1.0
                    for k in ks:
                        w = pk[k] * w_inc
                        if w <= 1e-300:
                            continue
                        key = (r - int(k), placed or inc)
                        new[key] = new.get(key, 0.0) + w * (kernel(int(k), inc) @ p)
            laws = new
        out = sum(laws.values())
        return out / out.sum()

    far = 5 * C / h
    other = -far if relation == "REPLACE_ONE" else None
    return _grid_epsilon(propagate(far), propagate(other), delta)


__all__ += ["balls_in_bins_huber_epsilon"]


# ----------------------------------------- the best known lower bound for fixed-size batches (issue 19)
LOWER_BOUND_GRID = 1 << 12
"""Grid of the lower law used by :func:`shuffled_lower_bound` (its lower end is certified at any size)."""


def _worst_shift(model: Linear) -> float:
    """``kappa S`` of the record's worst visit pattern (public batches): for ``reshuffle`` the
    largest contribution of every (independent) epoch, for a partition the worst batch."""
    if model.run.sampling == RESHUFFLE:
        return model.kappa * sum(float(np.max(vals)) for vals, _ in model.contributions())
    return model.kappa * float(np.max(np.abs(model.positions())))


def _enumerated_atoms(model: Linear, limit: int) -> int:
    """Atoms of the law :meth:`Linear.exact_law` would enumerate (counted up to just above ``limit``): the
    product of the independent contributions' sizes; 1 for ``full`` and the partitions, whose law is always
    enumerated (one atom per batch: their size is the caller's to check)."""
    if model.run.sampling in (FULL, CYCLIC, SHUFFLE_PARTITION):
        return 1
    count = 1
    for vals, _ in model.contributions():
        count *= len(vals)
        if count > limit:
            break
    return count


def _lower_end(model: Linear, delta: float, relation: str, grid_points: int, max_atoms: int = MAX_ENUM) -> float:
    """The largest ``epsilon(delta)`` over the worst known pairs of :func:`constructions_for` for the law
    of ``S``: enumerated up to ``max_atoms`` atoms, else the grid's lower law (``S_lo <= S``: the value is
    below the exact one, section 1.2). Not yet moved down by the root finder's margin."""
    law = model.exact_law() if _enumerated_atoms(model, max_atoms) <= max_atoms else None
    if law is None:
        law = model.grid_law(grid_points, up=False)
    return max(pair_for(law, model.kappa, k).epsilon(delta) for k in constructions_for(model.run.sampling, relation))


def shuffled_lower_bound(
    run: TrainingRunDpEvent,
    delta: float,
    *,
    relation: str = "REPLACE_ONE",
    curvature: Optional[float] = None,
    grid_points: int = LOWER_BOUND_GRID,
    max_atoms: int = MAX_ENUM,
) -> float:
    """The best known LOWER bound on the epsilon of ``run`` (``cyclic``, ``shuffle_partition``,
    ``reshuffle``): no valid analysis can report less. Not a privacy guarantee.

    The affine construction of :func:`exact_pair` (the worst known pair: the other records at
    ``-C e_1``, the record ``+C e_1`` against ``-C e_1``; ``half`` for ``cyclic`` under
    ADD_OR_REMOVE_ONE) with the curvature ``kappa`` anywhere in ``[m, M]`` (contraction
    ``1 - lr kappa >= 0``: ``kappa <= 1/lr``), the largest value over the endpoints and a few
    interior points; for secret ``shuffle_partition`` / ``reshuffle`` batches the mixture over the
    draws (exactly, or the certified lower end of its grid bracket), for public batches the
    worst visit pattern's Gaussian. At ``kappa = m`` with ``m`` the L2 strength the construction is
    an instance of the declared class; at larger ``kappa`` the curvature must come from the
    clipped gradients, which are affine only near the point the run converges to, so it is an
    instance in the limit of long runs whose iterates stay there (docs/derivations.md 5a.6);
    ``curvature=m`` keeps the exact instance only (``curvature`` fixes ``kappa``). With a
    projection the construction is not an instance and the function refuses. A ``reshuffle`` law of
    more than ``max_atoms`` atoms is put on the grid of ``grid_points`` (its certified lower end).

    >>> from hidden_state_accountants import LossGeometry, TrainingRunDpEvent
    >>> run = TrainingRunDpEvent(dataset_size=60, batch_size=6, steps=40, noise_multiplier=2.0, clip_norm=1.0,
    ...     learning_rate=0.5, sampling="reshuffle", geometry=LossGeometry(strong_convexity=0.5, smoothness=0.5))
    >>> round(shuffled_lower_bound(run, 1e-5), 3)
    1.317
    """
    relation = getattr(relation, "name", relation)
    if run.sampling not in (CYCLIC, SHUFFLE_PARTITION, RESHUFFLE):
        raise v.ParameterError(
            "sampling", f"the shuffled lower bound covers cyclic, shuffle_partition and reshuffle, not {run.sampling!r}"
        )
    constructions_for(run.sampling, relation)  # names the relation a schedule is not covered by
    delta = v.probability("delta", delta)
    if run.geometry is None:
        raise v.ParameterError("geometry", "the lower bound is over the declared class: declare a geometry")
    if run.geometry.diameter is not None:
        raise v.ParameterError("geometry", "with a projection (diameter) the affine construction is not an instance")
    if not run.is_constant:
        raise v.ParameterError("learning_rate", "the lower bound needs a constant learning rate and noise")
    lr = float(run.learning_rate)
    lo, hi = run.geometry.strong_convexity, min(run.geometry.smoothness, 1.0 / lr)
    if hi < lo:  # every allowed curvature makes the step expansive or sign-alternating; not searched
        raise v.ParameterError(
            "learning_rate", f"needs a curvature in [m, M] with 1 - lr*kappa >= 0, got lr*m = {lr * lo:g}"
        )
    kappas = sorted({lo, hi} | ({math.sqrt(lo * hi), (lo + hi) / 2} if lo > 0 else {hi / 2}))
    if curvature is not None:
        kappa = v.nonnegative_float("curvature", curvature)
        if not lo * (1 - 1e-12) <= kappa <= hi * (1 + 1e-12):
            raise v.ParameterError("curvature", f"must lie in [m, min(M, 1/lr)] = [{lo:g}, {hi:g}], got {kappa:g}")
        kappas, lo, hi = [kappa], kappa, kappa

    def value(kappa: float) -> float:
        model = Linear(run, 1.0 - lr * kappa)
        if not run.secret_batches and run.sampling != CYCLIC:
            return fdp.gdp_epsilon(_worst_shift(model) * (0.5 if relation == "ADD_OR_REMOVE_ONE" else 1.0), delta)
        # interior curvatures rarely win: a coarser grid (its lower end is still certified) keeps this quick
        return _lower_end(
            model, delta, relation, grid_points if kappa in (lo, hi) else max(256, grid_points // 8), max_atoms
        )

    best = max(value(k) for k in kappas)
    return max(0.0, best - 2 * EPS_PAD)


__all__ += ["shuffled_lower_bound"]


def affine_lower_bound(
    run: TrainingRunDpEvent,
    delta: float,
    *,
    relation: str = "REPLACE_ONE",
    curvature: Optional[float] = None,
    init_variance: float = 0.0,
    grid_points: int = LOWER_BOUND_GRID,
    max_atoms: int = MAX_ENUM,
) -> float:
    """The best known LOWER bound on the epsilon of a ``full``, ``without_replacement`` or ``balls_in_bins``
    run (the schedules :func:`shuffled_lower_bound` and :func:`poisson_lower_bound` leave): the lower end of
    ``exact_pair(run, relation=relation).epsilon(delta)`` with the curvature ``curvature`` (default: the
    declared ``m``), computed from the lower law alone (enumerated up to ``max_atoms`` atoms, else on a grid
    of ``grid_points``). ``init_variance``: the start is ``N(0, init_variance I)`` (as in :func:`exact_pair`).
    Not a privacy guarantee.

    The construction (module docstring): constant per-example gradients (data curvature 0) and the L2 term
    ``curvature`` once per step, contraction ``1 - lr curvature`` whatever the batch; an instance of the
    declared class when ``m <= curvature <= M`` and the run's L2 strength is ``curvature`` (or undeclared).
    For ``balls_in_bins``, whose batch sizes vary, a declared L2 strength other than ``curvature`` is refused
    (the curvature could not come from the data at a constant contraction).

    >>> from hidden_state_accountants import LossGeometry, TrainingRunDpEvent
    >>> run = TrainingRunDpEvent(dataset_size=60, batch_size=6, steps=20, noise_multiplier=2.0, clip_norm=1.0,
    ...     learning_rate=0.5, sampling="balls_in_bins", geometry=LossGeometry(strong_convexity=0.5, smoothness=1.0))
    >>> affine_lower_bound(run, 1e-5) == exact_pair(run).epsilon(1e-5)
    True
    """
    relation = getattr(relation, "name", relation)
    if run.sampling not in (FULL, WITHOUT_REPLACEMENT, BALLS_IN_BINS):
        raise v.ParameterError(
            "sampling",
            f"covers full, without_replacement and balls_in_bins, not {run.sampling!r} "
            "(shuffled_lower_bound, poisson_lower_bound)",
        )
    constructions_for(run.sampling, relation)  # names the relation a schedule is not covered by
    delta = v.probability("delta", delta)
    g = run.geometry
    if g is None:
        raise v.ParameterError("geometry", "the lower bound is over the declared class: declare a geometry")
    if g.diameter is not None:
        raise v.ParameterError("geometry", "with a projection (diameter) the affine construction is not an instance")
    if not run.is_constant:
        raise v.ParameterError("learning_rate", "the lower bound needs a constant learning rate and noise")
    lr = float(run.learning_rate)
    kappa = g.strong_convexity if curvature is None else v.nonnegative_float("curvature", curvature)
    hi = min(g.smoothness, 1.0 / lr)
    if not g.strong_convexity * (1 - 1e-12) <= kappa <= hi * (1 + 1e-12):
        raise v.ParameterError(
            "curvature", f"must lie in [m, min(M, 1/lr)] = [{g.strong_convexity:g}, {hi:g}], got {kappa:g}"
        )
    m_reg = run.l2_regularization
    if run.sampling == BALLS_IN_BINS and m_reg is not None and abs(m_reg - kappa) > 1e-12 * max(m_reg, kappa):
        raise v.ParameterError(
            "curvature",
            f"must be the declared L2 strength {m_reg:g} for balls_in_bins (batches "
            f"of varying size contract by 1 - lr curvature only with data curvature 0), got {kappa:g}",
        )
    model = Linear(run, 1.0 - lr * kappa, _in_noise_units(run, v.nonnegative_float("init_variance", init_variance)))
    return max(0.0, _lower_end(model, delta, relation, grid_points, max_atoms) - 2 * EPS_PAD)


__all__ += ["affine_lower_bound"]


# ------------------------------------- the best known lower bound of a Poisson run, fast (issue 18)
LOWER_BOUND_DIRECT_TERMS = 20_000_000  # (steps convolved term by term) x (frequencies) allowed: about a second


def _direct_terms(top: float, c: float, steps: int) -> int:
    """How many of the ``steps`` terms :func:`_poisson_log_cf` sums one by one at frequencies up to ``top``
    (those with ``top c^j > 1e-4``; none at ``c = 1``, which has a closed form, one at ``c = 0``)."""
    if c == 1.0:
        return 0
    if c == 0.0:
        return 1
    return steps if top <= 0 else min(steps, max(0, int(math.ceil(math.log(top * 1e4) / -math.log(c)))))


def _poisson_log_cf(theta: np.ndarray, q: float, c: float, steps: int) -> np.ndarray:
    """``log E exp(i theta S)``, ``S = sum_{j < steps} I_j c^j``, ``I_j ~ Bern(q)`` i.i.d.

    Term by term while ``|theta| c^j > 1e-4``; the rest by the first three cumulants of a Bernoulli
    (``q``, ``q(1-q)``, ``q(1-q)(1-2q)``) with the geometric power sums in closed form (the next term is
    below ``1e-16`` of the sum). ``c = 1``: ``steps log(1 - q + q e^{i theta})``."""
    theta = np.asarray(theta, dtype=float)
    one = lambda u: np.log1p(q * np.expm1(1j * u))
    if c == 1.0:
        return steps * one(theta)
    if c == 0.0:
        return one(theta)
    direct = _direct_terms(float(np.max(np.abs(theta))) if theta.size else 0.0, c, steps)
    if direct * theta.size > LOWER_BOUND_DIRECT_TERMS:
        raise v.ParameterError(
            "steps",
            f"too long a run with too weak a contraction (c = {c:.9g}) for the fast lower bound; use exact_pair",
        )
    out = np.zeros(theta.shape, dtype=complex)
    for start in range(0, direct, 4096):
        j = np.arange(start, min(direct, start + 4096))
        out += np.sum(one(theta[:, None] * c ** j[None, :]), axis=1)
    if direct < steps:
        rest = steps - direct
        power = lambda n: c ** (direct * n) * -math.expm1(rest * n * math.log(c)) / -math.expm1(n * math.log(c))
        kappas = (q, q * (1 - q), q * (1 - q) * (1 - 2 * q))
        for n, kappa in enumerate(kappas, start=1):
            out += kappa * (1j * theta) ** n / math.factorial(n) * power(n)
    return out


def s_max_of(c: float, steps: int) -> float:
    """``sum_{j < steps} c^j``."""
    if c == 1.0:
        return float(steps)
    if c == 0.0:
        return 1.0
    return -math.expm1(steps * math.log(c)) / (1 - c)


class _FourierLaw:
    """The law of ``X = a S + N(0, 1)`` (``sign = -1``: of ``-a S + N(0, 1)``) from its characteristic
    function: density and survival function by Fourier sums (Gil-Pelaez) on a midpoint grid of
    frequencies wide enough that the aliased mass is negligible."""

    def __init__(self, a: float, q: float, c: float, steps: int, sign: float = 1.0) -> None:
        self.dw, count = self.frequencies(a, q, c, steps)
        self.w = (np.arange(count) + 0.5) * self.dw
        self.phi = np.exp(_poisson_log_cf(sign * a * self.w, q, c, steps) - self.w**2 / 2)

    @staticmethod
    def frequencies(a: float, q: float, c: float, steps: int) -> Tuple[float, int]:
        """``(dw, count)``: the spacing ``pi / reach`` (``reach`` beyond the mass of ``X``) and the number
        of the frequencies, up to ``|w| = 12`` (``e^{-w^2/2} < 1e-31`` beyond)."""
        s_max = s_max_of(c, steps)
        mean = a * q * s_max
        sd = math.sqrt(
            1.0
            + a * a * q * (1 - q) * (s_max if c == 1.0 else (1 - c ** (2 * min(steps, 10**9))) / max(1 - c * c, 1e-300))
        )
        reach = min(a * s_max, mean + 25 * sd + 25 * a) + 15.0  # the mass beyond is below 1e-40
        dw = math.pi / reach
        return dw, int(math.ceil(12.0 / dw))

    def _both(self, t: np.ndarray):
        """Density and survival function at ``t`` (the last grid asked for is remembered)."""
        t = np.asarray(t, dtype=float)
        if getattr(self, "_t", None) is not None and self._t.shape == t.shape and np.array_equal(self._t, t):
            return self._vals
        e = np.exp(-1j * np.multiply.outer(t, self.w))
        dens = np.maximum(np.real(e @ self.phi) * self.dw / math.pi, 0.0)
        sf = np.clip(0.5 + np.imag(e @ (self.phi / self.w)) * self.dw / math.pi, 0.0, 1.0)
        self._t, self._vals = t.copy(), (dens, sf)
        return dens, sf

    def density(self, t):
        return self._both(t)[0]

    def sf(self, t):
        return self._both(t)[1]


def _poisson_construction(run: TrainingRunDpEvent) -> Tuple[float, float, float, int]:
    """``(a, q, c, T)`` of :func:`poisson_lower_bound`'s construction, refused where it is not an instance."""
    if run.sampling != POISSON:
        raise v.ParameterError("sampling", f"the fast lower bound is for sampling='poisson', not {run.sampling!r}")
    if not run.is_constant:
        raise v.ParameterError("learning_rate", "the lower bound needs a constant learning rate and noise")
    g = run.geometry
    m_reg = run.l2_regularization
    if g is None or m_reg is None:
        raise v.ParameterError("l2_regularization", "the construction needs the loss geometry and the L2 strength")
    if g.diameter is not None:
        raise v.ParameterError(
            "geometry", "with a projection the affine construction leaves the domain; see poisson_projected_epsilon"
        )
    if not g.strong_convexity <= m_reg <= g.smoothness:
        raise v.ParameterError(
            "l2_regularization",
            f"the affine construction (data curvature 0) is in the declared "
            f"class only when strong_convexity <= l2_regularization <= smoothness, got "
            f"{g.strong_convexity:g} <= {m_reg:g} <= {g.smoothness:g}",
        )
    lr, z = float(run.learning_rate), float(run.noise_multiplier)
    c = 1.0 - lr * m_reg
    if not 0.0 <= c <= 1.0:
        raise v.ParameterError(
            "learning_rate", f"the construction's contraction 1 - lr m_reg = {c:g} must lie in [0, 1]"
        )
    T, q = run.steps, run.sampling_rate
    c2 = c * c
    variance = float(T) if c2 == 1.0 else (1.0 if c2 == 0.0 else -math.expm1(T * math.log(c2)) / (1 - c2))
    a = (1.0 / z) / math.sqrt(variance)  # one use's shift of the last iterate, in units of its noise
    return a, q, c, T


def _poisson_reach(a: float, q: float, c: float, steps: int) -> float:
    """Half-width of :func:`poisson_lower_bound`'s threshold grid (beyond the mass of ``X``)."""
    return 12.0 + a * q * s_max_of(c, steps) + 12.0 * a * math.sqrt(q * s_max_of(c, steps))


def poisson_lower_bound_work(run: TrainingRunDpEvent) -> float:
    """The size of :func:`poisson_lower_bound`'s computation, known before it starts: frequencies x (terms
    of the characteristic function summed one by one + 4 x the threshold grid's points, the Fourier sums
    it evaluates). Refuses what :func:`poisson_lower_bound` refuses."""
    a, q, c, T = _poisson_construction(run)
    dw, count = _FourierLaw.frequencies(a, q, c, T)
    points = 2 * _poisson_reach(a, q, c, T) / 0.02 + 1
    return float(count) * (_direct_terms(a * count * dw, c, T) + 4 * points)


def poisson_lower_bound(run: TrainingRunDpEvent, delta: float, relation="REPLACE_ONE") -> float:
    """:func:`poisson_lower_bound_resolved`'s value: the best known lower bound of a Poisson run."""
    return poisson_lower_bound_resolved(run, delta, relation)[0]


def poisson_lower_bound_resolved(run: TrainingRunDpEvent, delta: float, relation="REPLACE_ONE") -> Tuple[float, bool]:
    """The best known lower bound on the epsilon of a Poisson run (shown beside a reported bound, never as
    the guarantee): the exact epsilon of the affine construction with the worst known pair, computed from
    the characteristic function of the last iterate (a mixture over the secret inclusions), fast at any
    length (docs/derivations.md section 17).

    The construction: every per-example gradient constant (``v_i``, ``||v_i|| <= C``, data curvature 0),
    the run's L2 term ``m_reg`` once per step, so every step contracts by ``c = 1 - lr m_reg``; an instance
    of the declared class when ``m <= m_reg <= M``. The pairs are those of :func:`exact_pair`
    (:func:`constructions_for`): ``half`` (the record ``+C`` against absent / ``0``) and, under
    REPLACE_ONE, ``mirror`` (``+C`` against ``-C``); it equals ``exact_pair(run, relation=...).epsilon``
    up to the Fourier inversion's accuracy (about 1e-6 relative at ``delta >= 1e-9``).

    Returns ``(value, resolved)``: ``resolved`` is False when some Neyman-Pearson threshold lies where
    the densities are below ``1e-12`` (large epsilons); the value is then smaller than the construction's
    (still a lower bound), possibly 0.

    >>> from hidden_state_accountants import LossGeometry, TrainingRunDpEvent
    >>> run = TrainingRunDpEvent(dataset_size=20, batch_size=6, steps=4, noise_multiplier=1.0, clip_norm=1.0,
    ...     learning_rate=0.5, sampling="poisson", sampling_probability=0.3, l2_regularization=0.2,
    ...     geometry=LossGeometry(strong_convexity=0.2, smoothness=1.0))
    >>> value, resolved = poisson_lower_bound_resolved(run, 1e-5, "ADD_OR_REMOVE_ONE")
    >>> round(value, 4) == round(exact_pair(run, relation="ADD_OR_REMOVE_ONE").epsilon(1e-5), 4), resolved
    (True, True)
    """
    relation = getattr(relation, "name", relation)
    if relation not in ("REPLACE_ONE", "ADD_OR_REMOVE_ONE"):
        raise v.ParameterError("relation", f"must be REPLACE_ONE or ADD_OR_REMOVE_ONE, got {relation!r}")
    v.probability("delta", delta)
    a, q, c, T = _poisson_construction(run)
    law = _FourierLaw(a, q, c, T)
    reach = _poisson_reach(a, q, c, T)
    grid = np.arange(-reach, reach + 0.01, 0.02)
    unresolved = []

    def log_p(t):
        return np.log(np.maximum(law.density(t), 1e-300))

    def threshold_epsilon(log_ratio, gap, densities) -> float:
        """The Neyman-Pearson half-line traced by its threshold ``t``: ``eps = log_ratio(t)`` where ``gap(t) =
        H(t) - delta`` turns negative beyond ``log_ratio = 0``, located on the grid where both densities are
        resolved (above 1e-12), then refined. Where the crossing lies beyond them, the ratio at the last
        resolved point with a positive gap: a smaller value, still a lower bound."""
        ok = np.flatnonzero(np.minimum(*densities) > 1e-12)
        if not ok.size:
            unresolved.append(True)
            return 0.0
        lo, hi = int(ok[0]), int(ok[-1]) + 1
        r, g = log_ratio(grid[lo:hi]), gap(grid[lo:hi])
        start = np.flatnonzero(r >= 0)
        if not start.size:
            unresolved.append(True)
            return 0.0
        i0 = int(start[0])
        if g[i0] <= 0:
            return 0.0
        below = np.flatnonzero(g[i0:] <= 0)
        if not below.size:
            unresolved.append(True)
            return max(0.0, float(r[-1]))
        j = lo + i0 + int(below[0])
        t = optimize.brentq(lambda x: float(gap(np.array([x]))[0]), grid[j - 1], grid[j], xtol=1e-13)
        return max(0.0, float(log_ratio(np.array([t]))[0]))

    ex = lambda x: np.exp(np.minimum(x, 700.0))
    log_gauss = lambda t: -0.5 * t * t - 0.5 * math.log(2 * math.pi)
    # half: X = a S + N(0,1) against N(0,1); forward on {x > t}, reverse on {x < -t}
    lr_half = lambda t: log_p(t) - log_gauss(t)
    fwd = lambda t: law.sf(t) - ex(lr_half(t)) * special.ndtr(-t) - delta
    rev = lambda t: special.ndtr(-t) - ex(-lr_half(-t)) * (1.0 - law.sf(-t)) - delta
    p_grid, p_flip = law.density(grid), law.density(-grid)
    gauss = np.exp(log_gauss(grid))
    best = max(
        threshold_epsilon(lr_half, fwd, (p_grid, gauss)),
        threshold_epsilon(lambda t: -lr_half(-t), rev, (p_flip, gauss)),
    )
    if relation == "REPLACE_ONE":  # mirror: a S + N against -a S' + N (symmetric)
        lr_mirror = lambda t: log_p(t) - log_p(-t)
        gap = lambda t: law.sf(t) - ex(lr_mirror(t)) * (1.0 - law.sf(-t)) - delta
        best = max(best, threshold_epsilon(lr_mirror, gap, (p_grid, p_flip)))
    return (best + EPS_PAD if best > 0 else 0.0), not unresolved


__all__ += ["poisson_lower_bound", "poisson_lower_bound_resolved", "poisson_lower_bound_work"]
