"""Composition baselines (every iterate released), under REPLACE_ONE or ADD_OR_REMOVE_ONE.

Bok et al.'s Thms 4.1/4.4/4.8 (in :mod:`.bok`) cover full, cyclic and
sampling-without-replacement batches as exact GDP/f-DP compositions. This module adds the
baselines that come from dp_accounting and the Poisson schedule, and translates standard
``dp_accounting`` events into bounds so a training run can be composed with them.

Sensitivity convention: a ``GaussianDpEvent(z)`` adds ``N(0, (zC)^2)`` to a sum of values
of norm ``<= C`` (dp_event's docstring); replacing one record changes the sum by up to
``2C``, so the event is ``G(2/z)``. (dp_accounting 0.4.3's PLD accountant uses sensitivity
``C`` under REPLACE_ONE, the newest uses ``2C``; we follow the docstring, the larger.)

Under ADD_OR_REMOVE_ONE (``ctx.neighboring_relation``) the sensitivity is ``C``: a
``GaussianDpEvent(z)`` is ``G(1/z)``, a Poisson-sampled Gaussian is dp_accounting's own
add/remove PLD (add and remove directions composed separately, the exact object for this
relation: docs/derivations.md section 8, section 11) and RDP; sampling without replacement has no
add/remove statement (as in dp_accounting) and is refused.
"""

from __future__ import annotations

import math
import numbers
from collections import Counter
from typing import List

import numpy as np
from dp_accounting import dp_event

from hidden_state_accountants import fdp
from hidden_state_accountants import validation as v
from hidden_state_accountants import rdp as rdp_tools
from hidden_state_accountants.analyses import _common as cm
from hidden_state_accountants.analyses.analysis_info import analysis
from hidden_state_accountants.bounds import Bound, GdpBound, NotApplicable, PldBound, RdpBound
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from hidden_state_accountants.events import TrainingRunDpEvent
from hidden_state_accountants.relations import ADD_OR_REMOVE_ONE
from hidden_state_accountants.schedules import POISSON, WITHOUT_REPLACEMENT

from hidden_state_accountants.analyses import long_composition as lc

POISSON_PLD_CITATION = "Balle, Barthe & Gaboardi (2018), Thm 2 (Poisson, REPLACE_ONE), composed as a PLD"
POISSON_AR_PLD_CITATION = (
    "Poisson-subsampled Gaussian, ADD_OR_REMOVE_ONE: dp_accounting's PLD "
    "(from_gaussian_mechanism with sampling_prob, both directions), composed"
)
POISSON_AR_RDP_CITATION = (
    "Mironov, Talwar & Zhang (2019), sampled Gaussian mechanism RDP (dp_accounting), ADD_OR_REMOVE_ONE, composed"
)
POISSON_RDP_CITATION = (
    "Mironov (2017) Prop. 11 (weak triangle inequality) over the add/remove "
    "sampled-Gaussian RDP of Mironov, Talwar & Zhang (2019); Ye & Shokri (2022) Lemma 4.1 "
    "(joint convexity); Poisson, REPLACE_ONE"
)


