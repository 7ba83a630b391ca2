"""HiddenStatePrivacyCallback: its epsilon is the core's, the budget stop, the refusals,
regularisation outside clipping and projection."""

import math
import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
tfp = pytest.importorskip("tensorflow_privacy")
pytestmark = pytest.mark.tf

from sklearn.datasets import make_classification  # noqa: E402

from hidden_state_accountants import (  # noqa: E402
    CompositionFallbackWarning,
    HiddenStateAccountant,
    LossGeometry,
    ParameterError,
    TrainingRunDpEvent,
    max_epochs_within_budget,
)
from hidden_state_accountants.tf_privacy import (  # noqa: E402
    DecoupledL2DPKerasSGDOptimizer,
    HiddenStatePrivacyCallback,
    L2BallProjection,
    PrivacyBudgetExceeded,
    batched_dataset,
    clip_feature_norms,
    compute_hidden_state_privacy_statement,
    projection_diameter,
    read_dp_optimizer_settings,
)

from keras_common import B, C, CLASSES, DELTA, DIM, GEOMETRY, L2, LR, N, SPE, Z  # noqa: E402


@pytest.fixture(scope="module")
def data():
    x, y = make_classification(
        n_samples=N, n_features=DIM, n_informative=3, n_redundant=0, n_classes=CLASSES, random_state=0
    )
    return clip_feature_norms(x, 1.0), y.astype(np.int64)


def per_example_loss(reduction=tf.keras.losses.Reduction.NONE):
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


def dp_sgd(**kwargs):
    params = dict(l2_norm_clip=C, noise_multiplier=Z, l2_regularization=L2, learning_rate=LR)
    params.update(kwargs)
    return DecoupledL2DPKerasSGDOptimizer(**params)


def make_model(optimizer, loss=None, **dense_kwargs):
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.layers.Dense(CLASSES, input_shape=(DIM,), **dense_kwargs)])
    model.compile(optimizer=optimizer, loss=loss or per_example_loss(), metrics=["accuracy"])
    return model


def callback(sampling="cyclic", geometry=GEOMETRY, batch_size=B, **kwargs):
    return HiddenStatePrivacyCallback(
        geometry=geometry, sampling=sampling, dataset_size=N, batch_size=batch_size, delta=DELTA, verbose=0, **kwargs
    )


def fit(model, data, cb, epochs, sampling="cyclic", batch_size=B, extra=()):
    ds = batched_dataset(*data, batch_size, sampling)
    return model.fit(ds, epochs=epochs, callbacks=[cb, *extra], verbose=0)


