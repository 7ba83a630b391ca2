"""DP-SBCD for PyTorch: the closed-form updates solve their sub-problems, clipping holds,
bad inputs fail clearly, training works, the schedule and seeds follow the core's rule, it
works without Opacus, and the optimizer's epsilon is the core's."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.torch,
    pytest.mark.usefixtures("torch_one_thread"),
    pytest.mark.filterwarnings("ignore::hidden_state_accountants.analyses.sbcd.SbcdAssumptionWarning"),
]

from scipy import optimize  # noqa: E402
from torch import nn  # noqa: E402

from hidden_state_accountants import BatchSchedule, HiddenStateAccountant, ParameterError  # noqa: E402
from hidden_state_accountants.analyses import sbcd as core  # noqa: E402
from hidden_state_accountants.pytorch.sbcd import DPSBCD, UnsupportedLayerError, u_update  # noqa: E402
from hidden_state_accountants.sbcd_training import CALLER_SEED_NOTE  # noqa: E402
from hidden_state_accountants.schedules import CYCLIC, POISSON, SHUFFLE_PARTITION  # noqa: E402


def _mlp(sizes=(6, 5, 4, 3), dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    mods = []
    for i in range(len(sizes) - 1):
        mods.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods).to(dtype)


def _cnn(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(2, 2, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(2 * 3 * 3, 3),
    ).to(dtype)


def _opt(model=None, n=24, shape=(6,), b=6, **kw):
    model = _mlp() if model is None else model
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(1)
    x = torch.randn((n,) + shape, generator=g, dtype=dtype)
    y = torch.randint(0, 3, (n,), generator=g)
    conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
    # eta <= 2 / (gamma rho_eff^2): a convolution's im2col input has a larger norm bound
    args = dict(batch_size=b, step_size=[0.01, 0.02, 0.2] if conv else 0.2, noise=1e-30, rho=1.5, seed=0)
    args.update(kw)
    return DPSBCD(model, x, y, **args)


def _minimize(f, x0):
    """A numerical minimiser (BFGS with autograd gradients) for the checks below."""
    shape = x0.shape

    def fun(z):
        t = torch.tensor(z, dtype=torch.float64, requires_grad=True)
        val = f(t.reshape(shape))
        (grad,) = torch.autograd.grad(val, t)
        return float(val.detach()), grad.numpy()

    res = optimize.minimize(
        fun, x0.detach().reshape(-1).numpy(), jac=True, method="BFGS", options=dict(gtol=1e-12, maxiter=10_000)
    )
    return torch.tensor(res.x).reshape(shape)


# ------------------------------------------------------------- the closed-form updates
@pytest.mark.parametrize("d", [1, 2])
def test_x_update_solves_eq4_dense(d):
    opt = _opt()
    blk = opt.blocks[d]
    g = torch.Generator().manual_seed(3)
    prev = torch.rand((4,) + blk.in_shape, generator=g, dtype=torch.float64)
    target = torch.randn((4,) + blk.out_shape, generator=g, dtype=torch.float64)
    got = opt._x_update(d, prev, target)
    m = blk.module

    def f(x):
        return ((x - prev) ** 2).sum() + ((target - m(x)) ** 2).sum()

    ref = _minimize(lambda x: f(x), torch.zeros_like(prev))
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)


def test_x_update_solves_eq4_conv_toeplitz():
    opt = _opt(_cnn(), n=12, shape=(1, 6, 6), b=4)
    d = 1
    blk = opt.blocks[d]
    assert blk.kind == "conv"
    g = torch.Generator().manual_seed(4)
    prev = torch.rand((2,) + blk.in_shape, generator=g, dtype=torch.float64)
    target = torch.randn((2,) + blk.out_shape, generator=g, dtype=torch.float64)
    got = opt._x_update(d, prev, target)
    m = blk.module
    ref = _minimize(lambda x: ((x - prev) ** 2).sum() + ((target - m(x)) ** 2).sum(), torch.zeros_like(prev))
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)


def test_u_update_solves_eq6():
    g = torch.Generator().manual_seed(5)
    a = torch.randn(400, generator=g, dtype=torch.float64) * 2
    xn = torch.randn(400, generator=g, dtype=torch.float64) * 2
    got = u_update(a, xn)
    grid = torch.linspace(-8, 8, 160001, dtype=torch.float64)
    cost = (xn[:, None] - torch.relu(grid)[None]) ** 2 + (grid[None] - a[:, None]) ** 2
    best = cost.min(dim=1).values
    mine = (xn - torch.relu(got)) ** 2 + (got - a) ** 2
    assert torch.all(mine <= best + 1e-9)


def _small_residual_targets(opt, d, x, scale=1e-3):
    """Targets close to the layer's output, so the per-example clipping is inactive."""
    blk = opt.blocks[d]
    with torch.no_grad():
        out = blk.module(x)
    g = torch.Generator().manual_seed(7)
    return out + scale * torch.randn(out.shape, generator=g, dtype=out.dtype)


