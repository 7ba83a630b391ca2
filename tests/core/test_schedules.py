"""Batch schedules (core): one definition of every schedule, and one secret-seed rule."""

from fractions import Fraction

import numpy as np
import pytest

from hidden_state_accountants import ParameterError
from hidden_state_accountants.schedules import (
    CYCLIC,
    FULL,
    POISSON,
    SAMPLINGS,
    SHUFFLE_PARTITION,
    WITHOUT_REPLACEMENT,
    BatchSchedule,
    check_schedule,
    poisson_sizes,
)


@pytest.mark.parametrize("sampling", [SHUFFLE_PARTITION, WITHOUT_REPLACEMENT, POISSON])
def test_random_schedules_draw_a_secret_seed_by_default(sampling):
    a, b = BatchSchedule(100, 10, sampling), BatchSchedule(100, 10, sampling)
    assert a.seed_is_secret and b.seed_is_secret
    assert a.seed != b.seed  # 63 fresh bits each
    assert "secret" in repr(a) and str(a.seed) not in repr(a)
    fixed = BatchSchedule(100, 10, sampling, seed=7)
    assert not fixed.seed_is_secret and fixed.seed == 7
    assert [fixed.batch(t).tolist() for t in range(5)] == [
        BatchSchedule(100, 10, sampling, 7).batch(t).tolist() for t in range(5)
    ]


def test_a_secret_seed_can_be_shared_between_processes():
    """Several processes (ranks) follow one schedule: the first one's secret draw is shared."""
    drawn = []

    def share(seed):  # stands in for a broadcast from rank 0
        drawn.append(seed)
        return drawn[0]

    first = BatchSchedule(100, 10, SHUFFLE_PARTITION, share_seed=share)
    second = BatchSchedule(100, 10, SHUFFLE_PARTITION, share_seed=share)
    assert first.seed == second.seed == drawn[0] and first.seed_is_secret and second.seed_is_secret
    assert np.array_equal(first.partition(), second.partition())
    assert len(drawn) == 2 and drawn[0] != drawn[1]  # each process drew, the shared one is used
    assert BatchSchedule(100, 10, SHUFFLE_PARTITION, seed=3, share_seed=share).seed == 3  # an explicit seed
    with pytest.raises(ParameterError, match="seed"):
        BatchSchedule(100, 10, SHUFFLE_PARTITION, share_seed=lambda s: -1)


@pytest.mark.parametrize("sampling", [FULL, CYCLIC])
def test_deterministic_schedules_take_no_seed(sampling):
    b = 100 if sampling == FULL else 10
    assert BatchSchedule(100, b, sampling).seed is None
    with pytest.raises(ParameterError, match="seed"):
        BatchSchedule(100, b, sampling, seed=0)


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, True, "0"])
def test_bad_seeds_are_refused(seed):
    with pytest.raises(ParameterError, match="seed"):
        BatchSchedule(100, 10, SHUFFLE_PARTITION, seed=seed)


def test_partitions_are_fixed_and_drop_the_remainder():
    s = BatchSchedule(23, 5, SHUFFLE_PARTITION, seed=3)
    assert s.steps_per_epoch == 4 and s.dropped_per_epoch == 3
    epoch = [s.batch(t).tolist() for t in range(4)]
    assert epoch == [s.batch(t).tolist() for t in range(4, 8)]  # the same partition every epoch
    used = sorted(i for batch in epoch for i in batch)
    assert len(used) == 20 and len(set(used)) == 20
    assert np.array_equal(s.partition(), np.array(epoch))
    c = BatchSchedule(23, 5, CYCLIC)
    assert c.batch(0).tolist() == [0, 1, 2, 3, 4] and c.batch(5).tolist() == [5, 6, 7, 8, 9]


def test_without_replacement_and_poisson_draw_afresh_and_resume_anywhere():
    w = BatchSchedule(50, 7, WITHOUT_REPLACEMENT, seed=1)
    assert all(len(set(w.batch(t))) == 7 for t in range(20))
    assert w.batch(1000).tolist() == BatchSchedule(50, 7, WITHOUT_REPLACEMENT, seed=1).batch(1000).tolist()
    p = BatchSchedule(1000, 50, POISSON, seed=2)
    sizes = [len(p.batch(t)) for t in range(200)]
    assert abs(np.mean(sizes) - 50) < 3 and len(set(sizes)) > 5  # random sizes around b


def test_describe_round_trip_keeps_the_schedule():
    for sampling in SAMPLINGS:
        b = 100 if sampling == FULL else 10
        s = BatchSchedule(100, b, sampling)
        t = BatchSchedule.from_description(s.describe())
        assert t == s and [t.batch(i).tolist() for i in range(3)] == [s.batch(i).tolist() for i in range(3)]
    with pytest.raises(ParameterError, match="missing seed"):
        BatchSchedule.from_description({"sampling": CYCLIC, "dataset_size": 10, "batch_size": 2})


def test_a_restored_secret_seed_stays_secret_only_when_said_so():
    s = BatchSchedule(100, 10, SHUFFLE_PARTITION)
    assert not BatchSchedule.from_description(s.describe()).seed_is_secret  # a stored seed: the caller's
    t = BatchSchedule.from_description(s.describe(), seed_is_secret=True)  # e.g. a private checkpoint of the run
    assert t == s and t.seed_is_secret and t.partition().tolist() == s.partition().tolist()
    assert not BatchSchedule.from_description(
        BatchSchedule(100, 10, CYCLIC).describe(), seed_is_secret=True
    ).seed_is_secret  # no seed, nothing secret
    with pytest.raises(ParameterError, match="^seed_is_secret: must be True or False"):
        BatchSchedule.from_description(s.describe(), seed_is_secret="yes")


@pytest.mark.parametrize(
    "n,b,sampling,param",
    [
        (10, 11, CYCLIC, "batch_size"),
        (10, 5, FULL, "batch_size"),
        (10, 6, CYCLIC, "batch_size"),
        (10, 6, SHUFFLE_PARTITION, "batch_size"),
        (0, 1, CYCLIC, "dataset_size"),
        (10, 2, "reshuffled", "sampling"),
    ],
)
def test_schedule_checks_name_the_parameter(n, b, sampling, param):
    with pytest.raises(ParameterError) as err:
        check_schedule(n, b, sampling)
    assert err.value.parameter == param


def test_poisson_rate_is_carried_exactly():
    """Opacus gives the rate as a float; the schedule keeps it (no fraction rounding)."""
    for k in range(2, 201):
        s = BatchSchedule(*poisson_sizes(1 / k), POISSON, sampling_probability=1 / k)
        assert s.sampling_probability == 1 / k
    for n, b in [(60000, 256), (50000, 64), (1000, 3), (60000, 600)]:
        q = 1 / len(range(0, n, b))  # Opacus' 1 / len(data_loader)
        size_n, size_b = poisson_sizes(q, n)
        assert size_n == n and abs(size_b - q * n) <= 0.5
    assert poisson_sizes(0.04) == (25, 1) and Fraction(1, 25) == Fraction(0.04).limit_denominator(100)
    with pytest.raises(ParameterError, match="sampling_probability"):
        poisson_sizes(1.5)
