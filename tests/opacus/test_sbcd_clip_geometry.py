"""Audit of DP-SBCD's per-example clipping (issue 27, item 3), PyTorch: finite differences of the
map the optimizer runs on one block, against the constants its accountant uses.

Each example's clipped gradient must be the gradient of a convex ``gamma rho_eff^2``-smooth function
of the block (its residual is projected onto a ball whose radius does not depend on ``theta``), and
one step ``theta -> Prox(theta - eta mean(clipped gradients))`` (or the Appendix C update) must be
``L_F L_T``-Lipschitz, with ``beta``, ``L_F`` and ``L_T`` read from
``hidden_state_accountants.analyses.sbcd.layer_constants`` for the event the optimizer records.
A negative control clips a convolution's gradient by its own norm and fails the same checks; two
witnesses show that the step Algorithm 2 runs, with ``x_d`` and ``u_d`` recomputed from ``theta_d``,
is not the analysed map (docs/dp_sbcd.md, "Audit: per-example clipping keeps each sub-problem convex").
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.torch,
    pytest.mark.usefixtures("torch_one_thread"),
    pytest.mark.filterwarnings("ignore::hidden_state_accountants.analyses.sbcd.SbcdAssumptionWarning"),
    pytest.mark.filterwarnings("ignore::hidden_state_accountants.errors.HiddenStateWarning"),
]

from sbcd_fd import STEP_OPTIONS, check_gradient_field, check_lipschitz, jacobian  # noqa: E402
from torch import nn  # noqa: E402

from hidden_state_accountants.analyses.sbcd import layer_constants  # noqa: E402
from hidden_state_accountants.pytorch.sbcd import DPSBCD, _clip_rows, u_update  # noqa: E402


def _model(kind: str, bias: bool) -> nn.Sequential:
    torch.manual_seed(0)
    if kind == "mlp":
        layers = [
            nn.Linear(6, 5, bias=bias),
            nn.ReLU(),
            nn.Linear(5, 4, bias=bias),
            nn.ReLU(),
            nn.Linear(4, 3, bias=bias),
        ]
    else:
        layers = [
            nn.Conv2d(1, 2, 3, padding=1, bias=bias),
            nn.ReLU(),
            nn.Conv2d(2, 2, 3, stride=2, padding=1, bias=bias),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(2 * 3 * 3, 3, bias=bias),
        ]
    return nn.Sequential(*layers).to(torch.float64)


def _opt(kind: str, bias: bool, cls=DPSBCD, **kw) -> DPSBCD:
    g = torch.Generator().manual_seed(1)
    shape = (6,) if kind == "mlp" else (1, 6, 6)
    x = torch.randn((12,) + shape, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (12,), generator=g)
    args = dict(batch_size=4, step_size=0.2 if kind == "mlp" else [0.02, 0.04, 0.2], noise=1e-3, rho=1.5, seed=0)
    args.update(kw)
    return cls(_model(kind, bias), x, y, **args)


def _batch(opt: DPSBCD, d: int, seed: int = 2):
    """A batch of the layer's (clipped) inputs and targets at four distances from the layer's
    output: clipping binds for some examples and not for others."""
    blk = opt.blocks[d]
    x = opt.xs[d][:4]
    with torch.no_grad():
        out = blk.module(x)
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([1e-3, 30.0, 0.03, 100.0], dtype=torch.float64).view((-1,) + (1,) * (out.dim() - 1))
    return x, out + scale * torch.randn(out.shape, generator=g, dtype=torch.float64)


def _clipped(opt: DPSBCD, d: int, x, target) -> torch.Tensor:
    """Which examples the optimizer clips at the block's current weights."""
    blk = opt.blocks[d]
    p, u = opt._patches(blk, x), opt._as_rows(blk, target)
    r = torch.einsum("blk,ok->blo", p, opt._theta(blk)) - u
    return r.flatten(1).norm(dim=1) * p.flatten(1).norm(dim=1) > opt.rho_eff[d] / 2


def _set(opt: DPSBCD, d: int, theta: np.ndarray) -> None:
    blk = opt.blocks[d]
    opt._set_theta(blk, torch.tensor(theta.reshape(opt._theta(blk).shape)))


def _field(opt: DPSBCD, d: int, x, target):
    """theta -> the optimizer's clipped contribution of the one example in ``x``."""

    def f(theta):
        _set(opt, d, theta)
        return opt.per_example_contributions(d, x, target)[0].numpy().ravel()

    return f


