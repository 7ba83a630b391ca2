"""Altschuler & Talwar (2022), *Privacy of Noisy SGD: More Iterations without More Privacy Loss*.

Projected noisy SGD ``w <- Proj_K(w - eta (G + Z))``, ``Z ~ N(0, sigma^2 I)``, on convex,
``L``-Lipschitz, ``M``-smooth losses over a convex set of diameter ``D`` with ``eta <= 2/M``
and batches of ``b`` drawn without replacement afresh each step. Eq. (3.3), from the
proof of Thm 3.1, holds at every order ``alpha > 1`` (the restrictions in Thm 3.1 only
serve the asymptotic Lemma 2.6)::

    eps(alpha) <= min_tau  (T - tau) S_alpha(b/n, b sigma_2 / (2L))
                          + alpha D^2 / (2 eta^2 sigma_1^2 (T - tau)),   sigma_1^2 + sigma_2^2 = sigma^2

From framework DP-SGD (docs/design.md, section 1): ``sigma = z C / b``, Lipschitz ``L = C``
(per-example updates differ by at most ``2C``), so the sampled-Gaussian noise multiplier is
``b sigma_2 / (2C) = z sqrt(s) / 2`` with ``s = sigma_2^2 / sigma^2``. ``S_alpha`` is taken
from dp_accounting's sampled-Gaussian RDP, which bounds both directions of the mixture
(:func:`hidden_state_accountants.rdp.sampled_gaussian_rdp`).
"""

from __future__ import annotations

import math

import numpy as np

from hidden_state_accountants import rdp as rdp_tools
from hidden_state_accountants.analyses import _common as cm
from hidden_state_accountants.analyses import poisson_hidden_state as ph
from hidden_state_accountants.analyses.analysis_info import analysis
from hidden_state_accountants.analyses.composition import poisson_replace_one_rdp
from hidden_state_accountants.bounds import Bound, NotApplicable, RdpBound
from hidden_state_accountants.events import TrainingRunDpEvent
from hidden_state_accountants.relations import ADD_OR_REMOVE_ONE, sensitivity_factor
from hidden_state_accountants.schedules import WITHOUT_REPLACEMENT

CITE = "Altschuler & Talwar (2022)"
# Fractions s = sigma_2^2 / sigma^2 tried for the noise split; any split is valid.
SPLITS = (0.1, 0.3, 0.5, 0.7, 0.9)


