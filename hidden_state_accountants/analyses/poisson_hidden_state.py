"""Hidden-state bounds under Poisson sampling (Opacus' default loader), both neighbouring relations.

Setting (docs/derivations.md section 6): every record joins each step's batch independently with
probability ``q``; the clipped sum is divided by a *fixed* public divisor ``b`` (Opacus: the
expected batch size); the L2 strength ``m_reg`` (``TrainingRunDpEvent.l2_regularization``,
torch's ``weight_decay``) is applied once per step outside the batch sum::

    theta <- Proj_K(theta - lr [ (1/b) sum_{i in B_t} clip_C(grad l_i) + m_reg theta + (z C/b) xi ])

What differs from the fixed-size schedules is that the batch size is random, so a step's
contraction is random: a step averaging ``k`` records is ``c(k)``-Lipschitz with
``c(k) = max(|1 - lr m_k|, |1 - lr M_k|)``, ``m_k = m_reg + (k/b) m_d``,
``M_k = m_reg + (k/b)(M - m_reg)``, ``m_d = m - m_reg`` (section 6). An empty batch contracts only
through ``m_reg`` and a large one can be expansive. This is handled by a cap ``K`` on the *other*
records' batch size (an event of the others alone, which keeps the differing record's inclusion
an independent ``Bern(q)``): conditioned on ``G_K`` every map is ``c_K = max(c(0), c(K+1))``-
Lipschitz, and ``P(not G_K) = 1 - (1 - P(Bin(N_o, q) > K))^T`` is added to delta
(section 7). Every cap gives a valid bound. The L2 strength must be declared (section 16).

This module holds that machinery and the package's own analysis, **Lemma SI-R** (f-DP,
docs/derivations.md sections 8, 13-15): shifted interpolation (Bok, Su & Altschuler, *Shifted
Interpolation for Differential Privacy*, ICML 2024, arXiv:2403.00278, Lemma 3.2 / Thm 3.3) with the
auxiliary process driven by the first run's step maps, so that the differing record enters only
through each step's sampled pair, and with the distance its earlier uses put between the runs taken
as a *random* shift::

    delta(eps) <= E_S delta_{ g(1)^{(x)(k-r)} (x) g(s)^{(x) r} (x) G(mu(S)) }(eps),
    mu(S) = c^k min(Dn, (rho/z) S) / (sqrt(1-s) sqrt(sum_{i<r} c^{2i})),   S = sum_{j>=0} I_j c^j,

for any window ``k``, ``r <= k`` and split ``s``, in units of the step noise ``lr z C/b``
(``Dn = D b/(lr z C)``, ``rho = 2`` under REPLACE_ONE, ``1`` under ADD_OR_REMOVE_ONE, ``I_j ~ Bern(q)``
the record's inclusions before the window). The per-step pair ``g`` is the antipodal pair under
REPLACE_ONE, proved to dominate every pair of clipped gradients (section 13;
:func:`hidden_state_accountants.fdp.poisson_replace_one_profile`) and the sampled Gaussian with both
directions under ADD_OR_REMOVE_ONE. The composition of the sampled steps (``tau = 0``) is a candidate
too, and the bound never decreases with the number of steps (section 15). Bok et al.'s Thms 4.9/4.10
with ``p = q`` are corollaries of Lemma SI (section 8) and add nothing over it, so they are not
registered for Poisson. The Rényi form ([AT] eq. (3.3), section 9, with the deterministic drift of
:func:`si_shift_mu`) lives in :mod:`.altschuler_talwar`, the Poisson form of Ye & Shokri's Thm 4.3
(section 10) in :mod:`.ye_shokri`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import fft as sfft
from scipy import special, stats

from hidden_state_accountants import fdp
from hidden_state_accountants.analyses import _common as cm
from hidden_state_accountants.analyses.analysis_info import analysis
from hidden_state_accountants.bounds import Bound, Cap, CappedBound, NotApplicable, mixture_components, with_failure
from hidden_state_accountants.events import TrainingRunDpEvent
from hidden_state_accountants.relations import ADD_OR_REMOVE_ONE, REPLACE_ONE, sensitivity_factor
from hidden_state_accountants.schedules import POISSON, UNBOUNDED_STEPS

BOK = "Bok, Su & Altschuler (ICML 2024, arXiv:2403.00278)"
SI_CITATION = (
    f"Lemma SI-R (docs/derivations.md sections 8, 13-15): shifted interpolation after {BOK} Lemma 3.2 / "
    "Thm 3.3 with sampled steps and the earlier uses as a random shift; batch-size cap with its failure "
    "probability added to delta (sections 6-7)"
)

# Fractions of delta the cap's failure probability may use; the largest admissible cap is always tried.
CAP_FRACTIONS = (1e-3, 1e-1, 0.5)
# The deltas the cap candidates are tuned for (any cap is valid at every delta).
CAP_DELTAS = (1e-3, 1e-5, 1e-7, 1e-9)
# Noise splits s = sigma_2^2 / sigma^2 of the Renyi form with a deterministic drift ([AT] eq. (3.3), section 9).
SPLITS = (0.1, 0.25, 0.5, 0.75, 0.9)

NEED_L2 = (
    "needs l2_regularization > 0 declared (under Poisson sampling a step may have an empty batch, "
    "which contracts only through the L2 term: 1 - lr m_reg)"
)
NEED_L2_DECLARED = (
    "needs l2_regularization declared (0 when the optimizer applies no L2 term outside the per-example gradients): "
    "under Poisson sampling the batch size is random, and how a step contracts depends on how the declared "
    "curvature splits between the L2 term and the data; with the L2 strength unknown, a weight decay above the "
    "declared strong convexity lets large batches expand (docs/derivations.md section 16)"
)


# =============================================================================== sections 6-7: the cap
def log_cap_failure(others: int, q: float, steps: int, cap: int) -> float:
    """``log P(exists t <= steps: |O_t| > cap)`` with ``|O_t| ~ Bin(others, q)`` i.i.d. (section 7).

    Exact for independent steps, ``1 - (1 - sf)^T`` in log space; where scipy's tail underflows,
    ``T exp(-others KL((cap+1)/others || q))`` (Chernoff), an upper bound, never optimistic.

    >>> round(math.exp(log_cap_failure(10, 0.5, 1, 9)), 6)  # P(Bin(10, 1/2) = 10)
    0.000977
    >>> log_cap_failure(10, 0.5, 3, 10)
    -inf
    """
    if cap >= others:
        return -math.inf
    if cap < 0:
        return 0.0
    # as floats (numpy has no integers beyond 2**63): the tail grows with ``others`` and falls with ``cap``,
    # so ``others`` is rounded up and ``cap`` down
    n_f, k_f = float(others), float(cap)
    n_f = n_f if n_f >= others else math.nextafter(n_f, math.inf)
    k_f = k_f if k_f <= cap else math.nextafter(k_f, -math.inf)
    log_sf = float(stats.binom.logsf(k_f, n_f, q))
    if not math.isfinite(log_sf) or log_sf < -700:
        x = (cap + 1) / others
        if x <= q:
            return 0.0
        kl = x * math.log(x / q) + ((1 - x) * math.log((1 - x) / (1 - q)) if x < 1 else 0.0)
        return min(0.0, math.log(steps) - others * kl)
    sf = math.exp(log_sf)
    if sf >= 1.0:
        return 0.0
    return float(math.log(-math.expm1(steps * math.log1p(-sf))))


def log_step_lipschitz(lr: float, m_reg: float, m_data: float, M: float, b: float, k: float) -> float:
    """``log`` of the Lipschitz constant of ``theta -> theta - lr (m_reg theta + (1/b) sum_{k records} d_i)``
    (Bok et al. Lemma 2.8 for the sum, section 6): the Jacobian's spectrum lies in
    ``[1 - lr (m_reg + (k/b)(M - m_reg)), 1 - lr (m_reg + (k/b) m_data)]``. The L2 strength ``m_reg`` must be
    known: with it unknown no bound holds for ``k > b`` (section 16)."""
    lo = lr * (m_reg + (k / b) * m_data)
    hi = lr * (m_reg + (k / b) * (M - m_reg))
    return max(cm.log_abs_one_minus(lo), cm.log_abs_one_minus(hi))


def log_cap_lipschitz(lr, m_reg, m_data, M, b, max_batch) -> float:
    """Largest step Lipschitz constant (log) over batch sizes ``0..max_batch``: ``|1 - lr(u + k v)|``
    is convex in ``k``, so the maximum sits at an end (section 6)."""
    return max(
        log_step_lipschitz(lr, m_reg, m_data, M, b, 0.0), log_step_lipschitz(lr, m_reg, m_data, M, b, float(max_batch))
    )


def caps(
    others: int,
    q: float,
    steps: int,
    *,
    lr: float,
    m_reg: Optional[float],
    m_data: float,
    M: float,
    b: float,
    admissible: Callable[[float], bool],
    deltas: Sequence[float] = CAP_DELTAS,
) -> List[Cap]:
    """Candidate caps (section 7): the largest cap whose maps satisfy ``admissible(log_c)``, and for each
    ``delta`` and fraction in :data:`CAP_FRACTIONS` the smallest cap with so small a failure
    probability, where that gives a smaller contraction. The differing record adds one to a batch."""
    lc = lambda K: log_cap_lipschitz(lr, m_reg, m_data, M, b, K + 1)
    if not admissible(lc(0)):
        return []
    if admissible(lc(others)):
        k_max = others
    else:  # largest admissible cap (lc is non-decreasing in K)
        lo, hi = 0, others
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if admissible(lc(mid)) else (lo, mid)
        k_max = lo
    out = {k_max: Cap(k_max, log_cap_failure(others, q, steps, k_max), lc(k_max))}
    for delta in deltas:
        for f in CAP_FRACTIONS:
            target = math.log(delta * f)
            if log_cap_failure(others, q, steps, k_max) > target:
                continue
            a, z = 0, k_max  # smallest K <= k_max with log_p <= target (log_p is non-increasing in K)
            while z - a > 1:
                mid = (a + z) // 2
                a, z = (a, mid) if log_cap_failure(others, q, steps, mid) <= target else (mid, z)
            K = a if log_cap_failure(others, q, steps, a) <= target else z
            if lc(K) < out[k_max].log_c and K not in out:
                out[K] = Cap(K, log_cap_failure(others, q, steps, K), lc(K))
    return sorted(out.values(), key=lambda c: c.cap)


@dataclass(frozen=True)
class PoissonSetup:
    """The numbers a Poisson hidden-state analysis reads from a (normalised, ``C = 1``) run."""

    n: int
    b: int
    q: float
    m_reg: float
    m_data: float
    M: float
    lr: float
    z: float
    steps: int
    others: int  # records common to both datasets
    Dn: Optional[float]  # diameter in units of the step noise
    rho: float  # one record's effect on a step, in units of the step noise times z


def poisson_setup(run: TrainingRunDpEvent, ctx: cm.Context) -> Tuple[Optional[PoissonSetup], str]:
    """The setup, or ``None`` and the reason no Poisson hidden-state analysis applies."""
    reason = cm.hidden_state_preconditions(run)
    if reason:
        return None, reason
    g = run.geometry
    m_reg = run.l2_regularization
    if m_reg is None:
        return None, NEED_L2_DECLARED
    if m_reg > g.strong_convexity:
        return None, (
            f"l2_regularization {m_reg:g} exceeds the declared strong_convexity {g.strong_convexity:g}; "
            "the declared geometry must include the L2 term"
        )
    m_data = g.strong_convexity - m_reg
    n, b = run.dataset_size, run.batch_size
    relation = ctx.neighboring_relation
    others = n - 1 if relation == REPLACE_ONE else n  # the larger dataset, conservatively
    C = run.clip_norm
    Dn = None if g.diameter is None else g.diameter * b / (run.learning_rate * run.noise_multiplier * C)
    return PoissonSetup(
        n=n,
        b=b,
        q=run.sampling_rate,
        m_reg=m_reg,
        m_data=m_data,
        M=g.smoothness,
        lr=run.learning_rate,
        z=run.noise_multiplier,
        steps=run.steps,
        others=others,
        Dn=Dn,
        rho=sensitivity_factor(relation),
    ), ""


def capped(
    run: TrainingRunDpEvent,
    ctx: cm.Context,
    setup: PoissonSetup,
    admissible: Callable[[float], bool],
    inner_for_cap: Callable[[Cap], Bound],
) -> Bound:
    """A :class:`CappedBound` over the candidate caps, each with ``inner_for_cap(cap)``."""
    s = setup
    refusal = cap_refusal(s, admissible)
    if refusal:
        return NotApplicable(reason=refusal)
    cands, reasons = [], []
    for c in caps(s.others, s.q, s.steps, lr=s.lr, m_reg=s.m_reg, m_data=s.m_data, M=s.M, b=s.b, admissible=admissible):
        inner = inner_for_cap(c)
        if inner.applicable:
            cands.append((c, inner))
        else:
            reasons.append(inner.reason)
    if not cands:
        return NotApplicable(
            reason=reasons[0]
            if reasons
            else (
                "no batch-size cap keeps every step map within the theorem's contraction condition (even an empty "
                "batch fails it: lr m_reg must lie in (0, 2))"
            )
        )
    estimates = tuple(getattr(inner, "estimate", None) for _, inner in cands)
    return CappedBound(candidates=tuple(cands), relation=ctx.neighboring_relation.name, estimates=estimates)


# ============================ section 8: Lemma SI with a deterministic drift (shared with the [AT] form)
def si_shift_mu(
    *, k, r, split: float, steps: int, log_c: float, z: float, Dn: Optional[float], rho: float
) -> np.ndarray:
    """GDP parameter of Lemma SI's Gaussian term, in noise units (section 8)::

        mu = c^k Z / (sqrt(1 - split) sqrt(sum_{i<r} c^{2i})),  Z = min(Dn, (rho/z)(1 - c^tau)/(1 - c)),

    ``tau = steps - k`` (``Z = 0`` at ``tau = 0``); ``c = 1`` uses ``(rho/z) tau``.

    >>> round(float(si_shift_mu(k=1, r=1, split=0.5, steps=2, log_c=math.log(0.5), z=1.0, Dn=None, rho=2.0)[0]), 6)
    1.414214
    """
    k = np.atleast_1d(np.asarray(k, dtype=float))
    r = np.atleast_1d(np.asarray(r, dtype=float))
    tau = steps - k
    rho0 = rho / z
    if log_c == -math.inf:  # c = 0: the distance at tau is forgotten in one step
        return np.zeros_like(k)
    if log_c < 0:
        one_minus_c = -math.expm1(log_c)
        drift = rho0 * -np.expm1(tau * log_c) / one_minus_c
        window = -np.expm1(2 * r * log_c) / -math.expm1(2 * log_c)
    else:  # c = 1 (non-expansive only)
        drift = rho0 * tau
        window = r
    Z = drift if Dn is None else np.minimum(drift, Dn)
    with np.errstate(over="ignore", invalid="ignore"):
        mu = np.exp(k * min(log_c, 0.0)) * Z / (math.sqrt(1.0 - split) * np.sqrt(window))
    return np.where(tau == 0, 0.0, mu)


# ============================================ section 13: one sampled step, exact connect-the-dots PLDs
_STEP_CACHE: Dict = {}


def _cached(cache: Dict, key, limit: int, make: Callable):
    """``cache[key]``, made by ``make()`` when missing; the cache is emptied beyond ``limit`` entries."""
    if key not in cache:
        if len(cache) > limit:
            cache.clear()
        cache[key] = make()
    return cache[key]


def _grid_end(profile: Callable[[np.ndarray], np.ndarray], d: float) -> int:
    """``k`` with ``profile(k d) <= TAIL_MASS`` (the smallest on a 1/4 grid), at most ``MAX_LOSS / d``:
    what lies beyond goes to ``+infinity`` (pessimistic)."""
    coarse = np.arange(0.0, fdp.MAX_LOSS + 0.25, 0.25)
    ok = np.flatnonzero(profile(coarse) <= fdp.TAIL_MASS)
    end = float(coarse[ok[0]]) if ok.size else fdp.MAX_LOSS
    return max(1, int(math.ceil(end / d)))


def _ctd_pmf(d: float, lower: int, deltas: np.ndarray) -> pld_pmf.DensePLDPmf:
    """Connect-the-dots masses (Doroshenko et al., *Connect the Dots*, PETS 2022, arXiv:2207.04380,
    Alg. 1) from a convex profile at ``eps = (lower + i) d``; the last value is the mass at
    ``+infinity``. Rounding can make a few masses ~-1e-16: set to 0, which only raises ``delta``."""
    deltas = np.minimum.accumulate(np.clip(deltas, 0.0, 1.0))  # a profile is non-increasing
    ed = math.exp(d)
    diff = np.diff(deltas)
    probs = np.empty(deltas.size)
    probs[0] = (1 - deltas[0]) + diff[0] / (ed - 1)
    probs[1:-1] = (diff[1:] - ed * diff[:-1]) / (ed - 1)
    probs[-1] = diff[-1] / (math.exp(-d) - 1)
    return pld_pmf.DensePLDPmf(d, lower, np.maximum(probs, 0.0), float(deltas[-1]), True)


def step_pld(z: float, q: float, relation, d: float) -> fdp.PLD:
    """One Poisson-sampled step, noise multiplier ``z`` relative to one record's clip norm, as the
    connect-the-dots PLD of its exact profile (section 13): REPLACE_ONE, the antipodal dominating pair
    (:func:`~hidden_state_accountants.fdp.antipodal_delta`, symmetric); ADD_OR_REMOVE_ONE, the sampled
    Gaussian with its two directions kept apart
    (:func:`~hidden_state_accountants.fdp.poisson_add_remove_deltas`, the pair dp_accounting's
    ``from_gaussian_mechanism(sampling_prob=q)`` discretises). Cached (PLDs are immutable)."""
    return _cached(_STEP_CACHE, (float(z), float(q), relation, float(d)), 256, lambda: _step_pld(z, q, relation, d))


def _step_pld(z: float, q: float, relation, d: float) -> fdp.PLD:
    r = 1.0 / z
    if q >= 1.0:  # every step uses the record: a Gaussian pair
        return gaussian_pld(r * sensitivity_factor(relation), d)
    if relation == ADD_OR_REMOVE_ONE:
        k = _grid_end(lambda e: np.maximum(*fdp.poisson_add_remove_deltas(r, q, e)), d)
        fwd, bwd = fdp.poisson_add_remove_deltas(r, q, np.arange(-k, k + 1) * d)
        if fwd[-1] >= 0.5 or bwd[-1] >= 0.5:
            raise fdp.VacuousBound("delta(MAX_LOSS) >= 1/2")
        return pld_lib.PrivacyLossDistribution(_ctd_pmf(d, -k, fwd), _ctd_pmf(d, -k, bwd))
    k = _grid_end(lambda e: fdp.antipodal_delta(r, q, e), d)
    deltas = fdp.antipodal_delta(r, q, np.arange(-k, k + 1) * d)
    if deltas[-1] >= 0.5:
        raise fdp.VacuousBound("delta(MAX_LOSS) >= 1/2")
    return pld_lib.PrivacyLossDistribution(_ctd_pmf(d, -k, deltas))


def gaussian_pld(mu: float, d: float) -> fdp.PLD:
    """Pessimistic connect-the-dots PLD of ``G(mu)`` from its exact profile on ``[-E, E]``, vectorised;
    ``delta(E) <= 1e-20`` goes to ``+infinity``. Outside ``[1e-4, 25]`` the package's envelope."""
    if mu <= 0:
        return pld_lib.identity(value_discretization_interval=d)
    if not 1e-4 <= mu <= 25:
        return fdp.gaussian_pld(mu, d)
    E = mu * mu / 2 + 9.3 * mu  # Phi(-E/mu + mu/2) <= 1e-20
    k = max(1, int(math.ceil(E / d)))
    deltas = fdp.gdp_delta(mu, np.arange(-k, k + 1) * d)
    return pld_lib.PrivacyLossDistribution(_ctd_pmf(d, -k, np.asarray(deltas)))


