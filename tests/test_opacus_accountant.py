"""``PrivacyEngine(accountant="hidden_state")``: the core's number, fallbacks, refusals,
calibration through ``make_private_with_epsilon`` and checkpoints."""

import math
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
pytestmark = pytest.mark.torch

from opacus import PrivacyEngine  # noqa: E402
from opacus.accountants import create_accountant  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import hidden_state_accountants.opacus as hso  # noqa: E402
from hidden_state_accountants import (  # noqa: E402
    HiddenStateAccountant,
    LossGeometry,
    ParameterError,
    TrainingRunDpEvent,
)

DELTA = 1e-5
N, D, K = 60, 5, 3


def data(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, D, generator=g), torch.randint(0, K, (n,), generator=g))


def sampler_for(sampling, n=N, b=10, seed=0):
    return {
        "cyclic": lambda: hso.CyclicBatchSampler(n, b),
        "shuffle_partition": lambda: hso.ShufflePartitionBatchSampler(n, b, seed),
        "without_replacement": lambda: hso.WithoutReplacementBatchSampler(n, b, seed),
        "full": lambda: hso.FullBatchSampler(n),
    }[sampling]()


def private(sampler=None, *, lr=0.5, z=2.0, clip=1.0, optimizer="sgd", seed=0, n=N, batch_size=10,
            gen=None, **make_private_kwargs):
    """A DP logistic-regression setup on generated data; ``sampler=None`` is Opacus' Poisson default."""
    torch.manual_seed(seed)
    ds = data(n)
    if sampler is None:
        loader, poisson = DataLoader(ds, batch_size=batch_size), True
    else:
        loader, poisson = DataLoader(ds, batch_sampler=sampler), False
    model = nn.Sequential(hso.FeatureClip(1.0), nn.Linear(D, K))
    opt = (torch.optim.SGD(model.parameters(), lr=lr) if optimizer == "sgd"
           else torch.optim.Adam(model.parameters(), lr=lr))
    engine = PrivacyEngine(accountant="hidden_state")
    kwargs = dict(poisson_sampling=poisson, noise_generator=gen)
    kwargs.update(make_private_kwargs)
    model, opt, loader = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                             noise_multiplier=z, max_grad_norm=clip, **kwargs)
    return engine, model, opt, loader


def train(model, opt, loader, epochs, on_epoch=None):
    for e in range(epochs):
        for xb, yb in loader:
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            opt.zero_grad()
        if on_epoch:
            on_epoch(e)


def core_epsilon(run, delta=DELTA):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return HiddenStateAccountant().compose(run).get_epsilon(delta)


# ---------------------------------------------------------------------------------------
def test_registered_under_hidden_state():
    engine = PrivacyEngine(accountant="hidden_state")
    assert isinstance(engine.accountant, hso.OpacusHiddenStateAccountant)
    assert type(create_accountant("hidden_state")) is hso.OpacusHiddenStateAccountant
    assert engine.accountant.mechanism() == "hidden_state" and len(engine.accountant) == 0
    assert engine.get_epsilon(DELTA) == 0.0


@pytest.mark.parametrize("sampling", ["cyclic", "shuffle_partition", "without_replacement", "full"])
def test_epsilon_equals_the_core_for_the_same_run(sampling):
    s = sampler_for(sampling)
    engine, model, opt, loader = private(s, lr=0.5, z=2.0, clip=1.5)
    hook = hso.ProjectionHook(opt, radius=3.0, l2_regularization=0.05)
    engine.accountant.configure(geometry=hook.logistic_regression_geometry(1.0), sampler=s)
    train(model, opt, loader, 3)
    b = N if sampling == "full" else 10
    expected = TrainingRunDpEvent.from_epochs(
        dataset_size=N, batch_size=b, epochs=3, noise_multiplier=2.0, clip_norm=1.5, learning_rate=0.5,
        sampling=sampling, geometry=LossGeometry.logistic_regression(1.0, 0.05, diameter=6.0))
    assert engine.accountant.training_run() == expected
    assert engine.get_epsilon(DELTA) == core_epsilon(expected)
    assert len(engine.accountant) == expected.steps


