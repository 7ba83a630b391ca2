"""Projection keeps the norm bound, the L2 strength is the strong convexity, bad setups are
refused or warned about, and feature clipping bounds every input."""

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
pytestmark = pytest.mark.torch

from opacus import PrivacyEngine  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import hidden_state_accountants.opacus as hso  # noqa: E402
from hidden_state_accountants import LossGeometry, ParameterError  # noqa: E402

N, D, K = 60, 8, 3


def setup(base="sgd", lr=5.0, **opt_kwargs):
    torch.manual_seed(0)
    x = 10 * torch.randn(N, D)  # large inputs and lr: unprojected weights would grow fast
    y = torch.randint(0, K, (N,))
    s = hso.CyclicBatchSampler(N, 10)
    model = nn.Linear(D, K)
    opt = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[base](model.parameters(), lr=lr, **opt_kwargs)
    engine = PrivacyEngine(accountant="hidden_state")
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(x, y), batch_sampler=s),
        noise_multiplier=1.0,
        max_grad_norm=10.0,
        poisson_sampling=False,
    )
    return engine, s, model, opt, loader


def norm(model):
    return float(torch.sqrt(sum((p.detach() ** 2).sum() for p in model.parameters())))


def step(model, opt, xb, yb, penalty=0.0):
    loss = nn.functional.cross_entropy(model(xb), yb)
    if penalty:
        loss = loss + penalty * sum((p**2).sum() for p in model.parameters())
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_projection_keeps_every_iterate_in_the_ball():
    engine, s, model, opt, loader = setup()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(100.0)  # start far outside
    hook = hso.ProjectionHook(opt, radius=2.0)
    assert norm(model) <= 2.0, "theta_0 is projected at attach time"
    norms = []
    for _ in range(3):
        for xb, yb in loader:
            step(model, opt, xb, yb)
            norms.append(norm(model))
    assert max(norms) <= 2.0 and max(norms) > 1.9, "on the boundary, never outside"
    assert hook.diameter == 4.0
    hook.detach()
    for xb, yb in loader:
        step(model, opt, xb, yb)
    assert norm(model) > 2.0, "detached: no more projection"


def test_projection_leaves_points_inside_unchanged():
    engine, s, model, opt, loader = setup()
    before = [p.detach().clone() for p in model.parameters()]
    hso.ProjectionHook(opt, radius=1e6)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_l2_regularization_is_weight_decay_and_strong_convexity():
    engine, s, model, opt, loader = setup(lr=0.1)
    hook = hso.ProjectionHook(opt, l2_regularization=0.03)
    assert all(g["weight_decay"] == 0.03 for g in opt.original_optimizer.param_groups)
    assert hook.strong_convexity == 0.03 and hook.diameter is None
    assert hook.logistic_regression_geometry(2.0) == LossGeometry.logistic_regression(2.0, 0.03)
    # applied after clipping and noise: with zero noise and zero gradient... check the step itself
    opt.noise_multiplier = 0.0
    xb, yb = next(iter(loader))
    w0 = [p.detach().clone() for p in model.parameters()]
    loss = nn.functional.cross_entropy(model(xb), yb)
    loss.backward()
    opt.pre_step()  # clipped, noised (zero noise), scaled gradient now in p.grad
    grads = [p.grad.clone() for p in model.parameters()]
    opt.original_optimizer.step()
    for p, w, g in zip(model.parameters(), w0, grads):
        assert torch.allclose(p.detach(), w - 0.1 * (g + 0.03 * w), atol=1e-6)


def test_hook_refuses_setups_that_break_the_update_rule():
    engine, s, model, opt, loader = setup()
    with pytest.raises(ParameterError, match="^optimizer: must be the DPOptimizer"):
        hso.ProjectionHook(opt.original_optimizer, radius=1.0)
    with pytest.raises(ParameterError, match="^radius: give a radius"):
        hso.ProjectionHook(opt)
    with pytest.raises(ParameterError, match="^radius: must be > 0"):
        hso.ProjectionHook(opt, radius=0.0)
    engine, s, model, opt, loader = setup(base="adam", lr=0.01)
    with pytest.raises(ParameterError, match="^optimizer: adam applies its own update"):
        hso.ProjectionHook(opt, l2_regularization=0.1)
    engine, s, model, opt, loader = setup(momentum=0.9)
    with pytest.raises(ParameterError, match="^momentum: momentum=0.9"):
        hso.ProjectionHook(opt, radius=1.0)
    engine, s, model, opt, loader = setup(weight_decay=0.5)
    with pytest.raises(ParameterError, match="^l2_regularization: the optimizer already has weight_decay=0.5"):
        hso.ProjectionHook(opt, l2_regularization=0.1)
    hso.ProjectionHook(opt, radius=1.0)
    with pytest.raises(ParameterError, match="already has a ProjectionHook"):
        hso.ProjectionHook(opt, radius=1.0)


def test_warns_when_a_loss_penalty_would_be_dropped():
    engine, s, model, opt, loader = setup(lr=0.1)
    hso.ProjectionHook(opt, l2_regularization=0.01)
    xb, yb = next(iter(loader))
    with pytest.warns(UserWarning, match="penalty in the loss .* dropped by Opacus"):
        step(model, opt, xb, yb, penalty=1.0)


def test_no_warning_for_a_clean_loss():
    engine, s, model, opt, loader = setup(lr=0.1)
    hso.ProjectionHook(opt, l2_regularization=0.01)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for xb, yb in loader:
            step(model, opt, xb, yb)
    assert not [w for w in rec if "ProjectionHook" in str(w.message)]


def test_accountant_learns_the_diameter_from_the_hook():
    engine, s, model, opt, loader = setup(lr=0.5)
    hook = hso.ProjectionHook(opt, radius=1.5, l2_regularization=0.1)
    engine.accountant.configure(
        geometry=LossGeometry(smoothness=1.0, strong_convexity=0.1), sampler=s, model=model, optimizer=opt
    )
    for xb, yb in loader:
        step(model, opt, xb, yb)
    assert engine.accountant.training_run().geometry.diameter == 3.0
    hook.detach()  # later steps are unprojected: the claim no longer holds, composition does
    for xb, yb in loader:
        step(model, opt, xb, yb)
    run = engine.accountant.training_run()
    assert run.geometry is None and "the projection changed during training" in run.hidden_state_refusal


def test_clip_features_bounds_every_row():
    x = torch.randn(100, 3, 4) * torch.logspace(-2, 2, 100).reshape(-1, 1, 1)
    out = hso.clip_features(x, 1.5)
    norms = out.reshape(100, -1).norm(dim=1)
    assert norms.max() <= 1.5
    small = x.reshape(100, -1).norm(dim=1) <= 1.4
    assert torch.equal(out[small], x[small]), "rows inside the ball are unchanged"
    big = ~small & (x.reshape(100, -1).norm(dim=1) > 1.6)
    cos = nn.functional.cosine_similarity(out[big].reshape(big.sum(), -1), x[big].reshape(big.sum(), -1))
    assert torch.allclose(cos, torch.ones_like(cos)), "clipping only rescales"
    layer = hso.FeatureClip(0.5)
    assert layer(x).reshape(100, -1).norm(dim=1).max() <= 0.5 and layer.feature_norm_bound == 0.5
    with pytest.raises(ParameterError, match="^max_norm"):
        hso.FeatureClip(-1.0)
