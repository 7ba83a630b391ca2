"""Balls-in-bins sampling: every epoch, each record draws its step uniformly and independently
among the epoch's ``t = n // b`` steps; the clipped sum of a batch of random size is divided by the
fixed public ``b`` (docs/derivations.md, "Balls-in-bins sampling"; Chua et al., *Balls-and-Bins Sampling for
DP-SGD*, AISTATS 2025, arXiv:2412.16802; Feldman & Shenfeld, *Privacy Amplification by Random
Allocation*, arXiv:2502.08202, call it random 1-out-of-t allocation).

What makes it different from the package's other shuffled schedules is that where a record goes
does not depend on the other records: given the others' placement ``o``, the record's steps ``J``
(one uniform step per epoch) are independent of ``o``, and the run without the record does not
depend on ``J`` at all. Hence:

* **ADD_OR_REMOVE_ONE holds** (adding a record changes nothing else), with ``t`` and ``b`` public
  constants, as Opacus and dp_accounting treat Poisson's ``q`` (B.1).
* **Common null** (B.3). With ``Q_o`` the run without the record and ``P_{o,J}`` the run
  with it, a test of level ``alpha`` under ``Q_o`` is one for every ``J``, so
  ``T(Q_o, E_J P_{o,J}) >= E_J T(Q_o, P_{o,J})``: the tradeoff curves are *averaged at equal
  alpha*, which keeps the amplification of the mixture that averaging ``delta`` at equal
  ``eps`` (joint convexity, section 3.1) loses. With each pattern ``mu(J)``-GDP by shifted
  interpolation (section 2; Bok, Su & Altschuler, ICML 2024, arXiv:2403.00278, Lemma 3.2 /
  Thm 3.3), the run is dominated by the one-dimensional pair
  ``(sum_J p_J N(mu_J, 1), N(0, 1))`` (:class:`GaussianMixturePairBound`).
* **Batch sizes vary**, so a step's contraction depends on its size (section 6): the other
  records' batch sizes are capped as in section 7 (:func:`~.poisson_hidden_state.caps`), with the
  failure probability of the cap bounded by a union bound over each epoch's steps (the sizes of
  one epoch are multinomial, negatively associated: the independent-steps formula of section 7
  would be too small) and added to delta.
* **REPLACE_ONE** goes through the dataset without the record (B.4): the hockey-stick
  triangle inequality ``H_{e^(a+b)}(P||R) <= H_{e^a}(P||Q) + e^a H_{e^b}(Q||R)`` with both legs the
  add/remove pair (:class:`ReplaceTriangleBound`).

The unamplified composition baseline (every iterate released, the positions public) is one Gaussian
per epoch (the record is used once per epoch): ``G(rho sqrt(E) / z)``, Bok et al. Thm 4.4's argument for
reshuffling, ``rho = 2`` (REPLACE_ONE) or 1 (ADD_OR_REMOVE_ONE). With secret draws the composition is
amplified by the random allocation: :mod:`.random_allocation` (B.7). ``si_balls_in_bins_any_length``
bounds every shorter run at once (B.3a), for budgets over the number of epochs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from dataclasses import replace as attr_replace
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
from scipy import special

from hidden_state_accountants import fdp
from hidden_state_accountants.analyses import _common as cm
from hidden_state_accountants.analyses import bok
from hidden_state_accountants.analyses import shifted_interpolation as si
from hidden_state_accountants.analyses.poisson_hidden_state import caps, log_cap_failure
from hidden_state_accountants.analyses.analysis_info import analysis
from hidden_state_accountants.bounds import (
    Bound,
    Cap,
    CappedBound,
    GdpBound,
    MixtureGdpBound,
    NotApplicable,
    mixture_components,
)
from hidden_state_accountants.events import TrainingRunDpEvent
from hidden_state_accountants.mixture_pair import MixturePair
from hidden_state_accountants.relations import ADD_OR_REMOVE_ONE, sensitivity_factor
from hidden_state_accountants.schedules import BALLS_IN_BINS, RESHUFFLE

SI_CITATION = (
    "Bok, Su & Altschuler (ICML 2024, arXiv:2403.00278) Lemma 3.2/Thm 3.3 per visit pattern "
    "(docs/derivations.md 2.2-2.3); the common-null average of the patterns' tradeoff curves "
    "(docs/derivations.md B.3); batch-size cap with its failure probability added to delta (sections "
    "6-7, B.2); REPLACE_ONE through the dataset without the record (B.4)"
)
COMPOSITION_CITATION = (
    "Bok, Su & Altschuler (ICML 2024) Thm 4.4's argument: one use per epoch, composed (docs/derivations.md B.5)"
)

PREVIOUS_EPOCH_GROUPS = 16
"""The second-to-last epoch's positions are averaged in this many groups (each at its most recent
member: moving a use later never lowers the energy, docs/derivations.md 2.3)."""
MAX_PATTERNS = 4096
"""Visit patterns evaluated per bound (one small convex hull each)."""
PAIR_COMPONENTS = 1024
"""Components of the dominating pair; beyond, each ``mu`` is rounded up onto a geometric grid
(:func:`~hidden_state_accountants.bounds.mixture_components`; at most 0.3% at the MNIST scale)."""
ESTIMATE_TERMS = 1_000_000
"""Terms of an epoch that :func:`_energy_estimate` sums one by one (the rest are estimated)."""
TRACE_POINTS = 3000
"""Points at which the dominating pair's two privacy profiles are traced exactly."""

