"""The loader actually trained on is the one accounted (issue 29, U1 and U2).

U1: ``make_private(..., poisson_sampling=False)`` without ``configure`` accounted a plain ``DataLoader``
as Poisson sampling at ``1/len(loader)``: n = 1500, b = 100, z = 1, 5 epochs reported 4.124 under
ADD_OR_REMOVE_ONE, where the fixed-size batches' valid bound is 28.37 under REPLACE_ONE (each record is
in one batch per epoch: five Gaussian mechanisms of sensitivity 2C and noise zC, mu = 2 sqrt(5)). The
claim is now the loader's schedule (the core's ``claim_for_source``), or the loader is refused.

U2: a Poisson claim whose loop iterated the ``DataLoader`` passed to ``make_private`` instead of the
``DPDataLoader`` it returned was accepted (every batch had exactly b records); every step is now checked
to have drawn its batch from the ``DPDataLoader`` (its batch sampler counts what it hands out).
"""

import math
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
pytestmark = pytest.mark.torch

from opacus import PrivacyEngine  # noqa: E402
from opacus.utils.batch_memory_manager import BatchMemoryManager  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import hidden_state_accountants.opacus as hso  # noqa: E402
from hidden_state_accountants import HiddenStateAccountant, ParameterError, TrainingRunDpEvent  # noqa: E402
from hidden_state_accountants.recording import CompositionFallbackWarning  # noqa: E402
from hidden_state_accountants.schedules import CYCLIC, RESHUFFLE, BatchSchedule  # noqa: E402
from opacus_common import D, K, private_logistic, random_classification, train_epochs  # noqa: E402

N, B, Z, EPOCHS, DELTA, LR = 1500, 100, 1.0, 5, 1e-5, 0.1


def gdp_epsilon(mu: float, delta: float) -> float:
    """The epsilon of mu-GDP at ``delta`` (Dong, Roth & Su 2022, Cor. 2.13), by bisection."""

    def phi(x):
        return 0.5 * math.erfc(-x / math.sqrt(2))

    def delta_of(eps):
        return phi(-eps / mu + mu / 2) - math.exp(eps) * phi(-eps / mu - mu / 2)

    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
    return hi


def private(loader, *, poisson_sampling=False):
    return private_logistic(loader, lr=LR, z=Z, poisson_sampling=poisson_sampling)


def explain(engine):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompositionFallbackWarning)
        return engine.accountant.explain(DELTA)


# ------------------------------------------------------------------------------------ U1
@pytest.mark.parametrize("shuffle", [True, False])
def test_a_plain_loader_without_configure_is_accounted_as_what_it_is(shuffle):
    engine, model, opt, loader = private(DataLoader(random_classification(N), batch_size=B, shuffle=shuffle))
    sampling = RESHUFFLE if shuffle else CYCLIC
    assert engine.accountant.claim.schedule.sampling == sampling  # made so by make_private
    train_epochs(model, opt, loader, EPOCHS)
    report = explain(engine)
    expected = TrainingRunDpEvent(
        dataset_size=N,
        batch_size=B,
        steps=EPOCHS * N // B,
        noise_multiplier=Z,
        clip_norm=1.0,
        learning_rate=LR,
        sampling=sampling,
        secret_batches=not shuffle,  # torch's global generator, seeded by the script: public
        l2_regularization=0.0,
    )
    assert engine.accountant.training_run().replace(hidden_state_refusal=None) == expected
    assert report.neighboring_relation == "REPLACE_ONE" and report.analysis == "bok_thm4.4"
    assert report.epsilon == pytest.approx(gdp_epsilon(2 * math.sqrt(EPOCHS) / Z, DELTA), rel=1e-6)
    assert report.epsilon == pytest.approx(28.37, abs=0.01)  # the number issue 29 gives; it reported 4.124
    assert any(note.startswith("reported under REPLACE_ONE, not the host's ADD_OR_REMOVE_ONE") for note in report.notes)


