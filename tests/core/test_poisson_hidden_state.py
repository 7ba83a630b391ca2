"""Poisson hidden-state analyses (docs/derivations.md sections 6-10) pinned against ground truth.

Exact values: :func:`hidden_state_accountants.exact.exact_pair` (linear losses, the worst known
pairs of each relation); brute force where the batch-size cap binds (a non-linear loss whose large
batches are expansive) and with a projection. A bound is checked as ``bound >= exact`` with a
relative slack of 1e-6 (exact values are certified lower ends; PLD bounds are pessimistic); a wrong
factor (e.g. sensitivity C instead of 2C, or a cap whose failure probability is dropped) fails.
"""

import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from scipy import stats

from hidden_state_accountants import HiddenStateAccountant, LossGeometry, TrainingRunDpEvent, exact
from hidden_state_accountants.accountant import analyze_training_run
from hidden_state_accountants.analyses import _common as cm
from hidden_state_accountants.analyses import poisson_hidden_state as ph
from hidden_state_accountants.bounds import CappedBound
from hidden_state_accountants.relations import ADD_OR_REMOVE_ONE, REPLACE_ONE

RELATIONS = (REPLACE_ONE, ADD_OR_REMOVE_ONE)
POISSON = ("si_poisson", "altschuler_talwar_eq3.3_poisson", "ye_shokri_thm4.3_poisson")
DELTAS = (1e-3, 1e-5, 1e-7)
ORDERS = (2.0, 4.0, 8.0, 16.0)
SLACK = 1e-6


def run_of(n, q, b, T, z, lr, m_reg, M=None, D=None, l2="same"):
    geom = LossGeometry(smoothness=m_reg if M is None else M, strong_convexity=m_reg, diameter=D)
    return TrainingRunDpEvent(
        dataset_size=n,
        batch_size=b,
        steps=T,
        noise_multiplier=z,
        clip_norm=1.0,
        learning_rate=lr,
        sampling="poisson",
        sampling_probability=q,
        geometry=geom,
        l2_regularization=m_reg if l2 == "same" else l2,
    )


def bounds_of(run, relation):
    ctx = cm.Context(neighboring_relation=relation)
    return {b.name: b for b in analyze_training_run(run, ctx) if b.name in POISSON}


def check(run, relation, deltas=DELTAS, orders=None, expect_applicable=POISSON):
    truth = exact.exact_pair(run, relation=relation.name)
    bounds = bounds_of(run, relation)
    for name in expect_applicable:
        assert bounds[name].applicable, (name, getattr(bounds[name], "reason", ""))
    for name, b in bounds.items():
        for d in deltas:
            e, x = b.epsilon(d), truth.epsilon(d)
            assert e >= x * (1 - SLACK) - 1e-9, (name, relation.name, d, e, x)
        if orders is not None and b.applicable:
            curve = b.rdp(np.asarray(orders))
            if curve is not None:
                xr = truth.renyi(orders)
                assert np.all(curve >= xr * (1 - SLACK) - 1e-12), (name, relation.name, curve, xr)
    return bounds


FAST_GRID = [  # (n, q, b, T, z, lr, m_reg)
    (20, 0.3, 2, 1, 1.0, 0.5, 0.2),
    (20, 0.3, 2, 4, 1.0, 0.5, 0.2),
    (20, 0.1, 2, 10, 2.0, 0.5, 0.9),
    (20, 0.5, 2, 12, 4.0, 0.3, 1.0),
    (20, 0.05, 1, 12, 1.0, 1.0, 0.5),
    (20, 0.2, 2, 6, 0.5, 0.9, 0.5),
]


@pytest.mark.parametrize("relation", RELATIONS, ids=lambda r: r.name)
@pytest.mark.parametrize("setting", FAST_GRID)
def test_poisson_bounds_above_exact(setting, relation):
    # M = m_reg: the linear losses' true smoothness: no cap needed (P(fail) = 0), RDP curves comparable
    run = run_of(*setting)
    check(run, relation, orders=ORDERS if run.steps <= 8 else None)


