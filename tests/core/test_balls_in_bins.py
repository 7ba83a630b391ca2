"""Balls-in-bins sampling (docs/derivations.md, "Balls-in-bins sampling"): the schedule's law and its
analyses pinned against ground truth.

Exact values: :func:`hidden_state_accountants.exact.exact_pair` (linear losses, the worst known pairs
of each relation: *half* under ADD_OR_REMOVE_ONE, the worse of *mirror* and *half* under REPLACE_ONE);
brute force where the batch-size cap binds (:func:`~hidden_state_accountants.exact.balls_in_bins_huber_epsilon`).
A bound is checked as ``bound >= exact`` (relative slack 1e-6); at one step the add/remove bound must
equal the exact sampled Gaussian, so a wrong factor (sensitivity 2C instead of C, or C/2) fails.
"""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st
from scipy import stats

from hidden_state_accountants import HiddenStateAccountant, LossGeometry, ParameterError, TrainingRunDpEvent, exact, fdp
from hidden_state_accountants.analyses import _common as cm
from hidden_state_accountants.analyses import balls_in_bins as bib
from hidden_state_accountants.analyses import registry
from hidden_state_accountants.bounds import MixtureGdpBound, mixture_components
from hidden_state_accountants.relations import ADD_OR_REMOVE_ONE, REPLACE_ONE, schedule_reason
from hidden_state_accountants.schedules import BALLS_IN_BINS, RANDOM, SAMPLINGS, BatchSchedule

RELATIONS = (REPLACE_ONE, ADD_OR_REMOVE_ONE)
SLACK = 1e-6


def run_of(n, b, T, z, lr, m, M=None, l2="same", **kw):
    return TrainingRunDpEvent(
        dataset_size=n,
        batch_size=b,
        steps=T,
        noise_multiplier=z,
        clip_norm=1.0,
        learning_rate=lr,
        sampling=BALLS_IN_BINS,
        geometry=LossGeometry(strong_convexity=m, smoothness=m if M is None else M),
        l2_regularization=m if l2 == "same" else l2,
        **kw,
    )


def ctx_of(relation):
    return cm.Context(neighboring_relation=relation)


def check(run, relation, deltas=(1e-3, 1e-5, 1e-7)):
    truth = exact.exact_pair(run, relation=relation.name)
    bound = bib.si_balls_in_bins(run, ctx_of(relation))
    assert bound.applicable, bound.reason
    out = []
    for d in deltas:
        e, x = bound.epsilon(d), truth.epsilon(d)
        assert e >= x * (1 - SLACK) - 1e-9, (relation.name, d, e, x)
        out.append((e, x))
    return out


# ------------------------------------------------------------------------------ the schedule
def test_every_record_once_per_epoch_in_batches_of_random_size():
    s = BatchSchedule(50, 7, BALLS_IN_BINS, seed=3)
    t = s.steps_per_epoch
    assert t == 7 and not s.fixed_batch_size and s.dropped_per_epoch == 0 and BALLS_IN_BINS in RANDOM
    for e in range(3):
        batches = [s.batch(e * t + j).tolist() for j in range(t)]
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(50))  # each record exactly once
        assert all(b == sorted(b) for b in batches)
    sizes = [len(s.batch(k)) for k in range(70)]
    assert len(set(sizes)) > 3  # sizes vary around n / t


def test_steps_are_uniform_and_independent_across_records_and_epochs():
    """Chi-square tests on many epochs: each record's step is uniform, two records' steps are jointly
    uniform (independent), and a record's steps in consecutive epochs are independent."""
    n, b = 40, 8
    s = BatchSchedule(n, b, BALLS_IN_BINS, seed=11)
    t = s.steps_per_epoch
    a = np.stack([s.epoch_assignment(e) for e in range(3000)])  # (epochs, records)
    p_uniform = stats.chisquare(np.bincount(a[:, 0], minlength=t)).pvalue
    p_pair = stats.chisquare(np.bincount(a[:, 0] * t + a[:, 1], minlength=t * t)).pvalue
    p_epochs = stats.chisquare(np.bincount(a[:-1, 2] * t + a[1:, 2], minlength=t * t)).pvalue
    assert min(p_uniform, p_pair, p_epochs) > 1e-4, (p_uniform, p_pair, p_epochs)
    counts = np.stack([np.bincount(row, minlength=t) for row in a[:200]])
    assert np.all(counts.sum(axis=1) == n)


