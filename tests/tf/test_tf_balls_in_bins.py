"""``batched_dataset(..., sampling="balls_in_bins")`` (issues 19, 28, 29): the schedule's batches, fresh every
epoch and resumable, padded to ``b`` rows of weight 0 so that TF-Privacy's division by the batch's rows is the
fixed divisor ``b``; the Keras callback accounts them (with no geometry: the amplified composition), and its
calibration uses that number."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
pytest.importorskip("tensorflow_privacy")
pytestmark = pytest.mark.tf

from hidden_state_accountants import HiddenStateAccountant, ParameterError, TrainingRunDpEvent  # noqa: E402
from hidden_state_accountants.keras.data import PAD_OVERFLOW, balls_in_bins_steps, overflow_delta  # noqa: E402
from hidden_state_accountants.schedules import BALLS_IN_BINS  # noqa: E402
from hidden_state_accountants.tf_privacy import (  # noqa: E402
    HiddenStatePrivacyCallback,
    batched_dataset,
    dataset_schedule,
    partition_indices,
)

N, B = 240, 40
DELTA = 1e-5


def _data(n=N):
    x = np.stack([np.arange(n), -np.arange(n)], axis=1).astype(np.float32)
    return x, np.arange(n, dtype=np.int64)


def _epoch(ds):
    """The records of each batch (the rows of weight 1); every batch has B rows, the padding weight 0."""
    out = []
    for xb, yb, wb in ds:
        assert xb.shape[0] == yb.shape[0] == wb.shape[0] == B
        w = wb.numpy()
        real = int(w.sum())
        assert np.all(w[:real] == 1.0) and np.all(w[real:] == 0.0)
        np.testing.assert_array_equal(xb.numpy()[:, 0], yb.numpy())
        out.append(yb.numpy()[:real].tolist())
    return out


def test_each_epoch_is_the_schedules_padded_to_b_rows():
    x, y = _data()
    ds = batched_dataset(x, y, B, BALLS_IN_BINS)
    schedule = dataset_schedule(ds)
    t = balls_in_bins_steps(N, B)
    assert schedule.sampling == BALLS_IN_BINS and schedule.seed_is_secret and schedule.steps_per_epoch == t > N // B
    epochs = [_epoch(ds) for _ in range(3)]
    for k, epoch in enumerate(epochs):
        assert len(epoch) == t and sorted(i for b in epoch for i in b) == list(range(N))
        assert epoch == [schedule.batch(t * k + j).tolist() for j in range(t)]  # epoch k of the schedule
    assert epochs[0] != epochs[1]  # fresh draws every epoch
    assert len({len(b) for e in epochs for b in e}) > 1  # random sizes


def test_steps_per_epoch_make_overflow_negligible_and_are_public():
    """``t`` is the fewest steps for which a step draws more than b records (of n + 1: a neighbour with one
    more) with probability at most PAD_OVERFLOW; fewer are refused naming the parameter, a tiny batch too."""
    from scipy import stats

    t = balls_in_bins_steps(N, B)
    assert stats.binom.sf(B, N + 1, 1 / t) <= PAD_OVERFLOW < stats.binom.sf(B, N + 1, 1 / (t - 1))
    x, y = _data()
    assert dataset_schedule(batched_dataset(x, y, B, BALLS_IN_BINS, steps_per_epoch=t + 3)).steps_per_epoch == t + 3
    with pytest.raises(ParameterError, match="steps_per_epoch") as err:
        batched_dataset(x, y, B, BALLS_IN_BINS, steps_per_epoch=N // B)
    assert err.value.parameter == "steps_per_epoch"
    with pytest.raises(ParameterError, match="too small") as err:
        batched_dataset(x, y, 2, BALLS_IN_BINS)
    assert err.value.parameter == "batch_size"


def test_a_chosen_seed_is_reproducible_and_there_is_no_fixed_partition():
    x, y = _data()
    a, b = batched_dataset(x, y, B, BALLS_IN_BINS, seed=4), batched_dataset(x, y, B, BALLS_IN_BINS, seed=4)
    assert _epoch(a) == _epoch(b) and not dataset_schedule(a).seed_is_secret
    with pytest.raises(ParameterError, match="no fixed partition"):
        partition_indices(N, B, BALLS_IN_BINS)


def _model():
    model = tf.keras.Sequential(
        [tf.keras.Input((2,)), tf.keras.layers.Dense(4, activation="relu"), tf.keras.layers.Dense(3)]
    )
    from tensorflow_privacy import DPKerasSGDOptimizer

    opt = DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.2, learning_rate=0.1)
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=tf.losses.Reduction.NONE)
    model.compile(optimizer=opt, loss=loss)
    return model


def test_keras_fit_is_accounted_with_the_amplified_composition():
    """Issue 29: the callback accepts balls_in_bins; with no geometry a non-convex network gets the random-allocation
    composition, the core's number for the same event at delta less the padded batches' overflow chance."""
    x, y = _data()
    x = x / N
    ds = batched_dataset(x, y % 3, B, BALLS_IN_BINS)
    cb = HiddenStatePrivacyCallback(geometry=None, sampling=BALLS_IN_BINS, dataset_size=N, batch_size=B, delta=DELTA)
    model = _model()
    model.fit(ds, epochs=2, callbacks=[cb], verbose=0)
    t = dataset_schedule(ds).steps_per_epoch
    assert cb.steps == 2 * t and cb.report.analysis == "composition_allocation_pld"
    event = TrainingRunDpEvent(
        dataset_size=N,
        batch_size=B,
        steps=2 * t,
        noise_multiplier=cb.settings.noise_multiplier,
        clip_norm=1.0,
        learning_rate=0.1,
        sampling=BALLS_IN_BINS,
        epoch_steps=t,
    )
    accounted = DELTA - overflow_delta(dataset_schedule(ds), 2 * t)
    assert 0 < DELTA - accounted <= 2 * t * PAD_OVERFLOW
    core = HiddenStateAccountant().compose(event).get_epsilon(accounted)
    assert cb.history[-1].epsilon == pytest.approx(core, rel=1e-9)
    # far below the unamplified composition of one Gaussian per epoch
    assert core < 0.2 * HiddenStateAccountant().compose(event).explain(DELTA).analyses[0].epsilon
    # the model-card statement states the same run at the same accounted delta as the epsilon above
    import hidden_state_accountants.tf_privacy.callback as callback_module

    stated = []
    real = callback_module.render_statement
    callback_module.render_statement = lambda recorder, delta, **kw: stated.append(delta) or real(recorder, delta, **kw)
    try:
        text = cb.privacy_statement()
    finally:
        callback_module.render_statement = real
    assert stated == [accounted] and f"over {N} examples" in text


def test_the_standalone_statement_leaves_balls_in_bins_to_the_callback():
    from hidden_state_accountants.tf_privacy import compute_hidden_state_privacy_statement

    with pytest.raises(ParameterError, match="sampling.*privacy_statement"):
        compute_hidden_state_privacy_statement(
            N, B, 2, 1.0, DELTA, l2_norm_clip=1.0, learning_rate=0.1, sampling=BALLS_IN_BINS, geometry=None
        )


def test_keras_calibration_uses_the_amplified_composition():
    cb = HiddenStatePrivacyCallback(geometry=None, sampling=BALLS_IN_BINS, dataset_size=N, batch_size=B, delta=DELTA)
    z = cb.compute_noise(2.0, 5, learning_rate=0.1, l2_norm_clip=1.0)
    run = cb.calibration.run
    assert run.epoch_steps == balls_in_bins_steps(N, B)
    report = HiddenStateAccountant().compose(run.replace(noise_multiplier=z)).explain(DELTA)
    assert report.analysis == "composition_allocation_pld" and report.epsilon <= 2.0
    # the unamplified composition would need about four times the noise
    assert report.analyses[0].name == "composition_balls_in_bins" and report.analyses[0].epsilon > 6.0


def test_a_delta_below_the_overflow_chance_is_refused_alike_by_the_callback_and_the_calibration():
    from hidden_state_accountants.keras.data import keras_schedule
    from hidden_state_accountants.tf_privacy import compute_hidden_state_noise

    schedule = keras_schedule(N, B, BALLS_IN_BINS)
    overflow = overflow_delta(schedule, 10 * schedule.steps_per_epoch)
    assert 0 < overflow < 1e-9  # tiny, but a delta below it leaves nothing for the mechanism
    cb = HiddenStatePrivacyCallback(
        geometry=None, sampling=BALLS_IN_BINS, dataset_size=N, batch_size=B, delta=overflow / 2
    )
    cb.recorder = type("R", (), {"claim": type("C", (), {"schedule": schedule})()})()  # the schedule fit would run
    with pytest.raises(ParameterError, match="delta: .* below the chance .* overflows"):
        cb._delta(10 * schedule.steps_per_epoch)
    with pytest.raises(ParameterError, match="delta: .* below the chance .* overflows"):
        compute_hidden_state_noise(
            N, B, 1.0, 10, overflow / 2, sampling=BALLS_IN_BINS, learning_rate=0.1, l2_norm_clip=1.0, geometry=None
        )