@pytest.mark.parametrize("model_fn,shape", [(_mlp, (6,)), (_cnn, (1, 6, 6))])
@pytest.mark.parametrize("reg,lam", [("none", 0.0), ("l2", 0.7)])
def test_theta_step_solves_eq7(model_fn, shape, reg, lam):
    """Without noise, eq. (8) is eq. (7): argmin <grad F, t - theta> + ||t - theta||^2/(2 eta) + r(t)."""
    opt = _opt(model_fn(), n=12, shape=shape, b=4, regularizer=reg, regularization=lam)
    d = 0
    blk = opt.blocks[d]
    x = opt.xs[0][:4]
    target = _small_residual_targets(opt, d, x)
    theta0 = opt._theta(blk).clone()
    p = opt._patches(blk, x)
    u = opt._as_rows(blk, target)

    def f(theta):
        r = torch.einsum("blk,ok->blo", p, theta) - u
        return opt.gamma / 2 * (r**2).sum() / 4

    t = theta0.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(f(t), t)
    eta = opt.step_sizes[d]

    def lin(th):
        reg_term = lam / 2 * (th**2).sum() if reg == "l2" else 0.0
        return (grad * (th - theta0)).sum() + ((th - theta0) ** 2).sum() / (2 * eta) + reg_term

    ref = _minimize(lin, theta0)
    opt._theta_update(d, x, target, 1e-30)
    torch.testing.assert_close(opt._theta(blk), ref, atol=1e-7, rtol=1e-7)


def test_l1_prox_is_soft_thresholding():
    opt = _opt(regularizer="l1", regularization=0.3)
    d = 0
    g = torch.Generator().manual_seed(9)
    theta = torch.randn(5, 7, generator=g, dtype=torch.float64)
    got = opt._prox(theta, d)
    eta_lam = opt.step_sizes[d] * 0.3
    grid = torch.linspace(-4, 4, 80001, dtype=torch.float64)
    cost = eta_lam * grid.abs()[None] + (grid[None] - theta.reshape(-1, 1)) ** 2 / 2
    best = grid[cost.argmin(dim=1)].reshape(theta.shape)
    torch.testing.assert_close(got, best, atol=2e-4, rtol=0)


@pytest.mark.parametrize("model_fn,shape", [(_mlp, (6,)), (_cnn, (1, 6, 6))])
def test_appendix_c_step_solves_the_sub_problem(model_fn, shape):
    """Without noise, the Appendix C update is eq. (34): argmin F(t) + ||t - theta||^2 / (2 eta)."""
    opt = _opt(model_fn(), n=12, shape=shape, b=4, variant="appendix_c", radius=1e6, step_size=3.0)
    assert opt.step_sizes[0] == 3.0
    d = 0
    blk = opt.blocks[d]
    x = opt.xs[0][:4]
    g = torch.Generator().manual_seed(8)
    target = 1e-3 * torch.randn((4,) + blk.out_shape, generator=g, dtype=torch.float64)  # unclipped data term
    theta0 = opt._theta(blk).clone()
    p = opt._patches(blk, x)
    u = opt._as_rows(blk, target)

    def f(theta):
        r = torch.einsum("blk,ok->blo", p, theta) - u
        return opt.gamma / 2 * (r**2).sum() / 4 + ((theta - theta0) ** 2).sum() / (2 * 3.0)

    ref = _minimize(f, theta0)
    opt._theta_update(d, x, target, 1e-30)
    torch.testing.assert_close(opt._theta(blk), ref, atol=1e-7, rtol=1e-7)


