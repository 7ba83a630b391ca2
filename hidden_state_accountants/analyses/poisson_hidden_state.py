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
(section 7; :class:`~hidden_state_accountants.bounds.CappedBound`). Every cap gives a valid bound;
the candidates tried are the largest admissible cap and, per delta, the smallest caps whose failure
probability is a small fraction of delta (section 7).

This module holds that machinery and the package's own analysis, **Lemma SI** (f-DP,
docs/derivations.md section 8): shifted interpolation (Bok, Su & Altschuler, *Shifted Interpolation for
Differential Privacy*, ICML 2024, arXiv:2403.00278, Lemma 3.2 / Thm 3.3) with the auxiliary process
driven by the first run's step maps, so the differing record enters only through each step's
sampled pair::

    T(X_T, X'_T) >= g(1)^{(x)(k-r)} (x) g(s)^{(x) r} (x) G(mu),
    mu = c^k Z / ( sqrt(1-s) sqrt(sum_{i<r} c^{2i}) ),   Z = min(Dn, (rho/z)(1 - c^tau)/(1 - c)),

for any ``k = T - tau``, ``r <= k`` and split ``s``, in units of the step noise ``lr z C/b``
(``Dn = D b/(lr z C)``, ``rho = 2`` under REPLACE_ONE, ``1`` under ADD_OR_REMOVE_ONE). The per-step
pair ``g`` is the Poisson replace-one profile (Balle, Barthe & Gaboardi, NeurIPS 2018, Thm 2;
:func:`hidden_state_accountants.fdp.poisson_replace_one_profile`) or, under ADD_OR_REMOVE_ONE,
dp_accounting's sampled Gaussian with both directions. ``tau = 0`` is plain composition, so the
bound is never worse than the composition of the same per-step pair. Bok et al.'s Thms 4.9/4.10
with ``p = q`` are corollaries (section 8) and add nothing over it, so they are not registered for
Poisson. The Rényi form ([AT] eq. (3.3), section 9) lives in :mod:`.altschuler_talwar`, the Poisson form of
Ye & Shokri's Thm 4.3 (section 10) in :mod:`.ye_shokri`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import fft as sfft
from scipy import special, stats

from hidden_state_accountants import fdp
from hidden_state_accountants.analyses import _common as cm
from hidden_state_accountants.analyses.analysis_info import analysis
from hidden_state_accountants.bounds import Bound, Cap, CappedBound, NotApplicable, PldBound
from hidden_state_accountants.events import TrainingRunDpEvent
from hidden_state_accountants.relations import ADD_OR_REMOVE_ONE, REPLACE_ONE, sensitivity_factor
from hidden_state_accountants.schedules import POISSON

BOK = "Bok, Su & Altschuler (ICML 2024, arXiv:2403.00278)"
SI_CITATION = (f"Lemma SI (docs/derivations.md section 8): shifted interpolation after {BOK} Lemma 3.2 / Thm 3.3 with "
               "sampled steps; batch-size cap with its failure probability added to delta (sections 6-7)")

# Fractions of delta the cap's failure probability may use; the largest admissible cap is always tried.
CAP_FRACTIONS = (1e-3, 1e-1, 0.5)
# The deltas the cap candidates are tuned for (any cap is valid at every delta).
CAP_DELTAS = (1e-3, 1e-5, 1e-7, 1e-9)
# Noise splits s = sigma_2^2 / sigma^2 (the part given to the sampled steps that absorb the shift).
SPLITS = (0.1, 0.25, 0.5, 0.75, 0.9)
# Window lengths k scanned by the CLT estimate (only chooses; the chosen ones are composed exactly).
K_GRID = 240

NEED_L2 = ("needs l2_regularization > 0 declared (under Poisson sampling a step may have an empty batch, "
           "which contracts only through the L2 term: 1 - lr m_reg)")


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
    log_sf = float(stats.binom.logsf(cap, others, q))
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


def log_step_lipschitz(lr: float, m_reg: Optional[float], m_data: float, M: float, b: float, k: float) -> float:
    """``log`` of the Lipschitz constant of ``theta -> theta - lr (m_reg theta + (1/b) sum_{k records} d_i)``
    (Bok et al. Lemma 2.8 for the sum, section 6): the Jacobian's spectrum lies in
    ``[1 - lr (m_reg + (k/b)(M - m_reg)), 1 - lr (m_reg + (k/b) m_data)]``. With ``m_reg`` unknown
    (``None``): ``max(1, |1 - lr max(1, k/b) M|)``, valid for every ``m_reg`` in ``[0, m]``."""
    if m_reg is None:
        return max(0.0, cm.log_abs_one_minus(lr * max(1.0, k / b) * M))
    lo = lr * (m_reg + (k / b) * m_data)
    hi = lr * (m_reg + (k / b) * (M - m_reg))
    return max(cm.log_abs_one_minus(lo), cm.log_abs_one_minus(hi))


def log_cap_lipschitz(lr, m_reg, m_data, M, b, max_batch) -> float:
    """Largest step Lipschitz constant (log) over batch sizes ``0..max_batch``: ``|1 - lr(u + k v)|``
    is convex in ``k``, so the maximum sits at an end (section 6)."""
    return max(log_step_lipschitz(lr, m_reg, m_data, M, b, 0.0),
               log_step_lipschitz(lr, m_reg, m_data, M, b, float(max_batch)))


def caps(others: int, q: float, steps: int, *, lr: float, m_reg: Optional[float], m_data: float, M: float,
         b: float, admissible: Callable[[float], bool], deltas: Sequence[float] = CAP_DELTAS) -> List[Cap]:
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
    m_reg: Optional[float]
    m_data: float
    M: float
    lr: float
    z: float
    steps: int
    others: int          # records common to both datasets
    Dn: Optional[float]  # diameter in units of the step noise
    rho: float           # one record's effect on a step, in units of the step noise times z


def poisson_setup(run: TrainingRunDpEvent, ctx: cm.Context) -> Tuple[Optional[PoissonSetup], str]:
    """The setup, or ``None`` and the reason no Poisson hidden-state analysis applies."""
    reason = cm.hidden_state_preconditions(run)
    if reason:
        return None, reason
    g = run.geometry
    m_reg = run.l2_regularization
    if m_reg is not None and m_reg > g.strong_convexity:
        return None, (f"l2_regularization {m_reg:g} exceeds the declared strong_convexity {g.strong_convexity:g}; "
                      "the declared geometry must include the L2 term")
    m_data = g.strong_convexity - m_reg if m_reg is not None else 0.0
    n, b = run.dataset_size, run.batch_size
    relation = ctx.neighboring_relation
    others = n - 1 if relation == REPLACE_ONE else n  # the larger dataset, conservatively
    C = run.clip_norm
    Dn = None if g.diameter is None else g.diameter * b / (run.learning_rate * run.noise_multiplier * C)
    return PoissonSetup(n=n, b=b, q=run.sampling_rate, m_reg=m_reg, m_data=m_data, M=g.smoothness, lr=run.learning_rate,
                        z=run.noise_multiplier, steps=run.steps, others=others, Dn=Dn,
                        rho=sensitivity_factor(relation)), ""


def capped(run: TrainingRunDpEvent, ctx: cm.Context, setup: PoissonSetup, admissible: Callable[[float], bool],
           inner_for_cap: Callable[[Cap], Bound]) -> Bound:
    """A :class:`CappedBound` over the candidate caps, each with ``inner_for_cap(cap)``."""
    s = setup
    cands, reasons = [], []
    for c in caps(s.others, s.q, s.steps, lr=s.lr, m_reg=s.m_reg, m_data=s.m_data, M=s.M, b=s.b,
                  admissible=admissible):
        inner = inner_for_cap(c)
        if inner.applicable:
            cands.append((c, inner))
        else:
            reasons.append(inner.reason)
    if not cands:
        return NotApplicable(reason=reasons[0] if reasons else (
            "no batch-size cap keeps every step map within the theorem's contraction condition (even an empty "
            "batch fails it: lr m_reg must lie in (0, 2))"))
    estimates = tuple(getattr(inner, "estimate", None) for _, inner in cands)
    return CappedBound(candidates=tuple(cands), relation=ctx.neighboring_relation.name, estimates=estimates)


# ====================================================== section 8: PLD helpers for Lemma SI
_STEP_CACHE: Dict = {}


def sampled_step_pld(z: float, q: float, relation, d: float) -> fdp.PLD:
    """One sampled step, noise multiplier ``z`` relative to one record's clip norm: REPLACE_ONE, the
    Poisson replace-one profile (symmetric); ADD_OR_REMOVE_ONE, dp_accounting's Poisson-subsampled
    Gaussian (both directions, the exact pair: section 8). Cached (PLDs are immutable)."""
    key = (float(z), float(q), relation, float(d))
    if key not in _STEP_CACHE:
        if len(_STEP_CACHE) > 64:
            _STEP_CACHE.clear()
        if relation == ADD_OR_REMOVE_ONE:
            _STEP_CACHE[key] = pld_lib.from_gaussian_mechanism(
                standard_deviation=z, sensitivity=1.0, pessimistic_estimate=True,
                value_discretization_interval=d, sampling_prob=q)
        else:
            _STEP_CACHE[key] = fdp.pld_from_profile(fdp.poisson_replace_one_profile(z, q), d)
    return _STEP_CACHE[key]


def gaussian_pld(mu: float, d: float) -> fdp.PLD:
    """Pessimistic connect-the-dots PLD of ``G(mu)`` from its exact profile on ``[-E, E]``,
    vectorised (Doroshenko et al., *Connect the Dots*, PETS 2022, arXiv:2207.04380, Alg. 1);
    ``delta(E) <= 1e-20`` goes to ``+infinity``. Outside ``[1e-4, 25]`` the package's envelope."""
    if mu <= 0:
        return pld_lib.identity(value_discretization_interval=d)
    if not 1e-4 <= mu <= 25:
        return fdp.gaussian_pld(mu, d)
    E = mu * mu / 2 + 9.3 * mu  # Phi(-E/mu + mu/2) <= 1e-20
    k = max(1, int(math.ceil(E / d)))
    eps = np.arange(-k, k + 1) * d
    deltas = np.minimum.accumulate(np.clip(fdp.gdp_delta(mu, eps), 0.0, 1.0))
    return _connect_dots(d, -k, deltas)


def _connect_dots(d: float, lower: int, deltas: np.ndarray) -> fdp.PLD:
    """Connect-the-dots masses from a convex profile at ``eps = (lower + i) d``; rounding can make a few
    masses ~-1e-16: set to 0, which only raises every ``delta(eps)``."""
    ed = math.exp(d)
    diff = np.diff(deltas)
    probs = np.empty(deltas.size)
    probs[0] = (1 - deltas[0]) + diff[0] / (ed - 1)
    probs[1:-1] = (diff[1:] - ed * diff[:-1]) / (ed - 1)
    probs[-1] = diff[-1] / (math.exp(-d) - 1)
    pmf = pld_pmf.DensePLDPmf(d, lower, np.maximum(probs, 0.0), float(deltas[-1]), True)
    return pld_lib.PrivacyLossDistribution(pmf)


def _self_compose_pmf(pmf, k: int, tail: float = 1e-15):
    """dp_accounting's ``DensePLDPmf.self_compose`` (FFT power, Chernoff truncation of both tails moved
    to +infinity) with the Chernoff bounds' log-MGFs in one vectorised pass (same semantics, faster)."""
    if not isinstance(pmf, pld_pmf.DensePLDPmf) or k == 1:
        return pmf.self_compose(k, tail)
    probs = np.asarray(pmf._probs, dtype=float)  # noqa: SLF001
    n = probs.size
    orders = np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / n
    with np.errstate(divide="ignore"):
        logp = np.log(np.where(probs > 0, probs, 0.0))
    lm = special.logsumexp(orders[:, None] * np.arange(n)[None, :] + logp[None, :], axis=1)
    upper, lower = (n - 1) * k, 0
    for o, l in zip(orders, lm):
        bound = (k * l + math.log(2 / tail)) / o
        if o > 0:
            upper = min(upper, math.ceil(bound))
        else:
            lower = max(lower, math.floor(bound))
    out_len = upper - lower + 1
    fast_len = sfft.next_fast_len(max(out_len, n))
    conv = np.real(sfft.ifft(sfft.fft(probs, fast_len) ** k))
    out = np.roll(conv, -lower)[:out_len]
    inf_prob = tail - math.expm1(k * math.log1p(-pmf._infinity_mass))  # noqa: SLF001
    return pld_pmf.DensePLDPmf(pmf._discretization, pmf._lower_loss * k + lower, out, inf_prob,  # noqa: SLF001
                               pmf._pessimistic_estimate)  # noqa: SLF001


def self_compose(pld: fdp.PLD, k: int) -> fdp.PLD:
    """``pld.self_compose(k)`` with the faster per-direction step."""
    rem = _self_compose_pmf(pld._pmf_remove, k)  # noqa: SLF001
    if pld._symmetric:  # noqa: SLF001
        return pld_lib.PrivacyLossDistribution(rem)
    return pld_lib.PrivacyLossDistribution(rem, _self_compose_pmf(pld._pmf_add, k))  # noqa: SLF001


def grid_epsilon(pld: fdp.PLD, delta: float) -> float:
    """An upper bound on the PLD's epsilon at ``delta`` (smallest grid loss meeting it), vectorised;
    only chooses between candidates (the reported value is dp_accounting's)."""
    out = 0.0
    for pmf in (pld._pmf_remove, pld._pmf_add):  # noqa: SLF001
        if not isinstance(pmf, pld_pmf.DensePLDPmf):
            return fdp.pld_epsilon(pld, delta)
        p = np.asarray(pmf._probs, dtype=float)  # noqa: SLF001
        inf = pmf._infinity_mass  # noqa: SLF001
        if inf > delta:
            return math.inf
        loss = (pmf._lower_loss + np.arange(p.size)) * pmf._discretization  # noqa: SLF001
        tail_p = np.concatenate([np.cumsum(p[::-1])[::-1][1:], [0.0]])
        w = p * np.exp(-(loss - loss[-1]))
        tail_w = np.concatenate([np.cumsum(w[::-1])[::-1][1:], [0.0]])
        dl = inf + tail_p - np.exp(loss - loss[-1]) * tail_w
        ok = np.flatnonzero(dl <= delta)
        out = max(out, float(loss[ok[0]]) if ok.size else math.inf)
    return max(out, 0.0)


# ====================================================== section 8: Lemma SI
def si_shift_mu(*, k, r, split: float, steps: int, log_c: float, z: float, Dn: Optional[float],
                rho: float) -> np.ndarray:
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


def _clt_sq(z: float, q: float, rho: float) -> float:
    """Squared CLT estimate of one sampled step's GDP parameter, capped by the unsampled one (only
    chooses parameters and grids)."""
    mu = rho / z
    with np.errstate(over="ignore"):
        clt = float(fdp.subsampled_gaussian_clt_mu(mu, q, 1)) ** 2
    return min(clt, mu * mu) if math.isfinite(clt) else mu * mu


def si_family(*, q: float, z: float, steps: int, log_c: float, Dn: Optional[float], relation,
              base_discretization: float) -> Tuple[Optional[Tuple[Callable, float, float]], str]:
    """Lemma SI as a family of f-DP bounds over ``(k, r, split)``: the CLT picks three candidates,
    each composed exactly as a pessimistic PLD. Returns ``((build, d_min, estimate), "")`` or
    ``(None, reason)``."""
    rho = sensitivity_factor(relation)
    T = steps
    ks = np.unique(np.round(np.geomspace(1, T, K_GRID)).astype(np.int64)).astype(float)
    best = []
    h_full = _clt_sq(z, q, rho)
    for split in SPLITS:
        h_split = _clt_sq(z * math.sqrt(split), q, rho)
        for mode in ("last", "spread"):
            r = np.ones_like(ks) if mode == "last" else ks.copy()
            mu = si_shift_mu(k=ks, r=r, split=split, steps=T, log_c=log_c, z=z, Dn=Dn, rho=rho)
            with np.errstate(invalid="ignore", over="ignore"):
                approx = np.sqrt(np.where(ks > r, (ks - r) * h_full, 0.0) + r * h_split + mu ** 2)
            approx = np.where(np.isfinite(approx), approx, np.inf)
            i = int(np.argmin(approx))
            best.append((float(approx[i]), int(ks[i]), mode, split))
    best.sort()
    est, k0, mode, split = best[0]
    if not math.isfinite(est) or est > fdp.MU_MAX_PLD:
        return None, fdp.TOO_LARGE
    d_min = fdp.discretization_for(est, base_discretization)
    if d_min is None:
        return None, fdp.TOO_LARGE
    cands = sorted({(int(min(T, max(1, round(k0 * f)))), mode, split) for f in (0.7071, 1.0, 1.4142)})

    def fixed(k, mode_, sp, d):
        if k == T:  # tau = 0: nothing to shift, the whole noise goes to the sampled steps
            return self_compose(sampled_step_pld(z, q, relation, d), T)
        r = 1 if mode_ == "last" else k
        mu = float(si_shift_mu(k=k, r=r, split=sp, steps=T, log_c=log_c, z=z, Dn=Dn, rho=rho)[0])
        out = self_compose(sampled_step_pld(z * math.sqrt(sp), q, relation, d), r)
        if k - r > 0:
            out = out.compose(self_compose(sampled_step_pld(z, q, relation, d), k - r))
        if mu > 0:
            out = out.compose(gaussian_pld(mu, d))
        return out

    plds: Dict = {}

    def build(delta, d):
        choice = None
        for k, mode_, sp in cands:
            key = (k, mode_, sp, d)
            if key not in plds:
                try:
                    plds[key] = fixed(k, mode_, sp, d)
                except fdp.VacuousBound:
                    plds[key] = None
            e = grid_epsilon(plds[key], delta) if plds[key] is not None else math.inf
            if choice is None or e < choice[0]:
                choice = (e, key)
        k, mode_, sp, _ = choice[1]
        where = "the last step" if mode_ == "last" else "the whole window"
        return plds[choice[1]], f"tau = T - {k}, shift absorbed over {where}, split {sp}"

    return (build, d_min, est), ""


@analysis("si_poisson", SI_CITATION, (POISSON,), hidden_state=True,
          needs="l2_regularization > 0 (or D), every capped batch's step c-Lipschitz with c < 1 (c <= 1 with D)",
          add_or_remove="native")
def si_poisson(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """Lemma SI (docs/derivations.md section 8) for Poisson batches, f-DP, both relations.

    Conditions, checked per cap: every step map that can occur given the cap (at most ``K + 1``
    records over the divisor ``b``) is ``c``-Lipschitz with ``c < 1`` without a diameter (this needs
    ``l2_regularization > 0``: an empty batch contracts only through it), ``c <= 1`` with one.
    The bound is conditioned on the cap and its failure probability is added to delta (section 7).
    """
    s, reason = poisson_setup(run, ctx)
    if s is None:
        return NotApplicable(reason=reason)
    strict = s.Dn is None
    if strict and (s.m_reg is None or s.m_reg <= 0):
        return NotApplicable(reason=NEED_L2 + " or a diameter")
    admissible = (lambda lc: lc < 0) if strict else (lambda lc: lc <= 0)

    def inner(c: Cap) -> Bound:
        fam, why = si_family(q=s.q, z=s.z, steps=s.steps, log_c=min(c.log_c, 0.0), Dn=s.Dn,
                             relation=ctx.neighboring_relation, base_discretization=ctx.discretization)
        if fam is None:
            return NotApplicable(reason=why)
        build, d_min, est = fam
        out = PldBound(build=build, discretization=d_min)
        out.estimate = est
        return out

    return capped(run, ctx, s, admissible, inner)


__all__ = ["si_poisson", "poisson_setup", "caps", "log_cap_failure", "log_step_lipschitz", "si_shift_mu",
           "sampled_step_pld", "PoissonSetup", "capped"]
