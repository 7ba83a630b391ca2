"""The Keras callback reads facts and the core decides (issue 9): model structure, secret
seeds, batches that must come from the declared schedule, one policy for every framework."""

import re
import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
tfp = pytest.importorskip("tensorflow_privacy")
pytestmark = pytest.mark.tf

from hidden_state_accountants import (  # noqa: E402
    BatchSchedule,
    CompositionFallbackWarning,
    HiddenStateAccountant,
    LossGeometry,
    ParameterError,
    TrainingRunDpEvent,
)
from hidden_state_accountants.recording import (  # noqa: E402
    ASSUMED_CONVEX_NOTE,
    Claim,
    LayerFacts,
    ModelFacts,
    RunRecorder,
    StepFacts,
    model_refusal,
)
from hidden_state_accountants.tf_privacy import (  # noqa: E402
    DecoupledL2DPKerasSGDOptimizer,
    HiddenStatePrivacyCallback,
    batched_dataset,
    clip_feature_norms,
    partition_indices,
)
from hidden_state_accountants.keras.data import dataset_source  # noqa: E402

from keras_common import B, C, CLASSES, DELTA, DIM, GEOMETRY, L2, LR, N, SPE, Z  # noqa: E402


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    return clip_feature_norms(rng.normal(size=(N, DIM)), 1.0), rng.integers(0, CLASSES, N)


def dp_sgd(**kwargs):
    return DecoupledL2DPKerasSGDOptimizer(
        **dict(dict(l2_norm_clip=C, noise_multiplier=Z, l2_regularization=L2, learning_rate=LR), **kwargs)
    )


def compiled(model, optimizer=None):
    model.compile(
        optimizer=optimizer or dp_sgd(),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=tf.keras.losses.Reduction.NONE),
    )
    return model


def logistic(optimizer=None):
    tf.keras.utils.set_random_seed(0)
    return compiled(tf.keras.Sequential([tf.keras.layers.Dense(CLASSES, input_shape=(DIM,))]), optimizer)


def callback(sampling="shuffle_partition", geometry=GEOMETRY, **kwargs):
    return HiddenStatePrivacyCallback(
        geometry=geometry, sampling=sampling, dataset_size=N, batch_size=B, delta=DELTA, verbose=0, **kwargs
    )


def refused(model, cb, x, y=None, **fit_kwargs):
    """The ParameterError fit raises, checked to come before any step."""
    with pytest.raises(ParameterError) as err:
        model.fit(x, y, callbacks=[cb], verbose=0, **dict(dict(epochs=2), **fit_kwargs))
    assert int(model.optimizer.iterations.numpy()) == 0
    assert "\n" not in str(err.value)
    return err.value


def epsilon(steps, sampling="shuffle_partition", geometry=GEOMETRY):
    run = TrainingRunDpEvent(
        dataset_size=N,
        batch_size=B,
        steps=steps,
        noise_multiplier=Z,
        clip_norm=C,
        learning_rate=LR,
        sampling=sampling,
        geometry=geometry,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompositionFallbackWarning)  # no geometry: composition, said here
        return HiddenStateAccountant().compose(run).get_epsilon(DELTA)


# ------------------------------------------------------------ 1. model structure
def conv_net():
    tf.keras.utils.set_random_seed(0)
    return compiled(
        tf.keras.Sequential(
            [
                tf.keras.layers.Conv2D(4, 3, input_shape=(8, 8, 1), name="conv"),
                tf.keras.layers.ReLU(),
                tf.keras.layers.Flatten(name="flatten"),
                tf.keras.layers.Dense(8, name="hidden"),
                tf.keras.layers.ReLU(),
                tf.keras.layers.Dense(CLASSES, name="logits"),
            ],
            name="convnet",
        )
    )


