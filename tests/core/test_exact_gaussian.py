"""Every bound against the exact last-iterate law of a loss with linear gradients.

For g_i(theta) = c_i + m theta the last iterate is Gaussian (full, cyclic) or a Gaussian
mixture over batch schedules (shuffle_partition, without_replacement, poisson); see
hidden_state_accountants.exact. A bound below the exact value would be a security bug;
Bok et al. Thm 4.2 must *equal* it (the paper says it is exact).
"""

import math

import numpy as np
import pytest

from hidden_state_accountants import HiddenStateAccountant, LossGeometry, TrainingRunDpEvent, analyze_training_run
from hidden_state_accountants.analyses import bok, chourasia, ye_shokri
from hidden_state_accountants.analyses._common import Context
from hidden_state_accountants.exact import exact_pair

ORDERS = np.array([1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0])
DELTAS = (1e-3, 1e-5)


def run_for(sampling, *, n=24, b=6, steps=12, z=1.2, lr=0.3, m=0.5, M=None, C=1.0, **kw):
    b = n if sampling == "full" else b
    geometry = LossGeometry(strong_convexity=m, smoothness=m if M is None else M)
    return TrainingRunDpEvent(
        dataset_size=n,
        batch_size=b,
        steps=steps,
        noise_multiplier=z,
        clip_norm=C,
        learning_rate=lr,
        sampling=sampling,
        geometry=geometry,
        **kw,
    )


def check_all_bounds_above_exact(run, pair):
    exact_rdp = pair.renyi(ORDERS)
    exact_eps = {d: pair.epsilon(d) for d in DELTAS}
    checked = 0
    for bound in analyze_training_run(run):
        if not bound.applicable:
            continue
        curve = bound.rdp(ORDERS)
        if curve is not None:
            assert np.all(curve >= exact_rdp * (1 - 1e-9)), (bound.name, curve, exact_rdp)
        for d in DELTAS:
            assert bound.epsilon(d) >= exact_eps[d] * (1 - 1e-6), (bound.name, d, bound.epsilon(d), exact_eps[d])
        checked += 1
    report = HiddenStateAccountant().compose(run).explain(1e-5)
    assert report.epsilon >= exact_eps[1e-5] * (1 - 1e-6)
    return checked


@pytest.mark.parametrize("m,lr,z,steps", [(0.5, 0.3, 1.2, 12), (0.2, 0.9, 3.0, 40), (1.0, 0.05, 0.7, 200)])
def test_full_batch_bok_4_2_is_exact(m, lr, z, steps):
    run = run_for("full", m=m, lr=lr, z=z, steps=steps)
    pair = exact_pair(run)
    bound = bok.thm_4_2(run, Context())
    assert bound.mu == pytest.approx(pair.mu, rel=1e-12)
    assert bound.epsilon(1e-5) == pytest.approx(pair.epsilon(1e-5), rel=1e-6)
    assert "exact" in bound.detail(1e-5)


def test_full_batch_bok_4_2_wrong_factor_would_be_caught():
    # the garbled text prints sqrt((1-c^t)/(1+c^t)) * (1+c)/(1-c); that reading differs from the truth
    run = run_for("full", steps=12)
    c = 1 - run.learning_rate * 0.5
    garbled = math.sqrt((1 - c**12) / (1 + c**12)) * (1 + c) / (1 - c) * 2 / run.noise_multiplier
    assert abs(garbled - exact_pair(run).mu) > 0.1


@pytest.mark.parametrize("sampling", ["full", "cyclic", "shuffle_partition"])
@pytest.mark.parametrize("m,lr,z,steps", [(0.5, 0.3, 1.2, 12), (0.1, 1.0, 2.0, 36), (0.3, 0.05, 0.8, 60)])
def test_gaussian_schedules_bounds_above_exact(sampling, m, lr, z, steps):
    run = run_for(sampling, m=m, lr=lr, z=z, steps=steps)
    assert check_all_bounds_above_exact(run, exact_pair(run)) >= 2


@pytest.mark.parametrize("sampling", ["without_replacement", "poisson"])
@pytest.mark.parametrize("m,lr,z", [(0.5, 0.3, 1.2), (0.2, 0.8, 2.5)])
def test_mixture_schedules_bounds_above_exact(sampling, m, lr, z):
    run = run_for(sampling, m=m, lr=lr, z=z, steps=10, n=20, b=5)
    assert check_all_bounds_above_exact(run, exact_pair(run)) >= 2


def test_cyclic_positions_ye_shokri_3_3_above_exact_everywhere():
    run = run_for("cyclic", steps=20, n=24, b=6, m=0.4, lr=0.5, z=1.5)
    for position in range(run.steps_per_epoch):
        exact = exact_pair(run, position=position).renyi(ORDERS)
        bound = ye_shokri.fixed_order_rdp(run, ORDERS, position=position)
        assert np.all(bound >= exact), position
    # the worst position is the last batch and equals the reported worst case
    worst = ye_shokri.fixed_order_rdp(run, ORDERS)
    assert np.allclose(worst, ye_shokri.fixed_order_rdp(run, ORDERS, position=run.steps_per_epoch - 1))


def test_chourasia_cor1_above_exact_with_its_gaussian_initialisation():
    run = run_for("full", m=0.5, lr=0.3, z=1.2, steps=30, gaussian_initialization=True)
    std = chourasia.required_initial_std(
        dataset_size=run.dataset_size,
        noise_multiplier=run.noise_multiplier,
        clip_norm=run.clip_norm,
        learning_rate=run.learning_rate,
        strong_convexity=0.5,
    )
    pair = exact_pair(run, init_variance=std**2)
    bound = chourasia.cor_1(run, Context())
    assert bound.applicable
    assert np.all(bound.rdp(ORDERS) >= pair.renyi(ORDERS))


def test_chourasia_thm3_lower_bound_below_cor1():
    # Thm 3: alpha S_g^2/(4 sigma^2 n^2)(1 - e^{-eta K}) <= true RDP <= Cor. 1 (squared loss, lambda = 1)
    run = run_for("full", m=1.0, M=1.0, lr=0.5, z=1.0, steps=25, gaussian_initialization=True)
    n, C, z, eta, K = run.dataset_size, run.clip_norm, run.noise_multiplier, run.learning_rate, run.steps
    sigma2 = eta * z * z * C * C / (2 * n * n)
    lower = ORDERS * (2 * C) ** 2 / (4 * sigma2 * n * n) * (1 - math.exp(-eta * K))
    assert np.all(chourasia.cor_1(run, Context()).rdp(ORDERS) >= lower)


def test_bounds_would_fail_with_half_the_sensitivity():
    """A factor of 2 in the sensitivity (add/remove instead of replace-one) must be caught."""
    run = run_for("full", steps=12)
    pair = exact_pair(run)
    halved_mu = bok.thm_4_2(run, Context()).mu / 2
    assert halved_mu * halved_mu / 2 * ORDERS[-1] < pair.renyi(ORDERS)[-1]