NEED_L2 = (
    "needs l2_regularization > 0 declared: batch sizes vary, and a small batch contracts only through the "
    "L2 term (docs/derivations.md B.2); the projected, non-strongly-convex case is not derived for "
    "balls_in_bins"
)


# ====================================================================== B.2: the cap
def log_allocation_cap_failure(others: int, spe: int, steps: int, cap: int) -> float:
    """``log P(some step has more than cap of the other records)`` for ``others`` records each in a
    uniform step of every epoch (``spe`` steps), ``steps`` steps in all (B.2).

    One epoch's counts are multinomial: a union bound over its steps, ``min(1, m P(Bin(others,
    1/spe) > cap))`` for an epoch of ``m`` steps; epochs are independent. Where scipy's tail
    underflows the Chernoff bound replaces it (larger, never optimistic).

    >>> round(math.exp(log_allocation_cap_failure(4, 2, 2, 3)), 6)  # all 4 in one of the 2 steps: 2/16
    0.125
    >>> log_allocation_cap_failure(4, 2, 10, 4)
    -inf
    """
    # one step: log P(Bin(others, 1/spe) > cap) (-inf for cap >= others, 0 below 0; Chernoff where tiny)
    log_sf = log_cap_failure(others, 1.0 / spe, 1, cap)
    full, rest = divmod(steps, spe)
    out = 0.0  # log P(every epoch stays within the cap), a lower bound
    for count, m in ((full, spe), (1 if rest else 0, rest)):
        if count:
            log_epoch = min(0.0, math.log(m) + log_sf)  # union bound over the epoch's steps
            if log_epoch >= 0.0:
                return 0.0
            out += count * math.log(-math.expm1(log_epoch))
    return float(math.log(-math.expm1(out))) if out < 0 else -math.inf


@dataclass(frozen=True)
class AllocationSetup:
    """The numbers the hidden-state analysis reads from a (normalised, ``C = 1``) run."""

    n: int
    b: int
    spe: int
    steps: int
    z: float
    lr: float
    m_reg: float
    m_data: float
    M: float
    others: int
    rho: float