def test_adding_a_record_leaves_every_other_records_step_unchanged():
    """The draws are i.i.d. per record: appending one (same t) changes no other record's step, unlike
    the package's permutation schedules, where it moves others (docs/derivations.md section 11)."""
    n, b = 61, 6  # n // b = (n + 1) // b = 10
    for seed in (1, 2, 3):
        small, large = BatchSchedule(n, b, BALLS_IN_BINS, seed=seed), BatchSchedule(n + 1, b, BALLS_IN_BINS, seed=seed)
        for e in range(5):
            assert np.array_equal(large.epoch_assignment(e)[:n], small.epoch_assignment(e))
        reshuffled = [BatchSchedule(m, b, "reshuffle", seed=seed).epoch_order(0) for m in (n, n + 1)]
        assert not np.array_equal(reshuffled[0], reshuffled[1][reshuffled[1] < n])  # a permutation moves others


def test_secret_seed_by_default_resumable_and_described():
    s = BatchSchedule(30, 4, BALLS_IN_BINS)
    assert s.seed_is_secret and s.is_random
    restored = BatchSchedule.from_description(s.describe(), seed_is_secret=True)
    assert restored == s and restored.seed_is_secret
    fresh = BatchSchedule.from_description(s.describe())
    assert [fresh.batch(k).tolist() for k in (0, 9, 100, 7)] == [s.batch(k).tolist() for k in (0, 9, 100, 7)]
    with pytest.raises(ParameterError, match="draws no step per record"):
        BatchSchedule(30, 4, "reshuffle", seed=1).epoch_assignment(0)


# ------------------------------------------------------------------- registry and relations
def test_balls_in_bins_is_covered_under_add_or_remove():
    assert BALLS_IN_BINS in SAMPLINGS and schedule_reason(ADD_OR_REMOVE_ONE, BALLS_IN_BINS) is None
    names = {a.name for a in registry.analyses_for(BALLS_IN_BINS)}
    assert {"si_balls_in_bins", "composition_balls_in_bins"} <= names
    assert "balls_in_bins" in schedule_reason(ADD_OR_REMOVE_ONE, "reshuffle")  # the reason points to it


# --------------------------------------------------------------------------- the cap
def _exact_epoch_failure(others, t, cap):
    """P(some step of one epoch holds more than cap of the others), by enumerating the multinomial."""
    total = 0.0
    for counts in itertools.product(range(others + 1), repeat=t):
        if sum(counts) == others and max(counts) > cap:
            total += stats.multinomial.pmf(counts, others, [1.0 / t] * t)
    return total


@pytest.mark.parametrize("others,t,cap", [(6, 3, 3), (8, 2, 5), (7, 4, 2), (5, 5, 1)])
def test_cap_failure_is_an_upper_bound_and_the_independent_formula_is_not(others, t, cap):
    steps = 2 * t + 1  # two whole epochs and one step
    p_epoch = _exact_epoch_failure(others, t, cap)
    sf = stats.binom.sf(cap, others, 1.0 / t)
    truth = 1 - (1 - p_epoch) ** 2 * (1 - sf)  # the partial epoch's one step is a binomial
    bound = math.exp(bib.log_allocation_cap_failure(others, t, steps, cap))
    assert bound >= truth * (1 - 1e-12)
    independent = 1 - (1 - sf) ** steps  # section 7's formula for independent steps
    assert independent <= truth + 1e-15  # negative association: it would under-report


