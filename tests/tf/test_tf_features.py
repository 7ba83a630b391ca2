"""Keras: the declared feature bound is enforced (a FeatureClip feeding the trainable Dense layer)
or checked on every record fit trains on before the first step, and the loss in ``model.loss`` is
compared with the one the geometry assumes (issue 18)."""

import json
import re
import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
tfp = pytest.importorskip("tensorflow_privacy")
pytestmark = pytest.mark.tf

from sklearn.datasets import load_digits  # noqa: E402

from hidden_state_accountants import LossGeometry, ParameterError  # noqa: E402
from hidden_state_accountants.checkpoint import seal_state, unseal_state  # noqa: E402
from hidden_state_accountants.tf_privacy import (  # noqa: E402
    DecoupledL2DPKerasSGDOptimizer,
    FeatureClip,
    HiddenStatePrivacyCallback,
    batched_dataset,
    clip_feature_norms,
    model_facts,
)

B, DELTA, L2 = 64, 1e-5, 0.01  # the digits' ten classes: l2_norm_clip 2, which cannot bind (derivations 18)
GEOMETRY = LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=L2)
PER_EXAMPLE = tf.keras.losses.Reduction.NONE


@pytest.fixture(scope="module")
def digits():
    """scikit-learn's digits as the README's Keras pattern would take them: raw pixels (norms up to 76.9)."""
    x, y = load_digits(return_X_y=True)
    return x[:640].astype(np.float32), y[:640].astype(np.int64)


def model_of(*layers, loss=None, **compile_kwargs):
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential(list(layers) or [tf.keras.layers.Dense(10, input_shape=(64,))])
    model.compile(
        optimizer=DecoupledL2DPKerasSGDOptimizer(
            l2_norm_clip=2.0, noise_multiplier=2.0, l2_regularization=L2, learning_rate=0.5
        ),
        loss=loss or tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=PER_EXAMPLE),
        **compile_kwargs,
    )
    return model


def callback(n, geometry=GEOMETRY, sampling="shuffle_partition", **kwargs):
    return HiddenStatePrivacyCallback(
        geometry=geometry, sampling=sampling, dataset_size=n, batch_size=B, delta=DELTA, verbose=0, **kwargs
    )


def refused(model, cb, x, y=None, **fit_kwargs):
    """The ParameterError fit raises, checked to come before any step (weights and iterations unchanged)."""
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ParameterError) as err:
        model.fit(x, y, callbacks=[cb], verbose=0, **dict(dict(epochs=3), **fit_kwargs))
    assert int(model.optimizer.iterations.numpy()) == 0
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    return err.value


def largest(x):
    return float(np.sqrt((np.asarray(x, np.float32).astype(np.float64) ** 2).sum(axis=1)).max())


# --------------------------------------------------------------- the README pattern, raw data
def test_the_readme_pattern_on_raw_digits_is_refused_before_any_step(digits):
    # issue 18: batched_dataset of raw digits with feature_norm_bound=1.0 trained and reported 3.63
    x, y = digits
    err = refused(model_of(), callback(len(x)), batched_dataset(x, y, B, "shuffle_partition"))
    assert str(err) == (
        f"feature_norm_bound: in the {len(x)} records fit trains on, the trainable layer has an input "
        f"of norm {largest(x)!r}, above the declared bound 1 by {largest(x) - 1:.3g}: the declared smoothness "
        "does not hold for it, so the claim ends before a step is taken on it (clip the features with the "
        "package's FeatureClip or clip_features, which round inside the ball: dividing by the norm in float32 "
        "can leave a norm a few roundings above it; or declare the bound the data has)"
    )


