"""``BallsInBinsBatchSampler`` in Opacus (issue 19): batches of random size divided by the fixed
``b``, resumable and secretly seeded, accounted under Opacus' ADD_OR_REMOVE_ONE exactly as the core
accounts the same ``TrainingRunDpEvent``."""

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore:BallsInBinsBatchSampler.*empty step")]

from opacus import PrivacyEngine  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import hidden_state_accountants.opacus as hso  # noqa: E402
from hidden_state_accountants import HiddenStateAccountant, LossGeometry, ParameterError, TrainingRunDpEvent  # noqa: E402
from hidden_state_accountants.schedules import BALLS_IN_BINS  # noqa: E402
from opacus_common import D, K, random_classification, train_epochs  # noqa: E402

DELTA = 1e-5


def train(n, b, *, epochs=2, divisor_fixed=True, sampler=None):
    torch.manual_seed(0)
    sampler = sampler or hso.BallsInBinsBatchSampler(n, b)
    loader = DataLoader(random_classification(n), batch_sampler=sampler)
    model = nn.Sequential(hso.FeatureClip(1.0), nn.Linear(D, K))
    engine = PrivacyEngine(accountant="hidden_state")
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=loader,
        noise_multiplier=1.5,
        max_grad_norm=1.0,
        poisson_sampling=False,
    )
    hook = hso.ProjectionHook(opt, l2_regularization=0.05)
    extra = {"optimizer": opt} if divisor_fixed else {}
    engine.accountant.configure(geometry=hook.logistic_regression_geometry(1.0), model=model, sampler=sampler, **extra)
    sizes = train_epochs(model, opt, loader, epochs)
    return engine, opt, sizes, sampler


def test_sampler_law_secret_seed_and_resume():
    s = hso.BallsInBinsBatchSampler(60, 7)
    assert s.sampling == BALLS_IN_BINS and s.schedule.seed_is_secret and len(s) == 8
    epochs = [list(s) for _ in range(3)]
    for e in epochs:
        assert sorted(i for b in e for i in b) == list(range(60))
    assert len({len(b) for e in epochs for b in e}) > 2  # random sizes
    s2 = hso.sampler_from_state_dict({**s.state_dict(), "position": 9}, seed_is_secret=True)
    assert isinstance(s2, hso.BallsInBinsBatchSampler) and s2.schedule.seed_is_secret
    assert list(s2) == [s.global_batch(t) for t in range(9, 16)]  # the rest of epoch 1
    ranks = [hso.BallsInBinsBatchSampler(60, 7, seed=3, num_replicas=2, rank=r) for r in (0, 1)]
    assert sorted(ranks[0].local_batch(4) + ranks[1].local_batch(4)) == ranks[0].global_batch(4)