# ------------------------------------------------------------------ soundness against exact
def test_one_step_equals_the_sampled_gaussian():
    """T = 1: the record is in the step with probability 1/t and the bound is exactly the sampled
    Gaussian ((1-1/t) N(0) + (1/t) N(1/z), N(0)), the exact half pair; sensitivity 2C or C/2 would miss."""
    for n, b, z in ((6, 2, 0.5), (20, 4, 1.0), (9, 3, 2.0)):
        run = run_of(n, b, 1, z, 0.5, 0.5)
        bound = bib.si_balls_in_bins(run, ctx_of(ADD_OR_REMOVE_ONE))
        truth = exact.exact_pair(run, relation="ADD_OR_REMOVE_ONE")
        t = n // b
        sampled = exact.MixturePair([0.0, 1.0 / z], np.log([1 - 1 / t, 1 / t]), [0.0], [0.0])
        for d in (1e-2, 1e-5):
            e = bound.epsilon(d)
            assert e == pytest.approx(truth.epsilon(d), rel=1e-6) and e == pytest.approx(sampled.epsilon(d), rel=1e-6)
            doubled = exact.MixturePair([0.0, 2.0 / z], np.log([1 - 1 / t, 1 / t]), [0.0], [0.0]).epsilon(d)
            assert e < 0.9 * doubled


@pytest.mark.parametrize("relation", RELATIONS, ids=lambda r: r.name)
@pytest.mark.parametrize(
    "n,b,T,z,lrm,Mfac",
    [
        (6, 2, 2, 0.5, 0.5, 1.0),
        (9, 3, 5, 1.0, 0.1, 1.5),
        (12, 3, 7, 2.0, 0.9, 1.0),
        (12, 4, 4, 4.0, 0.5, 1.2),
        (9, 3, 3, 1.0, 0.5, 1.5),
        (20, 4, 6, 1.0, 0.5, 1.0),
    ],
)
def test_bound_is_at_least_the_exact_pair(relation, n, b, T, z, lrm, Mfac):
    m = 0.5
    check(run_of(n, b, T, z, lrm / m, m, M=m * Mfac), relation)


@pytest.mark.slow
@pytest.mark.parametrize("relation", RELATIONS, ids=lambda r: r.name)
def test_bound_is_at_least_the_exact_pair_on_a_grid(relation):
    """340 settings per relation (300 with a cap below delta), three deltas: the ratios quoted in
    docs/derivations.md B.3/B.4."""
    ratios = []
    for (n, b), T, z, lrm, Mfac in itertools.product(
        ((6, 2), (9, 3), (12, 3)), (1, 2, 3, 5, 9), (0.5, 1, 2, 4), (0.1, 0.5, 0.9), (1.0, 1.5)
    ):
        m = 0.5
        if (lrm / m) * m * Mfac * (b + 1) / b >= 2:
            continue
        run = run_of(n, b, T, z, lrm / m, m, M=m * Mfac)
        bound = bib.si_balls_in_bins(run, ctx_of(relation))
        if not bound.applicable or not math.isfinite(bound.epsilon(1e-3)):
            continue  # a cap that cannot be met below delta: infinite, nothing to check
        ratios += [e / x for e, x in check(run, relation) if x > 0]
    assert min(ratios) >= 1 - SLACK and len(ratios) == 900


@pytest.mark.parametrize("relation", RELATIONS, ids=lambda r: r.name)
def test_binding_cap_against_brute_force(relation):
    """A Huber loss whose batches of more than 19 records are expansive: the largest admissible cap
    (18 others) fails with probability about 2e-3, which the bound adds to delta."""
    n, b, lr, m_reg, h = 30, 10, 0.976, 0.1, 1.0
    run = TrainingRunDpEvent(
        dataset_size=n,
        batch_size=b,
        steps=3,
        noise_multiplier=1.0,
        clip_norm=1.0,
        learning_rate=lr,
        sampling=BALLS_IN_BINS,
        l2_regularization=m_reg,
        geometry=LossGeometry(strong_convexity=m_reg, smoothness=m_reg + h),
    )
    setup, _ = bib.allocation_setup(run, ctx_of(relation))
    caps = bib.allocation_caps(setup)
    assert caps and max(c.cap for c in caps) < n and all(1e-4 < c.p < 1e-2 for c in caps)  # binding
    bound = bib.si_balls_in_bins(run, ctx_of(relation))
    others = n if relation == ADD_OR_REMOVE_ONE else n - 1
    truth = exact.balls_in_bins_huber_epsilon(
        n_others=others,
        b=b,
        steps_per_epoch=n // b,
        steps=3,
        z=1.0,
        C=1.0,
        lr=lr,
        m_reg=m_reg,
        h=h,
        relation=relation.name,
        delta=1e-2,
    )
    assert bound.epsilon(1e-2) >= truth * (1 + 1e-3)