def core_report(steps, sampling="cyclic", geometry=GEOMETRY, lr=LR, z=Z, batch_size=B):
    run = TrainingRunDpEvent(
        dataset_size=N,
        batch_size=batch_size,
        steps=steps,
        noise_multiplier=z,
        clip_norm=C,
        learning_rate=lr,
        sampling=sampling,
        geometry=geometry,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return HiddenStateAccountant().compose(run).explain(DELTA)


def composition(report):
    return min(a.epsilon for a in report.analyses if not a.hidden_state and a.epsilon is not None)


def begin(model, cb, data, epochs=1):
    """fit with the callback's schedule: its checks run before the first step."""
    return fit(model, data, cb, epochs, sampling=cb.sampling, batch_size=cb.batch_size)


# ------------------------------------------------------------------ epsilon = core


@pytest.mark.parametrize("sampling", ["cyclic", "shuffle_partition", "without_replacement", "full"])
def test_epsilon_in_logs_equals_the_core_each_epoch(data, sampling):
    b = N if sampling == "full" else B
    spe = 1 if sampling == "full" else SPE
    model = make_model(dp_sgd())
    cb = callback(sampling, batch_size=b)
    hist = fit(model, data, cb, epochs=3, sampling=sampling, batch_size=b).history
    assert len(hist["epsilon"]) == 3
    for k in range(3):
        report = core_report((k + 1) * spe, sampling, batch_size=b)
        assert hist["epsilon"][k] == pytest.approx(report.epsilon, rel=1e-12)
        assert hist["epsilon_composition"][k] == pytest.approx(composition(report), rel=1e-12)
        assert cb.history[k].steps == (k + 1) * spe
    assert cb.steps == int(model.optimizer.iterations.numpy()) == 3 * spe
    # the learning rate the optimizer used, as float32
    assert cb.run_event() == TrainingRunDpEvent(
        dataset_size=N,
        batch_size=b,
        steps=3 * spe,
        noise_multiplier=Z,
        clip_norm=C,
        learning_rate=LR,
        sampling=sampling,
        geometry=GEOMETRY,
        l2_regularization=L2,
    )
    assert cb.epsilon == hist["epsilon"][-1]
    # fixed-order schedules: the hidden-state bound is in use and beats composition already
    if sampling in ("cyclic", "shuffle_partition"):
        assert hist["epsilon"][-1] < hist["epsilon_composition"][-1]


def test_without_geometry_reports_composition_and_says_so(data):
    opt = tfp.DPKerasSGDOptimizer(l2_norm_clip=C, noise_multiplier=Z, learning_rate=LR)
    model = make_model(opt)
    cb = callback("shuffle_partition", geometry=None)
    with pytest.warns(CompositionFallbackWarning, match="no loss geometry") as record:
        hist = fit(model, data, cb, epochs=2, sampling="shuffle_partition").history
    assert len([w for w in record if w.category is CompositionFallbackWarning]) == 1  # once per run
    report = core_report(2 * SPE, "shuffle_partition", geometry=None)
    assert hist["epsilon"][-1] == pytest.approx(report.epsilon, rel=1e-12)
    assert hist["epsilon"] == hist["epsilon_composition"]


def test_learning_rate_schedule_is_read_per_step(data):
    # no geometry: a decaying schedule is accounted by composition (with a geometry it is
    # refused before training, test_tf_recording.py)
    schedule = tf.keras.optimizers.schedules.ExponentialDecay(LR, decay_steps=4, decay_rate=0.8)
    model = make_model(dp_sgd(learning_rate=schedule))
    cb = callback(geometry=None)
    with pytest.warns(CompositionFallbackWarning):
        hist = fit(model, data, cb, epochs=2).history
    expected = [float(np.float32(schedule(float(i)).numpy())) for i in range(2 * SPE)]
    assert cb.learning_rates == expected
    report = core_report(2 * SPE, lr=tuple(expected), geometry=None)
    assert hist["epsilon"][-1] == pytest.approx(report.epsilon, rel=1e-12)
    assert hist["epsilon"][-1] == pytest.approx(hist["epsilon_composition"][-1], rel=1e-12)
    # the callback's step size agrees with the one TF's optimizer computes itself
    assert cb._lr(cb.steps) == float(model.optimizer._decayed_lr(tf.float32).numpy())


def test_legacy_decay_argument_is_accounted(data):
    model = make_model(dp_sgd(decay=0.1))
    cb = callback(geometry=None)
    with pytest.warns(CompositionFallbackWarning):
        fit(model, data, cb, epochs=1)
    expected = [float(np.float32(LR) / (np.float32(1) + np.float32(0.1) * np.float32(i))) for i in range(SPE)]
    assert cb.learning_rates == expected
    assert cb._lr(cb.steps) == float(model.optimizer._decayed_lr(tf.float32).numpy())


def test_learning_rate_changed_by_another_callback_is_accounted(data):
    model = make_model(dp_sgd())
    cb = callback()
    scheduler = tf.keras.callbacks.LearningRateScheduler(lambda epoch, lr: LR if epoch == 0 else LR / 2)
    with pytest.warns(CompositionFallbackWarning, match="learning rate changed during training"):
        fit(model, data, cb, epochs=2, extra=[scheduler])
    assert cb.learning_rates == [LR] * SPE + [LR / 2] * SPE
    assert cb.epsilon == pytest.approx(core_report(2 * SPE, lr=tuple(cb.learning_rates)).epsilon, rel=1e-12)


def test_accounting_continues_across_fit_calls_and_refuses_unseen_steps(data):
    model = make_model(dp_sgd())
    cb = callback()
    fit(model, data, cb, epochs=1)
    hist = fit(model, data, cb, epochs=1).history
    assert cb.steps == 2 * SPE
    assert hist["epsilon"][-1] == pytest.approx(core_report(2 * SPE).epsilon, rel=1e-12)
    with pytest.raises(ParameterError, match=r"^optimizer: has taken 12 steps but this callback accounted 0"):
        begin(model, callback(), data)


# ------------------------------------------------------------------ budget


def test_budget_stops_training_at_the_last_epoch_that_fits(data):
    eps = [core_report(k * SPE).epsilon for k in range(1, 9)]
    target = (eps[2] + eps[3]) / 2  # 3 epochs fit, 4 do not
    expected = next(k for k in range(1, 9) if eps[k] > target)  # epochs before the first too many
    assert expected == 3
    run = TrainingRunDpEvent(
        dataset_size=N,
        batch_size=B,
        steps=SPE,
        noise_multiplier=Z,
        clip_norm=C,
        learning_rate=LR,
        sampling="cyclic",
        geometry=GEOMETRY,
    )
    assert max_epochs_within_budget(run, target, DELTA).epochs == expected  # the core agrees
    model = make_model(dp_sgd())
    cb = callback(target_epsilon=target)
    hist = fit(model, data, cb, epochs=8).history
    assert len(hist["epsilon"]) == expected
    assert hist["epsilon"][-1] <= target
    assert cb.steps == expected * SPE
    assert "one more epoch would reach" in cb.stopped_reason
    assert "(REPLACE_ONE)" in cb.stopped_reason and "(REPLACE_ONE)" in cb._describe()  # issue 12: named


def test_budget_is_rechecked_when_another_callback_changes_the_learning_rate(data):
    # epoch 2 runs at a new step size: the run is no longer constant, only composition holds,
    # and that exceeds the budget: the callback raises before the first step at the new rate
    hidden, comp = core_report(2 * SPE).epsilon, composition(core_report(2 * SPE))
    target = (hidden + comp) / 2
    assert core_report(SPE).epsilon <= target < comp
    model = make_model(dp_sgd())
    cb = callback(target_epsilon=target)
    scheduler = tf.keras.callbacks.LearningRateScheduler(lambda epoch, lr: LR if epoch == 0 else LR / 2)
    with pytest.raises(PrivacyBudgetExceeded, match="learning rate changed to 0.25 at step 6"):
        fit(model, data, cb, epochs=3, extra=[scheduler])
    assert int(model.optimizer.iterations.numpy()) == SPE
    assert cb.epsilon == pytest.approx(core_report(SPE).epsilon, rel=1e-12) and cb.epsilon <= target


def test_budget_spent_before_the_first_step_raises(data):
    model = make_model(dp_sgd())
    cb = callback(target_epsilon=0.5 * core_report(SPE).epsilon)
    with pytest.raises(PrivacyBudgetExceeded, match="target_epsilon"):
        fit(model, data, cb, epochs=3)
    assert int(model.optimizer.iterations.numpy()) == 0


# ------------------------------------------------------------------ refusals


def _refusal_cases():
    legacy = tf.keras.optimizers.legacy
    decaying = tf.keras.optimizers.schedules.ExponentialDecay(LR, decay_steps=4, decay_rate=0.8)
    return [
        ("plain Keras optimizer", lambda: make_model(legacy.SGD(LR)), {}, "optimizer", "not a TF-Privacy DP"),
        (
            "microbatches",
            lambda: make_model(
                tfp.DPKerasSGDOptimizer(l2_norm_clip=C, noise_multiplier=Z, num_microbatches=1, learning_rate=LR)
            ),
            dict(geometry=None),
            "batch_size",
            "divides the clipped sum by 1",
        ),
        (
            "accumulation",
            lambda: make_model(dp_sgd(gradient_accumulation_steps=2)),
            {},
            "accumulation",
            "2 batches per update",
        ),
        ("momentum", lambda: make_model(dp_sgd(momentum=0.9)), {}, "momentum", "momentum=0.9"),
        ("nesterov", lambda: make_model(dp_sgd(momentum=0.5, nesterov=True)), {}, "momentum", "nesterov=True"),
        (
            "adam",
            lambda: make_model(tfp.DPKerasAdamOptimizer(l2_norm_clip=C, noise_multiplier=Z, learning_rate=0.01)),
            {},
            "optimizer",
            "adam applies its own update",
        ),
        ("clipnorm", lambda: make_model(dp_sgd(clipnorm=1.0)), {}, "optimizer", "clipnorm=1.0 post-processes"),
        ("tree aggregation", lambda: make_model_ftrl(), dict(geometry=None), "optimizer", "DP query"),
        (
            "no L2 outside clipping",
            lambda: make_model(tfp.DPKerasSGDOptimizer(l2_norm_clip=C, noise_multiplier=Z, learning_rate=LR)),
            {},
            "geometry",
            "strong_convexity 0.05 exceeds the L2 regularisation applied outside clipping (0)",
        ),
        (
            "reduced loss",
            lambda: make_model(dp_sgd(), loss=per_example_loss(tf.keras.losses.Reduction.AUTO)),
            {},
            "loss",
            "reduction",
        ),
        (
            "string loss",
            lambda: make_model(dp_sgd(), loss="sparse_categorical_crossentropy"),
            {},
            "loss",
            "reduced to the batch mean",
        ),
        ("step size", lambda: make_model(dp_sgd(learning_rate=2.0)), {}, "learning_rate", "2/smoothness"),
        (
            "decaying schedule",
            lambda: make_model(dp_sgd(learning_rate=decaying)),
            {},
            "learning_rate",
            "learning rate changed",
        ),
        ("legacy decay", lambda: make_model(dp_sgd(decay=0.1)), {}, "learning_rate", "learning rate changed"),
        (
            "diameter without projection",
            lambda: make_model(dp_sgd()),
            dict(geometry=LossGeometry.logistic_regression(1.0, L2, diameter=4.0)),
            "geometry",
            "not projected",
        ),
        ("DPSequential", lambda: make_dp_sequential(), dict(geometry=None), "model", "DPModel/DPSequential"),
        ("hidden layer", lambda: make_deep_model(), {}, "model", "2 trainable layers"),
        (
            "other constraint",
            lambda: make_model(dp_sgd(), kernel_constraint=tf.keras.constraints.MaxNorm(1.0)),
            {},
            "optimizer",
            "MaxNorm",
        ),
    ]


def make_dp_sequential():
    model = tfp.DPSequential(
        l2_norm_clip=C, noise_multiplier=Z, layers=[tf.keras.layers.Dense(CLASSES, input_shape=(DIM,))]
    )
    model.compile(optimizer=tf.keras.optimizers.legacy.SGD(LR), loss=per_example_loss())
    return model


def make_deep_model():
    model = tf.keras.Sequential(
        [tf.keras.layers.Dense(4, activation="relu", input_shape=(DIM,)), tf.keras.layers.Dense(CLASSES)]
    )
    model.compile(optimizer=dp_sgd(), loss=per_example_loss())
    return model


def make_model_ftrl():
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.layers.Dense(CLASSES, input_shape=(DIM,))])
    opt = tfp.DPFTRLTreeAggregationOptimizer(
        l2_norm_clip=C, noise_multiplier=Z, var_list_or_model=model, learning_rate=LR
    )
    model.compile(optimizer=opt, loss=per_example_loss())
    return model