def test_a_conv_relu_network_is_refused_with_the_core_reason_as_in_opacus():
    """The Conv-ReLU-Linear-ReLU-Linear network that Opacus accepted: refused, by the core."""
    from hidden_state_accountants.tf_privacy import model_facts

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(N, 8, 8, 1)).astype(np.float32), rng.integers(0, CLASSES, N)
    model = conv_net()
    err = refused(model, callback(), batched_dataset(x, y, B, "shuffle_partition"))
    facts = model_facts(model)
    assert err.parameter == "model" and str(err) == f"model: {model_refusal(facts)}"
    assert str(err).startswith(
        "model: the Keras model 'convnet' has 3 trainable layers (conv, hidden, logits): a "
        "composition of trainable layers is not convex in its parameters"
    )
    # the same structure as the PyTorch network Opacus reports (Flatten is a reshape there)
    torch_like = ModelFacts(
        layers=[
            LayerFacts(name=n, kind=k, trainable=t)
            for n, k, t in [
                ("Conv2d", "other", True),
                ("ReLU", "other", False),
                ("Linear", "affine", True),
                ("ReLU", "other", False),
                ("Linear", "affine", True),
            ]
        ],
        complete=True,
        description=facts.description,
    )
    keras = [(layer.kind, layer.trainable) for layer in facts.layers if layer.name != "flatten"]
    assert keras == [(layer.kind, layer.trainable) for layer in torch_like.layers]
    assert re.sub(r"\(.*?\)", "()", model_refusal(facts)) == re.sub(r"\(.*?\)", "()", model_refusal(torch_like))


class Subclassed(tf.keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = tf.keras.layers.Dense(CLASSES)

    def call(self, x):
        return self.dense(tf.nn.relu(x) * x)  # custom code: the structure cannot be read


def functional_shared():
    inputs = tf.keras.Input((DIM,))
    shared = tf.keras.layers.Dense(DIM)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(CLASSES)(shared(shared(inputs))))


from hidden_state_accountants.tf_privacy import FeatureClip  # noqa: E402


def nested():
    inner = tf.keras.Sequential([tf.keras.layers.Dense(CLASSES, input_shape=(DIM,))])
    return tf.keras.Sequential([tf.keras.layers.Rescaling(0.5, input_shape=(DIM,)), inner])


@pytest.mark.parametrize(
    "build, reason",
    [
        (
            lambda: tf.keras.Sequential([tf.keras.layers.Dense(CLASSES, activation="relu", input_shape=(DIM,))]),
            "not an affine map",
        ),
        (
            lambda: tf.keras.Sequential(
                [tf.keras.layers.Dense(CLASSES, input_shape=(DIM,)), tf.keras.layers.Activation("softmax")]
            ),
            "follow the trainable layer",
        ),
        (
            lambda: tf.keras.Sequential(
                [tf.keras.layers.Dropout(0.2, input_shape=(DIM,)), tf.keras.layers.Dense(CLASSES)]
            ),
            "randomness",
        ),
        (
            lambda: tf.keras.Sequential(
                [tf.keras.layers.GaussianNoise(0.1, input_shape=(DIM,)), tf.keras.layers.Dense(CLASSES)]
            ),
            "randomness",
        ),
        (Subclassed, "could not be read"),
        (functional_shared, "3 trainable layers"),  # one Dense applied twice: a composition
    ],
)
def test_models_that_are_not_one_linear_map_are_refused_with_a_geometry(build, reason, data):
    tf.keras.utils.set_random_seed(0)
    model = compiled(build())
    err = refused(model, callback(), batched_dataset(*data, B, "shuffle_partition"))
    assert err.parameter == "model" and reason in str(err)


@pytest.mark.parametrize(
    "build",
    [
        lambda: tf.keras.Sequential([tf.keras.layers.Dense(CLASSES, activation="linear", input_shape=(DIM,))]),
        nested,  # a fixed rescaling, then a nested model of one Dense
        lambda: tf.keras.Model(
            *(lambda i: (i, tf.keras.layers.Dense(CLASSES)(tf.keras.layers.Flatten()(i))))(tf.keras.Input((DIM,)))
        ),
        lambda: tf.keras.Sequential(
            [
                tf.keras.layers.Dense(4, input_shape=(DIM,), trainable=False),
                FeatureClip(1.0),  # the bound holds for the trainable layer's input
                tf.keras.layers.Dense(CLASSES),
            ]
        ),  # a frozen feature map
    ],
)
def test_one_dense_layer_on_fixed_features_carries_a_geometry(build, data):
    from hidden_state_accountants.tf_privacy import model_facts

    tf.keras.utils.set_random_seed(0)
    model = compiled(build())
    assert model_refusal(model_facts(model)) is None
    cb = callback()
    model.fit(batched_dataset(*data, B, "shuffle_partition"), epochs=1, callbacks=[cb], verbose=0)
    assert cb.epsilon == pytest.approx(epsilon(SPE), rel=1e-12)


