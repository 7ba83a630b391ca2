"""Audit of DP-SBCD's per-example clipping (issue 27, item 3), Keras: finite differences (float64)
of the map the trainer runs on one Dense block, against the constants its accountant uses; the
PyTorch twin, with convolutions, the negative control and the witnesses that Algorithm 2's step is
not the analysed map, is tests/opacus/test_sbcd_clip_geometry.py (docs/dp_sbcd.md, "Audit:
per-example clipping keeps each sub-problem convex")."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
pytestmark = [
    pytest.mark.tf,
    pytest.mark.filterwarnings("ignore::hidden_state_accountants.analyses.sbcd.SbcdAssumptionWarning"),
    pytest.mark.filterwarnings("ignore::hidden_state_accountants.errors.HiddenStateWarning"),
]

from sbcd_fd import STEP_OPTIONS, check_gradient_field, check_lipschitz  # noqa: E402

from hidden_state_accountants.analyses.sbcd import layer_constants  # noqa: E402
from hidden_state_accountants.keras.sbcd import DPSBCD  # noqa: E402

L = tf.keras.layers


def _model(bias: bool):
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential(
        [
            L.Dense(5, activation="relu", use_bias=bias, dtype="float64"),
            L.Dense(4, activation="relu", use_bias=bias, dtype="float64"),
            L.Dense(3, use_bias=bias, dtype="float64"),
        ]
    )
    model.build((None, 6))
    return model


def _opt(bias: bool, **kw) -> DPSBCD:
    rng = np.random.default_rng(1)
    args = dict(batch_size=4, step_size=0.2, noise=1e-3, rho=1.5, seed=0)
    args.update(kw)
    return DPSBCD(_model(bias), rng.normal(size=(12, 6)), rng.integers(0, 3, 12), **args)


def _batch(opt: DPSBCD, d: int, seed: int = 2):
    """The layer's (clipped) inputs and targets at four distances from its output: clipping binds
    for some examples and not for others."""
    x = opt.xs[d][:4]
    out = opt._linear(d, x).numpy()
    scale = np.array([1e-3, 30.0, 0.03, 100.0])[:, None]
    return x, tf.constant(out + scale * np.random.default_rng(seed).normal(size=out.shape))


def _clipped(opt: DPSBCD, d: int, x, target) -> np.ndarray:
    p = opt._patches(d, x).numpy()
    r = p @ opt._theta(d).numpy().T - target.numpy()
    return np.linalg.norm(r, axis=1) * np.linalg.norm(p, axis=1) > opt.rho_eff[d] / 2


def _set(opt: DPSBCD, d: int, theta: np.ndarray) -> None:
    opt._set_theta(d, tf.constant(theta.reshape(opt._theta(d).shape)))


def _field(opt: DPSBCD, d: int, x, target):
    def f(theta):
        _set(opt, d, theta)
        return opt.per_example_contributions(d, x, target).numpy()[0].ravel()

    return f


def _step(opt: DPSBCD, d: int, x, target):
    def f(theta):
        _set(opt, d, theta)
        opt._theta_update(d, x, target, 0.0)
        return opt._theta(d).numpy().ravel()

    return f


@pytest.mark.parametrize("bias", [False, True])
def test_each_clipped_gradient_is_a_convex_beta_smooth_gradient(bias):
    """(a) symmetric PSD Jacobian, (b) eigenvalues <= beta = gamma rho_eff^2, per example."""
    opt = _opt(bias)
    consts = layer_constants(opt.privacy_event(steps=1))
    for d in range(opt.num_layers):
        beta = consts[d].smoothness
        assert beta == pytest.approx(opt.gamma * opt.rho_eff[d] ** 2)
        x, target = _batch(opt, d)
        clipped = _clipped(opt, d, x, target)
        assert clipped.any() and not clipped.all()
        theta = opt._theta(d).numpy().ravel()
        for i in range(4):
            check_gradient_field(_field(opt, d, x[i : i + 1], target[i : i + 1]), theta, beta)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("options", list(STEP_OPTIONS))
def test_one_step_is_as_lipschitz_as_the_accountant_assumes(bias, options):
    """(c) the noiseless step of every block is L_F L_T-Lipschitz, where clipping binds."""
    opt = _opt(bias, **STEP_OPTIONS[options])
    for d, c in enumerate(layer_constants(opt.privacy_event(steps=1))):
        x, target = _batch(opt, d)
        assert _clipped(opt, d, x, target).any()
        theta = opt._theta(d).numpy().ravel()
        for point in (theta, theta + np.random.default_rng(1).normal(size=theta.size)):
            check_lipschitz(_step(opt, d, x, target), point, c.lipschitz_f * c.lipschitz_t)
