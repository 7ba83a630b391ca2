"""Issue 19, item 2: amplification by the shuffle for reshuffled and shuffled-partition batches
(docs/derivations.md 5a), the best known lower bound for fixed-size batches (5a.6), and issue 18's
constrained shuffle_partition bound computed for all positions at once (2.3).

A bound is refuted only by the LOWER end of the exact bracket (hidden_state_accountants.exact).
"""

import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hidden_state_accountants import HiddenStateAccountant, LossGeometry, ParameterError, TrainingRunDpEvent, fdp
from hidden_state_accountants.analyses import bok, registry
from hidden_state_accountants.analyses import shifted_interpolation as si
from hidden_state_accountants.analyses import shuffle_amplification as sa
from hidden_state_accountants.analyses._common import Context
from hidden_state_accountants.exact import exact_pair, shuffled_lower_bound

CTX = Context()
DELTAS = (1e-2, 1e-5, 1e-8)
REL = 1e-9


def make(sampling, n, b, steps, z, lr=0.5, m=1.0, M=None, **kw):
    return TrainingRunDpEvent(
        dataset_size=n,
        batch_size=b,
        steps=steps,
        noise_multiplier=z,
        clip_norm=1.0,
        learning_rate=lr,
        sampling=sampling,
        geometry=LossGeometry(strong_convexity=m, smoothness=m if M is None else M),
        **kw,
    )


def amplified(run):
    return (sa.reshuffle_amplified if run.sampling == "reshuffle" else sa.position_amplified)(run, CTX)


def issue19(sampling, epochs=20, **kw):
    """The realistic run of issue 19: MNIST-sized logistic regression, L2 0.01 outside clipping."""
    return TrainingRunDpEvent(
        dataset_size=60000,
        batch_size=256,
        steps=epochs * 234,
        noise_multiplier=1.0,
        clip_norm=1.0,
        learning_rate=0.5,
        sampling=sampling,
        geometry=LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=0.01, num_classes=2),
        **kw,
    )


def assert_sound(bound, run, deltas=DELTAS):
    assert bound.applicable, bound.reason
    truth = exact_pair(run, grid_points=1 << 12)
    for d in deltas:
        e, t = bound.epsilon(d), truth.epsilon(d)
        assert e >= t * (1 - REL) - 1e-9, f"{run.sampling}: epsilon {e} < exact {t} at delta {d}"


# ========================================================================= Lemma 5a.1
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "sampling,n,b",
    [
        ("reshuffle", 20, 4),
        ("reshuffle", 7, 4),
        ("shuffle_partition", 61, 6),
        pytest.param("reshuffle", 60, 6, marks=SLOW),
        pytest.param("shuffle_partition", 20, 4, marks=SLOW),
    ],
)
@pytest.mark.parametrize("z", [0.5, 2.0, pytest.param(1.0, marks=SLOW)])
def test_one_step_is_exactly_the_subsampled_gaussian(sampling, n, b, z):
    """One step: the record is in the batch with probability b/n, else the outputs are identical;
    the plan with that common part is Balle et al.'s advanced joint convexity, i.e. exactly
    C_p(G(2/z)), which is the exact worst pair (docs/derivations.md 1.1, 5a.1). Any factor lost or
    gained (capacity, shift, weight) moves it off the exact value."""
    run = make(sampling, n, b, 1, z)
    bound, truth = amplified(run), exact_pair(run)
    for d in DELTAS:
        e, t = bound.epsilon(d), truth.epsilon(d)
        assert t * (1 - REL) - 1e-9 <= e <= t * (1 + 1e-6) + 1e-9, (d, e, t)
    # the same by the closed form of C_p: delta(eps) = p delta_G(log(1 + (e^eps - 1)/p))
    p = b / n
    for eps in (0.1, 1.0, 3.0):
        cp = p * fdp.gdp_delta(2.0 / z, math.log1p(math.expm1(eps) / p))
        assert bound.delta(eps) == pytest.approx(cp, rel=1e-6)