def test_assume_convex_model_is_the_documented_opt_in_and_is_reported(data):
    tf.keras.utils.set_random_seed(0)
    model = compiled(
        tf.keras.Sequential(
            [tf.keras.layers.Dense(4, activation="relu", input_shape=(DIM,)), tf.keras.layers.Dense(CLASSES)]
        )
    )
    cb = callback(assume_convex_model=True)
    model.fit(batched_dataset(*data, B, "shuffle_partition"), epochs=1, callbacks=[cb], verbose=0)
    assert cb.epsilon == pytest.approx(epsilon(SPE), rel=1e-12)
    assert ASSUMED_CONVEX_NOTE in cb.report.notes and ASSUMED_CONVEX_NOTE in cb.notes()
    assert "assume_convex_model=True" in " ".join(cb.privacy_statement().split())
    with pytest.raises(ParameterError, match="assume_convex_model"):
        callback(assume_convex_model="yes")


# -------------------------------------------------------------------- 3. seeds
def _labels(ds):
    return [yb.numpy().tolist() for _, yb in ds]


def test_random_schedules_draw_a_secret_seed_by_default(data):
    from hidden_state_accountants.tf_privacy import dataset_schedule

    x, y = data[0], np.arange(N)
    for sampling in ("shuffle_partition", "without_replacement"):
        a, b = batched_dataset(x, y, B, sampling), batched_dataset(x, y, B, sampling)
        assert _labels(a) != _labels(b)  # a fixed default seed gave the same batches every time
        assert dataset_schedule(a).seed_is_secret
    first, second = (partition_indices(N, B, "shuffle_partition").tolist() for _ in range(2))
    assert first != second
    # a seed you pass is your choice: reproducible, and stated as a secret to keep
    assert _labels(batched_dataset(x, y, B, "shuffle_partition", seed=5)) == _labels(
        batched_dataset(x, y, B, "shuffle_partition", seed=5)
    )
    cb = callback()
    model = logistic()
    model.fit(batched_dataset(*data, B, "shuffle_partition", seed=5), epochs=1, callbacks=[cb], verbose=0)
    assert any("seed chosen by the user" in n for n in cb.report.notes)
    assert "seed chosen by the user" in " ".join(cb.privacy_statement().split())
    with pytest.raises(ParameterError, match="^seed: sampling='cyclic' is deterministic"):
        batched_dataset(x, y, B, "cyclic", seed=0)


@pytest.mark.parametrize("sampling", ["cyclic", "shuffle_partition", "without_replacement", "full"])
def test_the_batches_are_the_core_schedules_batches(sampling):
    n, b = 23, 23 if sampling == "full" else 5
    x, y = np.arange(n, dtype=np.float32)[:, None], np.arange(n)
    seed = 11 if sampling in ("shuffle_partition", "without_replacement") else None
    ds = batched_dataset(x, y, b, sampling, seed=seed)
    schedule = BatchSchedule(n, b, sampling, seed)
    spe = schedule.steps_per_epoch
    for epoch in range(3):
        assert _labels(ds) == [schedule.batch(t).tolist() for t in range(epoch * spe, (epoch + 1) * spe)]