@analysis(
    "altschuler_talwar_eq3.3",
    f"{CITE}, eq. (3.3) / Thm 3.1 (projected noisy SGD)",
    (WITHOUT_REPLACEMENT,),
    hidden_state=True,
    needs="D, lr <= 2/M",
)
def eq_3_3(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """Eq. (3.3) minimised, per order, over ``tau`` (exactly, via the convex objective in
    ``k = T - tau``) and over the noise split (on the grid :data:`SPLITS`)."""
    reason = cm.hidden_state_preconditions(run)
    if not reason:
        reason = cm.first_reason(
            cm.need_diameter(run),
            cm.lr_below(run, 2.0 / run.geometry.smoothness, "2/M", strict=False),
        )
    if reason:
        return NotApplicable(reason=reason)

    orders = np.asarray(ctx.orders, dtype=float)
    q = run.sampling_rate
    z, eta, D, T = run.noise_multiplier, run.learning_rate, run.geometry.diameter, run.steps
    sigma = z * run.clip_norm / run.batch_size
    sigma2 = sigma * sigma  # inf for huge noise (** would raise)
    best = np.full(len(orders), math.inf)
    best_k = np.zeros(len(orders))
    for s in SPLITS:
        per_step = rdp_tools.sampled_gaussian_rdp(q, z * math.sqrt(s) / 2.0, orders)
        shift = orders * D * D / (2.0 * eta * eta * (1.0 - s) * sigma2)  # times 1/k
        with np.errstate(divide="ignore", invalid="ignore"):
            k_star = np.sqrt(shift / per_step)
        for k in (np.floor(k_star), np.ceil(k_star)):
            k = np.clip(np.nan_to_num(k, nan=T, posinf=T), 1, T)
            value = k * per_step + shift / k
            better = value < best
            best = np.where(better, value, best)
            best_k = np.where(better, k, best_k)
    note = f"T - tau between {int(best_k.min())} and {int(best_k.max())} across orders"
    return RdpBound(orders=ctx.orders, values=best, note=note)


# ------------------------------------------------------------------ Poisson sampling (section 9)
def sampled_step_rdp(z: float, q: float, relation, orders) -> np.ndarray:
    """RDP of one Poisson-sampled step (noise multiplier ``z`` relative to one record's clip norm).

    ADD_OR_REMOVE_ONE: the sampled Gaussian's RDP (Mironov, Talwar & Zhang 2019 via dp_accounting;
    it bounds both directions). REPLACE_ONE: the pair ``(1-q)N(0)+qN(w1)`` vs ``(1-q)N(0)+qN(w2)``,
    the package's :func:`~hidden_state_accountants.analyses.composition.poisson_replace_one_rdp`
    (joint convexity over the inclusion, and Mironov's weak triangle inequality through the dataset
    holding both records; docs/derivations.md section 9)."""
    orders = np.asarray(orders, dtype=float)
    if relation == ADD_OR_REMOVE_ONE:
        return rdp_tools.sampled_gaussian_rdp(q, z, orders)
    return poisson_replace_one_rdp(q, z, orders)


def poisson_rdp_curve(*, q: float, z: float, steps: int, log_c: float, Dn, relation, orders):
    """Lemma SI in Rényi form (docs/derivations.md section 9), minimised per order over ``k = T - tau``, the
    split ``s`` and where the shift is absorbed (``r = 1`` or ``r = k``)::

        eps(a) <= (k - r) S(z) + r S(z sqrt(s)) + a mu(k, r, s)^2 / 2,

    ``S`` from :func:`sampled_step_rdp`, ``mu`` from
    :func:`~hidden_state_accountants.analyses.poisson_hidden_state.si_shift_mu`. With ``c = 1``,
    ``r = k``, ``Z = D`` this is the form of eq. (3.3): ``(T - tau) S + a D^2 / (2 eta^2 sigma_1^2 (T - tau))``.
    """
    orders = np.asarray(orders, dtype=float)
    rho = sensitivity_factor(relation)
    T = steps
    ks = np.unique(np.concatenate([np.round(np.geomspace(1, T, 300)), [T]]).astype(np.int64)).astype(float)
    full = sampled_step_rdp(z, q, relation, orders)
    best = np.full(orders.shape, math.inf)
    best_k = np.full(orders.shape, float(T))
    for split in ph.SPLITS:
        part = sampled_step_rdp(z * math.sqrt(split), q, relation, orders)
        for mode in ("last", "spread"):
            r = np.ones_like(ks) if mode == "last" else ks.copy()
            mu = ph.si_shift_mu(k=ks, r=r, split=split, steps=T, log_c=log_c, z=z, Dn=Dn, rho=rho)
            with np.errstate(invalid="ignore", over="ignore"):
                vals = (
                    (ks - r)[:, None] * full[None, :]
                    + r[:, None] * part[None, :]
                    + orders[None, :] * mu[:, None] ** 2 / 2
                )
            vals[ks == T] = T * full  # tau = 0: plain composition
            vals = np.where(np.isnan(vals), np.inf, vals)
            i = np.argmin(vals, axis=0)
            v = vals[i, np.arange(len(orders))]
            better = v < best
            best_k = np.where(better, ks[i], best_k)
            best = np.where(better, v, best)
    return best, f"T - tau between {int(best_k.min())} and {int(best_k.max())} across orders"


@analysis(
    "altschuler_talwar_eq3.3_poisson",
    f"{CITE}, eq. (3.3) form for Poisson batches, re-derived through Lemma SI in Rényi form "
    "(docs/derivations.md section 9); batch-size cap (sections 6-7)",
    ("poisson",),
    hidden_state=True,
    needs="D or l2_regularization > 0; capped batches' steps non-expansive (contractive without D)",
    add_or_remove="native",
)
def eq_3_3_poisson(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """The Rényi form of eq. (3.3) for Poisson batches (section 9), conditioned on the batch-size cap.

    Reported only as (epsilon, delta) / PLD through the conditional curve with the cap's failure
    probability added to delta: an RDP curve is exposed only when no cap is needed (section 7)."""
    s, reason = ph.poisson_setup(run, ctx)
    if s is None:
        return NotApplicable(reason=reason)
    strict = s.Dn is None
    if strict and (s.m_reg is None or s.m_reg <= 0):
        return NotApplicable(reason=ph.NEED_L2 + " or a diameter")
    admissible = (lambda lc: lc < 0) if strict else (lambda lc: lc <= 0)

    def inner(c) -> Bound:
        vals, note = poisson_rdp_curve(
            q=s.q,
            z=s.z,
            steps=s.steps,
            log_c=min(c.log_c, 0.0),
            Dn=s.Dn,
            relation=ctx.neighboring_relation,
            orders=ctx.orders,
        )
        return RdpBound(orders=ctx.orders, values=vals, note=note)

    return ph.capped(run, ctx, s, admissible, inner)
