"""DP-SBCD for Keras: closed-form updates, clipping, errors, the core's schedule and seed rule,
training and its epsilon."""

from __future__ import annotations

import math

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
pytestmark = [
    pytest.mark.tf,
    pytest.mark.filterwarnings("ignore::hidden_state_accountants.analyses.sbcd.SbcdAssumptionWarning"),
]

from scipy import optimize  # noqa: E402

from hidden_state_accountants import BatchSchedule, HiddenStateAccountant, ParameterError  # noqa: E402
from hidden_state_accountants.analyses import sbcd as core  # noqa: E402
from hidden_state_accountants.sbcd_training import CALLER_SEED_NOTE  # noqa: E402
from hidden_state_accountants.schedules import CYCLIC, POISSON, SHUFFLE_PARTITION  # noqa: E402
from hidden_state_accountants.keras.sbcd import DPSBCD, UnsupportedLayerError, u_update  # noqa: E402

L = tf.keras.layers


def _model(sizes=(6, 5, 4, 3), seed=0):
    tf.keras.utils.set_random_seed(seed)
    layers = [L.Dense(s, activation="relu") for s in sizes[1:-1]] + [L.Dense(sizes[-1])]
    model = tf.keras.Sequential(layers)
    model.build((None, sizes[0]))
    return model


def _opt(model=None, n=24, b=6, **kw):
    model = _model() if model is None else model
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    y = rng.integers(0, 3, n)
    args = dict(batch_size=b, step_size=0.2, noise=1e-30, rho=1.5, seed=0)
    args.update(kw)
    return DPSBCD(model, x, y, **args)


def _minimize(fun_grad, x0):
    res = optimize.minimize(fun_grad, x0.ravel(), jac=True, method="BFGS", options=dict(gtol=1e-10, maxiter=10_000))
    return res.x.reshape(x0.shape)


@pytest.mark.parametrize("d", [1, 2])
def test_x_update_solves_eq4(d):
    opt = _opt()
    layer = opt.layers[d]
    k, bias = layer.kernel.numpy().astype(np.float64), layer.bias.numpy().astype(np.float64)
    rng = np.random.default_rng(3)
    prev = rng.random((4, k.shape[0]))
    target = rng.normal(size=(4, k.shape[1]))
    got = opt._x_update(d, tf.constant(prev, tf.float32), tf.constant(target, tf.float32)).numpy()

    def fg(z):
        x = z.reshape(prev.shape)
        r = target - x @ k - bias
        val = ((x - prev) ** 2).sum() + (r**2).sum()
        return val, (2 * (x - prev) - 2 * r @ k.T).ravel()

    np.testing.assert_allclose(got, _minimize(fg, np.zeros_like(prev)), atol=2e-5)


def test_u_update_solves_eq6():
    rng = np.random.default_rng(5)
    a, xn = rng.normal(size=300) * 2, rng.normal(size=300) * 2
    got = u_update(tf.constant(a), tf.constant(xn)).numpy()
    grid = np.linspace(-8, 8, 160001)
    best = ((xn[:, None] - np.maximum(grid, 0)[None]) ** 2 + (grid[None] - a[:, None]) ** 2).min(1)
    mine = (xn - np.maximum(got, 0)) ** 2 + (got - a) ** 2
    assert np.all(mine <= best + 1e-9)