@pytest.mark.parametrize("relation", RELATIONS, ids=lambda r: r.name)
def test_binding_cap_adds_its_failure_probability(relation):
    """A declared smoothness that makes batches of 12+ records expansive: the cap binds, P(fail) > 0 is
    added to delta, no unconditional RDP curve is exposed, and every bound stays above exact."""
    run = run_of(40, 0.05, 2, 8, 1.0, 0.5, 0.4, M=1.0)
    bounds = check(
        run, relation, deltas=(1e-2, 1e-3, 1e-4), expect_applicable=("si_poisson", "altschuler_talwar_eq3.3_poisson")
    )
    si = bounds["si_poisson"]
    fails = [math.exp(ph.log_cap_failure(si.setup.others, run.sampling_rate, run.steps, K)) for K, _ in si.cap_list]
    assert isinstance(si, ph.PoissonShiftBound) and all(p > 0 for p in fails)
    assert math.isfinite(si.epsilon(1e-3))
    assert si.rdp(np.asarray(ORDERS)) is None
    assert relation.name in si.detail(1e-3)
    # dropping the failure probability would be optimistic: below it only the composition of the sampled
    # steps (which needs no cap) is left
    assert si.epsilon(min(fails) / 2) >= si.epsilon(1e-3)
    assert "composition" in si.detail(min(fails) / 2)
    at = bounds["altschuler_talwar_eq3.3_poisson"]
    assert isinstance(at, CappedBound) and all(c.p > 0 for c, _ in at.candidates)
    assert at.epsilon(min(c.p for c, _ in at.candidates) / 2) == math.inf


def test_single_step_add_remove_is_the_sampled_gaussian():
    """T = 1: the last iterate is the sampled Gaussian; Lemma SI at tau = 0 is exactly it (section 8)."""
    run = run_of(20, 0.3, 2, 1, 1.0, 0.5, 0.2)
    truth = exact.exact_pair(run, relation="ADD_OR_REMOVE_ONE")
    si = bounds_of(run, ADD_OR_REMOVE_ONE)["si_poisson"]
    for d in DELTAS:
        assert truth.epsilon(d) <= si.epsilon(d) <= truth.epsilon(d) + 2e-3


def test_replace_one_is_not_the_add_remove_number():
    """Sensitivity 2C vs C: the replace-one exact value exceeds the add/remove bound (a bound that
    used C under REPLACE_ONE would fail the comparison above)."""
    run = run_of(20, 0.3, 2, 4, 1.0, 0.5, 0.2)
    ar = bounds_of(run, ADD_OR_REMOVE_ONE)["si_poisson"].epsilon(1e-5)
    assert exact.exact_pair(run).epsilon(1e-5) > ar


def test_cap_failure_probability():
    """Exact binomial tail over independent steps; the Chernoff fallback is an upper bound."""
    for others, q, T, K in [(59999, 256 / 60000, 10**5, 300), (100, 0.3, 50, 45), (10, 0.5, 3, 7)]:
        want = 1 - (1 - stats.binom.sf(K, others, q)) ** T
        got = math.exp(ph.log_cap_failure(others, q, T, K))
        assert math.isclose(got, want, rel_tol=1e-9) or (want < 1e-300 and got >= want)
    assert ph.log_cap_failure(60000, 0.004, 10**5, 5000) > -math.inf  # underflow: never optimistic
    assert ph.log_cap_failure(10, 0.5, 3, 10) == -math.inf


@settings(max_examples=60, deadline=None)
@given(
    lr=st.floats(0.01, 1.5),
    m_reg=st.floats(0, 0.5),
    m_data=st.floats(0, 0.3),
    extra=st.floats(0.3, 3),
    b=st.integers(1, 50),
    K=st.integers(0, 200),
)
def test_contraction_cap_endpoints(lr, m_reg, m_data, extra, b, K):
    """The largest step Lipschitz constant over batch sizes 0..K+1 sits at an end (brute force)."""
    M = m_reg + extra
    brute = max(ph.log_step_lipschitz(lr, m_reg, m_data, M, b, k) for k in range(K + 2))
    assert math.isclose(ph.log_cap_lipschitz(lr, m_reg, m_data, M, b, K + 1), brute, abs_tol=1e-12)