def _pmfs(pld: fdp.PLD) -> Tuple:
    """The (remove, add) PMFs of a PLD (the same object twice when it is symmetric)."""
    rem = pld._pmf_remove  # noqa: SLF001
    return (rem, rem) if pld._symmetric else (rem, pld._pmf_add)  # noqa: SLF001


MAX_COMPOSED_POINTS = 4_000_000  # a larger composition is not built (its epsilon is in the thousands)
_MGF_LAMBDAS = np.concatenate([-np.geomspace(0.05, 400.0, 12)[::-1], np.geomspace(0.05, 400.0, 12)])
_MGF_CACHE: Dict = {}


def _log_mgf(pmf: pld_pmf.DensePLDPmf, lam: np.ndarray, block: int = 1) -> np.ndarray:
    """An upper bound on ``log E e^{lam L}`` over the PMF's finite losses: the masses in blocks of
    ``block`` grid points, each at its block's largest loss for ``lam > 0`` and smallest for ``lam < 0``
    (exact for ``block = 1``)."""
    p = np.asarray(pmf._probs, dtype=float)  # noqa: SLF001
    blocks = -(-p.size // block)
    mass = np.bincount(np.arange(p.size) // block, weights=p, minlength=blocks)
    d, low = pmf._discretization, pmf._lower_loss  # noqa: SLF001
    first = (low + block * np.arange(blocks)) * d
    last = np.minimum(first + (block - 1) * d, (low + p.size - 1) * d)
    loss = np.where(lam[:, None] > 0, last[None, :], first[None, :])
    with np.errstate(divide="ignore"):
        logp = np.log(np.where(mass > 0, mass, 0.0))
    return special.logsumexp(lam[:, None] * loss + logp[None, :], axis=1)


def _pmf_log_mgf(pmf: pld_pmf.DensePLDPmf) -> np.ndarray:
    """:func:`_log_mgf` at :data:`_MGF_LAMBDAS` in blocks of 16 points (cached; the PMF is kept so that
    its ``id`` is not reused): it only sizes Chernoff windows."""
    return _cached(_MGF_CACHE, id(pmf), 512, lambda: (pmf, _log_mgf(pmf, _MGF_LAMBDAS, 16)))[1]


def compose_pmfs(parts: Sequence[Tuple[pld_pmf.DensePLDPmf, int]], tail: float = 1e-15) -> pld_pmf.DensePLDPmf:
    """The PMF of a sum of independent privacy losses, ``count`` copies of each part, in one FFT.

    dp_accounting's ``DensePLDPmf.self_compose`` generalised to several PMFs on the same grid: the
    output window comes from Chernoff bounds on both tails (the parts' log-MGFs, added), the at most
    ``tail`` of mass outside it (which the cyclic convolution folds back in) is added at
    ``+infinity``, so the result dominates the exact composition."""
    parts = [(p, int(k)) for p, k in parts if k > 0]
    d = parts[0][0]._discretization  # noqa: SLF001
    arrays = [np.asarray(p._probs, dtype=float) for p, _ in parts]  # noqa: SLF001
    base = sum(k * p._lower_loss for p, k in parts)  # noqa: SLF001
    top = sum(k * (a.size - 1) for a, (_, k) in zip(arrays, parts))
    total = sum(k * _pmf_log_mgf(p) for p, k in parts)
    lam = _MGF_LAMBDAS
    with np.errstate(invalid="ignore"):
        bounds = (total + math.log(2 / tail)) / lam  # P(L >= b) <= tail/2 for lam > 0, P(L <= b) for lam < 0
    pos = lam > 0
    hi_loss, lo_loss = float(np.min(bounds[pos])), float(np.max(bounds[~pos]))
    if not (math.isfinite(hi_loss) and math.isfinite(lo_loss)) or (hi_loss - lo_loss) / d > MAX_COMPOSED_POINTS:
        raise fdp.VacuousBound(f"the composition spans more than {MAX_COMPOSED_POINTS} grid points")
    upper = min(top, int(math.ceil(hi_loss / d)) - base)
    lower = max(0, int(math.floor(lo_loss / d)) - base)
    lower = min(lower, upper)
    out_len = upper - lower + 1
    size = sfft.next_fast_len(max(out_len, max(a.size for a in arrays)))
    spec = np.ones(size // 2 + 1, dtype=complex)
    for a, (_, k) in zip(arrays, parts):
        spec *= sfft.rfft(a, size) ** k
    conv = sfft.irfft(spec, size)
    out = np.maximum(np.roll(conv, -lower)[:out_len], 0.0)
    # P(every part finite) = prod (1 - inf_i)^k; a part whose loss is infinite with probability 1 makes
    # the composition's infinite with probability 1 (delta = 1 at every finite epsilon: vacuous)
    log_finite = sum(k * _log1m(p._infinity_mass) for p, k in parts)  # noqa: SLF001
    inf = min(1.0, tail - math.expm1(log_finite))
    return pld_pmf.DensePLDPmf(d, base + lower, out, inf, True)


def _log1m(x: float) -> float:
    """``log(1 - x)`` for a probability ``x`` (``-inf`` at ``x >= 1``)."""
    return math.log1p(-x) if x < 1.0 else -math.inf


def compose_plds(parts: Sequence[Tuple[fdp.PLD, int]]) -> fdp.PLD:
    """:func:`compose_pmfs` per direction (symmetric when every part is)."""
    parts = [(p, k) for p, k in parts if k > 0]
    rem = compose_pmfs([(_pmfs(p)[0], k) for p, k in parts])
    if all(p._symmetric for p, _ in parts):  # noqa: SLF001
        return pld_lib.PrivacyLossDistribution(rem)
    return pld_lib.PrivacyLossDistribution(rem, compose_pmfs([(_pmfs(p)[1], k) for p, k in parts]))


def self_compose(pld: fdp.PLD, k: int) -> fdp.PLD:
    """``pld.self_compose(k)`` in one FFT per direction."""
    return pld if k == 1 else compose_plds([(pld, k)])


def grid_epsilon(pld: fdp.PLD, delta: float) -> float:
    """An upper bound on the PLD's epsilon at ``delta`` (the smallest grid loss meeting it), vectorised;
    only chooses between candidates (reported values are dp_accounting's)."""
    out = 0.0
    for pmf in _pmfs(pld):
        p = np.asarray(pmf._probs, dtype=float)  # noqa: SLF001
        inf = pmf._infinity_mass  # noqa: SLF001
        if inf > delta:
            return math.inf
        loss = (pmf._lower_loss + np.arange(p.size)) * pmf._discretization  # noqa: SLF001
        tail_p = np.concatenate([np.cumsum(p[::-1])[::-1][1:], [0.0]])
        with np.errstate(over="ignore", invalid="ignore"):  # 0 * inf: the NaN only drops a candidate
            w = p * np.exp(-(loss - loss[-1]))
            tail_w = np.concatenate([np.cumsum(w[::-1])[::-1][1:], [0.0]])
            dl = inf + tail_p - np.exp(loss - loss[-1]) * tail_w
        ok = np.flatnonzero(dl <= delta)
        out = max(out, float(loss[ok[0]]) if ok.size else math.inf)
    return max(out, 0.0)


# =========================== section 14: the drift of the earlier uses, a random shift (Lemma SI-R)
THETA_NEAR = 0.02  # the uses with c^j >= THETA_NEAR are convolved exactly, the rest bounded by Chernoff
LAW_CELLS = 4096  # grid cells of a shift law
BLOCK_SPREAD = 0.01  # consecutive uses lumped into one block lose at most this fraction of their weight
NEAR_MAX_USES = 2000  # more expected uses than this among the near ones: Chernoff for all (run time only)
NEAR_MAX_BLOCKS = 4096


@dataclass(frozen=True)
class ShiftLaw:
    """A law that dominates ``S`` pointwise under a coupling: atoms ``values`` (ascending, ``>= 0``) with
    ``probs``; ``over`` is the mass beyond the last atom, at ``+infinity``."""

    values: np.ndarray
    probs: np.ndarray
    over: float


def _ein(y: np.ndarray) -> np.ndarray:
    """``int_0^y (e^u - 1)/u du = sum_{n>=1} y^n/(n n!) = Ei(y) - gamma - log y`` (``inf`` once it overflows)."""
    y = np.asarray(y, dtype=float)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        big = special.expi(np.maximum(y, 1.0)) - np.euler_gamma - np.log(np.maximum(y, 1.0))
        n = np.arange(1, 25)
        small = np.sum(np.power.outer(np.minimum(y, 1.0), n) / (n * special.factorial(n)), axis=-1)
        return np.where(y < 1.0, small, np.where(y > 700.0, np.inf, big))


def _tail_log_mgf(q: float, log_c: float, first: int, lam: np.ndarray) -> np.ndarray:
    """An upper bound on ``log E exp(lam R)``, ``R = sum_{j >= first} I_j c^j`` (``I_j ~ Bern(q)``):
    ``log(1 + x) <= x`` and the sum of the decreasing ``e^{lam c^j} - 1`` bounded by its first term
    plus the integral, ``Ein(lam c^first) / log(1/c)``."""
    w = math.exp(first * log_c)
    with np.errstate(over="ignore", invalid="ignore"):
        return q * (np.expm1(lam * w) + _ein(lam * w) / -log_c)


def _chernoff_sf(q: float, log_c: float, first: int, x: np.ndarray) -> np.ndarray:
    """``P(R >= x) <= min(1, min_lam exp(log E e^{lam R} - lam x))`` on a grid of ``lam``."""
    w = math.exp(first * log_c)
    lam = np.geomspace(1e-3, 1e4, 240) / w
    lm = _tail_log_mgf(q, log_c, first, lam)
    ok = np.isfinite(lm)
    lam, lm = lam[ok], lm[ok]
    with np.errstate(over="ignore", invalid="ignore"):
        expo = lm[None, :] - lam[None, :] * np.asarray(x, dtype=float)[:, None]
        return np.minimum(1.0, np.exp(np.min(expo, axis=1)))


def _shift_add(acc: np.ndarray, idx: np.ndarray, probs: np.ndarray, capped: bool) -> Tuple[np.ndarray, float]:
    """``sum_i probs_i * acc`` shifted up by ``idx_i`` cells; what leaves the grid is returned (or, when
    ``capped``, piled on the last cell)."""
    n = acc.size
    new = np.zeros(n)
    out = 0.0
    if idx.size > 64:  # a wide block: FFT convolution
        kernel = np.zeros(int(idx.max()) + 1)
        np.add.at(kernel, idx, probs)
        full = np.maximum(
            sfft.irfft(sfft.rfft(acc, n + kernel.size) * sfft.rfft(kernel, n + kernel.size), n + kernel.size)[
                : n + kernel.size - 1
            ],
            0.0,
        )
        new, out = full[:n], float(np.sum(full[n:]))
    else:
        for k, p in zip(idx, probs):
            if k < n:
                new[k:] += p * acc[: n - k]
                out += p * float(np.sum(acc[n - k :]))
            else:
                out += p * float(np.sum(acc))
    if capped:
        new[-1] += out
        out = 0.0
    return new, out


_LAW_CACHE: Dict = {}


def _near_uses(q: float, log_c: float) -> int:
    """How many of the latest steps are convolved exactly: those with ``c^j >= THETA_NEAR``, none when
    they hold more than ``NEAR_MAX_USES`` expected uses (``S`` then concentrates; run time only)."""
    near = int(math.ceil(math.log(THETA_NEAR) / log_c))
    return 0 if q * near > NEAR_MAX_USES else near


def shift_law(q: float, log_c: float, *, cap: Optional[float], eta: float) -> ShiftLaw:
    """A law that dominates ``min(S, cap)``, ``S = sum_{j >= 0} I_j c^j`` with ``I_j ~ Bern(q)`` i.i.d.: the
    weighted uses of the record before a window, over an unbounded past (which dominates every finite
    one, so the law does not depend on the run's length; section 14).

    ``c = 1`` (a diameter is then required, ``cap`` finite): the point mass at ``cap``. ``c < 1``: the
    uses with ``c^j >= THETA_NEAR`` in blocks of consecutive steps whose weight varies by at most
    ``BLOCK_SPREAD``, each block ``c^{j0} Bin(L, q)`` rounded *up* to a grid of ``LAW_CELLS`` cells, convolved
    exactly; the later ones by a Chernoff law (a survival function that bounds theirs). Without a cap the
    grid ends where a Chernoff bound on ``P(S >= x)`` falls below ``eta``; the mass beyond it (computed, not
    estimated) goes to ``+infinity``. Cached."""
    if log_c == -math.inf:  # c = 0: the distance at the window's start is forgotten in its first step
        return ShiftLaw(np.zeros(1), np.ones(1), 0.0)
    if log_c >= 0.0:
        if cap is None:
            raise ValueError("shift_law: c = 1 needs a cap (the diameter)")
        return ShiftLaw(np.array([float(cap)]), np.ones(1), 0.0)
    return _cached(
        _LAW_CACHE, (float(q), float(log_c), cap, float(eta)), 64, lambda: _geometric_shift_law(q, log_c, cap, eta)
    )


def _geometric_shift_law(q: float, log_c: float, cap: Optional[float], eta: float) -> ShiftLaw:
    if cap is not None:
        top = float(cap)
    else:  # P(S >= top) <= eta
        lam = np.geomspace(1e-3, 1e3, 400)
        lm = _tail_log_mgf(q, log_c, 0, lam)
        ok = np.isfinite(lm)
        top = float(np.min((lm[ok] - math.log(eta)) / lam[ok]))
    h = top / LAW_CELLS
    capped = cap is not None
    acc = np.zeros(LAW_CELLS + 1)
    acc[0] = 1.0
    over = 0.0
    near = _near_uses(q, log_c)
    block = max(1, int(BLOCK_SPREAD / -math.expm1(log_c)), -(-near // NEAR_MAX_BLOCKS))
    counts: Dict[int, Tuple] = {}  # Bin(size, q) on its support, once per block size

    def binomial(size):
        if size not in counts:
            lo = int(stats.binom.ppf(1e-25, size, q))
            hi = int(min(size, stats.binom.isf(1e-25, size, q) + 1))
            ks = np.arange(lo, hi + 1)
            pk = stats.binom.pmf(ks, size, q)
            if lo > 0:
                pk[0] += float(stats.binom.cdf(lo - 1, size, q))  # fewer uses: counted as lo (upward)
            counts[size] = (ks, pk, float(stats.binom.sf(hi, size, q)))  # more uses: to the top / +infinity
        return counts[size]

    j = 0
    while j < near:
        size = min(block, near - j)
        w = math.exp(j * log_c)  # the block's largest weight: every use in it rounded up to it
        ks, pk, beyond = binomial(size)
        total = float(np.sum(acc))
        acc, gone = _shift_add(acc, np.ceil(ks * w / h * (1 + 1e-12)).astype(np.int64), pk, capped)
        if capped:
            acc[-1] += beyond * total
        else:
            over += gone + beyond * total
        j += size
    # the later uses: a law whose survival function bounds theirs
    sf = _chernoff_sf(q, log_c, near, np.arange(LAW_CELLS + 1) * h)
    far = np.maximum(-np.diff(np.concatenate([[1.0], sf])), 0.0)
    idx = np.flatnonzero(far > 0)
    total = float(np.sum(acc))
    acc, gone = _shift_add(acc, idx, far[idx], capped)
    if capped:
        acc[-1] += float(sf[-1]) * total
    else:
        over += gone + float(sf[-1]) * total
    values = np.arange(LAW_CELLS + 1) * h
    keep = acc > 0
    return ShiftLaw(values[keep], acc[keep], min(1.0, over))


MIX_COMPONENTS = 128  # a mixture's distinct shifts (rounded up beyond that)
MU_REVEALED = 30.0  # a component G(mu) with a larger mu is counted as revealing (loss +infinity)


def mixture_pld(law: ShiftLaw, scale: float, d: float, components: int = MIX_COMPONENTS) -> fdp.PLD:
    """The pair "reveal ``S``, then ``N(scale S, 1)`` vs ``N(0, 1)``" (``S`` from ``law``; its mass at
    ``+infinity`` revealed as such): every privacy loss rounded *up* to the grid ``d`` (pessimistic).
    Given ``S`` the loss is ``N(mu^2/2, mu^2)``, ``mu = scale S``, in both directions (symmetric)."""
    probs, mus = mixture_components(law.probs, scale * law.values, components, floor=1e-3)
    probs = np.asarray(probs) * (1.0 - law.over)
    mus = np.asarray(mus)
    huge = ~(mus <= MU_REVEALED)  # as good as revealed: counted at +infinity
    over = law.over + float(np.sum(probs[huge]))
    probs, mus = probs[~huge], mus[~huge]
    pos = mus > 0
    zero_mass = float(np.sum(probs[~pos]))
    if not np.any(pos):
        pmf = pld_pmf.DensePLDPmf(d, 0, np.array([zero_mass]), min(1.0, over), True)
        return pld_lib.PrivacyLossDistribution(pmf)
    p, m = probs[pos], mus[pos]
    mean = m * m / 2
    first = np.floor((mean - 9.5 * m) / d).astype(np.int64)  # each component's own window
    last = np.ceil((mean + 9.5 * m) / d).astype(np.int64)
    lo, hi = min(0, int(first.min())), int(last.max())
    masses = np.zeros(hi - lo + 1)
    inf = over
    for pi, mi, ai, fi, li in zip(p, m, mean, first, last):
        x = np.arange(fi, li + 1) * d
        sf = special.ndtr(-(x - ai) / mi)  # P(L > x); below the window: rounded up to its first point
        masses[fi - lo : li - lo + 1] += pi * -np.diff(np.concatenate([[1.0], sf]))
        inf += pi * float(sf[-1])
    masses[-lo] += zero_mass
    pmf = pld_pmf.DensePLDPmf(d, lo, np.maximum(masses, 0.0), min(1.0, inf), True)
    # its log-MGF for the Chernoff windows of compose_pmfs, in closed form: each Gaussian loss's
    # (lam mu^2/2 + lam^2 mu^2/2), plus lam d for the rounding up (lam > 0); an upper bound, as needed
    lam = _MGF_LAMBDAS
    with np.errstate(over="ignore"):
        mgf = special.logsumexp(
            np.log(np.append(p, max(zero_mass, 1e-300)))[None, :]
            + np.append((lam[:, None] + lam[:, None] ** 2) * (m * m / 2)[None, :], np.zeros((lam.size, 1)), axis=1),
            axis=1,
        )
    _MGF_CACHE[id(pmf)] = (pmf, mgf + np.maximum(lam, 0.0) * d)  # registered for compose_pmfs
    return pld_lib.PrivacyLossDistribution(pmf)


# ============================================ section 15: choosing (k, r, s), the bound, monotone in T
SPLIT_GRID = (0.3, 0.5, 0.65, 0.75, 0.83, 0.89, 0.93, 0.96, 0.98, 0.99)
R_FRACTIONS = (1.0, 0.5, 0.25, 0.1, 0.0)  # the shift absorbed over the last r = ceil(f k) steps (0: r = 1)
K_POINTS = 72
SURROGATE_LAMBDAS = np.geomspace(0.02, 256.0, 32)
SURROGATE_DISCRETIZATION = 1e-2
MAX_ESTIMATE = 1e4  # a cap whose best window is estimated above this epsilon is not composed
SEARCH_COMPONENTS = 48  # the mixture's components in the search (rounded up: only coarser)
SEARCH_DISCRETIZATION = 4e-3  # the local search's exact evaluations (only choose; reported values use the bound's grid)


@dataclass(frozen=True)
class Window:
    """Lemma SI-R's free parameters: the last ``k`` steps are the window, the shift is absorbed over its
    last ``r`` steps, each giving the fraction ``1 - split`` of its noise variance to the shift."""

    k: int
    r: int
    split: float

    def scale(self, log_c: float, z: float, rho: float) -> float:
        """``mu / S``: ``c^k (rho/z) / sqrt((1 - split) sum_{i<r} c^{2i})`` (the optimal allocation)."""
        if log_c == -math.inf:
            return 0.0
        window = self.r if log_c >= 0 else -math.expm1(2 * self.r * log_c) / -math.expm1(2 * log_c)
        return math.exp(self.k * min(log_c, 0.0)) * (rho / z) / math.sqrt((1.0 - self.split) * window)


def _surrogate(
    q, z, relation, log_c, law: ShiftLaw, delta: float, rho: float, k_hi: int
) -> Tuple[Optional[Window], float]:
    """The window ranked best, and its estimate, by an RDP-style estimate (``log E e^{lam L}`` of each
    part, added, converted with ``delta <= e^{Lambda - lam eps} lam^lam / (lam+1)^(lam+1)``): only
    chooses, never reported."""
    lam = SURROGATE_LAMBDAS
    d = SURROGATE_DISCRETIZATION
    conv = lam * np.log(lam) - (lam + 1) * np.log1p(lam) - math.log(delta)
    steps = {}
    for s in SPLIT_GRID + (1.0,):
        try:
            steps[s] = [_log_mgf(pmf, lam) for pmf in _pmfs(step_pld(z * math.sqrt(s), q, relation, d))]
        except fdp.VacuousBound:
            continue
    if 1.0 not in steps:
        return None, math.inf
    ks = np.unique(np.round(np.geomspace(1, max(1, k_hi), K_POINTS)).astype(np.int64))
    # the mixture's log E e^{lam L} = g(x), x = (lam + lam^2) scale^2 / 2, g(x) = log sum_i w_i e^{x S_i^2}:
    # tabulated once (convex, increasing) and interpolated
    probs, mus = mixture_components(law.probs, law.values, 64, floor=1e-3)
    log_w, s2 = np.log(np.asarray(probs)), np.asarray(mus) ** 2
    cands, scales = [], []
    for s in steps:
        if s == 1.0:
            continue
        for f in R_FRACTIONS:
            for k in ks:
                w = Window(int(k), min(max(1, int(math.ceil(f * k))), int(k)), s)
                cands.append(w)
                scales.append(w.scale(log_c, z, rho))
    if not cands:
        return None, math.inf
    x = ((lam + lam * lam) / 2)[None, :] * (np.asarray(scales) ** 2)[:, None]
    top = float(np.max(x)) if x.size else 1.0
    grid = np.concatenate([[0.0], np.geomspace(1e-12, max(top, 1e-12), 3000)])
    with np.errstate(over="ignore", invalid="ignore"):
        table = special.logsumexp(log_w[None, :] + grid[:, None] * s2[None, :], axis=1)
        mix = np.interp(x, grid, table)
    kk = np.array([w.k for w in cands], dtype=float)[:, None]
    rr = np.array([w.r for w in cands], dtype=float)[:, None]
    best = np.full(len(cands), -np.inf)
    with np.errstate(over="ignore", invalid="ignore"):
        for direction in (0, 1):
            part = np.vstack([steps[w.split][direction] for w in cands])
            total = rr * part + (kk - rr) * steps[1.0][direction][None, :] + mix
            eps = np.min((total + conv[None, :]) / lam[None, :], axis=1)
            best = np.maximum(best, np.where(np.isfinite(eps), eps, np.inf))
    i = int(np.argmin(best))
    return (cands[i], float(best[i])) if math.isfinite(best[i]) else (None, math.inf)


LOCAL_FRACTIONS = (0.2, 0.4)  # r/k tried around the surrogate's window
LOCAL_K_FACTORS = (0.8, 0.9, 1.1, 1.25)
LOCAL_R_FACTORS = (0.6, 1.6)


def _local_search(start: Optional[Window], value: Callable[[Window], float]) -> Optional[Window]:
    """An exact local search from the surrogate's window (which tends to favour too large splits):
    its ``k`` with the splits from three below to one above its own and ``r/k`` in
    :data:`LOCAL_FRACTIONS` (and its own ``r``), then ``k`` scaled by :data:`LOCAL_K_FACTORS`, then
    ``r`` by :data:`LOCAL_R_FACTORS`; about 16 evaluations. Returns the best window (any is valid)."""
    if start is None:
        return None
    seen: Dict[Window, float] = {}

    def best_of(windows, current=None):
        for w in windows:
            if w not in seen:
                seen[w] = value(w)
        pool = list(windows) + ([current] if current is not None else [])
        return min(pool, key=lambda w: seen[w])

    def window(k, r, split):
        k = max(1, int(round(k)))
        return Window(k, max(1, min(k, int(round(r)))), split)

    i = SPLIT_GRID.index(start.split) if start.split in SPLIT_GRID else len(SPLIT_GRID) - 1
    splits = SPLIT_GRID[max(0, i - 3) : i + 2]
    best = best_of([start] + [window(start.k, f * start.k, s) for s in splits for f in LOCAL_FRACTIONS])
    best = best_of([window(best.k * f, best.r * f, best.split) for f in LOCAL_K_FACTORS], best)
    best = best_of([window(best.k, best.r * f, best.split) for f in LOCAL_R_FACTORS], best)
    return best if math.isfinite(seen[best]) else None


@dataclass
class _Plan:
    """What one delta needs: per usable cap, the chosen window (T-independent)."""

    caps: List[Tuple[int, float, Optional[Window]]]  # (cap, log_c, window)
    discretization: float  # the grid every PLD of this delta is built on


COMPOSITION_REACH = 2  # the composition is a candidate up to this multiple of the longest window


@dataclass
class PoissonShiftBound(Bound):
    """Lemma SI-R (docs/derivations.md sections 13-15) for a Poisson run, as a function of the number of
    steps that never decreases (``monotone_in_steps``):

        eps(T) = min( comp(T)                                  while T <= 2 max_K k_K,
                      max(eps_K,T(delta'), comp(k_K)(delta))   for each cap K with T > k_K ),

    ``comp`` the composition of the sampled steps (no cap needed), ``eps_K,T`` the window ``k_K`` with
    the drift of the earlier uses as a random shift, conditioned on the cap ``K``
    (``delta' = (delta - p_K(T)) / (1 - p_K(T))``). The caps and each cap's window depend on the run and
    ``delta`` only, never on ``T``; each term is non-decreasing in ``T`` and terms only leave the
    minimum as ``T`` grows, so the minimum is non-decreasing (docs/derivations.md section 15).
    """

    setup: Optional[PoissonSetup] = None
    relation: object = None
    cap_list: Tuple[Tuple[int, float], ...] = ()  # (cap, log c) for every cap of the fixed list
    discretization: float = 1e-3
    kind = "capped"
    _values: Dict = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ pieces
    def _eta(self, delta: float) -> float:
        return 1e-4 * delta

    def _law(self, log_c: float, delta: float) -> ShiftLaw:
        s = self.setup
        cap = None if s.Dn is None else s.Dn * s.z / s.rho
        return shift_law(s.q, log_c, cap=cap, eta=self._eta(delta))

    def _k_hi(self, log_c: float) -> int:
        if log_c >= 0:
            return 10**8
        return int(min(10**12, max(1, math.ceil(40.0 / -log_c))))

    def _exact(self, w: Window, log_c: float, delta: float, d: float, components: int = MIX_COMPONENTS) -> fdp.PLD:
        """The window's PLD: its sampled steps and the mixture of the shifts (cached: independent of T)."""
        s = self.setup

        def make():
            law = self._law(log_c, delta)
            return compose_plds(
                [
                    (step_pld(s.z * math.sqrt(w.split), s.q, self.relation, d), w.r),
                    (step_pld(s.z, s.q, self.relation, d), w.k - w.r),
                    (mixture_pld(law, w.scale(log_c, s.z, s.rho), d, components), 1),
                ]
            )

        key = (s.q, s.z, self.relation, s.Dn, s.rho, w, log_c, float(delta), d, components)
        return _cached(_WINDOW_CACHE, key, 64, make)

    def _comp(self, steps: int, d: float) -> fdp.PLD:
        key = ("comp", steps, d)
        if key not in self._values:
            self._values[key] = self_compose(step_pld(self.setup.z, self.setup.q, self.relation, d), steps)
        return self._values[key]

    def _caps_for(self, delta: float) -> List[Tuple[int, float]]:
        return list(self.cap_list[:1]) if self.free_cap_at(delta) else list(self.cap_list)

    def free_cap_at(self, delta: float) -> bool:
        """Whether the first cap fails with probability below ``FREE_CAP * delta`` even at the length
        :func:`~hidden_state_accountants.calibration.limit_epsilon` certifies: then it is the only cap."""
        s = self.setup
        K, _ = self.cap_list[0]
        return log_cap_failure(s.others, s.q, UNBOUNDED_STEPS, K) <= math.log(FREE_CAP * delta)

    def _plan(self, delta: float) -> _Plan:
        s = self.setup
        key = (
            s.q,
            s.z,
            self.relation,
            self.cap_list,
            self.free_cap_at(delta),
            s.Dn,
            s.rho,
            float(delta),
            self.discretization,
        )
        return _cached(_PLAN_CACHE, key, 256, lambda: self._make_plan(delta))

    def _make_plan(self, delta: float) -> _Plan:
        s = self.setup
        caps, d = [], self.discretization
        for K, log_c in self._caps_for(delta):
            law = self._law(log_c, delta)
            start, estimate = _surrogate(s.q, s.z, self.relation, log_c, law, delta, s.rho, self._k_hi(log_c))
            if not estimate <= MAX_ESTIMATE:  # epsilon in the ten thousands: not worth a PLD
                caps.append((K, log_c, None))
                continue
            # the grid: the base one unless the window's losses span more than ~2e5 of its points
            d_cap = max(self.discretization, (estimate + 50.0) / 2e5)

            # the search's grid: coarser (faster), but fine enough next to the estimate's size
            d_search = max(d_cap, min(SEARCH_DISCRETIZATION, estimate / 200.0))

            def value(w, log_c=log_c, d_search=d_search):  # exact at T = infinity (only chooses)
                try:
                    return grid_epsilon(self._exact(w, log_c, delta, d_search, SEARCH_COMPONENTS), delta)
                except fdp.VacuousBound:
                    return math.inf

            caps.append((K, log_c, _local_search(start, value)))
            d = max(d, d_cap)
        return _Plan(caps, d)

    def _terms(self, delta: float, d: float):
        """``(epsilon, pld, detail)`` of every term of the minimum at this length."""
        s = self.setup
        T = s.steps
        out = []
        plan = self._plan(delta)
        windows = [w.k for _, _, w in plan.caps if w is not None]
        if not windows or T <= COMPOSITION_REACH * max(windows):
            try:
                pld = self._comp(T, d)
                out.append((fdp.pld_epsilon(pld, delta), pld, "tau = 0: the composition of the sampled steps"))
            except fdp.VacuousBound:
                pass
        for K, log_c, w in plan.caps:
            if w is None or T <= w.k:
                continue
            log_p = log_cap_failure(s.others, s.q, T, K)
            p = math.exp(log_p)
            if not p < delta:
                continue
            inner = (delta - p) / (1.0 - p)
            try:
                pld = self._exact(w, log_c, delta, d)
            except fdp.VacuousBound:
                continue
            floor = fdp.pld_epsilon(self._comp(w.k, d), delta)
            e = max(fdp.pld_epsilon(pld, inner), floor)
            where = "the whole window" if w.r == w.k else ("the last step" if w.r == 1 else f"the last {w.r} steps")
            text = (
                f"cap {K} other records per batch (P(exceeded) = {p:.3g}, step Lipschitz {math.exp(log_c):.6g}); "
                f"tau = T - {w.k}, the earlier uses as a random shift absorbed over {where}, split {w.split}"
            )
            out.append((e, with_failure(pld, p), text))
        return out

    def _best(self, delta: float, d: float):
        if not delta >= MIN_DELTA:  # the caps' and shifts' tail probabilities would underflow: infinity is valid
            return None
        key = ("best", float(delta), float(d))
        if key not in self._values:
            terms = self._terms(delta, d)
            self._values[key] = min(terms, key=lambda t: t[0]) if terms else None
        return self._values[key]

    # ------------------------------------------------------------------ Bound API
    def _grid(self, delta: float) -> float:
        return self._plan(delta).discretization if delta >= MIN_DELTA else self.discretization

    def epsilon(self, delta: float) -> float:
        best = self._best(delta, self._grid(delta))
        return math.inf if best is None else best[0]

    def delta(self, epsilon: float) -> float:
        best = self._best(1e-5, self._plan(1e-5).discretization)  # windows tuned for a typical delta; any is valid
        return 1.0 if best is None else fdp.pld_delta(best[1], epsilon)

    def pld(self, delta: float, discretization: float) -> Optional[fdp.PLD]:
        best = self._best(delta, max(discretization, self.discretization))
        return None if best is None else best[1]

    def detail(self, delta: float) -> str:
        if not delta >= MIN_DELTA:
            return f"not computed for delta below {MIN_DELTA:g} (infinity is the bound reported)"
        best = self._best(delta, self._grid(delta))
        if best is None:
            return "no batch-size cap leaves a failure probability below delta"
        return "; ".join((best[2], self.relation.name))


# ====================================================================== the analysis
CAP_LEVELS = (0.5, 0.2, 0.05)  # further caps: the largest with log c_K <= level * log c(0)
MIN_DELTA = 1e-300  # below it the caps' failure budgets (FREE_CAP delta, 1e-4 delta) underflow
FREE_CAP = 1e-3  # a cap failing with probability below this fraction of delta at any length is the only one
CAP_REFUSAL = 1e-3  # refused when even the largest admissible cap fails with a larger probability
SUGGESTED_FAILURE = 1e-10  # the failure probability of the cap behind a suggested learning rate
_PLAN_CACHE: Dict = {}
_WINDOW_CACHE: Dict = {}


def clear_caches() -> None:
    """Empties every cache of this module (benchmarks time cold evaluations)."""
    for cache in (_STEP_CACHE, _LAW_CACHE, _MGF_CACHE, _PLAN_CACHE, _WINDOW_CACHE):
        cache.clear()


def cap_list(s: PoissonSetup, admissible: Callable[[float], bool]) -> List[Tuple[int, float]]:
    """The caps tried, ``(K, log c_K)``, independent of the number of steps (so that the bound is
    monotone in it, section 15): the largest cap with the best contraction ``c_K = c_0``, the largest
    admissible cap, and between them the largest caps with ``log c_K <= f log c_0`` for ``f`` in
    :data:`CAP_LEVELS`. Empty when no cap is admissible."""
    lc = lambda K: log_cap_lipschitz(s.lr, s.m_reg, s.m_data, s.M, s.b, K + 1)

    def largest(ok):  # the largest K in [0, others] with ok(lc(K)) (lc is non-decreasing in K)
        if ok(lc(s.others)):
            return s.others
        lo, hi = 0, s.others
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(lc(mid)) else (lo, mid)
        return lo

    base = lc(0)
    if not admissible(base):
        return []
    picks = {largest(lambda x: x <= base and admissible(x)), largest(admissible)}
    if base < 0:
        for f in CAP_LEVELS:
            picks.add(largest(lambda x, f=f: x <= f * base and admissible(x)))
    return [(K, lc(K)) for K in sorted(picks)]


def _suggested_lr(s: PoissonSetup, strict: bool) -> str:
    """Which learning rate would admit a cap that the batches exceed with probability at most
    :data:`SUGGESTED_FAILURE` over the run: every step with up to ``K + 1`` records contractive
    (``lr M_{K+1} < 2`` and ``lr m_reg < 2``; section 7)."""
    lo, hi = 0, s.others
    if log_cap_failure(s.others, s.q, s.steps, hi) > math.log(SUGGESTED_FAILURE):
        return ""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if log_cap_failure(s.others, s.q, s.steps, mid) <= math.log(SUGGESTED_FAILURE) else (mid, hi)
    K = hi if log_cap_failure(s.others, s.q, s.steps, lo) > math.log(SUGGESTED_FAILURE) else lo
    m_reg = s.m_reg or 0.0
    biggest = m_reg + (K + 1) / s.b * (s.M - m_reg)
    lr = 2.0 / max(biggest, m_reg, 1e-300)
    return (
        f"; a learning rate {'below' if strict else 'up to'} {lr:.4g} would keep every batch of up to "
        f"{K + 1} records contractive, exceeded with probability {SUGGESTED_FAILURE:g} over the run"
    )


def cap_refusal(s: PoissonSetup, admissible: Callable[[float], bool]) -> str:
    """Why no batch-size cap gives a usable bound (with a learning rate that would), or ``""``: none is
    admissible, or even the largest admissible one is exceeded with probability above
    :data:`CAP_REFUSAL` over the run (no useful delta absorbs that)."""
    strict = s.Dn is None
    caps_ = cap_list(s, admissible)
    if not caps_:
        return (
            "no batch-size cap keeps every step map within the theorem's contraction condition (even a batch "
            "of at most one record fails it: lr m_reg must lie in (0, 2) and lr M_1 below 2)" + _suggested_lr(s, strict)
        )
    K_max = caps_[-1][0]
    p_max = math.exp(log_cap_failure(s.others, s.q, s.steps, K_max))
    if p_max > CAP_REFUSAL:
        return (
            f"no batch-size cap works: every batch of more than {K_max + 1} records has an expansive step at "
            f"this learning rate, and one occurs with probability {p_max:.3g} over the {s.steps} steps "
            f"(above {CAP_REFUSAL:g}, no useful delta can absorb it)" + _suggested_lr(s, strict)
        )
    return ""


@analysis(
    "si_poisson",
    SI_CITATION,
    (POISSON,),
    hidden_state=True,
    needs="l2_regularization declared (> 0 without D); every capped batch's step c-Lipschitz with c < 1 "
    "(c <= 1 with D)",
    add_or_remove="native",
)
def si_poisson(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """Lemma SI-R (docs/derivations.md sections 8, 13-15) for Poisson batches, f-DP, both relations.

    The last ``k`` steps are composed as sampled steps (REPLACE_ONE: the antipodal dominating pair,
    section 13; ADD_OR_REMOVE_ONE: the sampled Gaussian), and the distance the earlier uses of the record
    put between the two runs enters as a *random* shift: the pair "reveal ``S``, then
    ``G(scale S)``", ``S = sum_j I_j c^j`` over the record's inclusions before the window (section 14),
    with the shift absorbed by the optimal allocation over the window's last ``r`` steps (section 8).
    Conditions, checked per cap: every step map that can occur given the cap is ``c``-Lipschitz with
    ``c < 1`` without a diameter (this needs ``l2_regularization > 0``), ``c <= 1`` with one; the cap's
    failure probability is added to delta (section 7). The value never decreases with the number of
    steps (section 15).
    """
    s, reason = poisson_setup(run, ctx)
    if s is None:
        return NotApplicable(reason=reason)
    strict = s.Dn is None
    if strict and (s.m_reg is None or s.m_reg <= 0):
        return NotApplicable(reason=NEED_L2 + " or a diameter")
    admissible = (lambda lc: lc < 0) if strict else (lambda lc: lc <= 0)
    refusal = cap_refusal(s, admissible)
    if refusal:
        return NotApplicable(reason=refusal)
    caps_ = cap_list(s, admissible)
    return PoissonShiftBound(
        setup=s,
        relation=ctx.neighboring_relation,
        cap_list=tuple((K, min(lc, 0.0)) for K, lc in caps_),
        discretization=ctx.discretization,
        monotone_in_steps=True,
    )


__all__ = [
    "si_poisson",
    "poisson_setup",
    "caps",
    "log_cap_failure",
    "log_step_lipschitz",
    "si_shift_mu",
    "step_pld",
    "PoissonSetup",
    "capped",
    "shift_law",
    "ShiftLaw",
    "mixture_pld",
    "compose_plds",
    "PoissonShiftBound",
    "Window",
    "cap_list",
    "clear_caches",
]