def test_a_kept_short_batch_needs_configure_to_set_opacus_divisor():
    """``DataLoader(shuffle=True)`` keeps a short batch when b does not divide n; Opacus divides every batch by
    int(n / len(loader)) = 96, not b = 100: refused at the first step with how to fix it, accounted once
    ``configure(optimizer=...)`` sets the divisor to b (as for every fixed-size loader)."""
    shuffled = DataLoader(random_classification(1550), batch_size=B, shuffle=True)
    engine, model, opt, loader = private(shuffled)
    with pytest.raises(
        ParameterError,
        match=r"^batch_size: the update divides the clipped sum by 96 but the schedule's batch at step 0 holds 100 "
        r"records; .*pass optimizer=\.\.\. to configure\(\)",
    ):
        train_epochs(model, opt, loader, 1)
    engine, model, opt, loader = private(shuffled)
    engine.accountant.configure(optimizer=opt)
    assert opt.expected_batch_size == B
    train_epochs(model, opt, loader, 1)
    assert engine.accountant.training_run().last_batch == "kept_batch_size" and len(engine.accountant) == 16


def test_a_loader_over_a_sampler_of_this_package_without_configure_is_its_schedule():
    sampler = hso.ShufflePartitionBatchSampler(N, B, seed=3)
    engine, model, opt, loader = private(DataLoader(random_classification(N), batch_sampler=sampler))
    assert engine.accountant.sampler is sampler and engine.accountant.claim.schedule == sampler.schedule
    train_epochs(model, opt, loader, 1)
    event = engine.accountant.training_run()
    assert (event.sampling, event.steps) == ("shuffle_partition", N // B)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompositionFallbackWarning)
        core = HiddenStateAccountant().compose(event).get_epsilon(DELTA)
    assert engine.get_epsilon(DELTA) == core


@pytest.mark.parametrize(
    "loader, message",
    [
        (  # data order keeping a short last batch: no schedule of this package
            lambda: DataLoader(random_classification(N + 50), batch_size=B),
            r"^data: the batches come from DataLoader\(batch_size=100, shuffle=False, drop_last=False\) in data "
            r"order, which keeps a short last batch of 50 records .*: neither the framework's Poisson sampling nor "
            r"a schedule of this package",
        ),
        (
            lambda: DataLoader(
                random_classification(N),
                batch_size=B,
                sampler=torch.utils.data.RandomSampler(range(N), replacement=True),
            ),
            r"^data: the batches come from a RandomSampler with replacement=True",
        ),
    ],
)
def test_a_loader_that_follows_no_schedule_is_refused_by_make_private(loader, message):
    with pytest.raises(ParameterError, match=message):
        private(loader())


def test_data_order_with_the_short_batch_dropped_is_cyclic():
    loader = DataLoader(random_classification(N + 50), batch_size=B, drop_last=True)
    engine, *_ = private(loader)
    assert engine.accountant.claim.schedule == BatchSchedule(N + 50, B, CYCLIC)


def test_make_private_with_epsilon_without_configure_calibrates_the_loaders_schedule():
    """Opacus calibrated for Poisson sampling at 1/len(loader) (add/remove) a run of fixed-size batches."""
    torch.manual_seed(0)
    model = nn.Sequential(hso.FeatureClip(1.0), nn.Linear(D, K))
    engine = PrivacyEngine(accountant="hidden_state")
    model, opt, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=DataLoader(random_classification(600), batch_size=B, shuffle=True),
        target_epsilon=8.0,
        target_delta=DELTA,
        epochs=2,
        max_grad_norm=1.0,
        poisson_sampling=False,
    )
    train_epochs(model, opt, loader, 2)
    report = explain(engine)
    assert engine.accountant.training_run().sampling == RESHUFFLE
    assert report.neighboring_relation == "REPLACE_ONE"
    assert 7.5 < report.epsilon <= 8.0  # calibrated for this run, within Opacus' tolerance


