"""The tf.data batch schedules yield exactly the batches they claim (no training here)."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
pytest.importorskip("tensorflow_privacy")
pytestmark = pytest.mark.tf

from hidden_state_accountants import ParameterError, TrainingRunDpEvent  # noqa: E402
from hidden_state_accountants.tf_privacy import (  # noqa: E402
    batched_dataset,
    clip_feature_norms,
    partition_indices,
)

N, B = 23, 5  # 4 batches per epoch, 3 records left over


def _data(n=N):
    # each record's feature row encodes its index, so batches can be traced back to records
    x = np.stack([np.arange(n), -np.arange(n)], axis=1).astype(np.float32)
    y = np.arange(n, dtype=np.int64)
    return x, y


def _epoch(ds):
    out = []
    for xb, yb in ds:
        xb, yb = xb.numpy(), yb.numpy()
        np.testing.assert_array_equal(xb[:, 0], yb)  # features stay paired with their labels
        out.append(yb.tolist())
    return out


def _steps_per_epoch(sampling, n=N, b=B):
    return TrainingRunDpEvent(
        dataset_size=n, batch_size=b, steps=1, noise_multiplier=1.0, clip_norm=1.0, learning_rate=0.1, sampling=sampling
    ).steps_per_epoch


def test_cyclic_is_the_data_order_every_epoch_and_drops_the_remainder():
    ds = batched_dataset(*_data(), B, "cyclic")
    first, second = _epoch(ds), _epoch(ds)
    expected = [list(range(k * B, (k + 1) * B)) for k in range(N // B)]
    assert first == expected
    assert second == expected
    assert len(first) == _steps_per_epoch("cyclic") == int(ds.cardinality())
    assert sorted(set(range(N)) - {i for b in first for i in b}) == [20, 21, 22]  # n % b dropped


def test_shuffle_partition_draws_one_partition_and_keeps_it():
    x, y = _data()
    ds = batched_dataset(x, y, B, "shuffle_partition", seed=7)
    epochs = [_epoch(ds) for _ in range(3)]
    assert epochs[0] == epochs[1] == epochs[2]  # the same partition, same order, every epoch
    flat = [i for b in epochs[0] for i in b]
    assert all(len(b) == B for b in epochs[0]) and len(epochs[0]) == N // B
    assert len(set(flat)) == len(flat) == (N // B) * B  # disjoint batches, n % b records unused
    assert flat != sorted(flat)  # actually shuffled
    assert epochs[0] == partition_indices(N, B, "shuffle_partition", seed=7).tolist()
    # reproducible from the seed, different for another seed
    assert _epoch(batched_dataset(x, y, B, "shuffle_partition", seed=7)) == epochs[0]
    assert _epoch(batched_dataset(x, y, B, "shuffle_partition", seed=8)) != epochs[0]
    # seed=None: a secret seed, different each time
    assert _epoch(batched_dataset(x, y, B, "shuffle_partition", seed=None)) != _epoch(
        batched_dataset(x, y, B, "shuffle_partition", seed=None)
    )


def test_without_replacement_draws_distinct_records_afresh_each_step():
    x, y = _data()
    ds = batched_dataset(x, y, B, "without_replacement", seed=3)
    e1, e2 = _epoch(ds), _epoch(ds)
    assert len(e1) == len(e2) == _steps_per_epoch("without_replacement") == int(ds.cardinality())
    for batch in e1 + e2:
        assert len(batch) == B and len(set(batch)) == B  # exact size, distinct records
    assert e1 != e2  # fresh draws every epoch
    again = batched_dataset(x, y, B, "without_replacement", seed=3)
    assert [_epoch(again), _epoch(again)] == [e1, e2]  # reproducible across datasets
    other = batched_dataset(x, y, B, "without_replacement", seed=4)
    assert _epoch(other) != e1


def test_without_replacement_is_uniform():
    # every record is in a step's batch with probability b/n
    n, b, epochs = 10, 3, 200
    x, y = _data(n)
    ds = batched_dataset(x, y, b, "without_replacement", seed=0)
    batches = [yb for _, yb in ds.repeat(epochs).as_numpy_iterator()]
    steps = len(batches)
    assert steps == epochs * (n // b)
    counts = np.bincount(np.concatenate(batches), minlength=n)
    p = b / n
    sd = np.sqrt(steps * p * (1 - p))
    assert np.all(np.abs(counts - steps * p) < 5 * sd), counts
    assert len({tuple(sorted(bt)) for bt in batches}) > 100  # most of the 120 subsets occur


def test_full_yields_every_record_once():
    x, y = _data()
    ds = batched_dataset(x, y, N, "full")
    epoch = _epoch(ds)
    assert len(epoch) == 1 == _steps_per_epoch("full", b=N)
    assert sorted(epoch[0]) == list(range(N))


@pytest.mark.parametrize(
    "kwargs, parameter",
    [
        (dict(batch_size=B, sampling="poisson"), "sampling"),
        (dict(batch_size=B, sampling="reshuffle", last_batch="kept_batch_size"), "last_batch"),  # not TF-Privacy
        (dict(batch_size=B, sampling="cyclic", last_batch="kept_own_size"), "last_batch"),
        (dict(batch_size=N + 1, sampling="cyclic"), "batch_size"),
        (dict(batch_size=B, sampling="full"), "batch_size"),
        (dict(batch_size=12, sampling="shuffle_partition"), "batch_size"),  # one batch only
        (dict(batch_size=0, sampling="cyclic"), "batch_size"),
        (dict(batch_size=B, sampling="cyclic", seed=-1), "seed"),
    ],
)
def test_bad_settings_name_the_parameter(kwargs, parameter):
    x, y = _data()
    with pytest.raises(ParameterError) as err:
        batched_dataset(x, y, **kwargs)
    assert err.value.parameter == parameter
    assert str(err.value).startswith(parameter + ":")


def test_labels_must_match_features():
    x, y = _data()
    with pytest.raises(ParameterError, match="labels"):
        batched_dataset(x, y[:-1], B, "cyclic")


def test_clip_feature_norms_bounds_rows_and_keeps_short_ones():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 4)) * rng.uniform(0.01, 5, size=(50, 1))
    out = clip_feature_norms(x, 1.5)
    norms = np.linalg.norm(out.astype(np.float64), axis=1)
    assert np.all(norms <= 1.5)
    short = np.linalg.norm(x, axis=1) < 1.4
    np.testing.assert_allclose(out[short], x[short], rtol=1e-6)
    with pytest.raises(ParameterError, match="max_norm"):
        clip_feature_norms(x, 0.0)


def test_module_doctests():
    import doctest

    from hidden_state_accountants.keras import data
    from hidden_state_accountants.tf_privacy import model

    for mod in (data, model):
        result = doctest.testmod(mod)
        assert result.attempted > 0 and result.failed == 0, mod.__name__