# ------------------------------------------------------------------------- clipping
@pytest.mark.parametrize("model_fn,shape", [(_mlp, (6,)), (_cnn, (1, 6, 6))])
@pytest.mark.parametrize("variant", ["proximal_gradient", "appendix_c"])
def test_per_example_contributions_are_clipped(model_fn, shape, variant):
    opt = _opt(model_fn(), n=12, shape=shape, b=4, variant=variant, radius=5.0)
    for d, blk in enumerate(opt.blocks):
        x = opt.xs[d][:8]
        g = torch.Generator().manual_seed(d)
        target = 100 * torch.randn((8,) + blk.out_shape, generator=g, dtype=torch.float64)
        c = opt.per_example_contributions(d, x, target)
        norms = c.flatten(1).norm(dim=1)
        bound = opt.gamma * opt.rho_eff[d] / 2
        assert torch.all(norms <= bound)
        # the clipping was needed: the unclipped contributions exceed the bound
        p, u = opt._patches(blk, x), opt._as_rows(blk, target)
        r = torch.einsum("blk,ok->blo", p, opt._theta(blk)) - u if variant == "proximal_gradient" else u
        raw = (opt.gamma * torch.einsum("blo,blk->bok", r, p)).flatten(1).norm(dim=1)
        assert torch.all(raw > bound)
        if blk.kind == "linear":  # rank one: the clipped norm is exactly the bound
            torch.testing.assert_close(norms, torch.full_like(norms, bound), rtol=1e-12, atol=0)


def test_replace_one_moves_the_mean_by_at_most_s_over_b():
    opt = _opt(b=6, rho=0.7)
    d = 0
    blk = opt.blocks[d]
    g = torch.Generator().manual_seed(11)
    worst = 0.0
    for _ in range(50):
        x = opt.xs[0][:6].clone()
        target = 10 * torch.randn((6,) + blk.out_shape, generator=g, dtype=torch.float64)
        x2, t2 = x.clone(), target.clone()
        x2[0] = torch.randn(blk.in_shape, generator=g, dtype=torch.float64)
        x2[0] *= 0.7 / x2[0].norm()
        t2[0] = -30 * torch.randn(blk.out_shape, generator=g, dtype=torch.float64)
        m1 = opt.per_example_contributions(d, x, target).mean(0)
        m2 = opt.per_example_contributions(d, x2, t2).mean(0)
        worst = max(worst, float((m1 - m2).norm()) / (opt.gamma * opt.rho_eff[d] / 6))
    assert worst <= 1.0 and worst > 0.3


def test_auxiliary_inputs_stay_clipped():
    opt = _opt(rho=[0.5, 0.8, 1.1], noise=1e-3)
    opt.fit(3, progress=False)
    for d, x in enumerate(opt.xs):
        assert float(x.flatten(1).norm(dim=1).max()) <= opt.rho_x[d] * (1 + 1e-12)
    assert opt.rho_eff == pytest.approx([math.sqrt(r * r + 1) for r in (0.5, 0.8, 1.1)])


def test_conv_effective_rho_bounds_the_patch_matrix():
    opt = _opt(_cnn(), n=12, shape=(1, 6, 6), b=4, rho=2.0)
    for d, blk in enumerate(opt.blocks):
        p = opt._patches(blk, opt.xs[d])
        assert float(p.flatten(1).norm(dim=1).max()) <= opt.rho_eff[d] * (1 + 1e-12)


def test_appendix_c_projects_onto_the_ball():
    opt = _opt(variant="appendix_c", radius=0.3, noise=1e-2)
    opt.fit(2, progress=False)
    for blk in opt.blocks:
        assert float(opt._theta(blk).norm()) <= 0.3 * (1 + 1e-9)


# ------------------------------------------------------------------- bad parameters
@pytest.mark.parametrize(
    "kw,param",
    [
        (dict(step_size=0.0), "step_size"),
        (dict(step_size=-0.1), "step_size"),
        (dict(rho=0.0), "rho"),
        (dict(rho=-1.0), "rho"),
        (dict(noise=0.0), "noise"),
        (dict(noise=-1e-3), "noise"),
        (dict(batch_size=1000), "batch_size"),
        (dict(regularizer="dropout"), "regularizer"),
        (dict(sampling=POISSON), "sampling"),
        (dict(variant="appendix_c"), "radius"),
        (dict(step_size=[0.1, 0.2]), "step_size"),
        (dict(regularization=-1.0), "regularization"),
        (dict(seed=-1), "seed"),
        (dict(seed=1.5), "seed"),
    ],
)
def test_bad_hyperparameters(kw, param):
    with pytest.raises(ParameterError) as err:
        _opt(**kw)
    assert err.value.parameter == param


