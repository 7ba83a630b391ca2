"""Reshuffling in Keras (issue 11): ``batched_dataset(..., "reshuffle")`` and Keras' own
``fit(x, y, batch_size=b, shuffle=True)`` accounted as the core's ``reshuffle`` schedule, with
the short last batch divided by its own size and the shuffle's secrecy read from the op."""

import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
tfp = pytest.importorskip("tensorflow_privacy")
pytestmark = pytest.mark.tf

from hidden_state_accountants import (  # noqa: E402
    CompositionFallbackWarning,
    HiddenStateAccountant,
    LossGeometry,
    ParameterError,
    TrainingRunDpEvent,
)
from hidden_state_accountants.tf_privacy import (  # noqa: E402
    DecoupledL2DPKerasSGDOptimizer,
    HiddenStatePrivacyCallback,
    batched_dataset,
    clip_feature_norms,
    compute_hidden_state_privacy_statement,
    dataset_schedule,
)

N, B, DIM, CLASSES = 61, 6, 4, 2  # 10 full batches and a short one of 1 record
R = N % B
Z, C, LR, L2, DELTA = 1.5, 1.0, 0.5, 0.05, 1e-5
GEOMETRY = LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=L2, num_classes=CLASSES)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(1)
    return clip_feature_norms(rng.normal(size=(N, DIM)), 1.0), rng.integers(0, CLASSES, N)


def logistic(optimizer=None, secret=True):
    tf.keras.utils.set_random_seed(0)  # the initial weights
    model = tf.keras.Sequential([tf.keras.layers.Dense(CLASSES, input_shape=(DIM,))])
    model.compile(
        optimizer=optimizer
        or DecoupledL2DPKerasSGDOptimizer(l2_norm_clip=C, noise_multiplier=Z, l2_regularization=L2, learning_rate=LR),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=tf.keras.losses.Reduction.NONE),
    )
    if secret:
        tf.random.set_seed(None)  # no global seed: Keras' shuffle is seeded by the operating system
    return model


def callback(n=N, b=B, **kwargs):
    return HiddenStatePrivacyCallback(
        geometry=GEOMETRY, sampling="reshuffle", dataset_size=n, batch_size=b, delta=DELTA, verbose=0, **kwargs
    )


def core_epsilon(steps, n=N, b=B, **kwargs):
    run = TrainingRunDpEvent(
        dataset_size=n,
        batch_size=b,
        steps=steps,
        noise_multiplier=Z,
        clip_norm=C,
        learning_rate=LR,
        sampling="reshuffle",
        geometry=GEOMETRY,
        **kwargs,
    )
    return HiddenStateAccountant().compose(run).explain(DELTA)


def _labels(ds):
    return [yb.numpy().tolist() for _, yb in ds]


# ----------------------------------------------------------------- batched_dataset
def test_batched_dataset_reshuffle_draws_a_secret_permutation_every_epoch():
    x = np.arange(N, dtype=np.float32)[:, None]
    y = np.arange(N)
    ds = batched_dataset(x, y, B, "reshuffle")
    schedule = dataset_schedule(ds)
    assert schedule.sampling == "reshuffle" and schedule.seed_is_secret and schedule.secret
    epochs = [_labels(ds) for _ in range(3)]
    spe = N // B
    for k, epoch in enumerate(epochs):
        assert epoch == [schedule.batch(t).tolist() for t in range(k * spe, (k + 1) * spe)]
        flat = [i for batch in epoch for i in batch]
        assert len(epoch) == spe and all(len(batch) == B for batch in epoch)
        assert len(set(flat)) == spe * B  # disjoint batches, n % b records left out
    assert epochs[0] != epochs[1] != epochs[2]  # a fresh permutation every epoch
    assert {tuple(sorted(i for b in e for i in b)) for e in epochs} != {
        tuple(range(spe * B))
    }  # different records left out
    # the short batch kept: ceil(n / b) batches, every record once per epoch
    kept = batched_dataset(x, y, B, "reshuffle", seed=3, last_batch="kept_own_size")
    epoch = _labels(kept)
    assert [len(batch) for batch in epoch] == [B] * spe + [R]
    assert sorted(i for batch in epoch for i in batch) == list(range(N))
    assert _labels(batched_dataset(x, y, B, "reshuffle", seed=3, last_batch="kept_own_size")) == epoch  # reproducible
    assert not dataset_schedule(kept).seed_is_secret


