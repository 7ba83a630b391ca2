"""Extreme inputs stay finite and valid: huge step counts, large orders, tiny and huge noise."""

import math

import numpy as np
import pytest

from hidden_state_accountants import HiddenStateAccountant, LossGeometry, TrainingRunDpEvent
from hidden_state_accountants import fdp
from hidden_state_accountants.accountant import analyze_training_run


def run(sampling, steps, z, m=1e-6, n=10000, b=100):
    b = n if sampling == "full" else b
    return TrainingRunDpEvent(
        dataset_size=n,
        batch_size=b,
        steps=steps,
        noise_multiplier=z,
        clip_norm=1.0,
        learning_rate=0.5,
        sampling=sampling,
        geometry=LossGeometry(strong_convexity=m, smoothness=1.0, diameter=1.0),
    )


def assert_valid(value):
    assert not math.isnan(value)
    assert value >= 0


@pytest.mark.parametrize("sampling", ["full", "cyclic", "shuffle_partition", "without_replacement", "poisson"])
@pytest.mark.parametrize("steps", [1, 10**12])
@pytest.mark.parametrize("z", [1e-3, 1.0, 1e4])
def test_extremes_give_finite_or_infinite_but_never_nan(sampling, steps, z):
    r = run(sampling, steps, z)
    report = HiddenStateAccountant(orders=(1.01, 2.0, 64.0, 1024.0, 1e5)).compose(r).explain(1e-10)
    assert_valid(report.epsilon)
    for a in report.analyses:
        if a.epsilon is not None:
            assert_valid(a.epsilon)
    if z >= 1e4 and steps == 1:
        assert report.epsilon < 1e-2
    if sampling != "poisson" and steps == 10**12 and z >= 1.0:
        assert math.isfinite(report.epsilon)  # hidden state: finite after 10^12 steps


def test_tiny_strong_convexity_is_not_rounded_to_zero():
    # c = 1 - 1e-17 rounds to 1.0 in floating point; log1p keeps the contraction
    r = run("cyclic", 10**15, 1.0, m=1e-17)
    names = {b.name: b for b in analyze_training_run(r)}
    assert names["bok_thm4.5"].applicable and math.isfinite(names["bok_thm4.5"].epsilon(1e-5))


def test_gdp_conversion_extremes():
    assert fdp.gdp_epsilon(1e-9, 1e-5) == 0.0
    huge = fdp.gdp_epsilon(1e4, 1e-5)
    assert math.isfinite(huge) and huge > 1e7 / 2
    assert float(fdp.gdp_delta(1e4, huge)) <= 1e-5 * 1.001
    for mu in (0.1, 1.0, 10.0):
        for d in (1e-3, 1e-8, 1e-15):
            e = fdp.gdp_epsilon(mu, d)
            assert float(fdp.gdp_delta(mu, e)) == pytest.approx(d, rel=1e-6)


def test_profiles_in_range_for_extreme_arguments():
    eps = np.array([-1e3, -5.0, 0.0, 1e-9, 5.0, 1e3])
    for profile in (
        fdp.subsampled_gaussian_profile(50.0, 0.5),
        fdp.subsampled_gaussian_profile(1e-6, 1e-6),
        fdp.poisson_replace_one_profile(1e-3, 0.3),
        fdp.rdp_profile([2.0, 1e4], [1e-3, 1e9]),
    ):
        values = profile(eps)
        assert np.all(np.isfinite(values)) and np.all((0 <= values) & (values <= 1))
        assert np.all(np.diff(values) <= 1e-15)


def test_gdp_epsilon_is_on_the_safe_side_of_the_root():
    """The returned epsilon satisfies delta_{G(mu)}(eps) <= delta by the closed form (Brent's
    root used to land up to ~1e-11 relative below it, e.g. full batch, z = 300, delta = 1e-12)."""
    from hidden_state_accountants import fdp

    for mu in np.geomspace(1e-4, 50.0, 120):
        for delta in (1e-3, 1e-5, 1e-8, 1e-12, 1e-15):
            eps = fdp.gdp_epsilon(float(mu), delta)
            assert eps == 0.0 or fdp.gdp_log_delta(float(mu), eps) <= math.log(delta), (mu, delta, eps)
    run = TrainingRunDpEvent(
        dataset_size=1000,
        batch_size=1000,
        steps=10,
        noise_multiplier=300.0,
        clip_norm=1.0,
        learning_rate=0.1,
        sampling="full",
    )
    with pytest.warns(UserWarning):
        eps = HiddenStateAccountant().compose(run).get_epsilon(1e-12)
    assert fdp.gdp_log_delta(2.0 / 300.0 * math.sqrt(10.0), eps) <= math.log(1e-12)