@pytest.mark.parametrize("case", _refusal_cases(), ids=lambda c: c[0])
def test_settings_it_cannot_account_for_are_refused_with_the_reason(case, data):
    _, build, cb_kwargs, parameter, text = case
    model = build()
    with pytest.raises(ParameterError) as err:
        begin(model, callback(**cb_kwargs), data, epochs=3)
    assert err.value.parameter == parameter
    assert text in str(err.value)
    assert "\n" not in str(err.value)
    assert int(model.optimizer.iterations.numpy()) == 0  # before any step


@pytest.mark.parametrize(
    "kwargs, parameter",
    [
        (dict(sampling="poisson"), "sampling"),
        (dict(delta=0.0), "delta"),
        (dict(target_epsilon=-1.0), "target_epsilon"),
        (dict(batch_size=N + 1), "batch_size"),
        (dict(geometry="logistic"), "geometry"),
    ],
)
def test_bad_callback_arguments(kwargs, parameter):
    params = dict(geometry=GEOMETRY, sampling="cyclic", dataset_size=N, batch_size=B, delta=DELTA)
    params.update(kwargs)
    with pytest.raises(ParameterError) as err:
        HiddenStatePrivacyCallback(**params)
    assert err.value.parameter == parameter


def test_adam_momentum_and_clipnorm_are_accounted_by_composition_without_geometry(data):
    for opt in (
        tfp.DPKerasAdamOptimizer(l2_norm_clip=C, noise_multiplier=Z, learning_rate=0.01),
        dp_sgd(momentum=0.9, clipnorm=1.0),
    ):
        model = make_model(opt)
        cb = callback(geometry=None)
        with pytest.warns(CompositionFallbackWarning, match="no loss geometry"):
            begin(model, cb, data)
        assert cb.settings.noise_multiplier == pytest.approx(Z)
        assert cb.epsilon == pytest.approx(core_report(SPE, geometry=None).epsilon, rel=1e-12)
    assert read_dp_optimizer_settings(tfp.DPKerasAdamOptimizer(l2_norm_clip=C, noise_multiplier=Z)).base == "adam"


