"""Issue 27 in Keras: the callback reads the Dense layer's units and refuses a hidden-state claim where the
clip can bind on three or more classes (docs/derivations.md section 18).

TF-Privacy clips with ``tf.clip_by_global_norm`` (the identity below the clip norm), so clip 2 cannot bind
for features of norm <= 1 and any number of classes.
"""

import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
pytest.importorskip("tensorflow_privacy")
pytestmark = pytest.mark.tf

from hidden_state_accountants import CompositionFallbackWarning, LossGeometry, ParameterError  # noqa: E402
from hidden_state_accountants.tf_privacy import (  # noqa: E402
    DecoupledL2DPKerasSGDOptimizer,
    HiddenStatePrivacyCallback,
    batched_dataset,
    clip_feature_norms,
)

N, B, DIM, DELTA, L2 = 120, 12, 4, 1e-5, 0.05
PER_EXAMPLE = tf.keras.losses.Reduction.NONE


def run(classes, clip, *, loss=None, num_classes=None, epochs=4, units=None):
    rng = np.random.default_rng(0)
    x, y = clip_feature_norms(rng.normal(size=(N, DIM)), 1.0), rng.integers(0, classes, N)
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.layers.Dense(units or classes, input_shape=(DIM,))])
    model.compile(
        optimizer=DecoupledL2DPKerasSGDOptimizer(
            l2_norm_clip=clip, noise_multiplier=2.0, l2_regularization=L2, learning_rate=0.5
        ),
        loss=loss or tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=PER_EXAMPLE),
    )
    cb = HiddenStatePrivacyCallback(
        geometry=LossGeometry.logistic_regression(1.0, L2, num_classes=num_classes),
        sampling="shuffle_partition",
        dataset_size=N,
        batch_size=B,
        delta=DELTA,
        verbose=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(batched_dataset(x, y, B, "shuffle_partition"), epochs=epochs, callbacks=[cb], verbose=0)
        report = cb.recorder.report(DELTA)
    return report, [str(w.message) for w in caught if issubclass(w.category, CompositionFallbackWarning)]


def hidden_state_numbers(report):
    return [a.epsilon for a in report.analyses if a.hidden_state and a.epsilon is not None]


def test_five_classes_at_clip_one_get_composition_with_the_reason():
    report, fallbacks = run(5, 1.0)
    assert not hidden_state_numbers(report) and report.epsilon == report.composition_epsilon
    assert any("5 classes with clip norm 1," in f and "clip norm >= 2)" in f for f in fallbacks)


def test_two_classes_at_clip_one_and_five_at_clip_two_get_the_same_hidden_state_bound():
    binary, none = run(2, 1.0)
    five, also_none = run(5, 2.0)
    sigmoid, neither = run(
        2, 1.0, units=1, loss=tf.keras.losses.BinaryCrossentropy(from_logits=True, reduction=PER_EXAMPLE)
    )
    assert not none and not also_none and not neither
    assert hidden_state_numbers(binary) and binary.epsilon < binary.composition_epsilon
    assert five.epsilon == pytest.approx(binary.epsilon, rel=1e-12) == sigmoid.epsilon


def test_binary_cross_entropy_on_several_logits_is_not_the_geometrys_loss():
    with pytest.raises(
        ParameterError, match=r"^loss: BinaryCrossentropy\(from_logits=True\) in model.loss on 3 logits"
    ):
        run(2, 2.0, units=3, epochs=1, loss=tf.keras.losses.BinaryCrossentropy(from_logits=True, reduction=PER_EXAMPLE))


def test_declared_classes_must_be_the_models():
    with pytest.raises(ParameterError, match="^num_classes: the geometry is declared for 3 classes, but the model"):
        run(5, 2.0, num_classes=3, epochs=1)