def test_hidden_state_beats_composition_when_configured():
    s = hso.ShufflePartitionBatchSampler(N, 10, seed=1)
    engine, model, opt, loader = private(s, lr=0.8, z=3.0)
    hook = hso.ProjectionHook(opt, l2_regularization=0.1)
    engine.accountant.configure(geometry=hook.logistic_regression_geometry(1.0), sampler=s)
    train(model, opt, loader, 20)
    report = engine.accountant.explain(DELTA)
    winner = [a for a in report.analyses if a.name == report.analysis][0]
    assert winner.hidden_state
    assert report.epsilon < 0.5 * engine.accountant.composition_epsilon(DELTA)


def test_without_configuration_poisson_composition_and_one_warning():
    engine, model, opt, loader = private(None, batch_size=10)
    train(model, opt, loader, 2)
    q_steps = len(loader)  # Opacus' sample rate is 1/len(loader)
    expected = TrainingRunDpEvent(dataset_size=q_steps, batch_size=1, steps=2 * q_steps, noise_multiplier=2.0,
                                  clip_norm=1.0, learning_rate=0.5, sampling="poisson")
    with pytest.warns(UserWarning, match="no hidden-state analysis applied.*not configured") as rec:
        eps = engine.get_epsilon(DELTA)
        engine.get_epsilon(DELTA / 10)
    assert sum("no hidden-state analysis" in str(w.message) for w in rec) == 1, "warn once"
    assert eps == core_epsilon(expected)
    assert "composition_poisson" in engine.accountant.explain(DELTA).analysis


def test_sampler_without_geometry_reports_its_composition_bound():
    s = hso.CyclicBatchSampler(N, 10)
    engine, model, opt, loader = private(s)
    engine.accountant.configure(sampler=s)
    train(model, opt, loader, 2)
    with pytest.warns(UserWarning, match="no loss geometry configured"):
        eps = engine.get_epsilon(DELTA)
    run = TrainingRunDpEvent.from_epochs(dataset_size=N, batch_size=10, epochs=2, noise_multiplier=2.0,
                                         clip_norm=1.0, learning_rate=0.5, sampling="cyclic")
    assert eps == core_epsilon(run)
    assert engine.accountant.explain(DELTA).analysis == "bok_thm4.4"  # cyclic composition
    # Bok Thm 4.4: each record is used once per epoch, G(2 sqrt(E)/z)
    from hidden_state_accountants import fdp
    assert eps == pytest.approx(fdp.gdp_epsilon(2 * math.sqrt(2) / 2.0, DELTA), rel=1e-6)


@pytest.mark.parametrize("what", ["learning_rate", "noise_multiplier"])
def test_schedule_change_mid_training_is_accounted_and_hidden_state_refused(what):
    s = hso.CyclicBatchSampler(N, 10)
    engine, model, opt, loader = private(s, lr=0.5, z=2.0)
    hook = hso.ProjectionHook(opt, l2_regularization=0.05)
    engine.accountant.configure(geometry=hook.logistic_regression_geometry(1.0), sampler=s)

    def change(epoch):
        if epoch == 0:
            if what == "learning_rate":
                opt.param_groups[0]["lr"] = 0.25
            else:
                opt.noise_multiplier = 3.0

    train(model, opt, loader, 2, on_epoch=change)
    first, second = (0.5, 0.25) if what == "learning_rate" else (2.0, 3.0)
    schedule = tuple([first] * 6 + [second] * 6)
    fields = dict(noise_multiplier=2.0, learning_rate=0.5)
    fields[what] = schedule
    run = TrainingRunDpEvent(dataset_size=N, batch_size=10, steps=12, clip_norm=1.0, sampling="cyclic",
                             geometry=LossGeometry.logistic_regression(1.0, 0.05), **fields)
    assert engine.accountant.training_run() == run
    report = engine.accountant.explain(DELTA)
    assert report.epsilon == core_epsilon(run)
    assert not [a for a in report.analyses if a.name == report.analysis][0].hidden_state
    reasons = [a.reason for a in report.analyses if a.hidden_state and a.reason]
    assert any("changes during training" in r for r in reasons)


