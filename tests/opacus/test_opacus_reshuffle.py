"""Reshuffling every epoch in Opacus (issue 11): ``ReshuffleBatchSampler`` and a plain
``DataLoader(shuffle=True)`` recognised as ``sampling="reshuffle"``, accounted exactly as the
core accounts the same ``TrainingRunDpEvent``, with the reason in ``explain()``."""

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
pytestmark = pytest.mark.torch

from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import hidden_state_accountants.opacus as hso  # noqa: E402
from hidden_state_accountants import HiddenStateAccountant, LossGeometry, ParameterError, TrainingRunDpEvent  # noqa: E402
from hidden_state_accountants.recording import CompositionFallbackWarning  # noqa: E402
from hidden_state_accountants.schedules import DROPPED, KEPT_BATCH_SIZE, RESHUFFLE  # noqa: E402
from opacus_common import D, K, private_logistic, random_classification, train_epochs  # noqa: E402

DELTA = 1e-5
GEOMETRY = LossGeometry.logistic_regression(1.0, 0.05, diameter=6.0, num_classes=2)


def run(loader, *, n, epochs=3, lr=0.5, z=2.0, clip=1.5, by="data_loader", sampler=None, radius=3.0):
    """Trains logistic regression under a geometry on ``loader``; returns the accountant."""
    engine, model, opt, loader = private_logistic(loader, lr=lr, z=z, clip=clip)
    hook = hso.ProjectionHook(opt, radius=radius, l2_regularization=0.05)
    where = {"data_loader": loader} if by == "data_loader" else {"sampler": sampler}
    engine.accountant.configure(
        geometry=hook.logistic_regression_geometry(1.0, num_classes=K), model=model, optimizer=opt, **where
    )
    sizes = train_epochs(model, opt, loader, epochs)
    return engine, model, opt, sizes


def core(event):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompositionFallbackWarning)
        return HiddenStateAccountant().compose(event).explain(DELTA)


def expected_event(n, b, steps, *, last_batch=DROPPED, secret=True, geometry=GEOMETRY):
    return TrainingRunDpEvent(
        dataset_size=n,
        batch_size=b,
        steps=steps,
        noise_multiplier=2.0,
        clip_norm=1.5,
        learning_rate=0.5,
        sampling=RESHUFFLE,
        geometry=geometry,
        last_batch=last_batch,
        secret_batches=secret,
        l2_regularization=0.05,
    )  # the ProjectionHook's, as recorded


# ------------------------------------------------------------------------- the sampler
def test_reshuffle_sampler_draws_a_fresh_permutation_every_epoch_with_a_secret_seed():
    s = hso.ReshuffleBatchSampler(60, 10)
    assert s.sampling == RESHUFFLE and s.schedule.seed_is_secret and len(s) == 6
    epochs = [list(s) for _ in range(3)]
    for e in epochs:
        assert sorted(i for b in e for i in b) == list(range(60))
    assert epochs[0] != epochs[1] != epochs[2], "a fresh permutation every epoch"
    assert hso.ReshuffleBatchSampler(60, 10).seed != s.seed


def test_reshuffle_sampler_resumes_anywhere_and_keeps_the_short_batch_on_request():
    s = hso.ReshuffleBatchSampler(61, 10, seed=4, last_batch=KEPT_BATCH_SIZE)
    whole = [b for _ in range(3) for b in s]
    assert [len(b) for b in whole[:7]] == [10] * 6 + [1] and len(s) == 7
    s2 = hso.sampler_from_state_dict({**s.state_dict(), "position": 9})
    assert [b for b in s2] == whole[9:14]
    with pytest.warns(UserWarning, match="of each epoch's permutation are left out of that epoch"):
        dropped = hso.ReshuffleBatchSampler(61, 10, seed=4)
    assert len(dropped) == 6 and dropped.schedule.last_batch == DROPPED
    with pytest.raises(ParameterError, match="^last_batch: Opacus divides every batch"):
        hso.ReshuffleBatchSampler(61, 10, last_batch="kept_own_size")
    ranks = [hso.ReshuffleBatchSampler(60, 10, seed=4, num_replicas=2, rank=r) for r in range(2)]
    assert sorted(ranks[0].local_batch(7) + ranks[1].local_batch(7)) == sorted(ranks[0].global_batch(7))