@pytest.mark.parametrize("variant", ["proximal_gradient", "appendix_c"])
def test_theta_update_solves_its_sub_problem(variant):
    """Eq. (7) (a proximal gradient step with L2) or eq. (34) (Appendix C), without noise."""
    kw = dict(variant=variant, regularizer="l2", regularization=0.4)
    if variant == "appendix_c":
        kw.update(radius=1e6, step_size=3.0, regularizer="none", regularization=0.0)
    opt = _opt(b=4, **kw)  # the update averages over the batch size b
    d, eta, lam = 0, opt.step_sizes[0], opt.lambdas[0]
    x = opt.xs[0].numpy()[:4].astype(np.float64)
    theta0 = opt._theta(d).numpy().astype(np.float64)  # (out, in + 1)
    p = np.hstack([x, np.ones((4, 1))])
    rng = np.random.default_rng(8)
    if variant == "proximal_gradient":
        target = p @ theta0.T + 1e-3 * rng.normal(size=(4, theta0.shape[0]))  # clipping inactive
    else:
        target = 1e-3 * rng.normal(size=(4, theta0.shape[0]))

    grad0 = (p @ theta0.T - target).T @ p / 4

    def fg(z):
        th = z.reshape(theta0.shape)
        if variant == "proximal_gradient":
            val = (grad0 * (th - theta0)).sum() + ((th - theta0) ** 2).sum() / (2 * eta) + lam / 2 * (th**2).sum()
            g = grad0 + (th - theta0) / eta + lam * th
        else:
            r = p @ th.T - target
            val = (r**2).sum() / 8 + ((th - theta0) ** 2).sum() / (2 * eta)
            g = r.T @ p / 4 + (th - theta0) / eta
        return val, g.ravel()

    ref = _minimize(fg, theta0.copy())
    opt._theta_update(d, tf.constant(x, tf.float32), tf.constant(target, tf.float32), tf.constant(1e-30))
    np.testing.assert_allclose(opt._theta(d).numpy(), ref, atol=5e-5)


@pytest.mark.parametrize("variant", ["proximal_gradient", "appendix_c"])
def test_per_example_contributions_are_clipped(variant):
    opt = _opt(variant=variant, radius=5.0)
    rng = np.random.default_rng(0)
    for d, layer in enumerate(opt.layers):
        x = opt.xs[d].numpy()[:8]
        target = (100 * rng.normal(size=(8, layer.kernel.shape[1]))).astype(np.float32)
        norms = np.linalg.norm(opt.per_example_contributions(d, x, target).numpy().reshape(8, -1), axis=1)
        bound = opt.gamma * opt.rho_eff[d] / 2
        assert np.all(norms <= bound * (1 + 1e-6))
        np.testing.assert_allclose(norms, bound, rtol=1e-5)  # rank one: clipped to the bound


def test_auxiliary_inputs_stay_clipped():
    opt = _opt(rho=[0.5, 0.8, 1.1], noise=1e-3)
    opt.fit(3, progress=False)
    for d, x in enumerate(opt.xs):
        assert np.linalg.norm(x.numpy(), axis=1).max() <= opt.rho_x[d] * (1 + 1e-5)


@pytest.mark.parametrize(
    "kw,param",
    [
        (dict(step_size=0.0), "step_size"),
        (dict(rho=-1.0), "rho"),
        (dict(noise=0.0), "noise"),
        (dict(noise=-1.0), "noise"),
        (dict(batch_size=100), "batch_size"),
        (dict(variant="appendix_c"), "radius"),
        (dict(sampling=POISSON), "sampling"),
        (dict(seed=-1), "seed"),
    ],
)
def test_bad_hyperparameters(kw, param):
    with pytest.raises(ParameterError) as err:
        _opt(**kw)
    assert err.value.parameter == param


@pytest.mark.parametrize(
    "layers,msg",
    [
        ([L.Dense(4, activation="sigmoid"), L.Dense(3)], "activation"),
        ([L.Dense(4), L.Dense(3)], "followed by ReLU"),
        ([L.Dense(4, activation="relu"), L.Dense(3, activation="relu")], "output layer"),
        ([L.Dense(4, activation="relu"), L.Dropout(0.1), L.Dense(3)], "Dropout"),
        ([L.Dense(4, activation="relu"), L.BatchNormalization(), L.Dense(3)], "BatchNormalization"),
    ],
)
def test_unsupported_models(layers, msg):
    model = tf.keras.Sequential(layers)
    x, y = np.zeros((12, 6), np.float32), np.zeros(12, int)
    with pytest.raises(UnsupportedLayerError, match=msg) as err:
        DPSBCD(model, x, y, batch_size=4, step_size=0.1, noise=1e-3)
    assert err.value.parameter == "model"