def test_fit_on_raw_arrays_is_refused_too(digits):
    x, y = digits
    err = refused(model_of(), callback(len(x), sampling="reshuffle"), x, y, batch_size=B)
    assert err.parameter == "feature_norm_bound" and f"{largest(x):.6g}" in str(err)
    # validation_split: the records fit trains on are the first 80%
    head = clip_feature_norms(x[:512], 1.0)
    split = np.concatenate([head, x[512:]])
    cb = callback(512, sampling="reshuffle")
    model_of().fit(split, y, batch_size=B, epochs=1, validation_split=0.2, callbacks=[cb], verbose=0)
    assert any(f"(largest seen {largest(head):.6g})" in n for n in cb.notes())


def test_clipped_data_is_checked_and_the_largest_reported(digits):
    x, y = digits
    x = clip_feature_norms(x, 1.0)
    cb = callback(len(x))
    model_of().fit(batched_dataset(x, y, B, "shuffle_partition"), epochs=2, callbacks=[cb], verbose=0)
    assert cb.steps == 20 and cb.report.analysis != "composition"
    assert cb.notes() == [
        f"feature norm <= 1: checked on the trainable layer's inputs before every step (largest seen {largest(x):.6g})",
        "loss: SparseCategoricalCrossentropy(from_logits=True) in model.loss, unweighted, as the geometry assumes",
    ]
    assert "largest seen" in " ".join(cb.privacy_statement().split())  # and in the model-card text
    assert cb.privacy_state()["largest_feature_norm"] == pytest.approx(largest(x), rel=1e-12)


def test_a_feature_clip_layer_enforces_the_bound_on_raw_data(digits):
    x, y = digits
    model = model_of(FeatureClip(1.0, input_shape=(64,)), tf.keras.layers.Dense(10))
    assert model_facts(model).feature_clip_norm == 1.0
    cb = callback(len(x))
    model.fit(batched_dataset(x, y, B, "shuffle_partition"), epochs=1, callbacks=[cb], verbose=0)
    assert cb.notes()[0] == (
        "feature norm <= 1: enforced by the model's feature clip (max_norm=1) in front of the trainable layer"
    )
    inputs = model.layers[0](x)
    assert largest(inputs) <= 1.0


def test_layers_before_the_trainable_layer_are_run_to_check_its_inputs(digits):
    x, y = digits
    scaled = model_of(tf.keras.layers.Rescaling(1 / 80, input_shape=(64,)), tf.keras.layers.Dense(10))
    cb = callback(len(x))
    scaled.fit(batched_dataset(x, y, B, "shuffle_partition"), epochs=1, callbacks=[cb], verbose=0)
    assert any(f"largest seen {largest(x / np.float32(80)):.6g}" in n for n in cb.notes())
    too_big = model_of(tf.keras.layers.Rescaling(1 / 16, input_shape=(64,)), tf.keras.layers.Dense(10))
    err = refused(too_big, callback(len(x)), batched_dataset(x, y, B, "shuffle_partition"))
    shown = re.search(r"\(after the layers before it\), the trainable layer has an input of norm ([0-9.]+),", str(err))
    assert float(shown.group(1)) == pytest.approx(largest(x / np.float32(16)), rel=1e-6)  # every digit printed


@pytest.mark.parametrize(
    "make",
    [
        lambda: (FeatureClip(2.0, input_shape=(64,)), tf.keras.layers.Dense(10)),
    ],
)
def test_a_feature_clip_wider_than_the_bound_is_refused(make, digits):
    x, y = digits
    err = refused(model_of(*make()), callback(len(x)), batched_dataset(x, y, B, "shuffle_partition"))
    assert str(err).startswith("feature_norm_bound: the model's feature clip (max_norm=2)")


def test_a_clip_that_does_not_feed_the_trainable_layer_enforces_nothing():
    inputs = tf.keras.Input((64,))
    _ = FeatureClip(1.0)(inputs)  # computed, but the Dense layer sees the raw input
    model = tf.keras.Model(inputs, tf.keras.layers.Dense(10)(tf.keras.layers.Rescaling(2.0)(inputs)))
    assert model_facts(model).feature_clip_norm is None
    inputs = tf.keras.Input((64,))
    model = tf.keras.Model(inputs, tf.keras.layers.Dense(10)(FeatureClip(0.5)(inputs)))
    assert model_facts(model).feature_clip_norm == 0.5