def test_reshuffle_sampler_run_equals_the_core_for_the_same_event():
    n, b = 60, 10
    s = hso.ReshuffleBatchSampler(n, b)
    engine, *_ = run(DataLoader(random_classification(n), batch_sampler=s), n=n, by="sampler", sampler=s)
    expected = expected_event(n, b, 18)
    assert engine.accountant.training_run() == expected
    report = engine.accountant.explain(DELTA)
    assert report.epsilon == core(expected).epsilon
    winner = [a for a in report.analyses if a.name == report.analysis][0]
    assert winner.hidden_state and report.epsilon < report.composition_epsilon


# --------------------------------------------------------------- DataLoader(shuffle=True)
@pytest.mark.parametrize("secret", [False, True])
def test_plain_shuffled_data_loader_is_accounted_as_reshuffle(secret):
    n, b = 60, 10
    loader = DataLoader(random_classification(n), batch_size=b, shuffle=True, drop_last=True)
    if secret:
        hso.secret_shuffle(loader)
    engine, _, _, sizes = run(loader, n=n)
    assert sizes == [b] * 18
    expected = expected_event(n, b, 18, secret=secret)
    assert engine.accountant.training_run() == expected
    report = engine.accountant.explain(DELTA)
    assert report.epsilon == core(expected).epsilon
    winner = [a for a in report.analyses if a.name == report.analysis][0]
    assert winner.hidden_state
    reason = (
        "drawn by the framework; the bound assumes its randomness is unknown"
        if secret
        else "batches are public (secret=False): only the bounds for the record's worst positions apply"
    )
    assert any(reason in note for note in report.notes), report.notes


def test_public_shuffle_is_never_reported_below_the_secret_one():
    n, b = 60, 10
    public, *_ = run(DataLoader(random_classification(n), batch_size=b, shuffle=True, drop_last=True), n=n)
    secret, *_ = run(
        hso.secret_shuffle(DataLoader(random_classification(n), batch_size=b, shuffle=True, drop_last=True)), n=n
    )
    assert public.get_epsilon(DELTA) >= secret.get_epsilon(DELTA)


@pytest.mark.parametrize("radius", [None, 3.0])
def test_kept_short_batch_is_divided_by_b_and_accounted_as_kept_batch_size(radius):
    n, b = 64, 10  # 6 full batches and a short one of 4 every epoch
    loader = hso.secret_shuffle(DataLoader(random_classification(n), batch_size=b, shuffle=True, drop_last=False))
    engine, _, opt, sizes = run(loader, n=n, epochs=2, radius=radius)
    assert sizes == ([b] * 6 + [4]) * 2
    assert opt.expected_batch_size == b  # configure set Opacus' divisor to b (its own is int(64 / 7) = 9)
    geometry = LossGeometry.logistic_regression(
        1.0, 0.05, diameter=None if radius is None else 2 * radius, num_classes=2
    )
    expected = expected_event(n, b, 14, last_batch=KEPT_BATCH_SIZE, geometry=geometry)
    assert engine.accountant.training_run() == expected
    report = engine.accountant.explain(DELTA)
    assert report.epsilon == core(expected).epsilon
    winner = [a for a in report.analyses if a.name == report.analysis][0]
    average = [a for a in report.analyses if a.name == "si_reshuffle_average"][0]
    # derivations 3.5: without a projection the short step contracts like the others; with one,
    # because the recorded L2 strength (0.05) lies in [m, M]
    assert winner.hidden_state and report.epsilon < report.composition_epsilon
    assert average.epsilon is not None and average.reason is None


