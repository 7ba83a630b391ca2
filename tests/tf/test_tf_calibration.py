"""The calibration invariant on the Keras side (issue 18, item 2).

``compute_hidden_state_noise`` / ``HiddenStatePrivacyCallback.compute_noise`` (the hidden-state
counterpart of TF-Privacy's ``compute_noise``): a run built with the returned noise and trained
for the planned epochs reports, in the callback, at most the target (REPLACE_ONE), and the noise
is the core's ``calibrate_noise_multiplier`` for the very event the callback records (raised by
2**-20 so that TF-Privacy's float32 copy of it is never below). A run ``fit`` is about to train
that would miss the calibrated target is refused before any step.
"""

import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
tfp = pytest.importorskip("tensorflow_privacy")
pytestmark = pytest.mark.tf

from hidden_state_accountants import LossGeometry, ParameterError, calibrate_noise_multiplier  # noqa: E402
from hidden_state_accountants.recording import CompositionFallbackWarning  # noqa: E402
from hidden_state_accountants.tf_privacy import (  # noqa: E402
    DecoupledL2DPKerasSGDOptimizer,
    HiddenStatePrivacyCallback,
    batched_dataset,
    clip_feature_norms,
    compute_hidden_state_noise,
    planned_run,
    read_dp_optimizer_settings,
    recorded_noise_multiplier,
)
from hidden_state_accountants.tf_privacy.calibration import FLOAT32_MARGIN  # noqa: E402

DIM, CLASSES, DELTA = 3, 2, 1e-5
LR, L2, C = 0.5, 0.05, 1.0
GEOMETRY = LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=L2, num_classes=CLASSES)


def data(n):
    rng = np.random.default_rng(0)
    return clip_feature_norms(rng.normal(size=(n, DIM)), 1.0), rng.integers(0, CLASSES, n)


def model_with(optimizer, secret=True):
    tf.keras.utils.set_random_seed(0)  # the initial weights
    model = tf.keras.Sequential([tf.keras.layers.Dense(CLASSES, input_shape=(DIM,))])
    model.compile(
        optimizer=optimizer,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=tf.keras.losses.Reduction.NONE),
    )
    if secret:
        tf.random.set_seed(None)  # Keras' own shuffle then draws from the operating system
    return model


def check_invariant(cb, z, target):
    """The callback's final epsilon is at most the target, and ``z`` is the core's calibration of
    the event the callback recorded (whose noise is TF-Privacy's float32 copy of ``z``)."""
    run = cb.run_event()
    assert cb.epsilon <= target
    assert run.noise_multiplier >= z / FLOAT32_MARGIN
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompositionFallbackWarning)
        core = calibrate_noise_multiplier(run, target, DELTA, neighboring_relation="REPLACE_ONE")
    assert z == pytest.approx(core.noise_multiplier * FLOAT32_MARGIN, rel=1e-12)
    assert cb.epsilon == pytest.approx(core.epsilon, rel=1e-4)  # the same event, noise 2**-20 apart


@pytest.mark.parametrize("z, clip", [(1.0, 1.0), (1.2345678901, 0.1), (3.3333333333, 2.7), (0.7071067811865476, 1e-3)])
def test_recorded_noise_is_what_the_callback_reads(z, clip):
    for opt in (
        DecoupledL2DPKerasSGDOptimizer(l2_norm_clip=clip, noise_multiplier=z, l2_regularization=0.0),
        tfp.DPKerasSGDOptimizer(l2_norm_clip=clip, noise_multiplier=z),
    ):
        assert read_dp_optimizer_settings(opt).noise_multiplier == recorded_noise_multiplier(z, clip)
    assert recorded_noise_multiplier(z * FLOAT32_MARGIN, clip) >= z


def test_batched_dataset_run_meets_the_target_with_the_cores_noise():
    n, b, epochs, target = 60, 10, 6, 2.0
    cb = HiddenStatePrivacyCallback(
        geometry=GEOMETRY, sampling="shuffle_partition", dataset_size=n, batch_size=b, delta=DELTA, verbose=0
    )
    z = cb.compute_noise(target, epochs, learning_rate=LR, l2_norm_clip=C, l2_regularization=L2)
    assert z == compute_hidden_state_noise(
        n,
        b,
        target,
        epochs,
        DELTA,
        sampling="shuffle_partition",
        learning_rate=LR,
        l2_norm_clip=C,
        geometry=GEOMETRY,
        l2_regularization=L2,
    )
    model = model_with(
        DecoupledL2DPKerasSGDOptimizer(l2_norm_clip=C, noise_multiplier=z, l2_regularization=L2, learning_rate=LR)
    )
    model.fit(batched_dataset(*data(n), b, "shuffle_partition"), epochs=epochs, callbacks=[cb], verbose=0)
    check_invariant(cb, z, target)
    assert cb.report.analysis != "composition" and cb.epsilon < cb.report.composition_epsilon


