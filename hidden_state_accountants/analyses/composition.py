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
from typing import Dict, List, Mapping, Optional, Tuple

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
    return wor_rdp_bound(
        "composition_wor_rdp",
        "Wang, Balle & Kasiviswanathan (2019), Thm 27 (RDP composition, dp_accounting)",
        run.sampling_rate,
        run.noise_counts(),
        ctx.orders,
    )


# dp_accounting's sampled-Gaussian RDP costs 20-40 ms per noise value on the default orders, its
# without-replacement RDP about 0.4 s: a ledger of many noise values is composed in fewer groups
# there (the PLDs, usually the tighter bounds, keep lc.NOISE_GROUPS)
RDP_NOISE_GROUPS = 8
WOR_RDP_NOISE_GROUPS = 1


def grouped(counts: Mapping[float, int], max_groups: Optional[int] = None) -> Tuple[Dict[float, int], str]:
    """:func:`.long_composition.noise_groups` of ``counts`` (in ``lc.NOISE_GROUPS`` groups unless
    ``max_groups`` says otherwise), and a note saying so when it rounded."""
    groups = lc.noise_groups(counts, lc.NOISE_GROUPS if max_groups is None else max_groups)
    if len(groups) == len(counts):
        return groups, ""
    return groups, f"{len(counts)} noise values in {len(groups)} groups, each at its smallest"


def wor_rdp_bound(name: str, citation: str, q: float, counts: Mapping[float, int], orders) -> Bound:
    """RDP composition of Gaussian steps on ``b``-of-``n`` samples without replacement (``counts``: noise
    multiplier -> steps), REPLACE_ONE: Wang, Balle & Kasiviswanathan (2019) Thm 27 via dp_accounting,
    whose base query's replace-one sensitivity is ``2C``, so its noise multiplier is ``z/2``."""
    groups, note = grouped(counts, WOR_RDP_NOISE_GROUPS)
    total = np.zeros(len(orders))
    for z, k in groups.items():
        total += k * rdp_tools.without_replacement_gaussian_rdp(q, z / 2.0, orders)
    return RdpBound(
        name=name,
        citation=citation,
        hidden_state=False,
        orders=tuple(orders),
        values=total,
        note=note,
        monotone_in_steps=True,
    )


def wor_pld_bound(name: str, citation: str, q: float, counts: Mapping[float, int], discretization: float) -> Bound:
    """``C_q(G(2/z))`` per step (Dong, Roth & Su, "Gaussian Differential Privacy", JRSS-B 2022, Def. 6 and
    Thm 9), composed as a pessimistic PLD over the steps of ``counts`` (noise multiplier -> steps); any
    number of steps, long runs in blocks on a bounded grid (:mod:`.long_composition`); at most
    ``lc.NOISE_GROUPS`` noise values (:func:`grouped`)."""
    groups, note = grouped(counts)
    steps = sum(groups.values())
    d_min = lc.grid_for(float(fdp.subsampled_gaussian_clt_mu(2.0 / min(groups), q, steps)), discretization)
    if not d_min <= lc.MAX_DISCRETIZATION:
        return NotApplicable(name=name, citation=citation, hidden_state=False, reason=lc.TOO_COARSE)

    def build(delta: float, d: float):
        total = None
        for z, k in groups.items():
            single = lambda grid, z=z: fdp.pld_from_profile(fdp.subsampled_gaussian_profile(2.0 / z, q), grid)
            mu_z = lambda j, z=z: float(fdp.subsampled_gaussian_clt_mu(2.0 / z, q, j))
            part = lc.compose_steps(single, k, mu_z, d, discretization)
            total = part if total is None else total.compose(part)
        return total, "; ".join(x for x in (f"p = b/n = {q:.6g}", note) if x)

    return PldBound(
        name=name, citation=citation, hidden_state=False, build=build, discretization=d_min, monotone_in_steps=True
    )