def test_clip_norm_change_mid_training_falls_back_to_composition():
    s = hso.CyclicBatchSampler(N, 10)
    engine, model, opt, loader = private(s, clip=1.0)
    hook = hso.ProjectionHook(opt, l2_regularization=0.05)
    engine.accountant.configure(geometry=hook.logistic_regression_geometry(1.0), sampler=s)

    def change(epoch):
        opt.max_grad_norm = 2.0

    train(model, opt, loader, 2, on_epoch=change)
    with pytest.warns(UserWarning, match="max_grad_norm changed during training"):
        eps = engine.get_epsilon(DELTA)
    # composition depends on the noise-to-sensitivity ratio z only, whatever C is
    run = engine.accountant.training_run()
    assert "max_grad_norm changed during training" in run.hidden_state_refusal
    assert run == TrainingRunDpEvent(dataset_size=N, batch_size=10, steps=12, noise_multiplier=2.0, clip_norm=2.0,
                                     learning_rate=0.5, sampling="cyclic", geometry=run.geometry,
                                     hidden_state_refusal=run.hidden_state_refusal)
    assert eps == core_epsilon(run) == core_epsilon(run.replace(geometry=None, hidden_state_refusal=None))


def test_non_sgd_optimizer_gets_composition_with_the_reason():
    s = hso.CyclicBatchSampler(N, 10)
    engine, model, opt, loader = private(s, optimizer="adam", lr=0.01)
    engine.accountant.configure(geometry=LossGeometry.logistic_regression(1.0, 0.0), sampler=s)
    train(model, opt, loader, 1)
    with pytest.warns(UserWarning, match="Adam, the analyses assume plain SGD"):
        eps = engine.get_epsilon(DELTA)
    run = TrainingRunDpEvent(dataset_size=N, batch_size=10, steps=6, noise_multiplier=2.0, clip_norm=1.0,
                             learning_rate=0.01, sampling="cyclic")
    assert eps == core_epsilon(run)
    assert any("Adam" in n for n in engine.accountant.explain(DELTA).notes)


# ------------------------------------------------------------------- bad configurations
def test_configure_refuses_bad_arguments():
    acc = hso.OpacusHiddenStateAccountant()
    geom = LossGeometry.logistic_regression(1.0, 0.1)
    with pytest.raises(ParameterError, match="^sampler: a hidden-state claim needs the batch schedule"):
        acc.configure(geometry=geom)
    with pytest.raises(ParameterError, match="^sampler: must be a sampler"):
        acc.configure(sampler=torch.utils.data.BatchSampler(range(10), 2, False))
    with pytest.raises(ParameterError, match="^geometry"):
        acc.configure(geometry={"smoothness": 1.0}, sampler=hso.CyclicBatchSampler(10, 2))


def test_configure_after_training_is_refused():
    s = hso.CyclicBatchSampler(N, 10)
    engine, model, opt, loader = private(s)
    engine.accountant.configure(sampler=s)
    train(model, opt, loader, 1)
    with pytest.raises(ParameterError, match="^configure: called after 6 steps"):
        engine.accountant.configure(sampler=s, geometry=LossGeometry.logistic_regression(1.0, 0.0))


def test_declared_strong_convexity_must_come_from_weight_decay():
    s = hso.CyclicBatchSampler(N, 10)
    engine, model, opt, loader = private(s)
    engine.accountant.configure(geometry=LossGeometry.logistic_regression(1.0, 0.1), sampler=s)
    train(model, opt, loader, 1)  # weight_decay is 0: nothing makes the update strongly convex
    with pytest.raises(ParameterError, match="^geometry: strong_convexity 0.1 exceeds the optimizer's weight_decay 0"):
        engine.get_epsilon(DELTA)