def test_configure_without_a_sampler_takes_the_loader_make_private_returned():
    """Before, ``configure(geometry=...)`` without a sampler claimed Poisson sampling (and needed the
    dataset size); the batches are the shuffled loader's, so the hidden-state claim is for ``reshuffle``."""
    engine, model, opt, loader = private(DataLoader(random_classification(200), batch_size=20, shuffle=True))
    hook = hso.ProjectionHook(opt, radius=3.0, l2_regularization=0.05)
    engine.accountant.configure(geometry=hook.logistic_regression_geometry(1.0), model=model, optimizer=opt)
    assert engine.accountant.claim.schedule.sampling == RESHUFFLE
    train_epochs(model, opt, loader, 2)
    report = explain(engine)
    assert report.analysis.startswith("si_reshuffle") and report.epsilon < report.composition_epsilon


def test_a_declared_schedule_must_be_the_loader_make_private_returned():
    shuffled = DataLoader(random_classification(200), batch_size=20, shuffle=True)
    # the reverse slip: Opacus' DPDataLoader is iterated, the shuffled loader declared
    engine, model, opt, _ = private(shuffled, poisson_sampling=True)
    with pytest.raises(ParameterError, match=r"^data: the batches do not come from a schedule of this package "):
        engine.accountant.configure(data_loader=shuffled)
    with pytest.raises(ParameterError, match=r"^data: the batches do not come from a schedule of this package "):
        engine.accountant.configure(sampler=hso.CyclicBatchSampler(200, 20))
    # declared before make_private: refused there, before Opacus replaces the loader
    engine = PrivacyEngine(accountant="hidden_state")
    engine.accountant.configure(sampler=hso.CyclicBatchSampler(200, 20))
    model = nn.Linear(D, K)
    with pytest.raises(ParameterError, match=r"^data: .*Opacus' DPDataLoader .*unless poisson_sampling=False"):
        engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=LR),
            data_loader=shuffled,
            noise_multiplier=Z,
            max_grad_norm=1.0,
        )


def test_a_run_on_a_loader_in_data_order_resumes_from_a_checkpoint_at_an_epoch_end(tmp_path):
    def build():
        return private(DataLoader(random_classification(200), batch_size=20))

    engine, model, opt, loader = build()
    train_epochs(model, opt, loader, 2)
    engine.save_checkpoint(path=tmp_path / "c.pt", module=model, optimizer=opt)
    engine2, model2, opt2, loader2 = build()
    engine2.load_checkpoint(path=tmp_path / "c.pt", module=model2, optimizer=opt2)
    train_epochs(model2, opt2, loader2, 1)
    engine3, model3, opt3, loader3 = build()
    train_epochs(model3, opt3, loader3, 3)
    assert engine2.accountant.training_run() == engine3.accountant.training_run()
    assert engine2.get_epsilon(DELTA) == engine3.get_epsilon(DELTA)

    for xb, yb in loader:  # one step into the next epoch
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()
        break
    engine.save_checkpoint(path=tmp_path / "mid.pt", module=model, optimizer=opt)
    engine4, model4, opt4, _ = build()
    with pytest.raises(ParameterError, match=r"^data: the run is at batch 1 of its 10-batch epoch"):
        engine4.load_checkpoint(path=tmp_path / "mid.pt", module=model4, optimizer=opt4)