@given(
    n=st.integers(4, 14),
    b=st.integers(1, 4),
    T=st.integers(1, 8),
    z=st.floats(0.4, 5.0),
    lrm=st.floats(0.05, 0.95),
    relation=st.sampled_from(RELATIONS),
)
def test_random_settings_are_sound(n, b, T, z, lrm, relation):
    if b > n:
        return
    check(run_of(n, b, T, z, lrm / 0.5, 0.5), relation, deltas=(1e-4,))


# ------------------------------------------------------------------- structure of the bound
def test_common_null_pair_is_below_joint_convexity():
    """Lemma CN averages tradeoff curves at equal alpha; joint convexity averages deltas at equal eps
    and is never smaller (docs/derivations.md B.3)."""
    pats = bib.visit_patterns(3 * 20, 20, math.log(0.9))
    probs, mus = [p for p, _ in pats], [math.sqrt(e) for _, e in pats]
    pair = bib.GaussianMixturePairBound(probs=probs, mus=mus)
    p1, m1 = mixture_components(probs, mus)
    average = MixtureGdpBound(probs=p1, mus=m1)
    for d in (1e-2, 1e-5, 1e-9):
        assert pair.epsilon(d) <= average.epsilon(d) + 1e-9
    for e in (0.1, 1.0, 3.0):
        assert pair.delta(e) <= average.delta(e) + 1e-12


def test_traced_profiles_are_exact_and_the_pld_dominates():
    pair = bib.GaussianMixturePairBound(probs=(0.7, 0.2, 0.1), mus=(0.1, 0.8, 2.0))
    ef, hf, er, hr = pair.traces()
    for i in range(0, ef.size, 997):
        if -5 < ef[i] < 5:
            assert hf[i] == pytest.approx(math.exp(pair.pair._log_forward(float(ef[i]))), rel=1e-6, abs=1e-15)
    for i in range(0, er.size, 997):
        if -5 < er[i] < 5:
            assert hr[i] == pytest.approx(math.exp(pair.pair._log_reverse(float(er[i]))), rel=1e-6, abs=1e-15)
    pld = pair.pld(1e-5, 1e-3)
    for e in (0.0, 0.5, 1.0, 2.5):
        assert fdp.pld_delta(pld, e) >= pair.delta(e) * (1 - 1e-9)


def test_replace_one_triangle_is_symmetric_in_the_legs_and_below_twice_the_shift():
    """The triangle bound lies above the add/remove pair and below per-pattern joint convexity with
    shift 2C at the MNIST scale (docs/derivations.md B.4: 1.01 against 7.05)."""
    pats = bib.visit_patterns(234 * 2, 234, math.log(0.995))
    probs, mus = [p for p, _ in pats], [math.sqrt(e) for _, e in pats]
    pair = bib.GaussianMixturePairBound(probs=probs, mus=mus)
    tri = bib.ReplaceTriangleBound(add_remove=pair)
    p2, m2 = mixture_components(probs, [2 * m for m in mus])
    for d in (1e-3, 1e-5):
        assert pair.epsilon(d) <= tri.epsilon(d) < MixtureGdpBound(probs=p2, mus=m2).epsilon(d)
    for e in (0.5, 1.0):
        assert tri.delta(e) >= pair.delta(e)


# ------------------------------------------------------------------------------- the baselines
@pytest.mark.parametrize("relation,rho", [(REPLACE_ONE, 2.0), (ADD_OR_REMOVE_ONE, 1.0)], ids=["replace", "add_remove"])
def test_composition_is_one_gaussian_per_epoch(relation, rho):
    run = run_of(20, 4, 12, 2.0, 0.5, 0.5)  # t = 5: 2 whole epochs and a partial one
    bound = registry.get("composition_balls_in_bins").function(run, ctx_of(relation))
    assert bound.mu == pytest.approx(rho * math.sqrt(3) / 2.0)
    noisy = run.replace(noise_multiplier=tuple([2.0] * 11 + [1.0]))  # the last epoch's noisiest step
    assert registry.get("composition_balls_in_bins").function(noisy, ctx_of(relation)).mu == pytest.approx(
        rho * math.sqrt(1 / 4 + 1 / 4 + 1.0)
    )