def test_declared_diameter_needs_the_projection():
    s = hso.CyclicBatchSampler(N, 10)
    engine, model, opt, loader = private(s)
    engine.accountant.configure(geometry=LossGeometry.logistic_regression(1.0, 0.0, diameter=4.0), sampler=s)
    train(model, opt, loader, 1)
    with pytest.raises(ParameterError, match=r"^geometry: diameter 4 is declared .* ProjectionHook\(optimizer, radius=2\)"):
        engine.get_epsilon(DELTA)


def test_declared_diameter_smaller_than_the_ball_is_refused():
    s = hso.CyclicBatchSampler(N, 10)
    engine, model, opt, loader = private(s)
    hso.ProjectionHook(opt, radius=3.0)
    engine.accountant.configure(geometry=LossGeometry.logistic_regression(1.0, 0.0, diameter=4.0), sampler=s)
    train(model, opt, loader, 1)
    with pytest.raises(ParameterError, match="^geometry: declared diameter 4 is smaller than the projection's 2R = 6"):
        engine.get_epsilon(DELTA)


def test_learning_rate_too_large_for_the_geometry():
    s = hso.CyclicBatchSampler(N, 10)
    engine, model, opt, loader = private(s, lr=2.5)
    engine.accountant.configure(geometry=LossGeometry.logistic_regression(1.0, 0.0), sampler=s)
    train(model, opt, loader, 1)
    with pytest.raises(ParameterError, match="^learning_rate: must be < 2/smoothness"):
        engine.get_epsilon(DELTA)


def test_poisson_loader_with_a_configured_sampler_is_refused():
    s = hso.CyclicBatchSampler(N, 10)
    engine, model, opt, loader = private(None, batch_size=10)  # Opacus replaces the loader by Poisson
    engine.accountant.configure(sampler=s)
    with pytest.raises(ParameterError, match="^data_loader: .* poisson_sampling=False"):
        train(model, opt, loader, 1)


def test_expected_batch_size_mismatch_is_refused_then_fixed():
    # n % b >= n // b: Opacus derives expected_batch_size = int(40 / 3) = 13, not 12
    with pytest.warns(UserWarning, match="40 % 12 = 4 records"):
        s = hso.CyclicBatchSampler(40, 12)
    engine, model, opt, loader = private(s, n=40)
    engine.accountant.configure(sampler=s)
    with pytest.raises(ParameterError, match=r"^expected_batch_size: .* by 13 .* set optimizer.expected_batch_size = 12"):
        train(model, opt, loader, 1)
    assert len(engine.accountant) == 0
    s.set_position(0)
    opt.zero_grad()
    opt.expected_batch_size = 12
    train(model, opt, loader, 1)
    assert len(engine.accountant) == 3


def test_per_layer_clipping_gets_composition_with_the_reason():
    s = hso.CyclicBatchSampler(N, 10)
    engine, model, opt, loader = private(s, clip=[0.6, 0.8], clipping="per_layer", lr=0.5)
    engine.accountant.configure(geometry=LossGeometry.logistic_regression(1.0, 0.0), sampler=s)
    train(model, opt, loader, 1)
    with pytest.warns(UserWarning, match="per-layer clipping"):
        eps = engine.get_epsilon(DELTA)
    # the flat norm of the per-layer bounds is the sensitivity Opacus scales its noise to
    run = engine.accountant.training_run()
    assert "per-layer clipping" in run.hidden_state_refusal
    assert run.replace(geometry=None, hidden_state_refusal=None) == TrainingRunDpEvent(
        dataset_size=N, batch_size=10, steps=6, noise_multiplier=2.0, clip_norm=1.0, learning_rate=0.5,
        sampling="cyclic")
    assert eps == core_epsilon(run)


def test_adaptive_clipping_is_refused():
    s = hso.CyclicBatchSampler(N, 10)
    engine, model, opt, loader = private(s, clipping="adaptive", target_unclipped_quantile=0.5,
                                         clipbound_learning_rate=0.2, max_clipbound=10.0, min_clipbound=0.1,
                                         unclipped_num_std=2.0)
    engine.accountant.configure(sampler=s)
    with pytest.raises(ParameterError, match="^clipping: adaptive clipping"):
        train(model, opt, loader, 1)