def test_fit_shuffle_with_a_kept_short_batch_and_public_batches():
    """``fit(x, y, batch_size=b, shuffle=True)``: ``reshuffle`` with the short batch divided by its
    own size; after ``tf.random.set_seed`` its batches are public, which the calibration must be
    told (and is refused at fit otherwise: it was calibrated for secret batches)."""
    n, b, epochs, target, lr = 61, 10, 5, 3.0, 0.1  # lr 0.1: float32 rounding matters
    x, y = data(n)
    cb = HiddenStatePrivacyCallback(
        geometry=GEOMETRY,
        sampling="reshuffle",
        dataset_size=n,
        batch_size=b,
        delta=DELTA,
        verbose=0,
        last_batch="kept_own_size",
    )
    z = cb.compute_noise(target, epochs, learning_rate=lr, l2_norm_clip=C, l2_regularization=L2)
    opt = DecoupledL2DPKerasSGDOptimizer(l2_norm_clip=C, noise_multiplier=z, l2_regularization=L2, learning_rate=lr)
    with pytest.raises(
        ParameterError,
        match=r"^compute_noise: calibrated noise multiplier .* it differs in "
        r"secret_batches False \(calibrated: True\)",
    ):
        model_with(opt, secret=False).fit(x, y, batch_size=b, shuffle=True, epochs=epochs, callbacks=[cb], verbose=0)
    z = cb.compute_noise(target, epochs, learning_rate=lr, l2_norm_clip=C, l2_regularization=L2, secret_batches=False)
    opt = DecoupledL2DPKerasSGDOptimizer(l2_norm_clip=C, noise_multiplier=z, l2_regularization=L2, learning_rate=lr)
    model_with(opt, secret=False).fit(x, y, batch_size=b, shuffle=True, epochs=epochs, callbacks=[cb], verbose=0)
    assert cb.run_event().last_batch == "kept_own_size" and not cb.run_event().secret_batches
    check_invariant(cb, z, target)


def test_a_run_that_misses_the_calibrated_target_is_refused_before_any_step():
    n, b, epochs = 60, 10, 4
    cb = HiddenStatePrivacyCallback(
        geometry=GEOMETRY, sampling="cyclic", dataset_size=n, batch_size=b, delta=DELTA, verbose=0
    )
    z = cb.compute_noise(2.0, epochs, learning_rate=LR, l2_norm_clip=C, l2_regularization=L2)
    model = model_with(
        DecoupledL2DPKerasSGDOptimizer(l2_norm_clip=C, noise_multiplier=0.9 * z, l2_regularization=L2, learning_rate=LR)
    )
    with pytest.raises(ParameterError, match=r"^compute_noise: .* it differs in noise_multiplier"):
        model.fit(batched_dataset(*data(n), b, "cyclic"), epochs=epochs, callbacks=[cb], verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


def test_refusals():
    cb = HiddenStatePrivacyCallback(
        geometry=GEOMETRY, sampling="reshuffle", dataset_size=61, batch_size=10, delta=DELTA, verbose=0
    )
    with pytest.raises(ParameterError, match="^last_batch: the callback leaves it to the data"):
        cb.compute_noise(2.0, 3, learning_rate=LR, l2_norm_clip=C)
    common = dict(sampling="cyclic", learning_rate=LR, l2_norm_clip=C, geometry=GEOMETRY)
    with pytest.raises(ParameterError, match="^learning_rate: must be < 2/smoothness"):
        compute_hidden_state_noise(60, 10, 2.0, 3, DELTA, **{**common, "learning_rate": 2.0})
    with pytest.raises(ParameterError, match="^geometry: strong_convexity 0.05 exceeds"):
        compute_hidden_state_noise(60, 10, 2.0, 3, DELTA, l2_regularization=0.0, **common)
    with pytest.raises(ParameterError, match="^sampling: must be one of"):
        compute_hidden_state_noise(60, 10, 2.0, 3, DELTA, **{**common, "sampling": "poisson"})
    with pytest.raises(ParameterError, match="^epochs: "):
        compute_hidden_state_noise(60, 10, 2.0, 0, DELTA, **common)
    with pytest.raises(ParameterError, match="^target_epsilon: "):
        compute_hidden_state_noise(60, 10, -1.0, 3, DELTA, **common)
    # the planned run is the callback's event: lr and clip norm in float32
    run = planned_run(60, 10, 3, 1.5, **{**common, "learning_rate": 0.1, "l2_norm_clip": 0.1})
    assert run.learning_rate == float(np.float32(0.1)) and run.clip_norm == float(np.float32(0.1))
    assert run.steps == 18 and run.l2_regularization == GEOMETRY.strong_convexity