def test_noise_schedule_reaching_zero_fails_at_that_step():
    opt = _opt(noise=core.linear_decay(2e-3, 1e-3))  # 0 at epoch 2
    opt.fit(2, progress=False)
    with pytest.raises(ParameterError) as err:
        opt.step()
    assert err.value.parameter == "noise" and "k=2" in str(err.value)


@pytest.mark.parametrize(
    "model,msg",
    [
        (nn.Sequential(nn.Linear(6, 4), nn.Sigmoid(), nn.Linear(4, 3)), "Sigmoid"),
        (nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3)), "followed by ReLU"),
        (nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3), nn.ReLU()), "end with a layer"),
        (nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Dropout(0.1), nn.Linear(4, 3)), "Dropout"),
        (nn.Sequential(nn.ReLU(), nn.Linear(6, 3)), "ReLU must follow"),
        (nn.Linear(6, 3), "nn.Sequential"),
        (nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(5, 3)), "expects 5 inputs"),
    ],
)
def test_unsupported_models(model, msg):
    x, y = torch.randn(12, 6), torch.randint(0, 3, (12,))
    with pytest.raises(UnsupportedLayerError, match=msg) as err:
        DPSBCD(model.double(), x.double(), y, batch_size=4, step_size=0.1, noise=1e-3)
    assert err.value.parameter == "model"


def test_unsupported_conv_models():
    x, y = torch.randn(12, 1, 6, 6), torch.randint(0, 3, (12,))
    bad = [
        (nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8, 3)), "MaxPool2d"),
        (
            nn.Sequential(
                nn.Conv2d(1, 2, 3, groups=1, padding_mode="reflect"), nn.ReLU(), nn.Flatten(), nn.Linear(32, 3)
            ),
            "padding_mode",
        ),
        (nn.Sequential(nn.Flatten(), nn.Linear(36, 36), nn.ReLU(), nn.Conv2d(1, 2, 3)), "Conv2d needs"),
        (nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Conv2d(2, 3, 4)), "output layer must be Linear"),
    ]
    for model, msg in bad:
        with pytest.raises(UnsupportedLayerError, match=msg):
            DPSBCD(model, x, y, batch_size=4, step_size=0.1, noise=1e-3)


def test_closure_and_lr_changes_are_refused():
    opt = _opt()
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    opt.param_groups[0]["lr"] = 1.0
    with pytest.raises(ValueError, match="lr"):
        opt.step()


@pytest.mark.parametrize("targets", [torch.full((12,), 7), torch.zeros(11, dtype=torch.long), torch.zeros(12, 5)])
def test_bad_targets(targets):
    x = torch.randn(12, 6, dtype=torch.float64)
    with pytest.raises(ParameterError) as err:
        DPSBCD(_mlp(), x, targets, batch_size=4, step_size=0.1, noise=1e-3)
    assert err.value.parameter == "targets"


# ---------------------------------------------------------------- training & privacy
def _digits(n=600):
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    return torch.tensor(X[:n] / 16.0, dtype=torch.float32), torch.tensor(y[:n])


def test_trains_an_mlp_on_digits():
    X, y = _digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = DPSBCD(
        model, X, y, batch_size=150, step_size=0.9, noise=1e-7, rho=1.0, regularizer="l2", regularization=1e-3, seed=0
    )
    before = opt.objective()
    acc0 = float((opt.predict(X).argmax(1) == y).float().mean())
    opt.fit(25, progress=False)
    acc = float((opt.predict(X).argmax(1) == y).float().mean())
    assert opt.objective() < 0.7 * before
    assert acc > 0.6 and acc > acc0 + 0.3


def test_trains_a_cnn_through_im2col():
    X, y = _digits(300)
    X = X.reshape(-1, 1, 8, 8)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64, 10),
    )
    opt = DPSBCD(model, X, y, batch_size=100, step_size=[0.027, 0.07, 0.9], noise=1e-8, rho=1.0, seed=0)
    before = opt.objective()
    opt.fit(10, progress=False)
    assert opt.objective() < 0.9 * before
    assert opt.rho_eff[0] == pytest.approx(math.sqrt(9 + 64))