def test_settings_are_read_from_each_optimizer_kind():
    generic = read_dp_optimizer_settings(
        tfp.DPKerasSGDOptimizer(l2_norm_clip=0.7, noise_multiplier=1.3, learning_rate=0.1)
    )
    vectorized = read_dp_optimizer_settings(
        tfp.VectorizedDPKerasSGDOptimizer(l2_norm_clip=0.7, noise_multiplier=1.3, num_microbatches=B, learning_rate=0.1)
    )
    decoupled = read_dp_optimizer_settings(dp_sgd())
    for s in (generic, vectorized):
        assert s.l2_norm_clip == pytest.approx(0.7) and s.noise_multiplier == pytest.approx(1.3)
        assert s.base == "sgd" and s.l2_regularization == 0.0
    assert vectorized.num_microbatches == B
    assert decoupled.l2_regularization == L2 and decoupled.noise_multiplier == pytest.approx(Z)


# ------------------------------------------------------------------ regularisation, projection


def test_decoupled_l2_acts_outside_clipping():
    # zero data gradient, tiny noise, tiny clip: the update is exactly lr * m * w, unclipped
    w0 = np.array([3.0, 0.0, 0.0, 4.0], dtype=np.float32)
    lr, m = 0.1, 0.5

    def step(opt, in_loss_l2):
        w = tf.Variable(w0)

        def loss():
            reg = 0.5 * m * tf.reduce_sum(w * w) if in_loss_l2 else 0.0 * tf.reduce_sum(w)
            return tf.zeros([2]) + reg  # two examples' losses

        opt.minimize(loss, var_list=[w])
        return w.numpy()

    decoupled = step(
        DecoupledL2DPKerasSGDOptimizer(l2_norm_clip=1e-3, noise_multiplier=1e-9, l2_regularization=m, learning_rate=lr),
        False,
    )
    np.testing.assert_allclose(decoupled, (1 - lr * m) * w0, atol=1e-6)
    # the same L2 term inside the per-example loss is clipped to norm 1e-3
    inside = step(tfp.DPKerasSGDOptimizer(l2_norm_clip=1e-3, noise_multiplier=1e-9, learning_rate=lr), True)
    assert np.linalg.norm(inside - w0) == pytest.approx(lr * 1e-3, rel=2e-2)  # float32 ulps of w


