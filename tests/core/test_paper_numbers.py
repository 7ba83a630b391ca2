"""Numbers printed in the papers, reproduced to their printed precision."""

import math

import numpy as np
import pytest

from hidden_state_accountants import HiddenStateAccountant, LossGeometry, TrainingRunDpEvent
from hidden_state_accountants.analyses import bok, ye_shokri
from hidden_state_accountants.analyses._common import Context


def bok_table1_run(epochs, c=0.9999):
    # Bok et al. (2024) Table 1 / D.2: MNIST n = 60000, b = 1500 (l = 40), L/(b sigma) = 2/3
    # (z = 3 since L/(b sigma) = 2/z), delta = 1e-5, c = 1 - eta*m = 0.9999.
    lr = 0.05
    m = (1 - c) / lr
    return TrainingRunDpEvent.from_epochs(
        dataset_size=60000,
        batch_size=1500,
        epochs=epochs,
        noise_multiplier=3.0,
        clip_norm=1.0,
        learning_rate=lr,
        sampling="cyclic",
        geometry=LossGeometry(strong_convexity=m, smoothness=1.0 + m),
    )


@pytest.mark.parametrize(
    "epochs,composition,rdp,ours",
    [
        (50, 30.51, 5.82, 4.34),
        (100, 49.88, 7.61, 5.60),
        (200, 83.83, 9.88, 7.58),
    ],
)
def test_bok_table_1(epochs, composition, rdp, ours):
    report = HiddenStateAccountant().compose(bok_table1_run(epochs)).explain(1e-5)
    eps = {a.name: a.epsilon for a in report.analyses}
    assert eps["bok_thm4.4"] == pytest.approx(composition, abs=0.006)  # "GDP Composition"
    assert eps["ye_shokri_thm3.3"] == pytest.approx(rdp, abs=0.006)  # "RDP"
    assert eps["bok_thm4.5"] == pytest.approx(ours, abs=0.006)  # "Our Bounds"
    assert report.epsilon == pytest.approx(ours, abs=0.006)
    assert report.analysis == "bok_thm4.5"


def test_bok_table_1_second_regularisation_is_smaller():
    # the authors' code also evaluates c = 0.9998 (lambda = 0.004): stronger convexity, smaller bound
    assert bok.thm_4_5(bok_table1_run(100, c=0.9998), Context()).mu < bok.thm_4_5(bok_table1_run(100), Context()).mu


def test_ye_shokri_cor_5_3_invariant():
    # Cor. 5.3: eps_0^1(alpha) = alpha eta S_g^2 / (4 sigma^2 b^2) = 2 alpha / sigma_mul^2
    run = bok_table1_run(1)
    orders = np.array([2.0, 10.0, 64.0])
    assert np.allclose(ye_shokri.eps0(run, orders, np.array([1]))[:, 0], 2 * orders / 3.0**2)


def test_chourasia_figure_1_formulas():
    # Fig. 1 setting: S_g = 4, n = 5000, eta = 0.02, sigma = 0.02, beta = 4, lambda in {1,2,4}
    from hidden_state_accountants.analyses import chourasia

    n, eta, sigma = 5000, 0.02, 0.02
    C = 2.0  # S_g = 2C = 4
    z = math.sqrt(2 * n * n * sigma**2 / eta) / C  # sigma^2 = eta z^2 C^2 / (2 n^2)
    for lam in (1.0, 2.0, 4.0):
        for K in (10, 1000, 100000):
            run = TrainingRunDpEvent(
                dataset_size=n,
                batch_size=n,
                steps=K,
                noise_multiplier=z,
                clip_norm=C,
                learning_rate=eta,
                sampling="full",
                gaussian_initialization=True,
                geometry=LossGeometry(strong_convexity=lam, smoothness=4.0),
            )
            vals = chourasia.cor_1(run, Context(orders=(10.0, 20.0, 30.0))).values
            expected = np.array([10, 20, 30]) * 16 / (lam * sigma**2 * n * n) * (1 - math.exp(-lam * eta * K / 2))
            assert np.allclose(vals, expected, rtol=1e-12)


def test_ye_shokri_figure_settings_shuffle_below_worst_fixed_order():
    # Figures 1-2 setting: n = 50, b = 2, lambda = 1, beta = 4, S_g = 4, eta = 0.02, sigma^2 = 4.
    # Paper: Thm 4.2 (shuffle) is always below Thm 3.3 at the worst position.
    n, b, eta, C = 50, 2, 0.02, 2.0
    z = math.sqrt(2 * b * b * 4.0 / eta) / C
    ctx = Context(orders=(10.0, 15.0))
    for K in (1, 10, 100, 1000):
        run = TrainingRunDpEvent.from_epochs(
            dataset_size=n,
            batch_size=b,
            epochs=K,
            noise_multiplier=z,
            clip_norm=C,
            learning_rate=eta,
            sampling="shuffle_partition",
            geometry=LossGeometry(strong_convexity=1.0, smoothness=4.0),
        )
        shuffle = ye_shokri.thm_4_2(run, ctx).values
        worst = ye_shokri.thm_3_3(run, ctx).values
        assert np.all(shuffle < worst)