# ------------------------------------------------- 4. batches from the schedule
def test_plain_fit_on_arrays_is_refused_with_what_it_does(data):
    """fit(x, y, batch_size=b) draws a new permutation every epoch: not shuffle_partition,
    although the number of steps matches."""
    model = logistic()
    err = refused(model, callback(), *data, batch_size=B)
    assert err.parameter == "data"
    # Keras' shuffle is the reshuffle schedule drawn by Keras, not the declared shuffle_partition
    assert "sampling='reshuffle', drawn by the framework" in str(err) and "'shuffle_partition'" in str(err)
    # with a short last batch (120 = 7 * 16 + 8)
    err = refused(
        logistic(),
        HiddenStatePrivacyCallback(
            geometry=GEOMETRY, sampling="cyclic", dataset_size=N, batch_size=16, delta=DELTA, verbose=0
        ),
        *data,
        batch_size=16,
        shuffle=False,
    )
    assert err.parameter == "data" and "short last batch of 8 records" in str(err)


def test_arrays_in_data_order_are_the_cyclic_schedule_and_a_full_batch_is_full(data):
    model = logistic()
    cb = callback("cyclic")
    model.fit(*data, batch_size=B, shuffle=False, epochs=2, callbacks=[cb], verbose=0)
    assert cb.epsilon == pytest.approx(epsilon(2 * SPE, "cyclic"), rel=1e-12)
    model = logistic()
    cb = HiddenStatePrivacyCallback(
        geometry=GEOMETRY, sampling="full", dataset_size=N, batch_size=N, delta=DELTA, verbose=0
    )
    model.fit(*data, batch_size=N, epochs=2, callbacks=[cb], verbose=0)
    assert cb.steps == 2 and cb.run_event().sampling == "full"


def test_other_data_is_refused_with_the_reason(data):
    x, y = data
    reshuffled = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N).batch(B, drop_remainder=True)
    err = refused(logistic(), callback(), reshuffled)
    assert err.parameter == "data" and "not returned by batched_dataset" in str(err)
    assert "batched_dataset(x, y, b, 'reshuffle')" in str(err)  # how to fix it
    err = refused(logistic(), callback("reshuffle"), reshuffled)  # also when reshuffle is declared
    assert err.parameter == "data" and "shuffle(" in str(err)
    infinite = batched_dataset(x, y, B, "shuffle_partition").repeat()
    err = refused(logistic(), callback(), infinite, steps_per_epoch=SPE)
    assert err.parameter == "data" and "an infinite tf.data.Dataset" in str(err)
    # without_replacement data under a shuffle_partition callback
    err = refused(logistic(), callback(), batched_dataset(x, y, B, "without_replacement"))
    assert err.parameter == "data" and "'without_replacement'" in str(err) and "'shuffle_partition'" in str(err)
    # another n and b with the same number of steps per epoch
    err = refused(logistic(), callback(), batched_dataset(x[:60], y[:60], 10, "shuffle_partition"))
    assert err.parameter == "data" and "dataset_size=60, batch_size=10" in str(err)
    # the right dataset, cut short by steps_per_epoch
    err = refused(logistic(), callback(), batched_dataset(x, y, B, "shuffle_partition"), steps_per_epoch=3)
    assert err.parameter == "steps_per_epoch"


def test_without_fit_the_batches_cannot_be_verified():
    model = logistic()
    cb = callback()
    cb.set_model(model)
    cb.set_params({"epochs": 1, "steps": SPE, "verbose": 0})
    with pytest.raises(ParameterError, match="^data: cannot find what model.fit trains on"):
        cb.on_train_begin()  # a custom training loop calling the hooks itself


class StopAfter(tf.keras.callbacks.Callback):
    def __init__(self, batches):
        super().__init__()
        self.batches = batches

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == self.batches:
            self.model.stop_training = True


def test_a_partition_restarted_mid_epoch_is_refused(data):
    model = logistic()
    cb = callback()
    ds = batched_dataset(*data, B, "shuffle_partition")
    model.fit(ds, epochs=2, callbacks=[cb, StopAfter(2)], verbose=0)
    assert cb.steps == 2
    with pytest.raises(ParameterError, match="^data: the run is at batch 2 of its 6-batch epoch"):
        model.fit(ds, epochs=1, callbacks=[cb], verbose=0)
    assert cb.steps == int(model.optimizer.iterations.numpy()) == 2