def test_batched_dataset_reshuffle_in_fit_continues_the_run(data):
    """A second fit on a fresh dataset continues the run's permutations (its seed, its epochs)."""
    x, y = data
    model, cb = logistic(), callback()
    model.fit(batched_dataset(x, y, B, "reshuffle"), epochs=2, callbacks=[cb], verbose=0)
    spe = N // B
    assert cb.steps == 2 * spe
    assert cb.epsilon == pytest.approx(core_epsilon(2 * spe).epsilon, rel=1e-12)
    fresh = batched_dataset(x, y, B, "reshuffle")
    model.fit(fresh, epochs=1, callbacks=[cb], verbose=0)
    schedule = cb.recorder.claim.schedule
    assert dataset_schedule(fresh) == schedule  # the run's secret seed, not the fresh one
    # the dataset is at the run's fourth epoch: no permutation is used twice
    assert _labels(fresh) == [y[schedule.batch(t)].tolist() for t in range(3 * spe, 4 * spe)]
    assert cb.epsilon == pytest.approx(core_epsilon(3 * spe).epsilon, rel=1e-12)


# ----------------------------------------------------------- fit(shuffle=True)
def test_fit_shuffle_true_is_reshuffle_with_the_short_batch_divided_by_its_own_size(data):
    model, cb = logistic(), callback()
    hist = model.fit(*data, batch_size=B, shuffle=True, epochs=2, callbacks=[cb], verbose=0).history
    spe = -(-N // B)
    assert cb.steps_per_epoch == spe == 11 and cb.steps == 2 * spe
    expected = core_epsilon(2 * spe, last_batch="kept_own_size", secret_batches=True)
    assert hist["epsilon"][-1] == pytest.approx(expected.epsilon, rel=1e-12)
    assert expected.analysis == "si_reshuffle_amplified" and cb.report.analysis == expected.analysis  # issue 19
    run = cb.run_event()
    assert (run.sampling, run.last_batch, run.secret_batches) == ("reshuffle", "kept_own_size", True)
    # the ledger: 10 steps divided by b, then the short one divided by its 1 record, every epoch
    assert [(s.divisor, count) for s, count in cb.recorder.ledger] == [(B, 10), (R, 1)] * 2
    assert cb.recorder.claim.schedule.external
    text = cb.privacy_statement()
    assert "Keras draws a new random permutation of the records every epoch" in " ".join(text.split())
    assert "secret: not seeded" in " ".join(text.split())
    assert "divided by its own size" in " ".join(text.split())
    assert f"{expected.epsilon:.3f}" in text


def test_fit_shuffle_true_after_a_global_seed_is_public_and_reports_the_worst_pattern(data):
    model = logistic(secret=False)  # tf.keras.utils.set_random_seed(0) is in force
    cb = callback()
    hist = model.fit(*data, batch_size=B, shuffle=True, epochs=2, callbacks=[cb], verbose=0).history
    public = core_epsilon(22, last_batch="kept_own_size", secret_batches=False)
    secret = core_epsilon(22, last_batch="kept_own_size", secret_batches=True)
    assert hist["epsilon"][-1] == pytest.approx(public.epsilon, rel=1e-12)
    assert public.analysis == "si_reshuffle_worst" and public.epsilon > secret.epsilon
    assert cb.run_event().secret_batches is False
    text = " ".join(cb.privacy_statement().split())
    assert "public (secret=False)" in text and "public: seeded" in text
    # tf.random.set_seed alone, with another value, is seen the same way
    model = logistic(secret=False)
    tf.random.set_seed(1234)
    cb = callback()
    model.fit(*data, batch_size=B, shuffle=True, epochs=1, callbacks=[cb], verbose=0)
    assert cb.run_event().secret_batches is False


def test_the_recorded_short_divisor_is_what_tf_privacy_divides_by():
    """Measured: the per-example gradient 0.5 (inside the clip norm), no noise; the update's
    gradient is the clipped sum over the divisor."""
    from tensorflow_privacy import DPKerasSGDOptimizer

    from hidden_state_accountants.tf_privacy.optimizers import read_dp_optimizer_settings, step_facts

    for make in (
        lambda: DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=0.0, learning_rate=1.0),
        lambda: DecoupledL2DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=0.0, l2_regularization=0.0, learning_rate=1.0
        ),
    ):
        for size in (B, R, 4):
            opt = make()
            w = tf.Variable([0.0])
            with tf.GradientTape() as tape:
                loss = 0.5 * w * tf.ones([size])  # one loss per record, gradient 0.5 each
            ((grad, _),) = opt._compute_gradients(loss, [w], tape=tape)
            divisor = 0.5 * size / float(grad.numpy()[0])
            assert divisor == pytest.approx(size)
    # what the callback records for the short step of a fit(shuffle=True) run (n % b = 1)
    opt = DecoupledL2DPKerasSGDOptimizer(l2_norm_clip=C, noise_multiplier=Z, l2_regularization=L2, learning_rate=LR)
    facts = step_facts(read_dp_optimizer_settings(opt), LR, batch_size=R)
    assert facts.divisor == R