def test_public_draws_get_the_worst_pattern_and_missing_l2_is_a_reason():
    run = run_of(20, 4, 12, 1.0, 0.5, 0.5)
    public = bib.si_balls_in_bins(run.replace(secret_batches=False), ctx_of(ADD_OR_REMOVE_ONE))
    secret = bib.si_balls_in_bins(run, ctx_of(ADD_OR_REMOVE_ONE))
    assert public.epsilon(1e-5) > secret.epsilon(1e-5)
    assert public.epsilon(1e-5) >= exact.exact_pair(run, relation="ADD_OR_REMOVE_ONE").epsilon(1e-5)
    for l2 in (None, 0.0):
        nope = bib.si_balls_in_bins(run.replace(l2_regularization=l2), ctx_of(REPLACE_ONE))
        assert not nope.applicable and "l2_regularization > 0" in nope.reason


def test_affine_analysis_and_audit_use_the_schedules_law():
    """The affine analysis averages the exact Gaussian over the record's steps (M = m), and the audit
    simulates one uniform step per epoch with the others at 0 (their random sum is common noise):
    its lower bound stays below the exact mirror pair."""
    from hidden_state_accountants.audit import audit

    run = run_of(20, 4, 6, 1.0, 1.0, 0.5)
    affine = registry.get("affine_exact_average").function(run, ctx_of(REPLACE_ONE))
    mirror = exact.exact_pair(run, construction="mirror").epsilon(1e-3)
    assert affine.epsilon(1e-3) >= exact.exact_pair(run).epsilon(1e-3) * (1 - SLACK)
    result = audit(run, repetitions=20000, delta=1e-3, seed=1)
    assert 0.5 * mirror < result.epsilon_lower <= mirror


def test_accountant_reports_add_remove_for_balls_in_bins():
    run = run_of(60, 6, 30, 1.0, 0.5, 0.5)
    report = HiddenStateAccountant(neighboring_relation="ADD_OR_REMOVE_ONE").compose(run).explain(1e-5)
    assert report.analysis == "si_balls_in_bins" and math.isfinite(report.epsilon)
    assert report.neighboring_relation == "ADD_OR_REMOVE_ONE"


@pytest.mark.slow
def test_mnist_scale_numbers_and_speed():
    """The numbers of docs/derivations.md B.8, and a query under a second at 1e5 steps (idle machine;
    generous here)."""
    import time

    geom = LossGeometry.logistic_regression(1.0, 0.01, num_classes=2)  # clip 1 binds on 3+ classes (section 18)
    run = TrainingRunDpEvent(
        dataset_size=60000,
        batch_size=256,
        steps=234 * 20,
        noise_multiplier=1.0,
        clip_norm=1.0,
        learning_rate=0.5,
        sampling=BALLS_IN_BINS,
        geometry=geom,
        l2_regularization=0.01,
    )
    add_remove = bib.si_balls_in_bins(run, ctx_of(ADD_OR_REMOVE_ONE)).epsilon(1e-5)
    replace = bib.si_balls_in_bins(run, ctx_of(REPLACE_ONE)).epsilon(1e-5)
    assert add_remove == pytest.approx(0.5445, abs=2e-3) and replace == pytest.approx(0.987, abs=5e-3)
    truth = exact.exact_pair(
        run.replace(geometry=LossGeometry(strong_convexity=0.01, smoothness=0.01)),
        relation="ADD_OR_REMOVE_ONE",
        grid_points=1 << 13,
    )
    assert add_remove >= truth.epsilon_bracket(1e-5)[1]
    long = run.replace(steps=10**5)
    start = time.perf_counter()
    HiddenStateAccountant(neighboring_relation="ADD_OR_REMOVE_ONE").compose(long).get_epsilon(1e-5)
    assert time.perf_counter() - start < 5.0
