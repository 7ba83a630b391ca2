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
from hidden_state_accountants.analyses.registry import analysis
from hidden_state_accountants.bounds import Bound, NotApplicable, RdpBound
from hidden_state_accountants.events import TrainingRunDpEvent
from hidden_state_accountants.schedules import WITHOUT_REPLACEMENT

CITE = "Altschuler & Talwar (2022)"
# Fractions s = sigma_2^2 / sigma^2 tried for the noise split; any split is valid.
SPLITS = (0.1, 0.3, 0.5, 0.7, 0.9)


@analysis(
    "altschuler_talwar_eq3.3", f"{CITE}, eq. (3.3) / Thm 3.1 (projected noisy SGD)", (WITHOUT_REPLACEMENT,),
    hidden_state=True, needs="D, lr <= 2/M")
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