def test_a_checkpoint_loads_into_a_loader_make_private_accounted_without_configure(tmp_path):
    """make_private(poisson_sampling=False) makes the claim the loader's schedule and nothing else: a
    checkpoint's claim (its geometry) loads onto it as into an unconfigured accountant, and one of another
    schedule is refused."""

    def build(n=200):
        loader = hso.secret_shuffle(DataLoader(random_classification(n), batch_size=20, shuffle=True))
        return private(loader)

    engine, model, opt, loader = build()
    hook = hso.ProjectionHook(opt, radius=3.0, l2_regularization=0.05)
    engine.accountant.configure(geometry=hook.logistic_regression_geometry(1.0), model=model, optimizer=opt)
    train_epochs(model, opt, loader, 2)
    engine.save_checkpoint(path=tmp_path / "r.pt", module=model, optimizer=opt)
    engine2, model2, opt2, loader2 = build()
    hso.ProjectionHook(opt2, radius=3.0, l2_regularization=0.05)
    engine2.load_checkpoint(path=tmp_path / "r.pt", module=model2, optimizer=opt2)
    assert engine2.accountant.claim == engine.accountant.claim  # the geometry came with the checkpoint
    train_epochs(model2, opt2, loader2, 1)
    train_epochs(model, opt, loader, 1)
    assert engine2.accountant.training_run() == engine.accountant.training_run()
    engine3, model3, opt3, _ = private(DataLoader(random_classification(200), batch_size=20))  # cyclic
    with pytest.raises(
        ParameterError, match=r"^data: the batches come from BatchSchedule\(.*'cyclic'\), but the accountant was told "
    ):
        engine3.load_checkpoint(path=tmp_path / "r.pt", module=model3, optimizer=opt3)


# ------------------------------------------------------------------------------------ U2
def poisson_claim(n=N):
    """A configured Poisson hidden-state claim (issue 29, U2)."""
    original = DataLoader(random_classification(n), batch_size=B, shuffle=True)
    engine, model, opt, dp_loader = private(original, poisson_sampling=True)
    hook = hso.ProjectionHook(opt, radius=3.0, l2_regularization=0.05)
    engine.accountant.configure(
        geometry=hook.logistic_regression_geometry(1.0), model=model, optimizer=opt, dataset_size=n
    )
    return engine, model, opt, original, dp_loader


def test_a_poisson_claim_refuses_steps_on_the_loader_passed_to_make_private():
    engine, model, opt, original, _ = poisson_claim()
    with pytest.raises(
        ParameterError,
        match=r"^data_loader: the DPDataLoader make_private returned has handed out 0 batches for 1 steps: the "
        r"batches did not come from it; iterate that loader",
    ):
        train_epochs(model, opt, original, 1)
    assert len(engine.accountant) == 0  # refused before it was accounted


def test_an_unconfigured_poisson_run_refuses_them_too():
    original = DataLoader(random_classification(300), batch_size=B, shuffle=True)
    engine, model, opt, _ = private(original, poisson_sampling=True)
    with pytest.raises(ParameterError, match=r"^data_loader: the DPDataLoader make_private returned has handed out"):
        train_epochs(model, opt, original, 1)


def test_the_dpdataloader_passes_also_split_by_batch_memory_manager():
    engine, model, opt, _, dp_loader = poisson_claim(n=300)
    sizes = train_epochs(model, opt, dp_loader, 2)
    assert len(engine.accountant) == len(sizes) == 6 and len(set(sizes)) > 1  # Poisson sizes
    with BatchMemoryManager(data_loader=dp_loader, max_physical_batch_size=40, optimizer=opt) as split:
        train_epochs(model, opt, split, 1)  # each Poisson batch in physical batches of at most 40
    assert len(engine.accountant) == 9


def test_a_resumed_poisson_run_counts_from_the_restored_steps(tmp_path):
    engine, model, opt, _, dp_loader = poisson_claim(n=300)
    train_epochs(model, opt, dp_loader, 2)
    engine.save_checkpoint(path=tmp_path / "p.pt", module=model, optimizer=opt)
    engine2, model2, opt2, original2, dp_loader2 = poisson_claim(n=300)
    engine2.load_checkpoint(path=tmp_path / "p.pt", module=model2, optimizer=opt2)
    assert len(engine2.accountant) == 6
    with pytest.raises(ParameterError, match=r"has handed out 6 batches for 7 steps"):
        train_epochs(model2, opt2, original2, 1)
    opt2.zero_grad()  # the refused step's gradients
    train_epochs(model2, opt2, dp_loader2, 1)
    assert len(engine2.accountant) == 9
