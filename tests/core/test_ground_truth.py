"""Issue 11, section 1: the ground truth is the worst known neighbouring pair (hidden_state_accountants.exact)."""

import math

import numpy as np
import pytest

from hidden_state_accountants import LossGeometry, ParameterError, TrainingRunDpEvent, exact, fdp, schedule_laws

from hidden_state_accountants.exact import exact_pair

GEOMETRY = LossGeometry(strong_convexity=0.5, smoothness=0.5)


def run(sampling, steps, z, n=60, b=6, lr=0.5, m=0.5, **kw):
    return TrainingRunDpEvent(
        dataset_size=n,
        batch_size=n if sampling == "full" else b,
        steps=steps,
        noise_multiplier=z,
        clip_norm=1.0,
        learning_rate=lr,
        sampling=sampling,
        geometry=LossGeometry(strong_convexity=m, smoothness=max(m, 1e-9)),
        **kw,
    )


@pytest.mark.parametrize(
    "sampling,steps,z,expected",
    [
        ("shuffle_partition", 40, 0.5, 11.526),
        ("shuffle_partition", 40, 2.0, 1.360),  # the issue's numbers
        ("without_replacement", 10, 0.5, 32.902),
        ("without_replacement", 10, 2.0, 2.009),
        ("cyclic", 40, 0.5, 15.282),
        ("cyclic", 40, 2.0, 2.914),
        ("full", 40, 2.0, 14.191),
        ("poisson", 10, 0.5, 8.948),
        ("poisson", 10, 2.0, 0.992),  # mirror is Poisson's worst
        ("reshuffle", 40, 0.5, 10.939),
        ("reshuffle", 40, 2.0, 1.317),
    ],
)
def test_the_worst_pair_reproduces_the_issue(sampling, steps, z, expected):
    assert exact_pair(run(sampling, steps, z)).epsilon(1e-5) == pytest.approx(expected, abs=6e-4)


def test_the_old_pair_was_weaker_where_the_batches_are_random():
    """The +C/-C pair (others 0) is a mixture on both sides; the worst pair's D' is one
    Gaussian. The old "exact" column (5.474 / 0.997 for shuffle_partition) was that pair's."""
    for z, old in ((0.5, 5.474), (2.0, 0.997)):
        r = run("shuffle_partition", 40, z)
        mirror = exact_pair(r, construction="mirror").epsilon(1e-5)
        assert mirror == pytest.approx(old, abs=2e-3)
        assert exact_pair(r).epsilon(1e-5) > 1.3 * mirror
    # a deterministic pattern makes every pair the same Gaussian
    c = run("cyclic", 40, 2.0)
    assert exact_pair(c, construction="mirror").epsilon(1e-5) == pytest.approx(exact_pair(c).epsilon(1e-5))


@pytest.mark.parametrize(
    "sampling,z",
    [("shuffle_partition", 0.5), ("reshuffle", 1.0), ("without_replacement", 2.0), ("shuffle_partition", 4.0)],
)
def test_one_step_is_exactly_the_subsampled_gaussian(sampling, z):
    """At T = 1 the worst pair is C_p(G(2/z)) (Bok, Su & Altschuler Def. 4.7), which Thm 4.8 reports."""
    pair = exact_pair(run(sampling, 1, z))
    profile = fdp.subsampled_gaussian_profile(2.0 / z, 6 / 60)
    for e in (0.0, 0.3, 1.0, 3.0, 8.0):
        ref = float(profile(np.array([e]))[0])
        assert abs(pair.delta(e) - ref) <= 1e-12 + 1e-9 * ref


def test_never_used_slots_have_their_own_weight():
    """n % b records are never used by a partition drawn once: weights b/n per batch and
    (n - l b)/n at S = 0 (the old law weighted the batches 1/l and was too large)."""
    r = run("shuffle_partition", 8, 1.0, n=15, b=6)
    law = exact.Linear(r, 0.75).exact_law()
    weights = dict(zip(np.round(law.values, 12), np.exp(law.log_w)))
    assert weights[0.0] == pytest.approx(3 / 15)
    assert sum(weights.values()) == pytest.approx(1.0)
    assert exact_pair(r, construction="mirror").epsilon(1e-5) == pytest.approx(6.994, abs=1e-3)  # old code: 12.34


def test_grid_bracket_contains_the_enumerated_value(monkeypatch):
    r = run("without_replacement", 12, 2.0)
    value = exact_pair(r).epsilon(1e-5)
    rdp = exact_pair(r.replace(steps=8)).renyi([2.0, 8.0])
    monkeypatch.setattr(schedule_laws, "MAX_ENUM", 10)  # the law of S is enumerated there
    for points in (1 << 9, 1 << 12):
        pair = exact_pair(r, grid_points=points)
        lo, hi = pair.epsilon_bracket(1e-5)
        assert not pair.exact and lo <= value <= hi and hi - lo < (0.07 if points == 1 << 9 else 0.01)
    coarse = exact_pair(r.replace(steps=8), grid_points=1 << 8)
    assert np.all(coarse.renyi([2.0, 8.0]) <= rdp * (1 + 1e-8))


def test_poisson_uses_the_worse_of_its_candidate_pairs():
    r = run("poisson", 10, 2.0)
    mirror = exact_pair(r, construction="mirror").epsilon(1e-5)
    half = exact_pair(r, construction="half").epsilon(1e-5)
    assert exact_pair(r).epsilon(1e-5) == max(mirror, half) and mirror > half


def test_kept_short_batch_divided_by_its_size_costs_more():
    """derivations 3.5: n = 61, b = 6, 2 epochs, z = 0.5: 15.66 kept (TF-Privacy) vs 10.88 dropped."""
    kept = run("reshuffle", 22, 0.5, n=61, last_batch="kept_own_size")
    dropped = run("reshuffle", 20, 0.5, n=61)
    assert exact_pair(kept).epsilon(1e-5) == pytest.approx(15.655, abs=2e-3)
    assert exact_pair(dropped).epsilon(1e-5) == pytest.approx(10.885, abs=2e-3)


def test_huge_epsilon_stays_finite():
    pair = exact_pair(run("shuffle_partition", 40, 0.02))
    assert 1000 < pair.epsilon(1e-5) < pair.epsilon(1e-7) < math.inf


def test_negative_contraction_uses_the_convex_loss():
    """lr m > 1: c = 1 - lr m < 0, shifts of both signs; the enumerated law still works."""
    r = run("reshuffle", 7, 1.0, n=6, b=2, lr=1.5, m=1.0)
    pair = exact_pair(r)
    assert pair.exact and 0 < pair.epsilon(1e-5) < math.inf
    with pytest.raises(ParameterError, match="learning_rate"):
        exact.Linear(r, -0.5).grid_laws(512)


def test_tradeoff_is_below_both_orders_and_above_the_diagonal_bound():
    pair = exact_pair(run("shuffle_partition", 40, 2.0))
    alpha = np.linspace(0, 1, 101)
    f = pair.tradeoff(alpha)
    assert np.all(f <= 1 - alpha + 1e-9) and np.all(np.diff(f) <= 1e-9)
    eps = pair.epsilon(1e-3)
    assert np.all(f >= 1 - 1e-3 - math.exp(eps) * alpha - 1e-3)