def test_gradient_accumulation_is_refused():
    s = hso.CyclicBatchSampler(N, 10)
    engine, model, opt, loader = private(s)
    engine.accountant.configure(sampler=s)
    it = iter(loader)
    for _ in range(2):
        xb, yb = next(it)
        nn.functional.cross_entropy(model(xb), yb).backward()
    with pytest.raises(ParameterError, match="^accumulated_iterations: 2 batches per step"):
        opt.step()


# -------------------------------------------------------------------------- calibration
def test_make_private_with_epsilon_calibrates_with_the_hidden_state_analysis():
    target, epochs = 2.0, 4
    results = {}
    for mode in ("hidden", "composition"):
        torch.manual_seed(0)
        s = hso.ShufflePartitionBatchSampler(N, 10, seed=0)
        model = nn.Sequential(hso.FeatureClip(1.0), nn.Linear(D, K))
        base = torch.optim.SGD(model.parameters(), lr=0.8, weight_decay=0.1)
        engine = PrivacyEngine(accountant="hidden_state")
        geometry = LossGeometry.logistic_regression(1.0, 0.1) if mode == "hidden" else None
        engine.accountant.configure(geometry=geometry, sampler=s)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt, loader = engine.make_private_with_epsilon(
                module=model, optimizer=base, data_loader=DataLoader(data(), batch_sampler=s),
                target_epsilon=target, target_delta=DELTA, epochs=epochs, max_grad_norm=1.0,
                poisson_sampling=False, **engine.accountant.calibration_kwargs(optimizer=base, max_grad_norm=1.0))
            train(model, opt, loader, epochs)
            results[mode] = (opt.noise_multiplier, engine.get_epsilon(DELTA))
    z_hidden, eps_hidden = results["hidden"]
    z_comp, eps_comp = results["composition"]
    # the run spends what it was calibrated for (Opacus' tolerance is 0.01), never more
    assert target - 0.02 <= eps_hidden <= target
    assert target - 0.02 <= eps_comp <= target
    assert z_hidden < 0.8 * z_comp, "the hidden-state analysis needs less noise for the same budget"


def test_calibration_without_the_configuration_warns_and_assumes_poisson():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, K))
    base = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = PrivacyEngine(accountant="hidden_state")
    with pytest.warns(UserWarning, match="no configuration reached Opacus' calibration call"):
        engine.make_private_with_epsilon(module=model, optimizer=base, data_loader=DataLoader(data(), batch_size=10),
                                         target_epsilon=2.0, target_delta=DELTA, epochs=2, max_grad_norm=1.0)


def test_calibration_refuses_a_loader_of_another_schedule():
    s = hso.CyclicBatchSampler(N, 10)
    model = nn.Sequential(nn.Linear(D, K))
    base = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = PrivacyEngine(accountant="hidden_state")
    engine.accountant.configure(sampler=s)
    with pytest.raises(ParameterError, match="^data_loader: Opacus' sample rate"):
        engine.make_private_with_epsilon(
            module=model, optimizer=base, data_loader=DataLoader(data(), batch_size=20),
            target_epsilon=2.0, target_delta=DELTA, epochs=2, max_grad_norm=1.0, poisson_sampling=False,
            **engine.accountant.calibration_kwargs(optimizer=base, max_grad_norm=1.0))


