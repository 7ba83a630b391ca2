"""``batched_dataset(..., sampling="balls_in_bins")`` (issue 19): the schedule's batches, fresh every
epoch and resumable, and the Keras callback's refusal (TF-Privacy divides by the realised size)."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
pytest.importorskip("tensorflow_privacy")
pytestmark = pytest.mark.tf

from hidden_state_accountants import LossGeometry, ParameterError  # noqa: E402
from hidden_state_accountants.schedules import BALLS_IN_BINS  # noqa: E402
from hidden_state_accountants.tf_privacy import (  # noqa: E402
    HiddenStatePrivacyCallback,
    batched_dataset,
    dataset_schedule,
    partition_indices,
)

N, B = 23, 5  # 4 steps per epoch, batches of random size


def _data(n=N):
    x = np.stack([np.arange(n), -np.arange(n)], axis=1).astype(np.float32)
    return x, np.arange(n, dtype=np.int64)


def _epoch(ds):
    out = []
    for xb, yb in ds:
        np.testing.assert_array_equal(xb.numpy()[:, 0], yb.numpy())
        out.append(yb.numpy().tolist())
    return out


def test_each_epoch_is_the_schedules_and_uses_every_record_once():
    x, y = _data()
    ds = batched_dataset(x, y, B, BALLS_IN_BINS)
    schedule = dataset_schedule(ds)
    assert schedule.sampling == BALLS_IN_BINS and schedule.seed_is_secret and schedule.steps_per_epoch == 4
    epochs = [_epoch(ds) for _ in range(3)]
    for k, epoch in enumerate(epochs):
        assert len(epoch) == 4 and sorted(i for b in epoch for i in b) == list(range(N))
        assert epoch == [schedule.batch(4 * k + j).tolist() for j in range(4)]  # epoch k of the schedule
    assert epochs[0] != epochs[1]  # fresh draws every epoch
    assert len({len(b) for e in epochs for b in e}) > 1  # random sizes


def test_a_chosen_seed_is_reproducible_and_there_is_no_fixed_partition():
    x, y = _data()
    a, b = batched_dataset(x, y, B, BALLS_IN_BINS, seed=4), batched_dataset(x, y, B, BALLS_IN_BINS, seed=4)
    assert _epoch(a) == _epoch(b) and not dataset_schedule(a).seed_is_secret
    with pytest.raises(ParameterError, match="no fixed partition"):
        partition_indices(N, B, BALLS_IN_BINS)


def test_keras_callback_refuses_it_with_the_reason():
    with pytest.raises(ParameterError, match="divide each batch by its own size") as err:
        HiddenStatePrivacyCallback(
            geometry=LossGeometry.logistic_regression(1.0, 0.01),
            sampling=BALLS_IN_BINS,
            dataset_size=N,
            batch_size=B,
            delta=1e-5,
        )
    assert err.value.parameter == "sampling"