def test_needs_are_checked():
    base = run_of(20, 0.3, 2, 4, 1.0, 0.5, 0.2)
    for run, text in [
        (base.replace(l2_regularization=None), "l2_regularization declared"),
        (base.replace(l2_regularization=0.0), "l2_regularization > 0"),
        (base.replace(l2_regularization=0.3), "exceeds the declared strong_convexity"),
        (base.replace(geometry=None), "no loss geometry"),
    ]:
        for name, b in bounds_of(run, REPLACE_ONE).items():
            assert not b.applicable and text in b.reason, (name, b.reason)


def test_mnist_scale_add_remove_below_composition():
    """The Opacus MNIST pattern (n = 60000, b = 256, z = 1, lr = 0.5, m_reg = 0.01): from about 10
    epochs on, the hidden-state bound under ADD_OR_REMOVE_ONE is below the composition number that
    Opacus' own accountants report, and it stops growing (docs/derivations.md section 12)."""
    geom = LossGeometry(smoothness=1.01, strong_convexity=0.01)
    out = {}
    for epochs in (10, 50):
        run = TrainingRunDpEvent(
            dataset_size=60000,
            batch_size=256,
            steps=epochs * 234,
            noise_multiplier=1.0,
            clip_norm=1.0,
            learning_rate=0.5,
            sampling="poisson",
            geometry=geom,
            l2_regularization=0.01,
        )
        report = HiddenStateAccountant(neighboring_relation="ADD_OR_REMOVE_ONE").compose(run).explain(1e-5)
        out[epochs] = report
        assert report.analysis == "si_poisson" and report.epsilon < report.composition_epsilon
    assert out[50].epsilon == pytest.approx(out[10].epsilon, abs=0.02)
    assert out[50].epsilon < 1.0 < out[50].composition_epsilon


@pytest.mark.slow
@pytest.mark.parametrize("relation", ["REPLACE_ONE", "ADD_OR_REMOVE_ONE"])
def test_nonlinear_brute_force_with_expansive_batches(relation):
    """Huber loss, slope 1 - lr (m_reg + k h/b): batches of 8+ records are expansive; every capped
    bound with P(fail) added to delta stays above the brute-force value (~1e-4 accuracy)."""
    n_others, q, b, T, z, lr, m_reg, h = 8, 0.1, 2, 6, 1.0, 0.5, 0.3, 1.0
    run = TrainingRunDpEvent(
        dataset_size=n_others + 1,
        batch_size=b,
        steps=T,
        noise_multiplier=z,
        clip_norm=1.0,
        learning_rate=lr,
        sampling="poisson",
        sampling_probability=q,
        geometry=LossGeometry(smoothness=m_reg + h, strong_convexity=m_reg),
        l2_regularization=m_reg,
    )
    bounds = bounds_of(run, REPLACE_ONE if relation == "REPLACE_ONE" else ADD_OR_REMOVE_ONE)
    finite = 0
    for d in (1e-2, 1e-3, 1e-5):
        truth = exact.poisson_huber_epsilon(
            n_others=n_others, q=q, b=b, steps=T, z=z, C=1.0, lr=lr, m_reg=m_reg, h=h, relation=relation, delta=d
        )
        for name, bound in bounds.items():
            e = bound.epsilon(d)
            finite += math.isfinite(e)
            assert e >= truth * (1 - 1e-3) - 1e-6, (name, relation, d, e, truth)
    assert finite > 0


