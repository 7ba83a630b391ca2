"""Issue 27 in Opacus: the accountant reads the model's classes and refuses a hidden-state claim where the
clip can bind on three or more of them (docs/derivations.md section 18).

A 5-class model with clip 1 and features of norm <= 1 gets composition, with the reason; two classes at
clip 1 and five classes at a clip that cannot bind (2 plus Opacus' 1e-6 margin) get the hidden-state bound,
the same number, since the bounds depend on the clip only through the noise multiplier.
"""

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
pytestmark = pytest.mark.torch

from opacus import PrivacyEngine  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import hidden_state_accountants.opacus as hso  # noqa: E402
from hidden_state_accountants import CompositionFallbackWarning, ParameterError  # noqa: E402

N, B, D, DELTA = 120, 12, 4, 1e-5


def run(classes: int, clip: float, *, num_classes=None, epochs: int = 4, poisson: bool = False):
    """Trains ``FeatureClip(1) -> Linear(D, classes)`` under a declared logistic geometry; returns the engine
    and the messages of the composition fallbacks."""
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(N, D, generator=g), torch.randint(0, classes, (N,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(hso.FeatureClip(1.0), nn.Linear(D, classes))
    sampler = None if poisson else hso.ShufflePartitionBatchSampler(N, B, seed=1)
    loader = DataLoader(ds, batch_size=B) if poisson else DataLoader(ds, batch_sampler=sampler)
    engine = PrivacyEngine(accountant="hidden_state")
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=loader,
        noise_multiplier=2.0,
        max_grad_norm=clip,
        poisson_sampling=poisson,
    )
    hook = hso.ProjectionHook(opt, l2_regularization=0.05)
    where = dict(dataset_size=N) if poisson else dict(sampler=sampler)
    geometry = hook.logistic_regression_geometry(1.0, num_classes=num_classes)
    engine.accountant.configure(geometry=geometry, model=model, optimizer=opt, **where)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(epochs):
            for xb, yb in loader:
                nn.functional.cross_entropy(model(xb), yb).backward()
                opt.step()
                opt.zero_grad()
        report = engine.accountant.explain(DELTA)
    return report, [str(w.message) for w in caught if issubclass(w.category, CompositionFallbackWarning)]


def hidden_state_numbers(report):
    return [a.epsilon for a in report.analyses if a.hidden_state and a.epsilon is not None]


@pytest.mark.parametrize("poisson", [False, True])
def test_five_classes_at_clip_one_get_composition_with_the_reason(poisson):
    report, fallbacks = run(5, 1.0, poisson=poisson)
    assert not hidden_state_numbers(report) and report.epsilon == report.composition_epsilon
    assert len(fallbacks) == 1
    assert "5 classes with clip norm 1," in fallbacks[0] and "clip norm >= 2.000001" in fallbacks[0]
    assert any("5 classes" in note for note in report.notes)


@pytest.mark.parametrize("poisson", [False, True])
def test_two_classes_at_clip_one_and_five_at_a_nonbinding_clip_get_the_same_hidden_state_bound(poisson):
    epochs = 30 if poisson else 4  # long enough for the hidden-state bound to win
    binary, none = run(2, 1.0, poisson=poisson, epochs=epochs)
    five, also_none = run(5, 2.000001, poisson=poisson, epochs=epochs)
    assert not none and not also_none
    assert hidden_state_numbers(binary) and binary.epsilon < binary.composition_epsilon
    assert five.analysis == binary.analysis and five.epsilon == pytest.approx(binary.epsilon, rel=1e-12)


def test_opacus_clip_margin_counts_at_the_threshold():
    """Opacus divides by the norm plus 1e-6, so clip 2 still rescales gradients of norm just below 2."""
    report, fallbacks = run(5, 2.0, epochs=1)
    assert not hidden_state_numbers(report)
    assert "the framework's clip rescales from 1e-06 below its clip norm" in fallbacks[0]


def test_declared_classes_must_be_the_models():
    with pytest.raises(ParameterError, match="^num_classes: the geometry is declared for 3 classes, but the model"):
        run(5, 2.01, num_classes=3, epochs=1)
    report, fallbacks = run(5, 2.01, num_classes=5, epochs=1)  # the same number declared: fine
    assert not fallbacks and hidden_state_numbers(report)