def test_epsilon_is_the_core_accountants(check_sbcd_report):
    opt = _opt(noise=core.linear_decay(5e-3, 1e-3), regularizer="l2", regularization=0.5)
    planned = opt.get_epsilon(1e-5, steps=12)
    opt.fit(3, progress=False)
    ev = opt.privacy_event()
    assert ev.steps == 12 and ev.num_layers == 3 and ev.rho == tuple(opt.rho_eff)
    assert ev.noise == (5e-3, 4e-3, 3e-3)
    direct = HiddenStateAccountant().compose(ev).get_epsilon(1e-5)
    assert opt.get_epsilon(1e-5) == pytest.approx(direct) == pytest.approx(planned)
    check_sbcd_report(opt)  # three blocks: the composition bound, Thm 4.5 does not apply (issue 27)


def test_a_multi_block_trainer_warns_that_thm_4_5_is_not_applied():
    opt = _opt(noise=1e-3, regularizer="l2", regularization=0.5)
    with pytest.warns(core.SbcdAssumptionWarning, match="not applied to this 3-block network"):
        opt.get_epsilon(1e-5, steps=12)


def test_a_one_block_model_gets_thm_4_5(check_sbcd_report):
    """A linear model (one block) is the case Thm 4.5 is proved for: the trainer reports it."""
    opt = _opt(_mlp(sizes=(6, 3)), noise=1e-3, regularizer="l2", regularization=0.5)
    opt.fit(3, progress=False)
    assert opt.privacy_event().num_layers == 1
    check_sbcd_report(opt)


def test_partition_is_fixed_and_left_out_records_untouched():
    opt = _opt(n=27, b=6, noise=1e-3)  # 4 batches, 3 records left out
    part = opt.partition.clone()
    used = set(part.reshape(-1).tolist())
    assert len(used) == 24
    left_out = sorted(set(range(27)) - used)
    before = [u[left_out].clone() for u in opt.us]
    opt.fit(2, progress=False)
    assert torch.equal(opt.partition, part)
    for u, b0 in zip(opt.us, before):
        assert torch.equal(u[left_out], b0)


def test_seed_makes_runs_reproducible():
    a = _opt(noise=1e-2, model=_mlp(seed=3))
    b = _opt(noise=1e-2, model=_mlp(seed=3))
    a.fit(2, progress=False)
    b.fit(2, progress=False)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)


# --------------------------------------------------------- schedule and seeds (issue 9)
@pytest.mark.parametrize("sampling,seed", [(SHUFFLE_PARTITION, 5), (CYCLIC, 5), (CYCLIC, None)])
def test_partition_comes_from_the_cores_batch_schedule(sampling, seed):
    opt = _opt(n=27, b=6, sampling=sampling, seed=seed)
    expected = BatchSchedule(27, 6, sampling, seed if sampling == SHUFFLE_PARTITION else None)
    np.testing.assert_array_equal(opt.partition.numpy(), expected.partition())
    assert opt.batch_schedule == expected
    assert opt.partition.shape == (4, 6) and opt.steps_per_epoch == 4


def test_schedule_is_checked_by_the_cores_rule():
    """n = 10, b = 6 is one batch: TrainingRunDpEvent refuses it, and so does DP-SBCD now."""
    for sampling in (CYCLIC, SHUFFLE_PARTITION):
        with pytest.raises(ParameterError) as err:
            _opt(n=10, b=6, sampling=sampling)
        assert err.value.parameter == "batch_size" and "two batches" in str(err.value)


def test_default_seed_is_secret_not_torchs_global_generator():
    """seed=None used to take torch's global generator: the same partition and noise after
    torch.manual_seed(0). Now both come from secret draws, and the global generator is untouched."""
    runs = []
    for sampling in (SHUFFLE_PARTITION, SHUFFLE_PARTITION, CYCLIC, CYCLIC):
        model = _mlp(seed=0)  # calls torch.manual_seed(0): the same global state every time
        x, y = torch.randn(24, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1)), torch.arange(24) % 3
        state = torch.get_rng_state()
        opt = DPSBCD(model, x, y, batch_size=6, step_size=0.2, noise=1e-2, sampling=sampling)
        assert torch.equal(torch.get_rng_state(), state)  # nothing drawn from torch's global generator
        assert opt.seed_is_secret and opt.batch_schedule.seed_is_secret == (sampling == SHUFFLE_PARTITION)
        opt.step()
        runs.append(opt)
    shuffled_a, shuffled_b, cyclic_a, cyclic_b = runs
    assert not torch.equal(shuffled_a.partition, shuffled_b.partition)
    # the same fixed partition and the same start: only the noise can differ
    assert torch.equal(cyclic_a.partition, cyclic_b.partition)
    assert not torch.equal(cyclic_a._theta(cyclic_a.blocks[0]), cyclic_b._theta(cyclic_b.blocks[0]))
    assert CALLER_SEED_NOTE not in cyclic_a.explain(1e-5).notes