def _step(opt: DPSBCD, d: int, x, target):
    """theta -> the optimizer's update of block ``d`` without its noise (o = 0)."""

    def f(theta):
        _set(opt, d, theta)
        opt._theta_update(d, x, target, 0.0)
        return opt._theta(opt.blocks[d]).numpy().ravel().copy()  # _theta is a view of the weights

    return f


def _theta0(opt: DPSBCD, d: int) -> np.ndarray:
    return opt._theta(opt.blocks[d]).numpy().ravel().copy()


CASES = [(kind, bias) for kind in ("mlp", "cnn") for bias in (False, True)]


@pytest.mark.parametrize("kind,bias", CASES)
def test_each_clipped_gradient_is_a_convex_beta_smooth_gradient(kind, bias):
    """(a) symmetric PSD Jacobian, (b) eigenvalues <= beta = gamma rho_eff^2 (Lemma 3.1) with
    rho_eff as the event records it; per example, clipped or not, every layer type."""
    opt = _opt(kind, bias)
    consts = layer_constants(opt.privacy_event(steps=1))
    for d, blk in enumerate(opt.blocks):
        beta = consts[d].smoothness
        assert beta == pytest.approx(opt.gamma * opt.rho_eff[d] ** 2)
        x, target = _batch(opt, d)
        clipped = _clipped(opt, d, x, target)
        assert clipped.any() and not clipped.all(), "the point must have clipped and unclipped examples"
        theta = _theta0(opt, d)
        for i in range(len(x)):
            check_gradient_field(_field(opt, d, x[i : i + 1], target[i : i + 1]), theta, beta)


@pytest.mark.parametrize("kind,bias", CASES)
@pytest.mark.parametrize("options", [o for o in STEP_OPTIONS if o != "expansive"])
def test_one_step_is_as_lipschitz_as_the_accountant_assumes(kind, bias, options):
    """(c) the noiseless step of every block is L_F L_T-Lipschitz (Lemmas 4.1, 4.2 as the
    accountant evaluates them), at a point where clipping binds."""
    opt = _opt(kind, bias, **STEP_OPTIONS[options])
    for d, c in enumerate(layer_constants(opt.privacy_event(steps=1))):
        x, target = _batch(opt, d)
        assert _clipped(opt, d, x, target).any()
        theta = _theta0(opt, d)
        for point in (theta, theta + np.random.default_rng(1).normal(size=theta.size)):  # and further off, more clipped
            check_lipschitz(_step(opt, d, x, target), point, c.lipschitz_f * c.lipschitz_t)


def test_an_expansive_step_stays_within_eta_beta_minus_one():
    """eta > 2 / beta: the accountant's L_F = eta beta - 1 > 1 (Lemma 4.1 with omega = 0) still
    bounds the step (beta-cocoercivity of a convex beta-smooth gradient)."""
    opt = _opt("mlp", False, **STEP_OPTIONS["expansive"])
    consts = layer_constants(opt.privacy_event(steps=1))
    for d, c in enumerate(consts):
        assert c.lipschitz_f == pytest.approx(c.eta * c.smoothness - 1) and c.lipschitz_f > 1
        x, target = _batch(opt, d)
        check_lipschitz(_step(opt, d, x, target), _theta0(opt, d), c.lipschitz_f * c.lipschitz_t)


class _ClipsTheGradientByItsOwnNorm(DPSBCD):
    """Negative control: scales each example's residual by ``min(1, c / ||R_i^T P_i||_F)``, i.e.
    clips the actual gradient. For a dense layer ``||r x^T|| = |r| |x|`` and this is the
    optimizer's rule; for a convolution it is not a function of ``|R_i|`` alone."""

    def _clipped_rows(self, d, p, u):
        r = torch.einsum("blk,ok->blo", p, self._theta(self.blocks[d])) - u
        norm = torch.einsum("blo,blk->bok", r, p).flatten(1).norm(dim=1)
        return r * torch.clamp(self.rho_eff[d] / 2 / torch.clamp(norm, min=1e-30), max=1.0).view(-1, 1, 1)