def test_projection_bounds_the_weights_and_reports_the_diameter(data):
    rk, rb = 0.3, 0.1
    model = make_model(dp_sgd(), kernel_constraint=L2BallProjection(rk), bias_constraint=L2BallProjection(rb))
    diameter = 2 * math.sqrt(rk**2 + rb**2)  # exact: the projection rescales a hair inside each ball
    assert projection_diameter(model) == pytest.approx(diameter)
    cb = callback()
    hist = fit(model, data, cb, epochs=2).history
    kernel, bias = model.get_weights()
    assert np.linalg.norm(kernel.astype(np.float64)) <= rk and np.linalg.norm(bias.astype(np.float64)) <= rb
    assert np.linalg.norm(kernel) > 0.9 * rk  # the projection was active, not vacuous
    geometry = LossGeometry.logistic_regression(1.0, L2, diameter=diameter, num_classes=CLASSES)
    assert cb.geometry == geometry == cb.run_event().geometry
    assert hist["epsilon"][-1] == pytest.approx(core_report(2 * SPE, geometry=geometry).epsilon, rel=1e-12)
    # a declared diameter must cover the projection set
    with pytest.raises(ParameterError, match="^geometry: declared diameter 0.5 is smaller"):
        begin(
            make_model(dp_sgd(), kernel_constraint=L2BallProjection(rk), bias_constraint=L2BallProjection(rb)),
            callback(geometry=LossGeometry.logistic_regression(1.0, L2, diameter=0.5)),
            data,
        )