def test_diagonal_plan_is_joint_convexity():
    w = np.array([0.2, 0.3, 0.5])
    mu = np.array([2.0, 0.7, 0.1])
    for eps in (0.0, 0.5, 2.0):
        joint = sum(wi * fdp.gdp_delta(m, eps) for wi, m in zip(w, mu))
        assert math.exp(sa.diagonal_log_delta(eps, np.log(w), mu)) == pytest.approx(joint, rel=1e-12)


def _gaussian_mixture_hockey(means_p, means_q, w, eps):
    """H_{e^eps} of two mixtures of unit-variance Gaussians on the line, both directions, by quadrature."""
    x = np.linspace(min(means_p.min(), means_q.min()) - 14, max(means_p.max(), means_q.max()) + 14, 400001)
    p = (w[None, :] * np.exp(-0.5 * (x[:, None] - means_p[None, :]) ** 2)).sum(1) / math.sqrt(2 * math.pi)
    q = (w[None, :] * np.exp(-0.5 * (x[:, None] - means_q[None, :]) ** 2)).sum(1) / math.sqrt(2 * math.pi)
    dx = x[1] - x[0]
    return max(np.sum(np.maximum(p - math.exp(eps) * q, 0)) * dx, np.sum(np.maximum(q - math.exp(eps) * p, 0)) * dx)


@settings(max_examples=8, deadline=None)
@given(k=st.integers(2, 6), seed=st.integers(0, 10**6), eps=st.sampled_from([0.0, 0.3, 1.0, 2.5]))
def test_every_plan_bounds_mixtures_that_meet_the_pairwise_bounds(k, seed, eps):
    """Lemma 5a.1 and the plan shape of 5a.4 on explicit mixtures: P_j = N(a_j), Q_i = N(b_i) meet
    T(Q_i, P_j) = G(|a_j - b_i|) exactly; every pool threshold and price gives a bound above the
    true hockey-stick divergence (by quadrature)."""
    rng = np.random.default_rng(seed)
    w = rng.dirichlet(np.ones(k))
    a = rng.normal(0, 1.5, k)
    b = a + rng.normal(0, 0.6, k) * rng.integers(0, 2, k)  # some components common
    mu = np.abs(a[:, None] - b[None, :])  # mu[j, i] for the pair (P_j, Q_i), Q_i against P_j
    truth = _gaussian_mixture_hockey(a, b, w, eps)
    lw = np.log(w)
    mu_self = np.diag(mu).copy()
    order = np.argsort(-mu_self)  # the pool: the components with the smallest self divergence
    for size in range(1, k):
        in_pool = np.zeros(k, dtype=bool)
        in_pool[order[k - size :]] = True
        # the pairs this shape uses: (P_j, Q_i) for j outside and i in the pool, both directions
        cross = np.where(in_pool, 0.0, np.max(np.maximum(mu, mu.T)[:, in_pool], axis=1))
        split = sa.Split.of(lw, mu_self, sa.Pool(in_pool, cross, 0))
        for tau in (-2.0, 0.0, 1.5, 4.0):
            cost, dem, sup = sa.plan_terms(eps, tau, split)
            if dem <= sup:
                assert math.exp(cost) >= truth * (1 - 1e-6) - 1e-12, (size, tau, math.exp(cost), truth)
        assert math.exp(sa.plan_log_delta(eps, split)[0]) >= truth * (1 - 1e-6) - 1e-12


# ===================================================================== against the truth
RS_CASES = [  # (n, b, steps, z, lr m, last_batch): whole and partial epochs, dropped slots, c near 0 and 1
    (60, 6, 40, 2.0, 0.5, "dropped"),
    (13, 3, 9, 0.5, 0.8, "dropped"),
    (11, 4, 7, 1.0, 0.5, "kept_own_size"),
    (7, 3, 9, 0.5, 0.5, "kept_batch_size"),
    pytest.param(64, 6, 25, 1.0, 0.2, "dropped", marks=SLOW),
    pytest.param(20, 4, 6, 0.5, 0.5, "dropped", marks=SLOW),
    pytest.param(7, 4, 5, 1.0, 0.5, "dropped", marks=SLOW),
    pytest.param(20, 4, 13, 1.0, 1e-4, "dropped", marks=SLOW),
    pytest.param(20, 4, 13, 1.0, 0.999, "dropped", marks=SLOW),
    pytest.param(61, 6, 17, 2.0, 0.5, "kept_own_size", marks=SLOW),
    pytest.param(61, 6, 22, 0.5, 0.3, "kept_batch_size", marks=SLOW),
]