def _poisson_pld_bound(name: str, q: float, counts: Counter, discretization: float, add_remove: bool = False) -> Bound:
    """PLD of the Poisson-sampled Gaussian steps in ``counts`` (noise multiplier -> number of
    steps; at most ``lc.NOISE_GROUPS`` noise values, :func:`grouped`): REPLACE_ONE, the package's per-step profile; ``add_remove``, dp_accounting's own
    pessimistic add/remove PLD of one step (:func:`add_remove_sampled_gaussian_pld`, the object
    its ``PLDAccountant`` composes).

    Any number of steps: long compositions are built in blocks on a bounded grid
    (:mod:`.long_composition`: every block's losses rounded up, in each direction), so the
    bound grows smoothly with the number of steps instead of giving way to a looser one at a
    size limit, and costs about the same under both relations. A composition too large for
    any grid is left to the RDP bound.
    """
    counts, note = grouped(counts)
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
        return total, "; ".join(x for x in (f"q = {q:.6g}" + (", ADD_OR_REMOVE_ONE" if add_remove else ""), note) if x)

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
    """RDP composition of the steps in ``counts`` with :func:`poisson_replace_one_rdp` (at most
    :data:`RDP_NOISE_GROUPS` noise values, :func:`grouped`). Valid at every order and for any number of steps."""
    orders = np.asarray(orders, dtype=float)
    groups, note = grouped(counts, RDP_NOISE_GROUPS)
    total = np.zeros(len(orders))
    for z, k in groups.items():
        total += k * poisson_replace_one_rdp(q, z, orders)
    return RdpBound(
        name=name,
        citation=POISSON_RDP_CITATION,
        hidden_state=False,
        orders=tuple(orders),
        values=total,
        note=note,
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
    """``sum_z count_z * eps_SGM(q, z)``: dp_accounting's ``RdpAccountant`` under ADD_OR_REMOVE_ONE (at most
    :data:`RDP_NOISE_GROUPS` noise values, :func:`grouped`)."""
    groups, note = grouped(counts, RDP_NOISE_GROUPS)
    total = np.zeros(len(orders))
    for z, k in groups.items():
        total += k * rdp_tools.sampled_gaussian_rdp(q, z, orders)
    return RdpBound(
        name=name,
        citation=POISSON_AR_RDP_CITATION,
        hidden_state=False,
        orders=tuple(orders),
        values=total,
        note=note,
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
    check_standard_event(event, ctx)
    add_remove = ctx.neighboring_relation == ADD_OR_REMOVE_ONE
    sensitivity, label = (1.0, "C (ADD_OR_REMOVE_ONE)") if add_remove else (2.0, "2C (REPLACE_ONE)")
    times = f", composed {count} times" if count > 1 else ""
    if is_no_op(event):
        return []
    z = _noise(getattr(event, "event", event))  # a sampled event's Gaussian
    if z == 0:
        return [non_private_bound(f"{type(event).__name__} with noise_multiplier 0")]
    if isinstance(event, dp_event.LaplaceDpEvent):
        eps = sensitivity / z  # L1 sensitivity
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
    ledger = sampled_gaussian(event)
    if ledger is not None:
        return ledger_bounds(ledger[0], {z: count}, ctx)
    # a Gaussian, or a Poisson-sampled one with q = 1 (every step holds the record)
    return [
        GdpBound(
            name="gaussian",
            citation=f"Gaussian mechanism, sensitivity {label}{times}",
            hidden_state=False,
            mu=sensitivity * math.sqrt(count) / z,
        )
    ]


def check_standard_event(event: dp_event.DpEvent, ctx: cm.Context) -> None:
    """Raises as :func:`standard_event_bounds` does for an unsupported event (UnsupportedEvent) or one
    whose parameters are out of range (ParameterError), computing nothing."""
    if isinstance(event, (dp_event.GaussianDpEvent, dp_event.LaplaceDpEvent)):
        _noise(event)
    elif isinstance(event, dp_event.PoissonSampledDpEvent):
        _gaussian_noise(event.event)
        _rate(event)
    elif isinstance(event, dp_event.SampledWithoutReplacementDpEvent):
        _gaussian_noise(event.event)
        _wor_sizes(event)
        if ctx.neighboring_relation == ADD_OR_REMOVE_ONE:
            raise UnsupportedEvent(WOR_ADD_REMOVE)
    else:
        raise UnsupportedEvent(f"unsupported event {type(event).__name__}")


WOR_ADD_REMOVE = (
    "SampledWithoutReplacementDpEvent is not supported under ADD_OR_REMOVE_ONE (as in dp_accounting): "
    "an added record changes every inclusion probability and displaces another record of the "
    "fixed-size sample; use REPLACE_ONE"
)


def sampled_gaussian(event: dp_event.DpEvent) -> Optional[Tuple[Tuple, float]]:
    """``(law, z)`` for a Poisson-sampled (``0 < q < 1``) or without-replacement sampled Gaussian event
    that touches a record with noise ``z > 0``: such events of one sampling ``law`` (``("poisson", q)``,
    ``("wor", n, k)``) compose into one ledger (noise -> steps, :func:`ledger_bounds`). ``None`` for
    every other event (parameters unchecked: :func:`standard_event_bounds` checks them)."""
    if not isinstance(event, (dp_event.PoissonSampledDpEvent, dp_event.SampledWithoutReplacementDpEvent)):
        return None
    inner = event.event
    z = getattr(inner, "noise_multiplier", None)
    if not isinstance(inner, dp_event.GaussianDpEvent) or not _positive_real(z):
        return None
    if isinstance(event, dp_event.PoissonSampledDpEvent):
        q = event.sampling_probability
        return (("poisson", float(q)), float(z)) if _positive_real(q) and q < 1 else None
    n, k = event.source_dataset_size, event.sample_size
    valid = all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in (n, k)) and 0 < k <= n
    return (("wor", int(n), int(k)), float(z)) if valid else None


def _positive_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and 0 < x < math.inf


def ledger_bounds(law: Tuple, counts: Mapping[float, int], ctx: cm.Context) -> List[Bound]:
    """The bounds of sampled Gaussian steps of one sampling ``law`` (:func:`sampled_gaussian`), ``counts``
    noise multiplier -> steps, under ``ctx.neighboring_relation``: a PLD composition and an RDP
    composition, in at most ``lc.NOISE_GROUPS`` (PLD) and :data:`RDP_NOISE_GROUPS` noise values (each
    group at its smallest, :func:`grouped`), so a ledger of any number of distinct values costs about what
    a handful of values cost."""
    counts = Counter(counts)
    if law[0] == "poisson":
        q = law[1]
        add_remove = ctx.neighboring_relation == ADD_OR_REMOVE_ONE
        rdp = _poisson_ar_rdp_bound if add_remove else _poisson_rdp_bound
        return [
            _poisson_pld_bound("poisson_gaussian_pld", q, counts, ctx.discretization, add_remove=add_remove),
            rdp("poisson_gaussian_rdp", q, counts, ctx.orders),
        ]
    if ctx.neighboring_relation == ADD_OR_REMOVE_ONE:
        raise UnsupportedEvent(WOR_ADD_REMOVE)
    _, n, k = law
    q = k / n
    steps = sum(counts.values())
    times = f", composed over {steps} steps" if steps > 1 else ""
    pld = wor_pld_bound(
        "wor_gaussian_pld",
        "Dong, Roth & Su (2022) Thm 9: C_p(G(2/z)), composed as a PLD" + times,
        q,
        counts,
        ctx.discretization,
    )
    rdp = wor_rdp_bound(
        "wor_gaussian_rdp", "Wang, Balle & Kasiviswanathan (2019) Thm 27" + times, q, counts, ctx.orders
    )
    return [pld, rdp] if pld.applicable else [rdp]


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