def test_tiny_batches_warn_about_empty_ones():
    with pytest.warns(UserWarning, match="empty step"):
        hso.BallsInBinsBatchSampler(20, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hso.BallsInBinsBatchSampler(600, 64)


def test_opacus_run_is_accounted_as_the_core_event_under_add_or_remove():
    n, b = 120, 12
    engine, opt, sizes, sampler = train(n, b)
    assert opt.expected_batch_size == b and len(set(sizes)) > 1  # divided by b, random sizes
    acc = engine.accountant
    report = acc.explain(DELTA)
    assert report.neighboring_relation == "ADD_OR_REMOVE_ONE"
    event = TrainingRunDpEvent(
        dataset_size=n,
        batch_size=b,
        steps=len(sizes),
        noise_multiplier=1.5,
        clip_norm=1.0,
        learning_rate=0.5,
        sampling=BALLS_IN_BINS,
        geometry=LossGeometry.logistic_regression(1.0, 0.05, num_classes=K),
        l2_regularization=0.05,
    )
    core = HiddenStateAccountant(neighboring_relation="ADD_OR_REMOVE_ONE").compose(event).explain(DELTA)
    assert engine.get_epsilon(DELTA) == pytest.approx(core.epsilon, rel=1e-9) and report.analysis == core.analysis


def test_opacus_own_divisor_is_refused_when_it_is_not_b():
    """Without configure(optimizer=...), Opacus divides by int(n / len(loader)) = 29 here, not b = 20:
    not even composition holds for the accounted run, so the step is refused with the fix."""
    with pytest.raises(ParameterError, match="divides the clipped sum by 29"):
        train(59, 20, epochs=1, divisor_fixed=False)


# ------------------------------------------------------------------ empty steps (issue 29)
def test_an_empty_step_is_refused_clearly_by_default():
    """A step no record drew used to reach torch's default_collate (IndexError); now the sampler refuses it
    before the DataLoader sees it, naming the fix."""
    with pytest.warns(UserWarning, match="empty step"):
        sampler = hso.BallsInBinsBatchSampler(6, 1, seed=0)
    assert any(not sampler.global_batch(t) for t in range(6))  # this seed has an empty step in epoch 0
    loader = DataLoader(random_classification(6), batch_sampler=sampler)
    with pytest.raises(ParameterError, match="balls_in_bins_loader") as err:
        list(loader)
    assert err.value.parameter == "empty_batches"


def test_empty_steps_train_with_noise_only_and_are_accounted():
    """With balls_in_bins_loader an empty step reaches the model as tensors with no rows; Opacus' DPOptimizer
    takes a noise-only step, and the accountant counts every step of the schedule."""
    n, b = 6, 1
    sampler = hso.BallsInBinsBatchSampler(n, b, seed=0, empty_batches="yield")
    data = random_classification(n)
    loader = hso.balls_in_bins_loader(data, sampler)
    batches = list(loader)
    assert len(batches) == 6 and any(len(xb) == 0 for xb, _ in batches)
    assert all(xb.shape[1:] == (D,) and yb.dtype == torch.long for xb, yb in batches)
    sampler.set_position(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 8), nn.ReLU(), nn.Linear(8, K))  # no geometry: composition
    engine = PrivacyEngine(accountant="hidden_state")
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
    )
    engine.accountant.configure(model=model, sampler=sampler, optimizer=opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sizes = train_epochs(model, opt, loader, 2)
    assert len(sizes) == 12 and 0 in sizes and len(engine.accountant) == 12
    report = engine.accountant.explain(DELTA)
    assert report.analysis == "composition_allocation_pld"


def test_make_private_with_epsilon_calibrates_with_the_amplified_composition():
    """Issue 28: a network (no geometry) on BallsInBinsBatchSampler is calibrated with the random-allocation
    composition, far less noise than one unamplified Gaussian per epoch, and meets its target."""
    n, b, epochs, target = 600, 30, 2, 2.0
    sampler = hso.BallsInBinsBatchSampler(n, b)
    loader = DataLoader(random_classification(n), batch_sampler=sampler)
    model = nn.Sequential(nn.Linear(D, 8), nn.ReLU(), nn.Linear(8, K))
    engine = PrivacyEngine(accountant="hidden_state")
    engine.accountant.configure(sampler=sampler, model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private_with_epsilon(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader,
            target_epsilon=target,
            target_delta=DELTA,
            epochs=epochs,
            max_grad_norm=1.0,
            poisson_sampling=False,
        )
        engine.accountant.configure(sampler=sampler, model=model, optimizer=opt)
        train_epochs(model, opt, loader, epochs)
    report = engine.accountant.explain(DELTA)
    assert report.analysis == "composition_allocation_pld" and report.epsilon <= target
    event = TrainingRunDpEvent(
        dataset_size=n, batch_size=b, steps=epochs * (n // b), noise_multiplier=opt.noise_multiplier,
        clip_norm=1.0, learning_rate=0.1, sampling=BALLS_IN_BINS,
    )  # fmt: skip
    unamplified = HiddenStateAccountant(neighboring_relation="ADD_OR_REMOVE_ONE").compose(event).explain(DELTA)
    assert unamplified.analyses[0].name == "composition_balls_in_bins" and unamplified.analyses[0].epsilon > 3 * target


def test_the_steps_per_epoch_are_a_public_constant_of_the_sampler():
    """Issue 27: with b dividing n + 1 the neighbour's sampler ran n // b + 1 steps; given, both run t."""
    small = hso.BallsInBinsBatchSampler(59, 4, seed=2, steps_per_epoch=14)
    large = hso.BallsInBinsBatchSampler(60, 4, seed=2, steps_per_epoch=14)
    assert len(small) == len(large) == 14 and hso.BallsInBinsBatchSampler(60, 4, seed=2).steps_per_epoch == 15
    assert [[i for i in b if i < 59] for b in large] == list(small)  # the common records' steps are the same
    again = hso.sampler_from_state_dict(large.state_dict())
    assert again.steps_per_epoch == 14 and again.schedule.same_law(large.schedule)