def test_a_declaration_that_does_not_match_what_runs_is_refused(data):
    # declared dropped, but fit keeps the short batch
    model = logistic()
    with pytest.raises(ParameterError) as err:
        model.fit(*data, batch_size=B, shuffle=True, epochs=1, callbacks=[callback(last_batch="dropped")], verbose=0)
    assert err.value.parameter == "data" and int(model.optimizer.iterations.numpy()) == 0
    assert "kept_own_size" in str(err.value)
    # declared kept_own_size, and it is: accepted
    model, cb = logistic(), callback(last_batch="kept_own_size")
    model.fit(*data, batch_size=B, shuffle=True, epochs=1, callbacks=[cb], verbose=0)
    assert cb.steps == 11
    # a kept batch divided by b is not what TF-Privacy does
    with pytest.raises(ParameterError, match="last_batch"):
        callback(last_batch="kept_batch_size")
    # shuffle=False with a short batch: data order, no schedule
    model = logistic()
    with pytest.raises(ParameterError, match="data order, with a short last batch of 1 records"):
        model.fit(*data, batch_size=B, shuffle=False, epochs=1, callbacks=[callback()], verbose=0)
    # shuffle='batch' is not a uniform permutation
    with pytest.raises(ParameterError, match="chunks of the batch size"):
        model.fit(*data, batch_size=B, shuffle="batch", epochs=1, callbacks=[callback()], verbose=0)


def test_b_dividing_n_drops_nothing_and_the_budget_stop_uses_the_run_epochs(data):
    x, y = data
    x, y = x[:60], y[:60]
    model, cb = logistic(), callback(n=60, b=B, target_epsilon=core_epsilon(30, n=60).epsilon * 1.0001)
    model.fit(x, y, batch_size=B, epochs=5, callbacks=[cb], verbose=0)
    assert cb.steps_per_epoch == 10 and cb.run_event().last_batch == "dropped"
    assert cb.steps == 30 and cb.stopped_reason  # stopped after 3 epochs: a 4th would exceed the budget


def test_statement_for_a_reshuffled_keras_run():
    common = dict(l2_norm_clip=C, learning_rate=LR, sampling="reshuffle", geometry=GEOMETRY)
    text = compute_hidden_state_privacy_statement(N, B, 2, Z, DELTA, last_batch="kept_own_size", **common)
    expected = core_epsilon(22, last_batch="kept_own_size")
    assert f"{expected.epsilon:.3f}  ({expected.analysis})" in text
    assert "short last batch of the 1 examples left over (61 mod 6) every epoch, divided by its own size" in " ".join(
        text.split()
    )
    public = compute_hidden_state_privacy_statement(
        N, B, 2, Z, DELTA, last_batch="kept_own_size", secret_batches=False, **common
    )
    worst = core_epsilon(22, last_batch="kept_own_size", secret_batches=False)
    assert f"{worst.epsilon:.3f}  (si_reshuffle_worst)" in public and "public (secret=False)" in " ".join(
        public.split()
    )
    dropped = compute_hidden_state_privacy_statement(N, B, 2, Z, DELTA, **common)
    assert f"{core_epsilon(20).epsilon:.3f}" in dropped and "dropped each epoch" in dropped
    with pytest.raises(ParameterError, match="last_batch"):
        compute_hidden_state_privacy_statement(N, B, 2, Z, DELTA, last_batch="kept_batch_size", **common)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompositionFallbackWarning)  # the text says why; no warning
        compute_hidden_state_privacy_statement(N, B, 2, Z, DELTA, **dict(common, geometry=None))