def test_the_projection_rounds_inside_the_ball():
    """Issue 21: the Keras projection scaled a float32 tensor onto the ball itself, and rounding left
    most tensors a few ulps outside it (covered by inflating the reported diameter instead, the
    opposite of the Opacus hook); both now follow the core's rule (``projection.inside_factor``):
    inside the declared ball, whose diameter is reported exactly."""
    rng = np.random.default_rng(0)
    for radius in (1.7, 0.3):
        for _ in range(20):
            w = tf.constant((rng.standard_normal(1000) * 10).astype(np.float32))
            assert np.linalg.norm(L2BallProjection(radius)(w).numpy().astype(np.float64)) <= radius
    small = tf.constant([0.1, 0.2], tf.float32)
    np.testing.assert_array_equal(L2BallProjection(1.0)(small).numpy(), small.numpy())  # inside: unchanged


def test_privacy_statement_of_the_callback_matches_the_function(data):
    model = make_model(dp_sgd())
    cb = callback("shuffle_partition")
    fit(model, data, cb, epochs=2, sampling="shuffle_partition")
    text = cb.privacy_statement()
    largest = float(np.sqrt((data[0].astype(np.float32).astype(np.float64) ** 2).sum(axis=1)).max())
    # a secret seed, a model the core checked: only what the geometry rests on (the data checked, the loss read)
    assert cb.notes() == [
        f"feature norm <= 1: checked on the trainable layer's inputs before every step (largest seen {largest:.6g})",
        "loss: SparseCategoricalCrossentropy(from_logits=True) in model.loss, unweighted, as the geometry assumes",
    ]
    calculated = compute_hidden_state_privacy_statement(
        N, B, 2, Z, DELTA, l2_norm_clip=C, learning_rate=LR, sampling="shuffle_partition", geometry=GEOMETRY
    )
    # the same text, except that the function sees neither the model nor the data and says so
    notes = [p for p in calculated.split("\n\n") if p.startswith("Note:")]
    assert len(notes) == 3 and notes[0].startswith("Note: the model structure was not verified")
    assert "is the user's claim: the statement is computed without the data" in " ".join(notes[1].split())

    def body(statement):
        return "\n\n".join(p for p in statement.split("\n\n") if not p.startswith("Note:"))

    assert body(text) == body(calculated)
    assert f"{cb.epsilon:.3f}" in text