@pytest.mark.parametrize("n,b,steps,z,lr_m,last_batch", RS_CASES)
def test_reshuffle_amplified_is_sound(n, b, steps, z, lr_m, last_batch):
    run = make("reshuffle", n, b, steps, z, m=lr_m / 0.5, last_batch=last_batch)
    assert_sound(amplified(run), run)


SP_CASES = [
    (60, 6, 40, 2.0, 0.5),
    (64, 6, 7, 1.0, 0.6),
    (60, 6, 3, 1.0, 0.5),
    pytest.param(60, 6, 20, 0.5, 0.1, marks=SLOW),
    pytest.param(64, 6, 25, 1.0, 0.6, marks=SLOW),
    pytest.param(20, 4, 30, 4.0, 0.5, marks=SLOW),
    pytest.param(20, 4, 13, 1.0, 1e-4, marks=SLOW),
    pytest.param(20, 4, 13, 1.0, 0.999, marks=SLOW),
]


@pytest.mark.parametrize("n,b,steps,z,lr_m", SP_CASES)
def test_position_amplified_is_sound(n, b, steps, z, lr_m):
    run = make("shuffle_partition", n, b, steps, z, m=lr_m / 0.5)
    assert_sound(amplified(run), run)


@SLOW
@settings(max_examples=10, deadline=None)
@given(
    n=st.integers(4, 40),
    b=st.integers(1, 8),
    steps=st.integers(1, 24),
    z=st.sampled_from([0.5, 1.0, 2.0, 4.0]),
    lr_m=st.floats(0.05, 0.95),
    M_over_m=st.sampled_from([1.0, 1.5]),
    delta=st.sampled_from(DELTAS),
    last_batch=st.sampled_from(["dropped", "kept_own_size", "kept_batch_size"]),
)
def test_randomised_soundness(n, b, steps, z, lr_m, M_over_m, delta, last_batch):
    b = min(b, max(1, n // 2))
    m = lr_m / 0.5
    M = min(m * M_over_m, 3.9)
    for sampling in ("reshuffle", "shuffle_partition"):
        if sampling == "shuffle_partition" and (n // b < 2 or last_batch != "dropped"):
            continue
        run = make(sampling, n, b, steps, z, m=m, M=M, last_batch=last_batch)
        assert amplified(run).epsilon(delta) >= exact_pair(run, grid_points=1 << 12).epsilon(delta) * (1 - REL) - 1e-9


@SLOW
def test_never_above_the_worst_position():
    """An average of pair costs is at most the worst position's (the diagonal plan is included)."""
    for lr_m, z in ((0.1, 1.0), (0.5, 2.0), (0.01, 0.5)):
        rs = make("reshuffle", 60, 6, 37, z, m=lr_m / 0.5)
        sp = make("shuffle_partition", 60, 6, 37, z, m=lr_m / 0.5)
        for d in DELTAS:
            assert amplified(rs).epsilon(d) <= si.reshuffle_worst(rs, CTX).epsilon(d) * (1 + 1e-9)
            assert amplified(sp).epsilon(d) <= bok.thm_4_5(sp, CTX).epsilon(d) * (1 + 1e-9)


@SLOW
def test_profile_is_a_dominating_pld_and_composes():
    run = make("reshuffle", 60, 6, 40, 2.0, m=0.5)
    bound = amplified(run)
    pld = bound.pld(1e-5, 1e-3)
    assert fdp.pld_epsilon(pld, 1e-5) >= bound.epsilon(1e-5) - 1e-9
    for eps in (0.5, 1.5, 3.0):
        assert fdp.pld_delta(pld, eps) >= bound.delta(eps) * (1 - 1e-9)
    assert bound.delta(-0.5) == pytest.approx(1 - math.exp(-0.5) + math.exp(-0.5) * bound.delta(0.5))
    acc = HiddenStateAccountant().compose(run, count=2)  # a composition of two runs goes through the PLD
    assert acc.get_epsilon(1e-5) < 2 * si.reshuffle_average(run, CTX).epsilon(1e-5)


# ============================================================== conditions and the registry
def test_conditions_and_relations():
    assert "public" in amplified(make("reshuffle", 60, 6, 20, 1.0, secret_batches=False)).reason
    assert "public" in amplified(make("shuffle_partition", 60, 6, 20, 1.0, secret_batches=False)).reason
    assert "strongly convex" in amplified(make("reshuffle", 60, 6, 20, 1.0, m=0.0, M=1.0)).reason
    for name, sampling in (("si_reshuffle_amplified", "reshuffle"), ("si_position_amplified", "shuffle_partition")):
        info = registry.get(name)
        assert info.schedules == (sampling,) and info.relations == ("REPLACE_ONE",)


# ============================================================== the run of issue 19
@pytest.mark.parametrize("sampling", ["reshuffle", "shuffle_partition"])
def test_issue19_run_meets_the_target(sampling):
    """reshuffle b = 256 on MNIST-sized logistic regression: 7.05 before (the per-position average),
    target 3.5, best known lower bound 0.965."""
    run = issue19(sampling)
    start = time.perf_counter()
    eps = amplified(run).epsilon(1e-5)
    assert time.perf_counter() - start < 5.0  # about 0.3 s alone; a loose bound on a shared machine
    assert eps == pytest.approx(2.53, abs=0.01) and eps <= 3.5
    assert eps >= shuffled_lower_bound(run, 1e-5) > 0.96
    before = (si.reshuffle_average if sampling == "reshuffle" else si.position_average)(run, CTX).epsilon(1e-5)
    assert before == pytest.approx(7.05, abs=0.01)
    report = HiddenStateAccountant().compose(run).explain(1e-5)
    assert report.epsilon == pytest.approx(eps) and report.analysis.endswith("_amplified")


def test_the_noise_does_not_recompute_the_pairs():
    run = issue19("reshuffle", epochs=5)
    amplified(run).epsilon(1e-5)
    start = time.perf_counter()
    for z in (0.8, 1.2, 2.0):
        amplified(run.replace(noise_multiplier=z)).epsilon(1e-5)
    assert time.perf_counter() - start < 5.0


# ================================================================= the lower bound (5a.6)
@pytest.mark.parametrize(
    "sampling,steps", [("reshuffle", 13), ("reshuffle", 40), ("shuffle_partition", 25), ("cyclic", 25)]
)
def test_lower_bound_is_the_exact_pair_for_one_curvature(sampling, steps):
    run = make(sampling, 60, 6, steps, 1.0, m=0.5)
    for d in (1e-3, 1e-6):
        assert shuffled_lower_bound(run, d) == pytest.approx(exact_pair(run, grid_points=1 << 12).epsilon(d), rel=1e-6)
    mixed = make(sampling, 60, 6, steps, 1.0, m=0.1, M=1.5)
    lb = shuffled_lower_bound(mixed, 1e-5)
    for kappa in (0.1, 1.5):
        fixed = mixed.replace(geometry=LossGeometry(strong_convexity=kappa, smoothness=kappa))
        assert lb >= exact_pair(fixed, grid_points=1 << 12).epsilon(1e-5) * (1 - 1e-6)
    assert shuffled_lower_bound(mixed, 1e-5, curvature=0.1) == pytest.approx(
        exact_pair(mixed, grid_points=1 << 12).epsilon(1e-5), rel=1e-6
    )


def test_lower_bound_public_batches_and_add_remove():
    cyc = make("cyclic", 60, 6, 25, 1.0, m=0.5)
    for sampling in ("reshuffle", "shuffle_partition"):  # public: the worst pattern is cyclic's worst batch
        public = make(sampling, 60, 6, 30, 1.0, m=0.5, secret_batches=False)
        assert shuffled_lower_bound(public, 1e-5) == pytest.approx(
            exact_pair(make("cyclic", 60, 6, 30, 1.0, m=0.5)).epsilon(1e-5), rel=1e-6
        )
    assert shuffled_lower_bound(cyc, 1e-5, relation="ADD_OR_REMOVE_ONE") == pytest.approx(
        exact_pair(cyc, relation="ADD_OR_REMOVE_ONE").epsilon(1e-5), rel=1e-6
    )


@pytest.mark.parametrize(
    "kwargs,change,parameter",
    [
        (dict(), dict(sampling="poisson"), "sampling"),
        (dict(), dict(relation="ADD_OR_REMOVE_ONE"), "neighboring_relation"),
        (dict(), dict(curvature=5.0), "curvature"),
        (dict(), dict(delta=0.0), "delta"),
    ],
)
def test_lower_bound_refuses_bad_input(kwargs, change, parameter):
    run = make("reshuffle", 60, 6, 20, 1.0, m=0.5, M=1.0)
    delta = change.pop("delta", 1e-5)
    if "sampling" in change:
        run = TrainingRunDpEvent(
            dataset_size=60,
            batch_size=6,
            steps=20,
            noise_multiplier=1.0,
            clip_norm=1.0,
            learning_rate=0.5,
            sampling="poisson",
            geometry=run.geometry,
        )
        change = {}
    with pytest.raises(ParameterError) as err:
        shuffled_lower_bound(run, delta, **change)
    assert err.value.parameter == parameter
    projected = make("reshuffle", 60, 6, 20, 1.0, m=0.5).replace(
        geometry=LossGeometry(strong_convexity=0.5, smoothness=0.5, diameter=1.0)
    )
    with pytest.raises(ParameterError, match="projection"):
        shuffled_lower_bound(projected, 1e-5)


def test_lower_bound_at_issue19_sizes():
    """The rows of issue 19: 0.965 for both shuffled schedules (curvature M), 8.42 for cyclic."""
    for sampling, expected in (("reshuffle", 0.9646), ("shuffle_partition", 0.9647), ("cyclic", 8.4191)):
        start = time.perf_counter()
        assert shuffled_lower_bound(issue19(sampling), 1e-5) == pytest.approx(expected, abs=2e-4)
        assert time.perf_counter() - start < 5.0  # 0.2-0.5 s alone


# ============================================ issue 18: the constrained partition bound, all positions at once
def _reference_constrained(model, last, visits, period, debt):
    return np.array(
        [si.constrained_energy(model, (m, v, period), [], debt) if v else 0.0 for m, v in zip(last, visits)]
    )


@pytest.mark.parametrize("log_c", [math.log(0.3), math.log(0.9), math.log(0.999), 0.0])
@pytest.mark.parametrize("debt", [0.0, 0.05, 1.0, 1e9])
def test_all_positions_at_once_equal_one_at_a_time(log_c, debt):
    for l, T in ((5, 3), (7, 40), (12, 300)):
        model = si.StepModel(T, l, log_c)
        full, rest = divmod(T, l)
        last = list(range(l))
        visits = [full + (1 if m < rest else 0) for m in last]
        new = si.chain_constrained_energies(model, last, visits, l, debt)
        np.testing.assert_allclose(new, _reference_constrained(model, last, visits, l, debt), rtol=1e-9, atol=1e-300)


def test_skipped_starts_past_the_cut_only_raise_the_energy():
    model = si.StepModel(3000, 40, math.log(0.5))  # cut = 432 steps: the starts further back are skipped
    last, visits = list(range(40)), [75] * 40
    new = si.chain_constrained_energies(model, last, visits, 40, 0.3)
    assert np.all(new >= _reference_constrained(model, last, visits, 40, 0.3) * (1 - 1e-12))


def test_constrained_partition_at_920_batches_is_fast():
    """Issue 18: 30 s per evaluation before (positions one by one, every start a hull of up to 256
    corners); the same value now."""
    run = TrainingRunDpEvent(
        dataset_size=58880,
        batch_size=64,
        steps=20 * 920,
        noise_multiplier=1.0,
        clip_norm=1.0,
        learning_rate=0.5,
        sampling="shuffle_partition",
        geometry=LossGeometry(strong_convexity=0.0, smoothness=1.01, diameter=1.0),
    )
    start = time.perf_counter()
    eps = si.position_average_constrained(run, CTX).epsilon(1e-5)
    assert time.perf_counter() - start < 3.0  # 0.1 s alone
    assert eps == pytest.approx(6.154825775836222, rel=1e-9)