def allocation_setup(run: TrainingRunDpEvent, ctx: cm.Context) -> Tuple[Optional[AllocationSetup], str]:
    """The setup, or ``None`` and the reason the hidden-state analysis does not apply."""
    reason = cm.hidden_state_preconditions(run)
    if reason:
        return None, reason
    g, m_reg = run.geometry, run.l2_regularization
    if m_reg is None or m_reg <= 0:
        return None, NEED_L2
    if m_reg > g.strong_convexity:
        return None, (
            f"l2_regularization {m_reg:g} exceeds the declared strong_convexity {g.strong_convexity:g}; "
            "the declared geometry must include the L2 term"
        )
    # n common records bound both neighbours of an n-record dataset (n - 1 under REPLACE_ONE or removal)
    return AllocationSetup(
        n=run.dataset_size,
        b=run.batch_size,
        spe=run.steps_per_epoch,
        steps=run.steps,
        z=float(run.noise_multiplier),
        lr=float(run.learning_rate),
        m_reg=m_reg,
        m_data=g.strong_convexity - m_reg,
        M=g.smoothness,
        others=run.dataset_size,
        rho=sensitivity_factor(ctx.neighboring_relation),
    ), ""


def allocation_caps(s: AllocationSetup) -> List[Cap]:
    """Candidate caps on the other records' batch size: the candidates of section 7 (chosen with the
    Poisson formula at ``q = 1/t``, which only tunes), each with its failure probability recomputed
    by :func:`log_allocation_cap_failure` (the one that holds here). Every map given the cap must be
    ``c``-Lipschitz with ``c < 1``."""
    found = caps(
        s.others,
        1.0 / s.spe,
        s.steps,
        lr=s.lr,
        m_reg=s.m_reg,
        m_data=s.m_data,
        M=s.M,
        b=s.b,
        admissible=lambda lc: lc < 0,
    )
    return [Cap(c.cap, log_allocation_cap_failure(s.others, s.spe, s.steps, c.cap), c.log_c) for c in found]