# --------------------------------------------------------------------------- checkpoints
def _resumable_run(tmp_path, epochs_before, epochs_after, seed=3):
    """Trains ``epochs_before`` epochs, checkpoints, rebuilds everything, resumes."""
    geometry = LossGeometry.logistic_regression(1.0, 0.05, diameter=6.0)
    batches = []

    def build():
        s = hso.ShufflePartitionBatchSampler(N, 10, seed=seed)
        gen = torch.Generator().manual_seed(seed)
        engine, model, opt, loader = private(s, gen=gen, seed=seed)
        hso.ProjectionHook(opt, radius=3.0, l2_regularization=0.05)
        engine.accountant.configure(geometry=geometry, sampler=s)
        return s, gen, engine, model, opt, loader

    s, gen, engine, model, opt, loader = build()
    train(model, opt, loader, epochs_before)
    batches += [s.global_batch(t) for t in range(s.position)]
    if epochs_after == 0:
        return engine, model, batches
    path = tmp_path / "ckpt.pt"
    engine.save_checkpoint(path=path, module=model, optimizer=opt, checkpoint_dict={"noise_rng": gen.get_state()})
    s, gen, engine, model, opt, loader = build()
    extra = engine.load_checkpoint(path=path, module=model, optimizer=opt)
    gen.set_state(extra["noise_rng"])
    start = s.position
    train(model, opt, loader, epochs_after)
    batches += [s.global_batch(t) for t in range(start, s.position)]
    return engine, model, batches


def test_checkpoint_resume_reports_exactly_the_uninterrupted_run(tmp_path):
    whole, model_a, batches_a = _resumable_run(tmp_path, 3, 0)
    resumed, model_b, batches_b = _resumable_run(tmp_path, 2, 1)
    assert batches_b == batches_a
    assert resumed.accountant.training_run() == whole.accountant.training_run()
    assert resumed.get_epsilon(DELTA) == whole.get_epsilon(DELTA)
    assert resumed.accountant.state_dict() == whole.accountant.state_dict()
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb), "same batches and noise: the same model"


def test_checkpoint_mid_epoch_continues_the_schedule(tmp_path):
    s = hso.CyclicBatchSampler(N, 10)
    engine, model, opt, loader = private(s)
    engine.accountant.configure(sampler=s)
    it = iter(loader)
    for _ in range(4):  # 4 of the 6 steps of epoch 1
        xb, yb = next(it)
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()
    state = engine.accountant.state_dict()
    s2 = hso.CyclicBatchSampler(N, 10)
    acc = hso.OpacusHiddenStateAccountant().configure(sampler=s2)
    acc.load_state_dict(state)
    assert len(acc) == 4 and s2.position == 4
    assert [b for b in s2] == [s.global_batch(4), s.global_batch(5)]


def test_load_into_an_unconfigured_accountant_restores_the_configuration():
    s = hso.ShufflePartitionBatchSampler(N, 10, seed=9)
    engine, model, opt, loader = private(s)
    hook = hso.ProjectionHook(opt, l2_regularization=0.05)
    engine.accountant.configure(geometry=hook.logistic_regression_geometry(1.0), sampler=s)
    train(model, opt, loader, 2)
    fresh = hso.OpacusHiddenStateAccountant()
    fresh.load_state_dict(engine.accountant.state_dict())
    assert fresh.geometry == engine.accountant.geometry
    assert fresh.sampler.describe() == s.describe() and fresh.sampler.position == 12
    assert fresh.get_epsilon(DELTA) == engine.get_epsilon(DELTA)


def test_load_refuses_a_different_configuration():
    s = hso.ShufflePartitionBatchSampler(N, 10, seed=9)
    engine, model, opt, loader = private(s)
    engine.accountant.configure(sampler=s)
    train(model, opt, loader, 1)
    state = engine.accountant.state_dict()
    other = hso.OpacusHiddenStateAccountant().configure(sampler=hso.ShufflePartitionBatchSampler(N, 10, seed=8))
    with pytest.raises(ParameterError, match="^sampler: checkpoint holds the schedule"):
        other.load_state_dict(state)
    geom = hso.OpacusHiddenStateAccountant().configure(
        sampler=hso.ShufflePartitionBatchSampler(N, 10, seed=9), geometry=LossGeometry.logistic_regression(1.0, 0.0))
    with pytest.raises(ParameterError, match="^geometry: the checkpoint was taken with None"):
        geom.load_state_dict(state)
    with pytest.raises(ValueError, match="rdp"):
        hso.OpacusHiddenStateAccountant().load_state_dict({"mechanism": "rdp", "history": []})