def test_loaders_that_are_not_a_schedule_are_refused_with_the_reason():
    acc = hso.OpacusHiddenStateAccountant()
    # data order is cyclic (issue 29) unless it keeps a short batch
    assert acc.configure(data_loader=DataLoader(random_classification(60), batch_size=10)).claim.schedule.sampling == (
        "cyclic"
    )
    with pytest.raises(
        ParameterError,
        match=r"^data_loader: its batches follow no schedule.*data order, which keeps a short last batch",
    ):
        acc.configure(data_loader=DataLoader(random_classification(65), batch_size=10))
    from torch.utils.data import RandomSampler

    with pytest.raises(ParameterError, match="^data_loader: .*replacement=True"):
        acc.configure(
            data_loader=DataLoader(
                random_classification(60), batch_size=10, sampler=RandomSampler(range(60), replacement=True)
            )
        )
    with pytest.raises(ParameterError, match="^data_loader: give the sampler or the data loader"):
        acc.configure(
            data_loader=DataLoader(random_classification(60), batch_size=10, shuffle=True),
            sampler=hso.CyclicBatchSampler(60, 10),
        )
    with pytest.raises(ParameterError, match="^sampler: .*pass the loader as data_loader"):
        acc.configure(sampler=DataLoader(random_classification(60), batch_size=10, shuffle=True))
    # a loader over a sampler of this package is that sampler
    s = hso.CyclicBatchSampler(60, 10)
    assert acc.configure(data_loader=DataLoader(random_classification(60), batch_sampler=s)).sampler is s


def test_a_plain_shuffled_loader_on_several_ranks_is_refused(monkeypatch):
    """Every rank's DataLoader(shuffle=True) draws its own permutation of all records: the core
    refuses that source (the same rule as Keras fit(shuffle=True) on several workers)."""
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    with pytest.raises(ParameterError, match="^data: DataLoader.*2 processes each draw their own permutation"):
        hso.OpacusHiddenStateAccountant().configure(
            data_loader=DataLoader(random_classification(60), batch_size=10, shuffle=True)
        )


def test_shuffled_loader_checkpoint_resumes_at_an_epoch_end_only():
    n, b = 60, 10
    engine, *_ = run(
        hso.secret_shuffle(DataLoader(random_classification(n), batch_size=b, shuffle=True, drop_last=True)),
        n=n,
        epochs=2,
    )
    state = engine.accountant.state_dict()
    fresh = hso.OpacusHiddenStateAccountant().configure(
        data_loader=hso.secret_shuffle(
            DataLoader(random_classification(n), batch_size=b, shuffle=True, drop_last=True)
        ),
        geometry=GEOMETRY,
        model=nn.Sequential(hso.FeatureClip(1.0), nn.Linear(D, K)),
    )
    fresh.load_state_dict(state)  # a fresh secret generator draws the same law
    assert fresh.training_run() == engine.accountant.training_run()
    unconfigured = hso.OpacusHiddenStateAccountant()
    unconfigured.load_state_dict(state)
    assert unconfigured.claim.schedule.same_law(engine.accountant.claim.schedule)
    assert unconfigured.get_epsilon(DELTA) == engine.get_epsilon(DELTA)

    # stopped mid-epoch: the loader would start a fresh permutation with records of this epoch unused
    def shuffled():
        return hso.secret_shuffle(DataLoader(random_classification(n), batch_size=b, shuffle=True, drop_last=True))

    partial = hso.OpacusHiddenStateAccountant().configure(data_loader=shuffled())
    partial.history = [(2.0, 1 / 6, 9)]  # 1.5 epochs
    target = hso.OpacusHiddenStateAccountant().configure(data_loader=shuffled())
    with pytest.raises(ParameterError, match="^data: the run is at batch 3 of its 6-batch epoch.*stopped mid-epoch"):
        target.load_state_dict(partial.state_dict())
    assert len(target) == 0