# ============================================================== B.3: the visit patterns
def visit_patterns(steps: int, spe: int, log_c: float, extra_use: bool = False) -> List[Tuple[float, float]]:
    """``(probability, energy)`` of the record's visit patterns (one uniform step per epoch, a partial
    last epoch missed with probability ``1 - t'/t``): the last epoch's step averaged exactly
    (grouped beyond :data:`~.shifted_interpolation.MAX_OPTIONS` positions), the epoch before in at
    most :data:`PREVIOUS_EPOCH_GROUPS` groups, each at its most recent member, the earlier epochs at
    their last step (moving a use later never lowers the energy, docs/derivations.md 2.3). The
    energy of a pattern is that of :func:`~.shifted_interpolation.corner_energy` (section 2.2).

    ``extra_use``: one more use, uniform over the last ``spe`` steps and independent of the others
    (grouped like the epoch before), the patterns that dominate every shorter run (B.3a)."""
    model = si.StepModel(steps, spe, log_c)
    epochs = -(-steps // spe)
    here = steps - (epochs - 1) * spe  # steps of the last epoch
    last = [(count / spe, d) for d, count in si._buckets(0, here - 1)]
    if here < spe:
        last.append(((spe - here) / spe, None))
    budget = MAX_PATTERNS // len(last)
    groups = max(1, min(PREVIOUS_EPOCH_GROUPS, budget if not extra_use else int(math.sqrt(4 * budget))))

    def grouped(offset: int) -> List[Tuple[float, int]]:
        edges = np.unique(np.round(np.geomspace(1, spe + 1, groups + 1)).astype(np.int64)) - 1
        return [((hi - lo) / spe, offset + int(lo)) for lo, hi in zip(edges[:-1], edges[1:])]

    if epochs >= 2:
        previous = grouped(here)
        prefix = si.chain(model, here + spe, epochs - 2, spe)  # earlier epochs at their last step
    else:
        previous, prefix = [(1.0, None)], []
    extra = grouped(0) if extra_use else [(1.0, None)]
    out = []
    for p_prev, d_prev in previous:
        for p_extra, d_extra in extra:
            base = prefix + [(d, model.log_injection(d)) for d in (d_prev, d_extra) if d is not None]
            for p_last, d_last in last:
                corners = base + ([(d_last, model.log_injection(d_last))] if d_last is not None else [])
                out.append((p_prev * p_extra * p_last, si.corner_energy(model, corners)))
    return out


def _energy_estimate(steps: int, spe: int, log_c: float) -> float:
    """``E_d sqrt(energy)`` of one use at a uniform step of the last epoch, alone (vectorised; it only
    chooses between caps)."""
    here = min(spe, steps)
    shown = min(here, ESTIMATE_TERMS)  # an epoch of 1e18 steps must not allocate 1e18 numbers
    d = np.arange(shown, dtype=float)
    lc2 = 2.0 * log_c
    capacity = -np.expm1((d + 1) * lc2) / -math.expm1(lc2) if lc2 < 0 else d + 1
    terms = np.exp(d * log_c) / np.sqrt(capacity)
    # the rest: terms no larger than the last one, and decaying like c^d (a rough tail: this only chooses a cap)
    tail = float(terms[-1]) * min(here - shown, 1.0 / -log_c if log_c < 0 else here - shown)
    return float((np.sum(terms) + tail) / spe)


# ===================================================== the dominating pair of B.3
@dataclass
class GaussianMixturePairBound(Bound):
    """The pair ``P* = sum_i p_i N(mu_i, 1)`` against ``Q* = N(0, 1)``, all ``mu_i >= 0``, as a
    dominating pair: its tradeoff curve ``T(Q*, P*)(alpha) = sum_i p_i G(mu_i)(alpha)`` is the
    average of the components' at equal ``alpha`` (the likelihood ratio is monotone, so every
    Neyman-Pearson test is a half-line), which bounds a run whose null (the run without the
    record) is common to all components (docs/derivations.md B.3).

    ``delta(eps)`` is the larger of ``H_{e^eps}(P*||Q*)`` and ``H_{e^eps}(Q*||P*)``, computed exactly
    in log space (:class:`~hidden_state_accountants.mixture_pair.MixturePair`). RDP: Ye & Shokri's Lemma
    4.1 over the components (valid and weaker). The PLD is pessimistic, of the symmetrised pair.

    >>> b = GaussianMixturePairBound(probs=(1.0,), mus=(1.0,))
    >>> abs(b.epsilon(1e-5) - fdp.gdp_epsilon(1.0, 1e-5)) < 1e-6
    True
    """

    probs: Tuple[float, ...] = ()
    mus: Tuple[float, ...] = ()
    note: str = ""
    kind = "mixture_pair"
    _pair: Optional[MixturePair] = field(default=None, repr=False)
    _traces: Optional[tuple] = field(default=None, repr=False)

    def __post_init__(self):
        mus = np.asarray(self.mus, dtype=float)
        if not np.all(np.isfinite(mus) & (mus >= 0)):
            raise ValueError("GaussianMixturePairBound: every mu must be finite and >= 0")
        positive = mus[mus > 0]
        floor = max(float(positive.min() / positive.max()), 1e-6) if positive.size else 1e-6
        # beyond PAIR_COMPONENTS distinct values every mu is rounded up (a larger mu: a smaller tradeoff curve)
        self.probs, self.mus = mixture_components(self.probs, mus, PAIR_COMPONENTS, floor=floor)

    @property
    def pair(self) -> MixturePair:
        if self._pair is None:
            self._pair = MixturePair(np.asarray(self.mus), np.log(np.asarray(self.probs)), [0.0], [0.0])
        return self._pair

    def delta(self, epsilon: float) -> float:
        return float(min(1.0, self.pair.delta(epsilon)))

    def epsilon(self, delta: float) -> float:
        if delta >= 1:
            return 0.0
        if delta <= 0:
            return math.inf
        e = self.pair.epsilon(delta)
        if e == 0.0 or not math.isfinite(e):
            return e
        step = max(1e-12, 1e-10 * e)
        while self.pair.delta(e) > delta:  # the root finder's side: never report below the root
            e += step
            step *= 2.0
        return e

    def traces(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(eps_f, H_f, eps_r, H_r)``: exact values of ``H_{e^eps}(P*||Q*)`` at ``eps_f`` and of
        ``H_{e^eps}(Q*||P*)`` at ``eps_r``, each increasing in ``eps``, traced by the threshold ``x``
        of the Neyman-Pearson half-line: ``eps = L(x)``, ``H = P*(X > x) - e^eps Q*(X > x)`` forward,
        ``eps = -L(x)``, ``H = Q*(X < x) - e^eps P*(X < x)`` backward."""
        if self._traces is None:
            mus, lw = np.asarray(self.mus), np.log(np.asarray(self.probs))
            top = float(np.max(mus))
            # thresholds where both tails still hold 1e-60 (Phi(-16.5)), spread evenly in the loss
            coarse = np.linspace(-16.5, top + 16.5, 1001)
            loss = self.pair.log_ratio(coarse)
            targets = np.linspace(max(loss[0], -60.0), min(loss[-1], 60.0), TRACE_POINTS)
            x = np.unique(np.concatenate([coarse[::10], np.interp(targets, loss, coarse)]))
            L = self.pair.log_ratio(x)
            with np.errstate(divide="ignore", invalid="ignore"):
                log_p_above = special.logsumexp(lw[None, :] + special.log_ndtr(mus[None, :] - x[:, None]), axis=1)
                log_p_below = special.logsumexp(lw[None, :] + special.log_ndtr(x[:, None] - mus[None, :]), axis=1)
                fwd = np.exp(log_p_above) * -np.expm1(np.minimum(L + special.log_ndtr(-x) - log_p_above, 0.0))
                rev = np.exp(special.log_ndtr(x)) * -np.expm1(np.minimum(-L + log_p_below - special.log_ndtr(x), 0.0))
            fwd, rev = np.nan_to_num(np.clip(fwd, 0.0, 1.0)), np.nan_to_num(np.clip(rev, 0.0, 1.0))
            order = np.argsort(-L)  # -L increasing
            self._traces = (L, fwd, -L[order], rev[order])
        return self._traces

    def profile(self, eps) -> np.ndarray:
        """An upper bound on ``max(H_{e^eps}(P*||Q*), H_{e^eps}(Q*||P*))`` from the traces: each
        direction's exact value at the largest traced ``eps`` at or below (a profile never increases)."""
        eps = np.asarray(eps, dtype=float)
        ef, hf, er, hr = self.traces()
        out = np.zeros_like(eps)
        for e_tr, h_tr in ((ef, hf), (er, hr)):
            i = np.searchsorted(e_tr, eps, side="right") - 1
            out = np.maximum(out, np.where(i >= 0, h_tr[np.maximum(i, 0)], 1.0))
        return np.clip(out, 0.0, 1.0)

    def rdp(self, orders: Sequence[float]) -> Optional[np.ndarray]:
        return MixtureGdpBound(probs=self.probs, mus=self.mus).rdp(orders)

    def pld(self, delta: float, discretization: float) -> Optional[fdp.PLD]:
        try:
            return fdp.pld_from_profile(fdp.symmetric_extension(self.profile), discretization)
        except fdp.VacuousBound:
            return None

    def detail(self, delta: float) -> str:
        text = f"{len(self.mus)} components, mu in [{min(self.mus):.4g}, {max(self.mus):.4g}]"
        return "; ".join(s for s in (text, self.note) if s)


@dataclass
class ReplaceTriangleBound(Bound):
    """REPLACE_ONE through the dataset without the record (docs/derivations.md B.4): with ``P``, ``R``
    the runs with ``x`` and with ``x'`` and ``Q`` the run without either, for every ``a``, ``b``

        H_{e^(a+b)}(P || R) <= H_{e^a}(P || Q) + e^a H_{e^b}(Q || R),

    and both legs are the add/remove pair ``add_remove`` (forward, then backward), or the profiles
    ``legs()`` gives: ``(eps_f, H(P||Q) there, eps_r, H(Q||P) there)``, each an upper bound. Evaluated at
    those points; by symmetry the same bound holds for ``H(R||P)``."""

    add_remove: GaussianMixturePairBound = None
    legs: Optional[Callable[[], Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]] = field(
        default=None, repr=False
    )
    note: str = ""
    kind = "triangle"
    _curve: Optional[tuple] = field(default=None, repr=False)
    _grid: Optional[tuple] = field(default=None, repr=False)

    def curve(self) -> Tuple[np.ndarray, np.ndarray]:
        """``(eps, delta)``: at each ``eps = a + b`` over pairs of traced points (any subset is
        valid), the smallest bound among the pairs with ``a + b <= eps``; ``delta`` non-increasing."""
        if self._curve is None:
            ef, hf, er, hr = self.legs() if self.legs is not None else self.add_remove.traces()
            ef, hf = _thin(ef, hf)
            er, hr = _thin(er, hr)
            with np.errstate(over="ignore"):
                values = (hf[:, None] + np.exp(ef)[:, None] * hr[None, :]).ravel()
            sums = (ef[:, None] + er[None, :]).ravel()
            order = np.argsort(sums, kind="stable")
            self._curve = (sums[order], np.minimum.accumulate(values[order]))
        return self._curve

    def epsilon(self, delta: float) -> float:
        if delta >= 1:
            return 0.0
        if self.legs is not None:
            return self._legs_epsilon(delta)
        sums, best = self.curve()
        i = int(np.searchsorted(-best, -delta, side="left"))  # first point with best <= delta
        return max(0.0, float(sums[i])) if i < sums.size else math.inf

    def _legs_epsilon(self, delta: float) -> float:
        """With ``legs`` on a fixed grid: for every grid point ``a`` of the first leg, the smallest grid point ``b``
        of the second with ``H(P||Q)(a) + e^a H(Q||R)(b) <= delta``; the smallest ``a + b`` (each pair a valid
        bound; the grid does not move with the run, so neither does the rounding)."""
        if self._grid is None:
            ef, hf, er, hr = self.legs()
            self._grid = (ef, hf, er, np.minimum.accumulate(hr))
        ef, hf, er, hr = self._grid
        with np.errstate(over="ignore"):
            room = (delta - hf) * np.exp(-ef)
        ok = room > 0
        j = np.searchsorted(-hr, -room[ok], side="left")  # the first b with H(Q||R)(b) <= room
        found = j < er.size
        sums = ef[ok][found] + er[j[found]]
        return max(0.0, float(sums.min())) if sums.size else math.inf

    def delta(self, epsilon: float) -> float:
        return float(self.profile(np.array([epsilon]))[0])

    def profile(self, eps) -> np.ndarray:
        sums, best = self.curve()
        i = np.searchsorted(sums, np.asarray(eps, dtype=float), side="right") - 1
        return np.clip(np.where(i >= 0, best[np.maximum(i, 0)], 1.0), 0.0, 1.0)

    def pld(self, delta: float, discretization: float) -> Optional[fdp.PLD]:
        try:  # the replace-one pair is symmetric: its profile for eps < 0 follows from eps > 0
            return fdp.pld_from_profile(fdp.symmetric_extension(self.profile), discretization)
        except fdp.VacuousBound:
            return None

    def detail(self, delta: float) -> str:
        return "; ".join(s for s in ("through the dataset without the record", self.note) if s)


TRIANGLE_POINTS = 900
"""Traced points per direction the triangle bound combines (any subset gives a valid bound)."""


def _thin(eps: np.ndarray, h: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """At most :data:`TRIANGLE_POINTS` of the traced points with ``0 < H < 1``, evenly spread in ``eps``."""
    keep = (h < 1.0) & (h > 0.0)
    eps, h = eps[keep], h[keep]
    if eps.size > TRIANGLE_POINTS:
        idx = np.unique(np.searchsorted(eps, np.linspace(eps[0], eps[-1], TRIANGLE_POINTS)).clip(0, eps.size - 1))
        eps, h = eps[idx], h[idx]
    return eps, h


@dataclass
class _Deferred(Bound):
    """A bound built on first use (the caps' candidates are many; only the chosen one is computed)."""

    build: Callable[[], Bound] = None
    estimate: Optional[float] = None
    _built: Optional[Bound] = field(default=None, repr=False)

    @property
    def inner(self) -> Bound:
        if self._built is None:
            self._built = self.build()
        return self._built

    @property
    def kind(self) -> str:  # type: ignore[override]
        return self.inner.kind

    def epsilon(self, delta: float) -> float:
        return self.inner.epsilon(delta)

    def delta(self, epsilon: float) -> float:
        return self.inner.delta(epsilon)

    def rdp(self, orders: Sequence[float]) -> Optional[np.ndarray]:
        return self.inner.rdp(orders)

    def pld(self, delta: float, discretization: float) -> Optional[fdp.PLD]:
        return self.inner.pld(delta, discretization)

    def detail(self, delta: float) -> str:
        return self.inner.detail(delta)


# ============================================================================ the analyses
@analysis(
    "composition_balls_in_bins",
    COMPOSITION_CITATION,
    (BALLS_IN_BINS,),
    hidden_state=False,
    needs="nothing",
    add_or_remove="native",
)
def composition(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """Every iterate released: the record is used once per epoch (a partial last epoch at most
    once), at a step that does not matter once the positions are revealed, so the run is the
    composition of ``E = ceil(T/t)`` Gaussian mechanisms of sensitivity ``rho C / b`` and noise
    ``z C / b``: ``G(rho sqrt(E) / z)``, each epoch charged its noisiest step under a noise
    schedule (Bok et al. Thm 4.4's reshuffling argument, evaluated by :func:`.bok.thm_4_4` on the
    reshuffled run with the same ``t``, then scaled by ``rho / 2``). Valid for public batches."""
    # the reshuffled run with the same t steps per epoch (n' = t b records)
    same_t = dict(dataset_size=run.steps_per_epoch * run.batch_size, epoch_steps=None)
    proxy = bok.thm_4_4(run.replace(sampling=RESHUFFLE, secret_batches=True, **same_t), ctx)
    rho = sensitivity_factor(ctx.neighboring_relation)
    return GdpBound(mu=proxy.mu * rho / 2.0, monotone_in_steps=True, note="one use per epoch")


@analysis(
    "si_balls_in_bins",
    SI_CITATION,
    (BALLS_IN_BINS,),
    hidden_state=True,
    needs="l2_regularization > 0, every capped batch's step c-Lipschitz with c < 1, secret draws for the average",
    add_or_remove="native",
)
def si_balls_in_bins(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """Balls-in-bins, hidden state, both relations (docs/derivations.md B.2-B.4).

    Given the others' placement within the cap (at most ``K`` others per step, so every step map is
    ``c_K``-Lipschitz, ``c_K = max(c(0), c(K+1))`` of section 6, ``< 1``), each visit pattern ``J``
    of the record is ``mu(J)``-GDP by shifted interpolation (section 2.2, ``mu = (rho/z)
    sqrt(E(J))``, the divisor ``b`` fixes the shift ``rho lr C / b`` and the noise ``lr z C / b``).
    ADD_OR_REMOVE_ONE: the run without the record does not depend on ``J``, so the run is dominated
    by ``(sum_J p_J N(mu_J, 1), N(0, 1))`` (B.3). REPLACE_ONE: that pair twice, through the dataset
    without the record (B.4). Public draws: the worst pattern. The cap's failure probability (a
    union bound per epoch, B.2) is added to delta. Not monotone in the steps (a partial last epoch
    often misses the record); :func:`si_balls_in_bins_any_length` is.
    """
    return _si_balls_in_bins(run, ctx, any_length=False)


@analysis(
    "si_balls_in_bins_any_length",
    SI_CITATION + "; every shorter run dominated by the whole epochs plus one uniform use (B.3a)",
    (BALLS_IN_BINS,),
    hidden_state=True,
    needs="l2_regularization > 0, every capped batch's step c-Lipschitz with c < 1, secret draws",
    add_or_remove="native",
)
def si_balls_in_bins_any_length(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """:func:`si_balls_in_bins` for every run of at most ``T`` steps at once (docs/derivations.md B.3a): with
    ``E = ceil(T/t)``, the visit patterns of ``E - 1`` whole epochs plus one more use uniform over the last
    ``t`` steps dominate those of every run of at most ``E`` epochs, and the cap's failure probability is
    taken over ``E t`` steps. Never decreases with ``T`` (flagged ``monotone_in_steps``), so its value for an
    unbounded run bounds every length (``hsa epochs``); larger than :func:`si_balls_in_bins` by about one
    last-epoch use. Secret draws only."""
    if not run.secret_batches:
        return NotApplicable(reason=cm.need_secret_batches(run))
    bound = _si_balls_in_bins(run, ctx, any_length=True)
    bound.monotone_in_steps = bound.applicable
    return bound


def _si_balls_in_bins(run: TrainingRunDpEvent, ctx: cm.Context, any_length: bool) -> Bound:
    s, reason = allocation_setup(run, ctx)
    if s is None:
        return NotApplicable(reason=reason)
    add_remove = ctx.neighboring_relation == ADD_OR_REMOVE_ONE
    epochs = -(-s.steps // s.spe)
    if any_length:  # every run of at most `epochs` epochs: the cap over all their steps
        s = attr_replace(s, steps=epochs * s.spe)

    def patterns(log_c: float) -> List[Tuple[float, float]]:
        if not any_length:
            return visit_patterns(s.steps, s.spe, log_c)
        if epochs == 1:
            return visit_patterns(s.spe, s.spe, log_c)
        return visit_patterns((epochs - 1) * s.spe, s.spe, log_c, extra_use=True)

    def build(log_c: float) -> Bound:
        if not run.secret_batches:
            model = si.StepModel(s.steps, s.spe, log_c)
            energy = si.corner_energy(model, si.worst_pattern(run, model))
            return GdpBound(mu=s.rho / s.z * math.sqrt(energy), note="public draws: the worst visit pattern")
        pairs = patterns(log_c)
        note = "the record's step uniform in every epoch; common null"
        if any_length:
            note = f"every run of at most {epochs} epochs: {note}; one more uniform use"
        pair = GaussianMixturePairBound(
            probs=[p for p, _ in pairs], mus=[math.sqrt(e) / s.z for _, e in pairs], note=note
        )
        return pair if add_remove else ReplaceTriangleBound(add_remove=pair, note=pair.note)

    def inner(cap: Cap) -> Bound:
        log_c = min(cap.log_c, 0.0)
        return _Deferred(build=lambda: build(log_c), estimate=s.rho / s.z * _energy_estimate(s.steps, s.spe, log_c))

    cands = [(c, inner(c)) for c in allocation_caps(s)]
    if not cands:
        return NotApplicable(
            reason=(
                "no batch-size cap keeps every step map contractive (even an empty batch fails: lr l2_regularization "
                "must lie in (0, 2))"
            )
        )
    return CappedBound(
        candidates=tuple(cands),
        relation=ctx.neighboring_relation.name,
        estimates=tuple(inner.estimate for _, inner in cands),
    )


__all__ = [
    "composition",
    "si_balls_in_bins",
    "si_balls_in_bins_any_length",
    "GaussianMixturePairBound",
    "ReplaceTriangleBound",
    "visit_patterns",
    "log_allocation_cap_failure",
    "allocation_caps",
    "allocation_setup",
    "AllocationSetup",
]