def test_fresh_draws_are_never_replayed(data):
    model = logistic()
    cb = callback("without_replacement")
    ds = batched_dataset(*data, B, "without_replacement", seed=3)
    model.fit(ds, epochs=1, callbacks=[cb], verbose=0)
    model.fit(ds, epochs=1, callbacks=[cb], verbose=0)  # the same dataset goes on drawing
    assert cb.steps == 2 * SPE
    # a new dataset with the same seed continues where the run is (it would otherwise hand
    # out the batches of steps 0.. again)
    fresh = batched_dataset(*data, B, "without_replacement", seed=3)
    model.fit(fresh, epochs=1, callbacks=[cb], verbose=0)
    assert cb.steps == 3 * SPE and dataset_source(fresh).next_step == 3 * SPE
    # one that has already handed out the draws of steps 0..5 elsewhere cannot be moved on
    used = batched_dataset(*data, B, "without_replacement", seed=3)
    list(used)
    with pytest.raises(ParameterError, match="has handed out 6 batches for 18 steps"):
        model.fit(used, epochs=1, callbacks=[cb], verbose=0)


class ExtraStep(tf.keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            x = np.zeros((B, DIM), np.float32)
            self.model.train_on_batch(x, np.zeros(B, np.int64))  # a step on other data


def test_steps_on_other_data_during_an_epoch_are_refused(data):
    model = logistic()
    with pytest.raises(ParameterError, match="fit's data has handed out 6 batches for 7 steps"):
        model.fit(
            batched_dataset(*data, B, "shuffle_partition"), epochs=1, callbacks=[callback(), ExtraStep()], verbose=0
        )


# ------------------------------------------------------------ 5/6. one policy
def core_error(step_kwargs, sampling="shuffle_partition"):
    """The core's verdict on the first step, as any framework's adapter gets it."""
    facts = dict(noise_multiplier=Z, clip_norm=C, learning_rate=LR, divisor=B, weight_decay=L2)
    recorder = RunRecorder(
        Claim(
            schedule=BatchSchedule(N, B, sampling),
            geometry=GEOMETRY,
            model=ModelFacts(layers=[LayerFacts(name="Linear", kind="affine", trainable=True)], complete=True),
        )
    )
    with pytest.raises(ParameterError) as err:
        recorder.check(StepFacts(**dict(facts, **step_kwargs)))
    return err.value


@pytest.mark.parametrize(
    "optimizer, same_as",
    [
        (lambda: dp_sgd(momentum=0.9), dict(momentum=0.9)),  # Opacus fell back to composition here
        (lambda: dp_sgd(learning_rate=2.0), dict(learning_rate=2.0)),
        (lambda: dp_sgd(l2_regularization=0.01), dict(weight_decay=0.01)),
        (
            lambda: tfp.DPKerasAdamOptimizer(l2_norm_clip=C, noise_multiplier=Z, learning_rate=LR),
            dict(optimizer="adam", weight_decay=0.0),
        ),
    ],
)
def test_contradictions_known_before_training_are_the_cores_errors(optimizer, same_as, data):
    err = refused(logistic(optimizer()), callback(), batched_dataset(*data, B, "shuffle_partition"))
    expected = core_error(same_as)
    assert (err.parameter, str(err)) == (expected.parameter, str(expected))


def test_a_schedule_that_is_not_constant_is_refused_before_training(data):
    schedule = tf.keras.optimizers.schedules.PiecewiseConstantDecay([8], [LR, LR / 2])  # changes in epoch 2
    ds = batched_dataset(*data, B, "shuffle_partition")
    err = refused(logistic(dp_sgd(learning_rate=schedule)), callback(), ds, epochs=2)
    assert err.parameter == "learning_rate" and "the planned run the learning rate changed" in str(err)
    # within the planned epochs it is constant: accepted
    model = logistic(dp_sgd(learning_rate=schedule))
    cb = callback()
    model.fit(ds, epochs=1, callbacks=[cb], verbose=0)
    assert cb.epsilon == pytest.approx(epsilon(SPE), rel=1e-12)


def test_a_learning_rate_changed_mid_run_falls_back_to_composition_with_one_warning(data):
    # even to a rate >= 2/M: composition holds for any use of the noisy gradients
    model = logistic()
    cb = callback()
    changer = tf.keras.callbacks.LearningRateScheduler(lambda epoch, lr: LR if epoch == 0 else 2.0)
    with pytest.warns(CompositionFallbackWarning, match="learning rate changed during training") as record:
        hist = model.fit(
            batched_dataset(*data, B, "shuffle_partition"), epochs=3, callbacks=[cb, changer], verbose=0
        ).history
    assert len([w for w in record if w.category is CompositionFallbackWarning]) == 1
    assert hist["epsilon"][0] == pytest.approx(epsilon(SPE), rel=1e-12)  # hidden state until the change
    assert hist["epsilon"][-1] == pytest.approx(epsilon(3 * SPE, geometry=None), rel=1e-12)
    assert hist["epsilon"][-1] == hist["epsilon_composition"][-1]
    assert any("learning rate changed during training" in n for n in cb.report.notes)
    assert "the learning rate changed during training" in " ".join(cb.privacy_statement().split())


def test_the_budget_stop_applies_to_the_fallback_number(data):
    target = (epsilon(SPE) + epsilon(2 * SPE, geometry=None)) / 2  # epoch 1 fits; epoch 2 at a new rate does not
    assert epsilon(2 * SPE) < target  # it would, with the rate unchanged
    model = logistic()
    cb = callback(target_epsilon=target)
    changer = tf.keras.callbacks.LearningRateScheduler(lambda epoch, lr: LR if epoch == 0 else LR / 2)
    from hidden_state_accountants.tf_privacy import PrivacyBudgetExceeded

    with pytest.raises(PrivacyBudgetExceeded, match="learning rate changed to 0.25 at step 6"):
        model.fit(batched_dataset(*data, B, "shuffle_partition"), epochs=3, callbacks=[cb, changer], verbose=0)
    assert cb.steps == SPE and cb.epsilon <= target


def test_no_geometry_warns_once_with_the_cores_warning_only(data):
    model = logistic()
    cb = callback(geometry=None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.fit(batched_dataset(*data, B, "shuffle_partition"), epochs=2, callbacks=[cb], verbose=0)
        cb.privacy_statement()
    ours = [w for w in record if issubclass(w.category, UserWarning)]
    assert [w.category for w in ours] == [CompositionFallbackWarning]
    assert "no loss geometry declared" in str(ours[0].message)


def test_a_loose_strong_convexity_is_advised_once(data):
    from hidden_state_accountants import HiddenStateWarning

    loose = LossGeometry(strong_convexity=L2 / 2, smoothness=1.0 + L2)
    model = logistic()
    cb = callback(geometry=loose, target_epsilon=100.0)  # planning runs too: it must not repeat the advice
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.fit(batched_dataset(*data, B, "shuffle_partition"), epochs=2, callbacks=[cb], verbose=0)
    advice = [w for w in record if w.category is HiddenStateWarning]
    assert len(advice) == 1 and "valid but loose" in str(advice[0].message)


def test_a_change_between_fit_calls_is_known_before_the_next_fit(data):
    model = logistic()
    cb = callback()
    ds = batched_dataset(*data, B, "shuffle_partition")
    model.fit(ds, epochs=1, callbacks=[cb], verbose=0)
    tf.keras.backend.set_value(model.optimizer.lr, LR / 2)
    with pytest.raises(ParameterError, match="^learning_rate: the planned run the learning rate changed"):
        model.fit(ds, epochs=1, callbacks=[cb], verbose=0)
    assert cb.steps == int(model.optimizer.iterations.numpy()) == SPE
    tf.keras.backend.set_value(model.optimizer.lr, LR)  # back to the run's rate: it goes on
    model.fit(ds, epochs=1, callbacks=[cb], verbose=0)
    assert cb.epsilon == pytest.approx(epsilon(2 * SPE), rel=1e-12)