@analysis(
    "composition_wor_rdp",
    "Wang, Balle & Kasiviswanathan (2019), Thm 27 (RDP composition, dp_accounting)",
    (WITHOUT_REPLACEMENT,),
    hidden_state=False,
    needs="nothing",
)
def without_replacement_rdp(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """RDP composition of Gaussian steps on ``b``-of-``n`` samples without replacement.

    Wang, Balle & Kasiviswanathan (2019) Thm 27 via dp_accounting's
    ``SampledWithoutReplacementDpEvent`` under REPLACE_ONE; the base query's replace-one
    sensitivity is ``2C`` so its noise multiplier is ``z/2``.
    """
    q = run.sampling_rate
    total = np.zeros(len(ctx.orders))
    for z, k in run.noise_counts().items():
        total += k * rdp_tools.without_replacement_gaussian_rdp(q, z / 2.0, ctx.orders)
    return RdpBound(
        name="composition_wor_rdp",
        citation="Wang, Balle & Kasiviswanathan (2019), Thm 27 (RDP composition, dp_accounting)",
        hidden_state=False,
        orders=ctx.orders,
        values=total,
        monotone_in_steps=True,
    )


def _poisson_pld_bound(name: str, q: float, counts: Counter, discretization: float, add_remove: bool = False) -> Bound:
    """PLD of the Poisson-sampled Gaussian steps in ``counts`` (noise multiplier -> number of
    steps): REPLACE_ONE, the package's per-step profile; ``add_remove``, dp_accounting's own
    pessimistic add/remove PLD of one step (:func:`add_remove_sampled_gaussian_pld`, the object
    its ``PLDAccountant`` composes).

    Any number of steps: long compositions are built in blocks on a bounded grid
    (:mod:`.long_composition`: every block's losses rounded up, in each direction), so the
    bound grows smoothly with the number of steps instead of giving way to a looser one at a
    size limit, and costs about the same under both relations. A composition too large for
    any grid is left to the RDP bound.
    """
    steps = sum(counts.values())
    rho = 1.0 if add_remove else 2.0  # the per-step GDP parameter's numerator: C or 2C over zC
    citation = POISSON_AR_PLD_CITATION if add_remove else POISSON_PLD_CITATION

    def clt_mu(k):
        return float(fdp.subsampled_gaussian_clt_mu(rho / min(counts), q, k))

    d_min = lc.grid_for(clt_mu(steps), discretization)
    if not d_min <= lc.MAX_DISCRETIZATION:
        return NotApplicable(name=name, citation=citation, hidden_state=False, reason=lc.TOO_COARSE)

    def single_step(z: float, grid: float) -> fdp.PLD:
        if add_remove:
            return add_remove_sampled_gaussian_pld(q, z, grid)
        return fdp.pld_from_profile(fdp.poisson_replace_one_profile(z, q), grid)

    def build(delta, d):
        total = None
        for z, k in counts.items():
            mu_z = lambda j, z=z: float(fdp.subsampled_gaussian_clt_mu(rho / z, q, j))
            part = lc.compose_steps(lambda grid, z=z: single_step(z, grid), k, mu_z, d, discretization)
            total = part if total is None else total.compose(part)
        return total, f"q = {q:.6g}" + (", ADD_OR_REMOVE_ONE" if add_remove else "")

    return PldBound(
        name=name, citation=citation, hidden_state=False, build=build, discretization=d_min, monotone_in_steps=True
    )


# Orders at which the add/remove RDP of the sampled Gaussian is evaluated for the
# replace-one bound (an order between two grid points is rounded up: RDP grows with the order).
_TRIANGLE_GRID = tuple(sorted(set(rdp_tools.DEFAULT_ORDERS) | {2048.0, 4096.0}))


def poisson_replace_one_rdp(q: float, noise_multiplier: float, orders) -> np.ndarray:
    """RDP of one Poisson-subsampled Gaussian step under REPLACE_ONE (sensitivity ``C`` per
    record, noise ``z C``), the pointwise smaller of two valid bounds.

    1. *Weak triangle inequality.* Replacing ``x`` by ``x'`` goes through ``D - {x}``, an
       add/remove neighbour of both. ``M(D)`` vs ``M(D - {x})`` is the sampled Gaussian mechanism
       of Mironov, Talwar & Zhang, "Renyi Differential Privacy of the Sampled Gaussian
       Mechanism" (arXiv:1908.10530), whose RDP ``e(a)`` dp_accounting computes as
       ``D_a(mixture || N(0))``; their Thm 5 shows the reverse ``D_a(N(0) || mixture)`` is
       no larger, which bounds ``M(D - {x})`` vs ``M(D')``. Mironov, "Renyi Differential
       Privacy" (CSF 2017, arXiv:1702.07476), Prop. 11 (Hoelder's inequality), for any ``p > 1``::

           D_a(P || R) <= (a - 1/p)/(a - 1) D_{p a}(P || Q) + D_{(p a - 1)/(p - 1)}(Q || R).

       Every ``p = g/a`` with ``g`` a grid order above ``a`` is tried, the second order rounded
       up to the grid. Close to ``4 e(a)`` for large orders, which is the replace-one value
       of the unsampled-limit quadratic term.
    2. *Joint convexity* of ``exp((a-1) D_a)`` over the inclusion event (Ye & Shokri 2022,
       Lemma 4.1): ``(a-1) eps_a <= log(1 - q + q exp((a-1) a (2/z)^2 / 2))``.

    At ``q = 1`` this is the Gaussian mechanism with sensitivity ``2C``: ``2 a / z^2``.
    """
    orders = np.asarray(orders, dtype=float)
    z = float(noise_multiplier)
    if q <= 0:
        return np.zeros(len(orders))
    with np.errstate(over="ignore", divide="ignore"):
        gaussian = orders * 2.0 / (z * z)
        if q >= 1:
            return gaussian
        joint = np.logaddexp(math.log1p(-q), math.log(q) + (orders - 1) * gaussian) / (orders - 1)
    if not 1e-100 < z < 1e100:  # the joint-convexity bound says all there is to say (0 or inf)
        return np.minimum(joint, gaussian)
    grid = np.asarray(_TRIANGLE_GRID)
    add_remove = rdp_tools.sampled_gaussian_rdp(q, z, grid)
    a = orders[:, None]
    g = grid[None, :]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        second_order = np.where(g > a, (g - 1) * a / (g - a), np.inf)
        idx = np.searchsorted(grid, second_order - 1e-12)
        second = np.where(idx < len(grid), add_remove[np.minimum(idx, len(grid) - 1)], np.inf)
        first = np.where(g > a, a * (1 - 1 / g) / (a - 1) * add_remove[None, :], np.inf)
        triangle = np.min(np.where(np.isnan(first + second), np.inf, first + second), axis=1)
    return np.minimum(np.minimum(triangle, joint), gaussian)


def _poisson_rdp_bound(name: str, q: float, counts: Counter, orders) -> Bound:
    """RDP composition of the steps in ``counts`` with :func:`poisson_replace_one_rdp`.
    Valid at every order and for any number of steps."""
    orders = np.asarray(orders, dtype=float)
    total = np.zeros(len(orders))
    for z, k in counts.items():
        total += k * poisson_replace_one_rdp(q, z, orders)
    return RdpBound(
        name=name,
        citation=POISSON_RDP_CITATION,
        hidden_state=False,
        orders=tuple(orders),
        values=total,
        monotone_in_steps=True,
    )


def add_remove_sampled_gaussian_pld(q: float, noise_multiplier: float, discretization: float) -> fdp.PLD:
    """One Poisson-subsampled Gaussian step under ADD_OR_REMOVE_ONE: dp_accounting's own
    pessimistic PLD (the constructor its ``PLDAccountant`` uses), add and remove directions kept
    separately."""
    return pld_lib.from_gaussian_mechanism(
        standard_deviation=float(noise_multiplier),
        sensitivity=1.0,
        pessimistic_estimate=True,
        value_discretization_interval=discretization,
        sampling_prob=float(q),
    )


def _poisson_ar_rdp_bound(name: str, q: float, counts: Counter, orders) -> Bound:
    """``sum_z count_z * eps_SGM(q, z)``: dp_accounting's ``RdpAccountant`` under ADD_OR_REMOVE_ONE."""
    total = np.zeros(len(orders))
    for z, k in counts.items():
        total += k * rdp_tools.sampled_gaussian_rdp(q, z, orders)
    return RdpBound(
        name=name,
        citation=POISSON_AR_RDP_CITATION,
        hidden_state=False,
        orders=tuple(orders),
        values=total,
        monotone_in_steps=True,
    )


@analysis(
    "composition_poisson_pld",
    POISSON_PLD_CITATION,
    (POISSON,),
    hidden_state=False,
    needs="nothing",
    add_or_remove="native",
)
def poisson_pld(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """Poisson sampling, every step composed as a PLD, for any number of steps. REPLACE_ONE: the
    package's per-step profile (:func:`hidden_state_accountants.fdp.poisson_replace_one_profile`);
    ADD_OR_REMOVE_ONE: dp_accounting's (equal to its ``PLDAccountant`` on
    ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` composed ``T`` times)."""
    q = run.sampling_rate
    if ctx.neighboring_relation == ADD_OR_REMOVE_ONE:
        return _poisson_pld_bound(
            "composition_poisson_pld", q, Counter(run.noise_counts()), ctx.discretization, add_remove=True
        )
    return _poisson_pld_bound("composition_poisson_pld", q, Counter(run.noise_counts()), ctx.discretization)


@analysis(
    "composition_poisson_rdp",
    POISSON_RDP_CITATION,
    (POISSON,),
    hidden_state=False,
    needs="nothing",
    add_or_remove="native",
)
def poisson_rdp(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """Poisson sampling composed in RDP: :func:`poisson_replace_one_rdp` (REPLACE_ONE) or the sampled
    Gaussian's RDP (ADD_OR_REMOVE_ONE, equal to dp_accounting's ``RdpAccountant``)."""
    q = run.sampling_rate
    if ctx.neighboring_relation == ADD_OR_REMOVE_ONE:
        return _poisson_ar_rdp_bound("composition_poisson_rdp", q, Counter(run.noise_counts()), ctx.orders)
    return _poisson_rdp_bound("composition_poisson_rdp", q, Counter(run.noise_counts()), ctx.orders)


# ------------------------------------------------------------ standard dp_accounting events
class UnsupportedEvent(Exception):
    pass


def is_no_op(event: dp_event.DpEvent) -> bool:
    """Events that touch no record: sampling with probability 0, or a sample of size 0."""
    if isinstance(event, dp_event.PoissonSampledDpEvent):
        return _rate(event) == 0
    if isinstance(event, dp_event.SampledWithoutReplacementDpEvent):
        _wor_sizes(event)
        return event.sample_size == 0
    return False


def _rate(event: dp_event.PoissonSampledDpEvent) -> float:
    q = event.sampling_probability
    if isinstance(q, bool) or not isinstance(q, numbers.Real) or not 0 <= q <= 1:
        raise v.ParameterError("sampling_probability", f"of a PoissonSampledDpEvent must lie in [0, 1], got {q!r}")
    return float(q)


def _wor_sizes(event: dp_event.SampledWithoutReplacementDpEvent):
    n, k = event.source_dataset_size, event.sample_size
    for name, x in (("source_dataset_size", n), ("sample_size", k)):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 0:
            raise v.ParameterError(name, f"of a SampledWithoutReplacementDpEvent must be an integer >= 0, got {x!r}")
    if k > n or n == 0:
        raise v.ParameterError("sample_size", f"must be <= source_dataset_size ({n}) and the source non-empty, got {k}")
    return int(n), int(k)


def standard_event_bounds(event: dp_event.DpEvent, ctx: cm.Context, count: int = 1) -> List[Bound]:
    """Bounds for a standard dp_accounting event composed ``count`` times, under
    ``ctx.neighboring_relation`` (raises UnsupportedEvent, or ParameterError for an event whose
    parameters are out of range): the sensitivity is ``2C`` under REPLACE_ONE and ``C`` under
    ADD_OR_REMOVE_ONE, as dp_accounting accounts them.

    The ``count``-fold composition is folded in before any PLD is built, so a self-composition
    costs what one training run of ``count`` steps costs (``count = 10**9`` in well under a
    second): a Gaussian becomes ``G(sqrt(count) mu)`` (Dong, Roth & Su 2022, Cor. 3.3, exact),
    RDP curves are multiplied by ``count`` (Mironov 2017, Prop. 1), and sampled Gaussians are
    composed as PLDs in blocks (:mod:`.long_composition`, every rounding pessimistic)."""
    count = v.positive_int("count", count)
    add_remove = ctx.neighboring_relation == ADD_OR_REMOVE_ONE
    sensitivity, label = (1.0, "C (ADD_OR_REMOVE_ONE)") if add_remove else (2.0, "2C (REPLACE_ONE)")
    times = f", composed {count} times" if count > 1 else ""

    def gaussian(z: float) -> Bound:
        return GdpBound(
            name="gaussian",
            citation=f"Gaussian mechanism, sensitivity {label}{times}",
            hidden_state=False,
            mu=sensitivity * math.sqrt(count) / z,
        )

    if isinstance(event, dp_event.GaussianDpEvent):
        z = _noise(event)
        return [non_private_bound("GaussianDpEvent with noise_multiplier 0")] if z <= 0 else [gaussian(z)]
    if isinstance(event, dp_event.LaplaceDpEvent):
        b = _noise(event)
        if b <= 0:
            return [non_private_bound("LaplaceDpEvent with noise_multiplier 0")]
        eps = sensitivity / b  # L1 sensitivity
        orders = np.asarray(ctx.orders, dtype=float)
        return [
            RdpBound(
                name="laplace",
                citation="Laplace mechanism: eps-DP implies (a, min(eps, a eps^2/2))-RDP" + times,
                hidden_state=False,
                orders=ctx.orders,
                values=count * np.minimum(eps, orders * eps * eps / 2),
            )
        ]
    if isinstance(event, dp_event.PoissonSampledDpEvent):
        z = _gaussian_noise(event.event)
        q = _rate(event)
        if q == 0:
            return []
        if z == 0:
            return [non_private_bound("Poisson-sampled Gaussian with noise_multiplier 0")]
        if q >= 1:
            return [gaussian(z)]
        counts = Counter({z: count})
        rdp = _poisson_ar_rdp_bound if add_remove else _poisson_rdp_bound
        return [
            _poisson_pld_bound("poisson_gaussian_pld", q, counts, ctx.discretization, add_remove=add_remove),
            rdp("poisson_gaussian_rdp", q, counts, ctx.orders),
        ]
    if isinstance(event, dp_event.SampledWithoutReplacementDpEvent):
        z = _gaussian_noise(event.event)
        n, k = _wor_sizes(event)
        if add_remove:
            raise UnsupportedEvent(
                "SampledWithoutReplacementDpEvent is not supported under ADD_OR_REMOVE_ONE (as in dp_accounting): "
                "an added record changes every inclusion probability and displaces another record of the "
                "fixed-size sample; use REPLACE_ONE"
            )
        if k == 0:
            return []
        if z == 0:
            return [non_private_bound("sampled Gaussian with noise_multiplier 0")]
        q = k / n
        mu = 2.0 / z
        rdp = RdpBound(
            name="wor_gaussian_rdp",
            citation="Wang, Balle & Kasiviswanathan (2019) Thm 27" + times,
            hidden_state=False,
            orders=ctx.orders,
            values=count * rdp_tools.without_replacement_gaussian_rdp(q, z / 2.0, ctx.orders),
        )
        clt_mu = lambda j: float(fdp.subsampled_gaussian_clt_mu(mu, q, j))
        d_min = lc.grid_for(clt_mu(count), ctx.discretization)
        if not d_min <= lc.MAX_DISCRETIZATION:
            return [rdp]
        single = lambda grid: fdp.pld_from_profile(fdp.subsampled_gaussian_profile(mu, q), grid)
        pld = PldBound(
            name="wor_gaussian_pld",
            citation="Dong, Roth & Su (2022) Thm 9: C_p(G(2/z)), composed as a PLD" + times,
            hidden_state=False,
            discretization=d_min,
            build=lambda delta, d: (lc.compose_steps(single, count, clt_mu, d, ctx.discretization), ""),
        )
        return [pld, rdp]
    raise UnsupportedEvent(f"unsupported event {type(event).__name__}")


def _noise(event) -> float:
    z = event.noise_multiplier
    if isinstance(z, bool) or not isinstance(z, numbers.Real) or math.isnan(z) or z < 0:
        raise v.ParameterError("noise_multiplier", f"of a {type(event).__name__} must be a number >= 0, got {z!r}")
    return float(z)


def _gaussian_noise(event: dp_event.DpEvent) -> float:
    if isinstance(event, dp_event.GaussianDpEvent):
        return _noise(event)
    raise UnsupportedEvent(f"sampled events must wrap a GaussianDpEvent, got {type(event).__name__}")


def non_private_bound(what: str) -> Bound:
    """A mechanism without noise: infinite epsilon at every order."""
    return RdpBound(name="non_private", citation=what, hidden_state=False, orders=(2.0,), values=np.array([math.inf]))
