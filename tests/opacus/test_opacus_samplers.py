"""Every sampler produces the schedule it claims: coverage, order, reuse across epochs, seeds,
remainders, resumption and sharding across ranks."""

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
pytestmark = pytest.mark.torch

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import hidden_state_accountants.opacus as hso  # noqa: E402
from hidden_state_accountants import ParameterError, TrainingRunDpEvent  # noqa: E402
from hidden_state_accountants.recording import CompositionFallbackWarning  # noqa: E402
from hidden_state_accountants.schedules import SHUFFLE_PARTITION, WITHOUT_REPLACEMENT, BatchSchedule  # noqa: E402


def epochs(sampler, k):
    return [list(sampler) for _ in range(k)]


def make(cls, n, b, seed=0, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if cls is hso.FullBatchSampler:
            return cls(n, **kw)
        if cls is hso.CyclicBatchSampler:
            return cls(n, b, **kw)
        return cls(n, b, seed, **kw)


ALL = [
    hso.CyclicBatchSampler,
    hso.ShufflePartitionBatchSampler,
    hso.WithoutReplacementBatchSampler,
    hso.FullBatchSampler,
]


def test_cyclic_is_the_fixed_order_every_epoch():
    s = hso.CyclicBatchSampler(12, 4)
    assert s.sampling == "cyclic" and len(s) == 3
    assert epochs(s, 3) == [[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]] * 3


def test_shuffle_partition_is_one_random_partition_reused_every_epoch():
    s = hso.ShufflePartitionBatchSampler(20, 5, seed=7)
    assert s.sampling == "shuffle_partition"
    e = epochs(s, 4)
    assert all(x == e[0] for x in e), "the partition and its order must not change between epochs"
    flat = [i for b in e[0] for i in b]
    assert sorted(flat) == list(range(20)), "each record exactly once per epoch"
    assert flat != list(range(20)), "the partition is random, not the identity"
    # seeded: same seed, same partition; another seed, another partition
    assert list(hso.ShufflePartitionBatchSampler(20, 5, seed=7)) == e[0]
    assert list(hso.ShufflePartitionBatchSampler(20, 5, seed=8)) != e[0]


def test_without_replacement_draws_distinct_records_afresh_every_step():
    n, b = 50, 10
    s = hso.WithoutReplacementBatchSampler(n, b, seed=3)
    assert s.sampling == "without_replacement" and len(s) == n // b
    batches = [batch for e in epochs(s, 40) for batch in e]
    assert all(len(x) == b and len(set(x)) == b for x in batches)
    assert all(0 <= i < n for x in batches for i in x)
    # afresh every step: the batches are not one partition
    assert len({tuple(sorted(x)) for x in batches}) == len(batches)
    # uniform inclusion: each record in about b/n of the 200 steps (std ~5.7)
    counts = torch.bincount(torch.tensor([i for x in batches for i in x]), minlength=n)
    assert counts.min() > 40 * b / n * 5 - 25 and counts.max() < 40 * b / n * 5 + 25
    assert [list(x) for x in hso.WithoutReplacementBatchSampler(n, b, seed=3)] == batches[: n // b]
    assert list(hso.WithoutReplacementBatchSampler(n, b, seed=4)) != batches[: n // b]


def test_full_batch_uses_every_record_at_every_step():
    s = hso.FullBatchSampler(7)
    assert s.sampling == "full" and len(s) == 1 and s.batch_size == 7
    assert epochs(s, 2) == [[list(range(7))]] * 2


@pytest.mark.parametrize("cls", [hso.CyclicBatchSampler, hso.ShufflePartitionBatchSampler])
def test_partition_samplers_drop_the_remainder_and_say_so(cls):
    with pytest.warns(UserWarning, match=r"10 % 3 = 1 records .* footnote 3"):
        s = cls(10, 3) if cls is hso.CyclicBatchSampler else cls(10, 3, 0)
    assert s.dropped_per_epoch == 1 and len(s) == 3
    e = epochs(s, 2)
    used = [i for b in e[0] for i in b]
    assert len(used) == 9 and len(set(used)) == 9
    assert set(used) | set(s.dropped_indices) == set(range(10))
    assert e[0] == e[1], "the same records are left out every epoch"
    if cls is hso.CyclicBatchSampler:
        assert s.dropped_indices == [9], "the last records of the order (Ye & Shokri fn. 3)"
    # the schedule the core accounts has exactly these steps per epoch
    run = TrainingRunDpEvent.from_epochs(
        dataset_size=10,
        batch_size=3,
        epochs=2,
        noise_multiplier=1.0,
        clip_norm=1.0,
        learning_rate=0.1,
        sampling=s.sampling,
    )
    assert run.steps == sum(len(x) for x in e)


def test_no_warning_without_remainder_and_none_for_without_replacement():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hso.CyclicBatchSampler(12, 4)
        hso.WithoutReplacementBatchSampler(10, 3, 0)  # draws from all n: nothing left out


@pytest.mark.parametrize("cls", ALL)
def test_resume_continues_the_same_schedule(cls):
    n, b = 23, 5
    ref = make(cls, n, b, seed=11)
    full = [x for e in epochs(ref, 3) for x in e]
    # interrupt mid-epoch after 6 batches, resume from the saved state in a new sampler
    a = make(cls, n, b, seed=11)
    first = list(a)  # one whole epoch, then part of the next
    it = iter(a)
    first += [next(it) for _ in range(min(2, len(a)))]
    state = a.state_dict()
    b2 = make(cls, n, b, seed=11)
    b2.load_state_dict(state)
    rest = [x for e in epochs(b2, 3) for x in e][: len(full) - len(first)]
    assert first + rest == full
    assert hso.sampler_from_state_dict(state).state_dict() == state


def test_default_seed_is_secret_random_and_kept_for_resumption():
    a, b = hso.ShufflePartitionBatchSampler(40, 5), hso.ShufflePartitionBatchSampler(40, 5)
    assert a.seed != b.seed and list(a) != list(b)
    assert list(hso.sampler_from_state_dict(a.state_dict())) == list(a)
    with pytest.raises(ParameterError, match="^seed: with num_replicas > 1"):
        hso.WithoutReplacementBatchSampler(40, 4, num_replicas=2, rank=0)


def test_every_random_sampler_defaults_to_a_secret_seed():
    """Issue 9, item 3: the base class defaulted to seed=0, a public seed."""
    import inspect

    assert inspect.signature(hso.HiddenStateBatchSampler).parameters["seed"].default is None

    class Custom(hso.HiddenStateBatchSampler):  # a subclass that passes no seed
        sampling = SHUFFLE_PARTITION

    a, b = Custom(40, 5), Custom(40, 5)
    assert a.schedule.seed_is_secret and a.seed != b.seed and list(a) != list(b)
    for cls in (hso.ShufflePartitionBatchSampler, hso.WithoutReplacementBatchSampler):
        assert cls(40, 5).schedule.seed_is_secret
    # a seed passed is the user's explicit choice, and the accountant's report says so
    explicit = hso.ShufflePartitionBatchSampler(40, 5, seed=0)
    assert not explicit.schedule.seed_is_secret
    acc = hso.OpacusHiddenStateAccountant().configure(sampler=explicit)
    acc.step(noise_multiplier=1.0, sample_rate=1 / 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompositionFallbackWarning)
        assert any("seed chosen by the user" in n for n in acc.explain(1e-5).notes)
    secret = hso.OpacusHiddenStateAccountant().configure(sampler=hso.ShufflePartitionBatchSampler(40, 5))
    secret.step(noise_multiplier=1.0, sample_rate=1 / 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompositionFallbackWarning)
        assert not any("seed" in n for n in secret.explain(1e-5).notes)


@pytest.mark.parametrize("cls", ALL)
def test_samplers_follow_the_core_schedule(cls):
    s = make(cls, 23, 5, seed=11)
    core = BatchSchedule(
        23,
        23 if cls is hso.FullBatchSampler else 5,
        s.sampling,
        11 if s.sampling in (SHUFFLE_PARTITION, WITHOUT_REPLACEMENT) else None,
    )
    assert s.schedule == core
    assert [s.global_batch(t) for t in range(12)] == [core.batch(t).tolist() for t in range(12)]


def test_load_state_dict_refuses_another_schedule():
    s = hso.ShufflePartitionBatchSampler(20, 5, seed=1)
    with pytest.raises(ParameterError, match="sampler"):
        hso.ShufflePartitionBatchSampler(20, 5, seed=2).load_state_dict(s.state_dict())


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_share_the_same_global_batch(cls, world):
    n, b = 30, 6
    single = [x for e in epochs(make(cls, n, b, seed=5), 2) for x in e]
    shards = [
        [x for e in epochs(make(cls, n, b, seed=5, num_replicas=world, rank=r), 2) for x in e] for r in range(world)
    ]
    for step, batch in enumerate(single):
        parts = [shards[r][step] for r in range(world)]
        assert sorted(i for p in parts for i in p) == sorted(batch), "ranks together use the global batch"
        assert len({i for p in parts for i in p}) == len(batch), "no record on two ranks"


def test_dataloader_yields_the_batches():
    x = torch.arange(12.0).unsqueeze(1)
    s = hso.CyclicBatchSampler(12, 4)
    loader = DataLoader(TensorDataset(x), batch_sampler=s)
    assert [xb.squeeze(1).tolist() for (xb,) in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert len(loader) == 3 and s.position == 3


@pytest.mark.parametrize(
    "args, param",
    [
        ((10, 11), "batch_size"),  # b > n
        ((10, 6), "batch_size"),  # one batch: cyclic needs n // b >= 2
        ((0, 1), "dataset_size"),
        ((10, 2.5), "batch_size"),
    ],
)
def test_bad_configurations_name_the_parameter(args, param):
    with pytest.raises(ParameterError) as err:
        hso.CyclicBatchSampler(*args)
    assert err.value.parameter == param


def test_bad_distributed_and_seed_arguments():
    with pytest.raises(ParameterError, match="rank"):
        hso.CyclicBatchSampler(10, 2, num_replicas=2, rank=2)
    with pytest.raises(ParameterError, match="num_replicas"):
        hso.CyclicBatchSampler(10, 2, num_replicas=3, rank=0)
    with pytest.raises(ParameterError, match="seed"):
        hso.ShufflePartitionBatchSampler(10, 2, seed=-1)
    with pytest.raises(ParameterError, match="position"):
        hso.CyclicBatchSampler(10, 2).set_position(-1)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(4, 60), b=st.integers(1, 30), seed=st.integers(0, 10**6), k=st.integers(1, 3))
def test_partition_schedule_properties(n, b, seed, k):
    if n // b < 2:
        return
    s = make(hso.ShufflePartitionBatchSampler, n, b, seed=seed)
    e = epochs(s, k)
    assert all(len(x) == n // b and all(len(batch) == b for batch in x) for x in e)
    used = [i for batch in e[0] for i in batch]
    assert len(set(used)) == (n // b) * b
    assert all(x == e[0] for x in e)