def test_clipping_a_convolutions_gradient_by_its_own_norm_fails_the_checks():
    opt = _opt("cnn", True, cls=_ClipsTheGradientByItsOwnNorm, regularizer="none")
    d = 0  # the first convolution
    x, target = _batch(opt, d)
    theta = _theta0(opt, d) + np.random.default_rng(1).normal(size=_theta0(opt, d).size)
    c = layer_constants(opt.privacy_event(steps=1))[d]
    # one example: the Jacobian is not symmetric and its symmetric part has a negative eigenvalue
    with pytest.raises(AssertionError, match="not a gradient field"):
        check_gradient_field(_field(opt, d, x[1:2], target[1:2]), theta, c.smoothness)
    jac = jacobian(_field(opt, d, x[1:2], target[1:2]), theta)
    assert np.linalg.eigvalsh((jac + jac.T) / 2)[0] < -0.01
    # the batch: the step is expansive, above the L_F L_T = 1 the accountant uses
    with pytest.raises(AssertionError, match="above L_F L_T"):
        check_lipschitz(_step(opt, d, x, target), theta, c.lipschitz_f * c.lipschitz_t)
    # the optimizer's rule at the same point passes both
    real = _opt("cnn", True, regularizer="none")
    check_gradient_field(_field(real, d, x[1:2], target[1:2]), theta, c.smoothness)
    check_lipschitz(_step(real, d, x, target), theta, c.lipschitz_f * c.lipschitz_t)


def test_for_a_dense_layer_the_two_rules_coincide():
    """``||r x^T||_F = |r| |x|``: clipping a dense layer's gradient by its norm is the optimizer's rule."""
    real, own = _opt("mlp", True), _opt("mlp", True, cls=_ClipsTheGradientByItsOwnNorm)
    for d in range(real.num_layers):
        x, target = _batch(real, d)
        torch.testing.assert_close(
            real.per_example_contributions(d, x, target),
            own.per_example_contributions(d, x, target),
            rtol=1e-12,
            atol=0,
        )


# -------------------------------------------- what the code runs on theta_d is not the analysed map
def test_the_output_blocks_step_with_x_recomputed_is_expansive():
    """Algorithm 2 recomputes x_D from theta_D (eq. 4) before the theta_D step, so the map on
    theta_D is theta -> step(theta; x_D(theta)): expansive, above L_F L_T = 1 (Lemma 4.1 holds
    for the step with x_D fixed, which the test above checks). A witness that the per-layer
    analysis is the paper's assumption, not a property of the run."""
    opt = _opt("mlp", False, regularizer="none")
    d = opt.num_layers - 1
    idx = opt.partition[0]
    prev, target = torch.relu(opt.us[d - 1][idx]), opt.targets[idx]

    def composite(theta):
        _set(opt, d, theta)
        x = _clip_rows(opt._x_update(d, prev, target), opt.rho_x[d])
        opt._theta_update(d, x, target, 0.0)
        return opt._theta(opt.blocks[d]).numpy().ravel().copy()

    c = layer_constants(opt.privacy_event(steps=1))[d]
    assert c.lipschitz_f * c.lipschitz_t == 1.0
    theta = _theta0(opt, d)
    lip = np.linalg.norm(jacobian(composite, theta + np.random.default_rng(0).normal(size=theta.size)), 2)
    assert lip > 1.05


def test_a_hidden_blocks_step_with_u_recomputed_is_discontinuous():
    """u_d = eq. (6)(theta_d x_d, x_{d+1}) is recomputed from theta_d before the theta_d step and
    jumps where its two branches tie (a = (1 - sqrt 2) x_{d+1} for x_{d+1} > 0, by sqrt(2)/2 x_{d+1}):
    the map Algorithm 2 runs on theta_d is not continuous, let alone L_F-Lipschitz."""
    opt = _opt("mlp", False, regularizer="none")
    d, i = 0, 0
    idx = opt.partition[0]
    x, x_next = opt.xs[d][idx], opt.xs[d + 1][idx]
    j = int(torch.argmax(x_next[i]))
    assert float(x_next[i, j]) > 0
    theta0 = opt._theta(opt.blocks[d]).clone()
    a0 = float(theta0[j] @ x[i])
    direction = torch.zeros_like(theta0)
    direction[j] = x[i] / float(x[i] @ x[i])  # moves a_ij = theta_j . x_i at unit speed
    tie = (1 - math.sqrt(2)) * float(x_next[i, j]) - a0

    def step_at(s):
        theta = theta0 + s * direction
        opt._set_theta(opt.blocks[d], theta)
        u = u_update(opt.blocks[d].module(x), x_next)
        opt._theta_update(d, x, u, 0.0)
        return opt._theta(opt.blocks[d]).clone(), theta

    eps = 1e-9
    (g_lo, t_lo), (g_hi, t_hi) = step_at(tie - eps), step_at(tie + eps)
    ratio = float((g_hi - g_lo).norm() / (t_hi - t_lo).norm())
    assert ratio > 1e4