def test_batched_dataset_refuses_features_above_a_bound_it_is_told(digits):
    x, y = digits
    with pytest.raises(
        ParameterError,
        match=rf"^feature_norm_bound: the features have a record of norm "
        rf"{largest(x.astype(np.float64)):.6g}, above 1",
    ):
        batched_dataset(x, y, B, "cyclic", feature_norm_bound=1.0)
    batched_dataset(clip_feature_norms(x, 1.0), y, B, "cyclic", feature_norm_bound=1.0)


# --------------------------------------------------------------------------------- the loss
@pytest.mark.parametrize(
    "loss,fit_kwargs,compile_kwargs,fragment",
    [
        (
            tf.keras.losses.SparseCategoricalCrossentropy(from_logits=False, reduction=PER_EXAMPLE),
            {},
            {},
            "SparseCategoricalCrossentropy(from_logits=False) in model.loss, which expects probabilities",
        ),
        (tf.keras.losses.MeanSquaredError(reduction=PER_EXAMPLE), {}, {}, "the loss MeanSquaredError in model.loss"),
        (None, dict(class_weight={k: 2.0 for k in range(10)}), {}, "weighted by the class_weight passed to fit"),
        (None, dict(sample_weight=np.full(640, 3.0)), {}, "weighted by the sample_weight passed to fit"),
        (None, {}, dict(loss_weights=[2.0]), "weighted by compile(loss_weights=[2.0])"),
    ],
)
def test_a_loss_other_than_the_geometrys_is_refused(loss, fit_kwargs, compile_kwargs, fragment, digits):
    x, y = digits
    x = clip_feature_norms(x, 1.0)
    model = model_of(loss=loss, **compile_kwargs)
    err = refused(model, callback(len(x), sampling="reshuffle"), x, y, batch_size=B, **fit_kwargs)
    assert err.parameter == "loss" and fragment in str(err)
    assert "is not the loss the geometry was derived from (softmax cross-entropy" in str(err)


def test_categorical_cross_entropy_needs_labels_summing_to_at_most_one(digits):
    x, y = digits
    x = clip_feature_norms(x, 1.0)
    loss = tf.keras.losses.CategoricalCrossentropy(from_logits=True, reduction=PER_EXAMPLE)
    one_hot = np.eye(10, dtype=np.float32)[y]
    cb = callback(len(x))
    model_of(loss=loss).fit(batched_dataset(x, one_hot, B, "shuffle_partition"), epochs=1, callbacks=[cb], verbose=0)
    assert cb.notes()[-1].startswith("loss: CategoricalCrossentropy(from_logits=True) in model.loss, unweighted")
    # labels summing to 2 double the Hessian of the loss: (R^2 + 1)/2 no longer bounds it
    err = refused(model_of(loss=loss), callback(len(x)), batched_dataset(x, 2 * one_hot, B, "shuffle_partition"))
    assert err.parameter == "loss" and "labels whose rows sum to 2..2" in str(err)


def test_binary_cross_entropy_on_logits_is_covered(digits):
    x, y = digits
    x = clip_feature_norms(x, 1.0)
    loss = tf.keras.losses.BinaryCrossentropy(from_logits=True, reduction=PER_EXAMPLE)
    cb = callback(len(x))
    model = model_of(tf.keras.layers.Dense(1, input_shape=(64,)), loss=loss)
    model.fit(
        batched_dataset(x, (y % 2).astype(np.float32)[:, None], B, "shuffle_partition"),
        epochs=1,
        callbacks=[cb],
        verbose=0,
    )
    assert cb.notes()[-1].startswith("loss: BinaryCrossentropy(from_logits=True)")