def test_given_seed_is_the_callers_choice_and_noted():
    opt = _opt(seed=3, noise=1e-3)
    assert not opt.seed_is_secret and opt.batch_schedule.seed == 3
    assert opt.noise_seed != 3  # an independent stream of the caller's seed
    opt.step()
    assert CALLER_SEED_NOTE in opt.explain(1e-5).notes


def test_works_without_opacus():
    """The PyTorch trainer lives in hidden_state_accountants.pytorch: importing and training
    with `import opacus` blocked (as if Opacus were not installed)."""
    import subprocess
    import sys

    code = (
        "import sys, warnings\n"
        "sys.modules['opacus'] = None  # any `import opacus` now raises ImportError\n"
        "warnings.simplefilter('ignore')\n"
        "import torch\n"
        "from hidden_state_accountants.pytorch import DPSBCD\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))\n"
        "opt = DPSBCD(model, torch.randn(20, 5), torch.arange(20) % 3, batch_size=5, step_size=0.3,\n"
        "             noise=1e-3, regularizer='l2', regularization=0.1)\n"
        "before = [p.clone() for p in model.parameters()]\n"
        "opt.fit(2, progress=False)\n"
        "assert opt.steps_done == 8\n"
        "assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))\n"
        "assert sys.modules['opacus'] is None\n"
        "print(opt.get_epsilon(1e-5))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert 0 < float(out.stdout.strip().splitlines()[-1]) < math.inf


def test_noise_has_the_stated_variance():
    """Same data and start, two noise seeds: after one step the weights differ only by the noise,
    so their difference has variance 2 * (2 eta o) per coordinate (eq. 8)."""
    diffs = []
    for seed in range(2):
        opt = _opt(model=_mlp(sizes=(6, 40, 40, 3), seed=0), noise=0.5, seed=seed, step_size=0.1)
        opt.step()
        diffs.append(opt._theta(opt.blocks[1]))
    var = float(((diffs[0] - diffs[1]) ** 2).mean())
    assert var == pytest.approx(2 * 2 * 0.1 * 0.5, rel=0.15)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_runs_on_cuda():
    X, y = _digits(300)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).cuda()
    opt = DPSBCD(model, X.cuda(), y.cuda(), batch_size=100, step_size=0.5, noise=1e-3, seed=0)
    before = opt.objective()
    opt.fit(5, progress=False)
    assert opt.xs[0].is_cuda and opt.objective() < before
    assert math.isfinite(opt.get_epsilon(1e-5))


def test_discard_auxiliary_state():
    opt = _opt(noise=1e-3)
    opt.fit(1, progress=False)
    eps = opt.get_epsilon(1e-5)
    model = opt.discard_auxiliary()
    assert model is opt.model and opt.xs is None and opt.us is None
    with pytest.raises(RuntimeError, match="discarded"):
        opt.step()
    assert opt.get_epsilon(1e-5) == eps  # the accounting does not need them


def test_huge_hidden_convolution_is_refused():
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,))
    model = nn.Sequential(
        nn.Conv2d(1, 300, 3, padding=1), nn.ReLU(), nn.Conv2d(300, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(72, 3)
    )
    with pytest.raises(UnsupportedLayerError, match="dense system"):
        DPSBCD(model, x, y, batch_size=4, step_size=0.01, noise=1e-3)


@pytest.mark.slow
def test_example_runs(sbcd_example_row):
    cells = sbcd_example_row("sbcd_digits_torch.py", timeout=600)
    assert float(cells[1].split()[0]) > 60  # DP-SBCD test accuracy (%)
    eps, analysis = cells[2].split()  # two blocks: the composition bound, not Thm 4.5 (issue 27)
    assert analysis == f"({core.COMPOSITION_NAME})" and float(eps) == pytest.approx(17.44, abs=0.006)