def test_conv2d_points_to_pytorch():
    model = tf.keras.Sequential([L.Conv2D(2, 3), L.ReLU(), L.Flatten(), L.Dense(3)])
    with pytest.raises(UnsupportedLayerError, match="PyTorch"):
        DPSBCD(model, np.zeros((12, 6, 6, 1), np.float32), np.zeros(12, int), batch_size=4, step_size=0.1, noise=1e-3)


def test_a_float64_model_trains_in_float64():
    """The trainer computes in the model's float type (float32 before: a float64 model failed with
    a dtype error); one type for all layers."""
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([L.Dense(5, activation="relu", dtype="float64"), L.Dense(3, dtype="float64")])
    rng = np.random.default_rng(0)
    opt = DPSBCD(model, rng.normal(size=(12, 6)), rng.integers(0, 3, 12), batch_size=4, step_size=0.2, noise=1e-3)
    opt.fit(1, progress=False)
    assert opt.xs[0].dtype == tf.float64 and all(layer.kernel.dtype == tf.float64 for layer in opt.layers)
    assert opt.predict(np.zeros((2, 6))).dtype == np.float64
    mixed = tf.keras.Sequential([L.Dense(4, activation="relu", dtype="float64"), L.Dense(3)])
    with pytest.raises(UnsupportedLayerError, match="float32 or float64 weights, all the same"):
        DPSBCD(mixed, np.zeros((12, 6)), np.zeros(12, int), batch_size=4, step_size=0.1, noise=1e-3)


def test_separate_relu_layers_are_accepted():
    model = tf.keras.Sequential([L.Dense(5), L.ReLU(), L.Dense(4), L.Activation("relu"), L.Dense(3)])
    opt = DPSBCD(
        model,
        np.random.default_rng(0).normal(size=(12, 6)).astype(np.float32),
        np.zeros(12, int),
        batch_size=4,
        step_size=0.1,
        noise=1e-3,
    )
    assert opt.num_layers == 3


def test_trains_an_mlp_on_digits():
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X, y = (X[:600] / 16.0).astype(np.float32), y[:600]
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([L.Dense(32, activation="relu"), L.Dense(10)])
    opt = DPSBCD(
        model, X, y, batch_size=150, step_size=0.9, noise=1e-7, rho=1.0, regularizer="l2", regularization=1e-3, seed=0
    )
    before = opt.objective()
    opt.fit(25, progress=False)
    acc = (opt.predict(X).argmax(1) == y).mean()
    assert opt.objective() < 0.7 * before
    assert acc > 0.6


def test_epsilon_is_the_core_accountants(check_sbcd_report):
    opt = _opt(noise=core.increase(1e-3, 1e-3), regularizer="l2", regularization=0.5)
    planned = opt.get_epsilon(1e-5, steps=12)
    opt.fit(3, progress=False)
    ev = opt.privacy_event()
    expected = core.DpSbcdRunDpEvent(
        dataset_size=24,
        batch_size=6,
        steps=12,
        num_layers=3,
        step_size=0.2,
        rho=math.sqrt(1.5**2 + 1),
        noise=(1e-3, 2e-3, 3e-3),
        regularizer="l2",
        regularization=0.5,
    )
    assert ev.rho == pytest.approx(expected.rho) and ev.noise == pytest.approx(expected.noise)
    direct = HiddenStateAccountant().compose(expected).get_epsilon(1e-5)
    assert opt.get_epsilon(1e-5) == pytest.approx(direct, rel=1e-9) == pytest.approx(planned, rel=1e-9)
    check_sbcd_report(opt)  # three blocks: the composition bound, Thm 4.5 does not apply (issue 27)


def test_a_one_block_model_gets_thm_4_5(check_sbcd_report):
    """A linear model (one block) is the case Thm 4.5 is proved for: the trainer reports it."""
    opt = _opt(_model(sizes=(6, 3)), noise=1e-3, regularizer="l2", regularization=0.5)
    opt.fit(3, progress=False)
    assert opt.privacy_event().num_layers == 1
    check_sbcd_report(opt)


