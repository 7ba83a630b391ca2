"""The one selection rule (issue 21): ``select_best`` picks the reported bound for the accountant
and for calibration, so the two agree on every schedule and relation, ties included."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from hidden_state_accountants import HiddenStateAccountant, LossGeometry, TrainingRunDpEvent, calibrate_noise_multiplier
from hidden_state_accountants import calibration as cal
from hidden_state_accountants import rdp as rdp_tools
from hidden_state_accountants.analyses import registry
from hidden_state_accountants.bounds import GdpBound, NotApplicable, RdpBound
from hidden_state_accountants.relations import schedule_reason
from hidden_state_accountants.schedules import SAMPLINGS
from hidden_state_accountants.selection import RDP_POINTWISE_MIN, bound_epsilon, pointwise_rdp_minimum, select_best

ORDERS = (1.5, 2.0, 4.0, 8.0, 16.0, 32.0)
SHORT_GRID = (1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0, 128.0, 256.0)  # keeps this file quick
DELTA = 1e-5
GEOMETRY = LossGeometry(strong_convexity=0.05, smoothness=1.0, diameter=2.0)


def run_of(sampling, z=2.0):
    n, b = (40, 40) if sampling == "full" else (40, 8)
    return TrainingRunDpEvent(
        dataset_size=n,
        batch_size=b,
        steps=20,
        noise_multiplier=z,
        clip_norm=1.0,
        learning_rate=0.5,
        sampling=sampling,
        geometry=GEOMETRY,
    )


CASES = [
    (s, r)
    for s in SAMPLINGS
    for r in ("REPLACE_ONE", "ADD_OR_REMOVE_ONE")
    if r == "REPLACE_ONE" or not schedule_reason(HiddenStateAccountant(neighboring_relation=r).neighboring_relation, s)
]


@pytest.mark.parametrize("sampling, relation", CASES)
def test_calibration_chooses_what_the_accountant_reports(sampling, relation):
    """At the same noise, calibration's choice over every analysis is the accountant's report,
    epsilon and analysis to the last bit."""
    run = run_of(sampling)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = HiddenStateAccountant(orders=SHORT_GRID, neighboring_relation=relation)
        report = acc.compose(run).explain(DELTA)
        cands = cal._Candidates(run, DELTA, acc.context)
        for info in cands.infos:
            cands.bound(info.name, run.noise_multiplier)
        assert cands.best(run.noise_multiplier) == (report.epsilon, report.analysis)
        pointwise = [a.epsilon for a in report.analyses if a.name == RDP_POINTWISE_MIN]
        assert pointwise == ([cands.epsilon(RDP_POINTWISE_MIN, run.noise_multiplier)] if pointwise else [])


def _calibrated_agrees(sampling, relation):
    run = run_of(sampling)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = calibrate_noise_multiplier(run, 3.0, DELTA, neighboring_relation=relation)
        again = (
            HiddenStateAccountant(neighboring_relation=relation)
            .compose(run.replace(noise_multiplier=found.noise_multiplier))
            .explain(DELTA)
        )
    assert (found.epsilon, found.analysis) == (again.epsilon, again.analysis)
    assert found.epsilon <= 3.0


@pytest.mark.parametrize(
    "sampling, relation",
    [("cyclic", "REPLACE_ONE"), ("shuffle_partition", "REPLACE_ONE"), ("full", "ADD_OR_REMOVE_ONE")],
)
def test_the_calibrated_noise_reports_the_calibrated_epsilon(sampling, relation):
    _calibrated_agrees(sampling, relation)


@pytest.mark.slow
@pytest.mark.parametrize("sampling, relation", CASES)
def test_the_calibrated_noise_reports_the_calibrated_epsilon_everywhere(sampling, relation):
    _calibrated_agrees(sampling, relation)


def _rdp(name, values, **kw):
    return RdpBound(name=name, orders=ORDERS, values=np.asarray(values, dtype=float), **kw)


def test_a_named_analysis_wins_a_tie_with_the_pointwise_minimum_then_the_smaller_name():
    same = [GdpBound(name="b", mu=1.0), GdpBound(name="a", mu=1.0)]
    best = select_best(same, DELTA, ORDERS)
    assert best.analysis == "a" and best.epsilon == GdpBound(mu=1.0).epsilon(DELTA)
    curve = np.array(ORDERS) * 0.5
    tied = [_rdp("z", curve), _rdp("y", curve)]  # the pointwise minimum equals each curve
    best = select_best(tied, DELTA, ORDERS)
    assert best.pointwise is not None and best.pointwise.epsilon == best.epsilon
    assert best.analysis == "y" and best.pointwise.winner == "z"  # the first curve in the bounds' order


def test_the_pointwise_minimum_of_crossing_curves_ties_the_best_curve():
    """One event's epsilon is a minimum over orders of a conversion increasing in the RDP value, so
    the pointwise minimum of two curves converts to the smaller of their epsilons: it ties, and
    the named analysis is reported (it matters when curves are summed over events)."""
    low_at_small = _rdp("small", [0.1, 0.2, 2.0, 8.0, 30.0, 100.0], monotone_in_steps=True)
    low_at_large = _rdp("large", [3.0, 3.0, 3.0, 3.1, 3.2, 3.3], monotone_in_steps=False)
    best = select_best([low_at_small, low_at_large], DELTA, ORDERS)
    expected, order = rdp_tools.rdp_to_epsilon(ORDERS, np.minimum(low_at_small.values, low_at_large.values), DELTA)
    assert best.pointwise.epsilon == expected == min(low_at_small.epsilon(DELTA), low_at_large.epsilon(DELTA))
    assert best.analysis == "large" and best.pointwise.winner == "large" and best.pointwise.order == order
    assert best.pointwise.monotone_in_steps is False  # not every curve is
    assert select_best([low_at_small, low_at_large], DELTA, ORDERS, pointwise=False).pointwise is None


def test_nan_and_inapplicable_bounds_never_win():
    nan = _rdp("nan", [math.nan] * len(ORDERS))
    assert bound_epsilon(nan, DELTA) == math.inf
    assert bound_epsilon(NotApplicable(name="na", reason="no"), DELTA) == math.inf
    best = select_best([nan, NotApplicable(name="na", reason="no"), GdpBound(name="g", mu=2.0)], DELTA, ORDERS)
    assert best.analysis == "g" and best.epsilons[1] is None
    # a NaN order counts as infinity in the pointwise minimum: the other curve answers there
    half = _rdp("half", [math.nan, math.nan, 1.0, 2.0, 4.0, 8.0])
    other = _rdp("other", [0.5, 0.6, 5.0, 9.0, 17.0, 33.0])
    p = pointwise_rdp_minimum([half, other], ORDERS, DELTA)
    assert p.epsilon == rdp_tools.rdp_to_epsilon(ORDERS, [0.5, 0.6, 1.0, 2.0, 4.0, 8.0], DELTA)[0]
    assert select_best([NotApplicable(name="na", reason="no")], DELTA, ORDERS).analysis == "none"


def test_calibration_and_the_accountant_read_a_nan_order_alike(monkeypatch):
    """A NaN order of one curve: the other curve answers there, in the accountant's report and
    in calibration's search alike (both take the pointwise minimum through select_best)."""
    from hidden_state_accountants.analyses.analysis_info import analysis

    @analysis("nan_at_low_orders", "test", ("full",), needs="-")
    def nan_at_low_orders(run, ctx):
        return RdpBound(orders=ctx.orders, values=np.where(np.asarray(ctx.orders) < 3, math.nan, 50.0))

    @analysis("good_at_low_orders", "test", ("full",), needs="-")
    def good_at_low_orders(run, ctx):
        orders = np.asarray(ctx.orders)
        return RdpBound(orders=ctx.orders, values=np.where(orders < 3, 0.1 * orders, 1000.0))

    monkeypatch.setitem(registry.ANALYSES, TrainingRunDpEvent, (nan_at_low_orders.info, good_at_low_orders.info))
    run = run_of("full", z=3.0)
    acc = HiddenStateAccountant(orders=ORDERS)
    report = acc.compose(run).explain(DELTA)
    rows = {a.name: a.epsilon for a in report.analyses}
    assert report.analysis == "good_at_low_orders" and rows[RDP_POINTWISE_MIN] == report.epsilon < 20
    cands = cal._Candidates(run, DELTA, acc.context)
    assert cands.epsilon(RDP_POINTWISE_MIN, 3.0) == rows[RDP_POINTWISE_MIN]
    assert cands.best(3.0) == (report.epsilon, report.analysis)