def test_a_geometry_given_by_its_constants_is_the_users_claim_and_nothing_is_checked(digits):
    x, y = digits  # raw: nothing about the features is claimed, so nothing is refused
    geometry = LossGeometry(smoothness=1.0 / 0.6, strong_convexity=L2)
    cb = callback(len(x), geometry=geometry)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model_of(loss=tf.keras.losses.MeanSquaredError(reduction=PER_EXAMPLE)).fit(
            batched_dataset(x / np.float32(80), y.astype(np.float32), B, "shuffle_partition"),
            epochs=1,
            callbacks=[cb],
            verbose=0,
        )
    assert cb.notes() == [
        f"the declared geometry (smoothness={1 / 0.6:g}, strong_convexity={L2:g}) is the user's "
        "claim: given by its constants, not derived from a loss, it cannot be observed from the "
        "training run"
    ]


# ------------------------------------------------------------------------------- resuming
def test_a_restored_state_must_show_its_steps_respected_the_bound(digits):
    x, y = digits
    x = clip_feature_norms(x, 1.0)
    model = model_of()
    cb = callback(len(x))
    model.fit(batched_dataset(x, y, B, "shuffle_partition"), epochs=1, callbacks=[cb], verbose=0)
    state = cb.privacy_state()
    payload = unseal_state(state)
    assert payload["largest_feature_norm"] == pytest.approx(largest(x), rel=1e-12)
    assert payload["claim"]["geometry"]["feature_norm_bound"] == 1.0
    missing = seal_state({k: v for k, v in payload.items() if k != "largest_feature_norm"})
    with pytest.raises(ParameterError, match=r"^checkpoint: the hidden-state privacy state lacks largest_feature_norm"):
        callback(len(x)).load_privacy_state(missing)
    with pytest.raises(
        ParameterError,
        match=r"^checkpoint: the hidden-state privacy state is of format .* version 2; "
        r"this version of the package reads .* version 4",
    ):
        callback(len(x)).load_privacy_state(seal_state({**payload, "version": 2}))
    unknown = seal_state({**payload, "largest_feature_norm": None})  # steps not known to respect the bound
    with pytest.raises(
        ParameterError,
        match=r"^checkpoint: the hidden-state privacy state has 10 steps whose "
        r"largest input norm is not known",
    ):
        callback(len(x)).load_privacy_state(json.loads(json.dumps(unknown)))
    again = callback(len(x))
    again.set_model(model)
    again.load_privacy_state(json.loads(json.dumps(state)))
    model.fit(batched_dataset(x, y, B, "shuffle_partition"), epochs=2, initial_epoch=1, callbacks=[again], verbose=0)
    assert again.steps == 20


def test_a_run_whose_bound_is_the_users_claim_resumes_from_its_state(digits):
    """Issue 18's open item (a): with ``assume_convex_model=True`` and inputs the callback cannot
    compute (two trainable layers), the bound is the user's claim; the state stored
    ``largest_feature_norm: null`` and the resumed fit was refused before the claim was formed. The
    claim carries the reason now, checkpoints included."""
    x, y = digits
    x = clip_feature_norms(x, 1.0)

    def model():
        return model_of(tf.keras.layers.Dense(8, input_shape=(64,)), tf.keras.layers.Dense(10))

    first = model()
    cb = callback(len(x), assume_convex_model=True)
    first.fit(batched_dataset(x, y, B, "shuffle_partition"), epochs=1, callbacks=[cb], verbose=0)
    state = json.loads(json.dumps(cb.privacy_state()))
    assert unseal_state(state)["claim"]["feature_unobservable"].startswith("the model has no single trainable Dense")
    again = callback(len(x), assume_convex_model=True)
    again.load_privacy_state(state)
    second = model()
    second.optimizer.iterations.assign(cb.steps)  # the optimizer restored with the state, as a checkpoint does
    second.fit(batched_dataset(x, y, B, "shuffle_partition"), epochs=2, initial_epoch=1, callbacks=[again], verbose=0)
    assert again.steps == 2 * cb.steps
    assert any(
        n.startswith("feature norm <= 1 is the user's claim: the model has no single trainable Dense")
        for n in again.notes()
    )