# --------------------------------------------------------- schedule and seeds (issue 9)
@pytest.mark.parametrize("sampling,seed", [(SHUFFLE_PARTITION, 5), (CYCLIC, 5), (CYCLIC, None)])
def test_partition_comes_from_the_cores_batch_schedule(sampling, seed):
    opt = _opt(n=27, b=6, sampling=sampling, seed=seed)
    expected = BatchSchedule(27, 6, sampling, seed if sampling == SHUFFLE_PARTITION else None)
    np.testing.assert_array_equal(opt.partition.numpy(), expected.partition())
    assert opt.batch_schedule == expected


def test_schedule_is_checked_by_the_cores_rule():
    """n = 10, b = 6 is one batch: TrainingRunDpEvent refuses it, and so does DP-SBCD now."""
    with pytest.raises(ParameterError) as err:
        _opt(n=10, b=6, sampling=CYCLIC)
    assert err.value.parameter == "batch_size" and "two batches" in str(err.value)


def test_default_seed_is_secret_not_tensorflows_global_seed():
    runs = []
    for sampling in (SHUFFLE_PARTITION, SHUFFLE_PARTITION, CYCLIC, CYCLIC):
        opt = _opt(model=_model(seed=0), noise=1e-2, sampling=sampling, seed=None)  # same global seed each time
        assert opt.seed_is_secret and opt.batch_schedule.seed_is_secret == (sampling == SHUFFLE_PARTITION)
        opt.step()
        runs.append(opt)
    shuffled_a, shuffled_b, cyclic_a, cyclic_b = runs
    assert not np.array_equal(shuffled_a.partition.numpy(), shuffled_b.partition.numpy())
    assert not np.array_equal(cyclic_a._theta(0).numpy(), cyclic_b._theta(0).numpy())  # only the noise differs
    assert CALLER_SEED_NOTE not in cyclic_a.explain(1e-5).notes


def test_given_seed_is_the_callers_choice_and_noted():
    opt = _opt(seed=3, noise=1e-3)
    assert not opt.seed_is_secret and opt.batch_schedule.seed == 3
    opt.step()
    assert CALLER_SEED_NOTE in opt.explain(1e-5).notes


def test_discard_auxiliary_state():
    opt = _opt(noise=1e-3)
    opt.fit(1, progress=False)
    opt.discard_auxiliary()
    with pytest.raises(RuntimeError, match="discarded"):
        opt.step()


@pytest.mark.slow
def test_example_runs(sbcd_example_row):
    cells = sbcd_example_row("sbcd_digits_keras.py", timeout=900)
    assert float(cells[1].split()[0]) > 60  # DP-SBCD test accuracy (%)
    eps, analysis = cells[2].split()  # two blocks: the composition bound, not Thm 4.5 (issue 27)
    assert analysis == f"({core.COMPOSITION_NAME})" and float(eps) == pytest.approx(17.44, abs=0.006)


def test_the_keras_trainer_imports_without_tensorflow_privacy():
    # issue 21: it lived in the TF-Privacy adapter, whose package imports tensorflow_privacy
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['tensorflow_privacy'] = None\n"  # any import of it now fails
        "from hidden_state_accountants.keras import DPSBCD, UnsupportedLayerError\n"
        "from hidden_state_accountants.errors import UnsupportedLayerError as core\n"
        "assert UnsupportedLayerError is core and DPSBCD.__module__ == 'hidden_state_accountants.keras.sbcd'\n"
        "assert not any(m.startswith(('tensorflow_privacy.', 'hidden_state_accountants.tf_privacy')) "
        "for m in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_former_module_name_is_the_same_module():
    from hidden_state_accountants.keras import sbcd
    from hidden_state_accountants.tf_privacy import sbcd as former

    assert former is sbcd and former.DPSBCD is DPSBCD
