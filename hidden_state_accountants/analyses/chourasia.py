"""Chourasia, Ye & Shokri (2021), *Differential Privacy Dynamics of Langevin Diffusion and Noisy GD*.

Full-batch noisy GD (their Algorithm 1): ``theta <- Proj_C(theta - (eta/n) sum_i grad l_i
+ sqrt(2 eta) N(0, sigma^2 I))`` with total gradient sensitivity ``S_g``. From framework
DP-SGD with ``b = n`` (docs/design.md, section 1)::

    sigma^2 = lr z^2 C^2 / (2 n^2),    S_g = 2 C,    K = number of steps.
"""

from __future__ import annotations

import math

import numpy as np

from hidden_state_accountants.analyses import _common as cm
from hidden_state_accountants.analyses.analysis_info import analysis
from hidden_state_accountants.bounds import Bound, NotApplicable, RdpBound
from hidden_state_accountants.events import TrainingRunDpEvent
from hidden_state_accountants.schedules import FULL

CITE = "Chourasia, Ye & Shokri (2021)"


def _sigma2(run: TrainingRunDpEvent) -> float:
    n, C, z, eta = run.dataset_size, run.clip_norm, run.noise_multiplier, run.learning_rate
    return eta * z * z * C * C / (2.0 * n * n)


def required_initial_std(
    *, dataset_size: int, noise_multiplier: float, clip_norm: float, learning_rate: float, strong_convexity: float
) -> float:
    """Per-coordinate std of the initialisation ``N(0, 2 sigma^2 / lambda I)`` that Cor. 1 needs.

    >>> round(required_initial_std(dataset_size=1000, noise_multiplier=1.0, clip_norm=1.0,
    ...                            learning_rate=0.5, strong_convexity=0.5), 6)
    0.001
    """
    sigma2 = learning_rate * noise_multiplier**2 * clip_norm**2 / (2.0 * dataset_size**2)
    return math.sqrt(2.0 * sigma2 / strong_convexity)


@analysis(
    "chourasia_thm2",
    f"{CITE}, Thm 2, eq. (16) (noisy GD, declared LSI constant)",
    (FULL,),
    hidden_state=True,
    needs="a declared LSI constant",
    add_or_remove="sensitivity_c",
)
def thm_2(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """Thm 2, eq. (16): if the coupled tracing diffusions satisfy ``c``-LSI throughout
    (declared as ``LossGeometry(lsi_constant=c)``; not checkable here), then

        eps(alpha) = alpha S_g^2 / (2 c sigma^4 n^2) * (1 - exp(-sigma^2 c eta K)).

    Evaluated as ``alpha S_g^2 eta K / (2 sigma^2 n^2) * h(sigma^2 c eta K)`` with
    ``h(x) = (1 - e^-x)/x`` (``h(0) = 1``), so a vanishing ``c`` (e.g. one that underflows when
    the run is rescaled to clip norm 1) gives the ``c -> 0`` limit, which is larger.
    """
    reason = cm.hidden_state_preconditions(run)
    if not reason and run.geometry.lsi_constant is None:
        reason = "needs a declared log-Sobolev constant (LossGeometry(lsi_constant=...))"
    if reason:
        return NotApplicable(reason=reason)
    c, s2, n, sg = run.geometry.lsi_constant, _sigma2(run), run.dataset_size, 2.0 * run.clip_norm
    orders = np.asarray(ctx.orders, dtype=float)
    eta_k = run.learning_rate * float(run.steps)
    x = s2 * c * eta_k
    h = 1.0 if x == 0 else -math.expm1(-x) / x
    with np.errstate(divide="ignore", over="ignore"):
        vals = orders * (sg * sg * eta_k / (2.0 * n * n)) / s2 * h if s2 > 0 else np.full(len(orders), np.inf)
    return RdpBound(orders=ctx.orders, values=vals, note=f"LSI constant {c:g} as declared", monotone_in_steps=True)


@analysis(
    "chourasia_cor1",
    f"{CITE}, Cor. 1 (noisy GD, strongly convex)",
    (FULL,),
    hidden_state=True,
    needs="m > 0, lr < 1/M, Gaussian initialisation",
    add_or_remove="sensitivity_c",
)
def cor_1(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """Cor. 1 (Lemma 5 + Thm 2): ``lambda``-strongly convex, ``beta``-smooth, ``eta < 1/beta``,
    ``theta_0 ~ Proj_C(N(0, 2 sigma^2/lambda I))`` (declared with ``gaussian_initialization``)::

        eps(alpha) = alpha S_g^2 / (lambda sigma^2 n^2) * (1 - exp(-lambda eta K / 2)).
    """
    reason = cm.hidden_state_preconditions(run)
    if not reason:
        reason = cm.first_reason(
            cm.need_strong_convexity(run),
            cm.lr_below(run, 1.0 / run.geometry.smoothness, "1/beta"),
            None
            if run.gaussian_initialization
            else (
                "needs the Gaussian initialisation theta_0 ~ N(0, 2 sigma^2/lambda I) "
                "(declare gaussian_initialization=True; see required_initial_std)"
            ),
        )
    if reason:
        return NotApplicable(reason=reason)
    lam, s2, n, sg = run.geometry.strong_convexity, _sigma2(run), run.dataset_size, 2.0 * run.clip_norm
    orders = np.asarray(ctx.orders, dtype=float)
    vals = orders * sg * sg / (lam * s2 * n * n) * (-math.expm1(-lam * run.learning_rate * run.steps / 2.0))
    return RdpBound(orders=ctx.orders, values=vals, monotone_in_steps=True)