@pytest.mark.slow
@pytest.mark.parametrize("relation", ["REPLACE_ONE", "ADD_OR_REMOVE_ONE"])
@pytest.mark.parametrize("z,T,q,lr,D", [(1.0, 30, 0.2, 0.5, 1.0), (2.0, 60, 0.1, 1.0, 0.5), (0.5, 40, 0.3, 0.3, 0.4)])
def test_projected_linear_brute_force(relation, z, T, q, lr, D):
    """Convex (c = 1) with a diameter: projected linear losses ([AT]'s lower-bound construction)."""
    run = TrainingRunDpEvent(
        dataset_size=50,
        batch_size=2,
        steps=T,
        noise_multiplier=z,
        clip_norm=1.0,
        learning_rate=lr,
        sampling="poisson",
        sampling_probability=q,
        geometry=LossGeometry(smoothness=1e-3, strong_convexity=0.0, diameter=D),
        l2_regularization=0.0,
    )
    bounds = bounds_of(run, REPLACE_ONE if relation == "REPLACE_ONE" else ADD_OR_REMOVE_ONE)
    assert bounds["si_poisson"].applicable and bounds["altschuler_talwar_eq3.3_poisson"].applicable
    for d in (1e-3, 1e-5):
        truth = exact.poisson_projected_epsilon(
            q=q, b=2, steps=T, z=z, C=1.0, lr=lr, m_reg=0.0, diameter=D, relation=relation, delta=d, grid=801
        )
        for name, bound in bounds.items():
            assert bound.epsilon(d) >= truth * (1 - 1e-3) - 1e-6, (name, relation, d)


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(
    z=st.sampled_from([0.5, 1.0, 2.0, 4.0]),
    T=st.integers(1, 10),
    q=st.floats(0.02, 0.6),
    lr=st.floats(0.05, 1.2),
    contraction=st.floats(0.05, 0.95),
    Mx=st.floats(1.0, 4.0),
    rel=st.sampled_from(RELATIONS),
)
def test_randomised_settings(z, T, q, lr, contraction, Mx, rel):
    m = contraction / lr
    b = max(1, int(round(q * 20)))
    M = m * Mx if lr * m * Mx < 2 else m
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check(run_of(20, q, b, T, z, lr, m, M=M), rel, deltas=(1e-5,), expect_applicable=())


FULL_GRID = [
    (20, q, max(1, int(round(q * 20))), T, z, lr, m)
    for z in (0.5, 1.0, 2.0, 4.0)
    for T in (1, 3, 8, 12)
    for q in (0.05, 0.3)
    for (lr, m) in ((0.5, 0.2), (1.0, 0.5), (0.5, 1.8))
]


@pytest.mark.slow
@pytest.mark.parametrize("setting", FULL_GRID)
def test_full_grid(setting):
    run = run_of(*setting)
    for rel in RELATIONS:
        check(run, rel, orders=ORDERS if run.steps <= 3 else None)


# ---------------------------------------------- fixed schedules under ADD_OR_REMOVE_ONE (section 11)
@pytest.mark.parametrize("n,T,z,lr,m", [(10, 20, 1.0, 0.5, 0.3), (50, 200, 2.0, 1.0, 0.1), (5, 3, 0.7, 0.2, 0.9)])
def test_bok_4_2_add_remove_is_the_exact_pair(n, T, z, lr, m):
    """Full batch, divisor n fixed: Bok et al. Thm 4.2 with L = C equals the exact add/remove
    Gaussian pair (lr <= 2/(m + M') with M' = ((n+1)/n) m for the quadratic loss)."""
    run = TrainingRunDpEvent(
        dataset_size=n,
        batch_size=n,
        steps=T,
        noise_multiplier=z,
        clip_norm=1.0,
        learning_rate=lr,
        sampling="full",
        geometry=LossGeometry(smoothness=m, strong_convexity=m),
        l2_regularization=m,
    )
    b = {x.name: x for x in analyze_training_run(run, cm.Context(neighboring_relation=ADD_OR_REMOVE_ONE))}
    truth = exact.exact_pair(run, relation="ADD_OR_REMOVE_ONE")
    assert b["bok_thm4.2"].mu == pytest.approx(truth.mu, rel=1e-9)
    assert b["bok_thm4.1"].mu >= truth.mu * (1 - 1e-12)
    replace = {x.name: x for x in analyze_training_run(run)}
    assert replace["bok_thm4.2"].mu == pytest.approx(exact.exact_pair(run).mu, rel=1e-9)
