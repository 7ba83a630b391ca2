"""DP-SBCD accountant (core, no framework): Thm 4.5 / Lemma A.3 / Cor. 4.4 and its event."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hidden_state_accountants import DpSbcdRunDpEvent, HiddenStateAccountant, ParameterError, TrainingRunDpEvent
from hidden_state_accountants.analyses import sbcd
from hidden_state_accountants.schedules import CYCLIC, PARTITIONS, SHUFFLE_PARTITION

pytestmark = pytest.mark.filterwarnings("ignore::hidden_state_accountants.analyses.sbcd.SbcdAssumptionWarning")

ORDERS = (1.5, 2.0, 4.0, 10.0, 32.0, 100.0)


def _event(**kw):
    base = dict(
        dataset_size=60,
        batch_size=10,
        steps=18,
        num_layers=2,
        step_size=0.3,
        rho=1.2,
        noise=(0.01,),
        regularizer="l2",
        regularization=0.5,
    )
    base.update(kw)
    return sbcd.DpSbcdRunDpEvent(**base)


# ---------------------------------------------------------------- independent reference
def _reference_rdp(ev: sbcd.DpSbcdRunDpEvent, orders, hidden=True, exponent_paper=False):
    """Cor. 4.4 applied step by step, written independently of the module's vectorised code."""
    n, b, T = ev.dataset_size, ev.batch_size, ev.steps
    l = n // b
    o = list(ev.noise_per_step())
    A = np.zeros(l)
    for d in range(ev.num_layers):
        eta, rho, lam = ev.step_size[d], ev.rho[d], ev.regularization[d]
        beta = ev.gamma * rho * rho
        if ev.variant == "proximal_gradient":
            S = ev.gamma * rho
            LF = max(abs(1 - eta * 0.0), abs(1 - eta * beta))
        else:
            R = ev.radius[d]
            S = ev.gamma * rho * rho * R + ev.gamma * rho + eta * ev.gamma**2 * rho**3 / 2
            LF = 1.0
        LT = 1.0 / (1.0 + eta * lam) if ev.regularizer == "l2" else 1.0
        for j0 in range(l):
            a = 0.0
            inv_c = 0.0  # 1/c, point mass at the start
            for t in range(T):
                if t % l == j0:
                    a += eta * S * S / (4 * b * b * o[t])
                elif hidden:
                    if inv_c == 0.0:
                        fac = 0.0
                    else:
                        fac = 1.0 / (1.0 + (1.0 / inv_c) * 2 * eta * o[t] / LF**2)
                        if exponent_paper:
                            fac = fac ** (1.0 / LT**2)
                    a *= fac
                inv_c = LT**2 * (LF**2 * inv_c + 2 * eta * o[t])
            A[j0] += a
    out = []
    for alpha in orders:
        if ev.sampling == "cyclic":
            out.append(alpha * A.max())
            continue
        terms = [math.log(b / n) + (alpha - 1) * alpha * a for a in A]
        if n > l * b:
            terms.append(math.log((n - l * b) / n))
        top = max(terms)
        out.append((top + math.log(sum(math.exp(x - top) for x in terms))) / (alpha - 1))
    return np.array(out)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        dict(regularizer="none"),
        dict(regularizer="l1", regularization=0.1),
        dict(sampling="cyclic"),
        dict(dataset_size=67, steps=23),  # dropped records, partial last epoch
        dict(noise=tuple(0.01 + 0.002 * k for k in range(3))),  # per epoch
        dict(noise=tuple(0.02 - 0.0005 * t for t in range(18))),  # per step
        dict(step_size=(0.3, 0.1), rho=(1.0, 2.0), regularization=(0.5, 2.0), num_layers=2),
        dict(step_size=2.0, rho=1.0),  # L_F = eta beta - 1 > 1
        dict(variant="appendix_c", radius=(3.0, 1.5)),
        dict(gamma=0.5, num_layers=3),
    ],
)
def test_matches_stepwise_cor_4_4(kw):
    ev = _event(**kw)
    np.testing.assert_allclose(sbcd.thm_4_5_rdp(ev, ORDERS), _reference_rdp(ev, ORDERS), rtol=1e-9)
    np.testing.assert_allclose(sbcd.composition_rdp(ev, ORDERS), _reference_rdp(ev, ORDERS, hidden=False), rtol=1e-9)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(4, 40),
    b=st.integers(1, 10),
    steps=st.integers(1, 30),
    eta=st.floats(0.01, 3.0),
    rho=st.floats(0.1, 3.0),
    lam=st.floats(0.0, 5.0),
    o=st.floats(1e-4, 1.0),
    cyclic=st.booleans(),
)
def test_matches_stepwise_random(n, b, steps, eta, rho, lam, o, cyclic):
    b = min(b, n // 2)  # at least two batches (the core's schedule rule)
    ev = sbcd.DpSbcdRunDpEvent(
        dataset_size=n,
        batch_size=b,
        steps=steps,
        num_layers=1,
        step_size=eta,
        rho=rho,
        noise=o,
        regularizer="l2",
        regularization=lam,
        sampling=CYCLIC if cyclic else SHUFFLE_PARTITION,
    )
    ref = _reference_rdp(ev, ORDERS)
    got = sbcd.thm_4_5_rdp(ev, ORDERS)
    np.testing.assert_allclose(got, ref, rtol=1e-8, atol=1e-300)
    assert np.all(got <= sbcd.composition_rdp(ev, ORDERS) * (1 + 1e-12))


# ------------------------------------------------------------------- soundness checks
def _exact_linear_gaussian(T, l, j0, eta, S, b, o, a, s):
    """Exact eps(alpha)/alpha for theta <- s (a theta - eta g + N(0, 2 eta o)), g shifted by S/b at
    the differing record's steps (same direction every time: the worst case for a linear chain)."""
    m, var = 0.0, 0.0
    for t in range(T):
        m = s * (a * m + (eta * S / b if t % l == j0 else 0.0))
        var = s * s * (a * a * var + 2 * eta * o)
    return m * m / (2 * var)


@pytest.mark.parametrize("a,s", [(1.0, 1.0), (0.9, 1.0), (1.0, 0.8), (0.95, 0.7), (1.05, 0.9)])
def test_bound_dominates_exact_linear_gaussian(a, s):
    n, b, T, eta, S, o = 40, 10, 23, 0.2, 1.5, 0.01
    ev = sbcd.DpSbcdRunDpEvent(
        dataset_size=n, batch_size=b, steps=T, num_layers=1, step_size=eta, rho=1.0, noise=o, sampling="cyclic"
    )
    c = sbcd.LayerConstants(eta, S, a, s, 1.0)
    A = np.exp(sbcd.layer_log_position_bounds(ev, c))
    for j0 in range(n // b):
        exact = _exact_linear_gaussian(T, n // b, j0, eta, S, b, o, a, s)
        assert A[j0] >= exact * (1 - 1e-12)


def test_paper_exponent_understates_linear_gaussian():
    """Cor. 4.4 as printed (factor ** (1/L_T^2)) falls below the exact divergence for L_T < 1:
    why the module uses exponent -1 (module docstring, correction 1)."""
    n, b, T, eta, S, o, a, s = 40, 10, 23, 0.2, 1.5, 0.01, 1.0, 0.8
    ev = sbcd.DpSbcdRunDpEvent(
        dataset_size=n, batch_size=b, steps=T, num_layers=1, step_size=eta, rho=1.0, noise=o, sampling="cyclic"
    )
    j0 = 0
    exact = _exact_linear_gaussian(T, n // b, j0, eta, S, b, o, a, s)
    # the paper's printed recursion, step by step
    acc, inv_c = 0.0, 0.0
    for t in range(T):
        if t % (n // b) == j0:
            acc += eta * S * S / (4 * b * b * o)
        else:
            acc *= (1.0 / (1.0 + 2 * eta * o / (inv_c * a * a))) ** (1.0 / s**2)
        inv_c = s * s * (a * a * inv_c + 2 * eta * o)
    assert acc < exact * 0.9  # the printed exponent is unsound
    ours = math.exp(sbcd.layer_log_position_bounds(ev, sbcd.LayerConstants(eta, S, a, s, 1.0))[j0])
    assert ours >= exact


def test_layers_composed_before_the_position_mixture():
    """Summing already-mixed per-layer bounds would be smaller (correction 5)."""
    ev = _event(num_layers=3, noise=(0.002,), steps=30)
    joint = sbcd.thm_4_5_rdp(ev, ORDERS)
    per_layer = 0.0
    for c in sbcd.layer_constants(ev):
        per_layer = per_layer + sbcd.rdp_from_positions(ev, sbcd.layer_log_position_bounds(ev, c), ORDERS)
    assert np.all(joint >= per_layer * (1 - 1e-12))
    assert np.any(joint > per_layer * 1.001)


def test_appendix_c_sensitivity_bounds_the_update_change():
    """Replacing one record moves the Appendix C pre-noise update by <= eta S / b (numerically)."""
    rng = np.random.default_rng(0)
    gamma, rho, R, eta, b, out, k = 1.0, 1.3, 2.0, 0.7, 5, 3, 4
    S = sbcd.appendix_c_sensitivity(gamma, rho, R, eta)
    worst = 0.0

    def clip_rows(v, bound):
        nrm = np.linalg.norm(v, axis=1, keepdims=True)
        return v * np.minimum(1.0, bound / np.maximum(nrm, 1e-30))

    def update(theta, x, u):
        terms = gamma * np.einsum("bo,bk->bok", u, x)
        nrm = np.linalg.norm(terms.reshape(len(x), -1), axis=1)
        terms *= np.minimum(1.0, gamma * rho / 2 / nrm)[:, None, None]
        a = terms.mean(0)
        sigma = gamma / len(x) * x.T @ x
        return (theta + eta * a) @ np.linalg.inv(np.eye(k) + eta * sigma)

    for _ in range(300):
        theta = rng.normal(size=(out, k))
        theta *= R / np.linalg.norm(theta) * rng.uniform(0.5, 1.0)
        x = clip_rows(rng.normal(size=(b, k)) * 3, rho)
        u = rng.normal(size=(b, out)) * rng.uniform(0.1, 10)
        x2, u2 = x.copy(), u.copy()
        x2[0] = clip_rows(rng.normal(size=(1, k)) * 3, rho)[0] * rng.choice([1.0, -1.0])
        u2[0] = rng.normal(size=out) * 20
        diff = np.linalg.norm(update(theta, x, u) - update(theta, x2, u2))
        worst = max(worst, diff / (eta * S / b))
    assert worst <= 1.0
    assert worst > 0.05  # the check can fail


# ----------------------------------------------------------- Section 4.3 (qualitative)
def _curve(schedule, epochs, lam=1.0, order=10.0):
    n, b, eta = 2100, 100, 0.01  # Fig. 2 settings; L2 supplies the contraction (correction 3)
    l = n // b
    out = []
    for k in epochs:
        vals = schedule.values(eta, k * l, l)
        ev = sbcd.DpSbcdRunDpEvent.from_epochs(
            dataset_size=n,
            batch_size=b,
            epochs=k,
            num_layers=1,
            step_size=eta,
            rho=1.0,
            noise=sbcd.compress_noise(vals, l),
            regularizer="l2",
            regularization=lam,
        )
        out.append(sbcd.thm_4_5_rdp(ev, [order])[0])
    return np.array(out)


def test_epoch_contributions_decay():
    """Fig. 2a: the older an epoch, the smaller its contribution to the final bound."""
    ev = sbcd.DpSbcdRunDpEvent.from_epochs(
        dataset_size=2100,
        batch_size=100,
        epochs=30,
        num_layers=1,
        step_size=0.01,
        rho=1.0,
        noise=0.01,
        regularizer="l2",
        regularization=1.0,
    )
    for j0 in (0, 15, 20):
        c = sbcd.epoch_contributions(ev, j0)
        assert np.all(np.diff(c) > 0)
        assert c[0] < 0.5 * c[-1]
        # eq. (29) is exactly the sum of these terms
        assert math.isclose(
            c.sum(), math.exp(sbcd.layer_log_position_bounds(ev, sbcd.layer_constants(ev)[0])[j0]), rel_tol=1e-9
        )


def test_constant_noise_converges():
    eps = _curve(sbcd.constant(5e-4), [5, 10, 20, 30, 60])
    assert np.all(np.diff(eps) >= -1e-15)
    assert eps[-1] - eps[-2] < 1e-3 * eps[-1]  # plateau
    assert eps[1] - eps[0] > 10 * (eps[-1] - eps[-2])


def test_constant_noise_without_contraction_keeps_growing():
    """Without L2 (L_F L_T = 1) the bound grows linearly (correction 3), at about half the
    composition rate."""
    eps = _curve(sbcd.constant(5e-4), [10, 20, 30], lam=0.0)
    steps = np.diff(eps)
    assert steps[1] > 0.9 * steps[0]


def test_decaying_noise_late_makes_the_loss_grow():
    eps_decay = _curve(sbcd.linear_decay(1e-3, 3e-5), [10, 20, 30])
    eps_const = _curve(sbcd.constant(5e-4), [10, 20, 30])
    assert np.all(np.diff(eps_decay) > 0)
    assert (eps_decay[2] - eps_decay[1]) > (eps_decay[1] - eps_decay[0])  # accelerating
    assert (eps_decay[2] - eps_decay[1]) > 10 * (eps_const[2] - eps_const[1])


def test_increasing_noise_lowers_the_loss():
    eps = _curve(sbcd.increase(1e-4, 3e-5), [10, 15, 20, 30])
    assert np.all(np.diff(eps) < 0)


def test_decay_then_constant_converges():
    eps = _curve(sbcd.decay_then_constant(5e-4, 3e-5, 10), [20, 30, 40])
    assert abs(eps[2] - eps[1]) < 0.01 * eps[2]


# ------------------------------------------------------------------ accountant wiring
def test_one_block_accountant_reports_best_of_both():
    ev = _event(steps=60, num_layers=1)
    acc = HiddenStateAccountant(orders=ORDERS).compose(ev)
    report = acc.explain(1e-5)
    names = {a.name: a for a in report.analyses}
    assert sbcd.THM_4_5_NAME in names and sbcd.COMPOSITION_NAME in names
    assert names[sbcd.THM_4_5_NAME].hidden_state and not names[sbcd.COMPOSITION_NAME].hidden_state
    eps = acc.get_epsilon(1e-5)
    assert eps <= names[sbcd.COMPOSITION_NAME].epsilon
    assert eps <= names[sbcd.THM_4_5_NAME].epsilon + 1e-12
    rdp = acc.get_rdp(ORDERS)
    np.testing.assert_allclose(rdp, np.minimum(sbcd.thm_4_5_rdp(ev, ORDERS), sbcd.composition_rdp(ev, ORDERS)))


# The digits setting of docs/dp_sbcd.md (n = 1437, b = 479, 30 epochs, eta = 2, rho = 1, L2 0.03, o = 3e-5).
DIGITS = dict(dataset_size=1437, batch_size=479, epochs=30, step_size=2.0, rho=1.0, noise=(3e-5,))


def _digits(num_layers, **kw):
    return sbcd.DpSbcdRunDpEvent.from_epochs(
        num_layers=num_layers, regularizer="l2", regularization=0.03, **DIGITS, **kw
    )


def _no_sbcd_warning(fn):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = fn()
    assert not [w for w in rec if issubclass(w.category, sbcd.SbcdAssumptionWarning)]
    return out


def test_one_block_keeps_its_thm_4_5_number():
    """A one-block run (a linear model) is the map Thm 4.5 is proved for: the number is unchanged
    (3.7004, computed before issue 27's decision) and no assumption warning is given (before, every
    Thm 4.5 evaluation warned that LSI and per-layer conditioning were assumed)."""
    report = _no_sbcd_warning(lambda: HiddenStateAccountant().compose(_digits(1)).explain(1e-5))
    assert report.analysis == sbcd.THM_4_5_NAME
    assert report.epsilon == pytest.approx(3.700429755664542, rel=1e-9)
    rows = {a.name: a for a in report.analyses}
    assert rows[sbcd.COMPOSITION_NAME].epsilon == pytest.approx(11.303219879545932, rel=1e-9)
    assert "one block" in rows[sbcd.THM_4_5_NAME].detail


@pytest.mark.parametrize("num_layers", [2, 3])
def test_multi_block_run_reports_the_composition_bound_and_why(num_layers):
    """Issue 27: with two or more blocks the step run on a block recomputes x_d, u_d from it and is
    not the map Thm 4.5 is proved for. It reported 5.51 (2 blocks) and 7.00 (3 blocks), Thm 4.5 under
    the paper's per-layer assumption; now the composition bound, with the reason and a warning."""
    ev = _digits(num_layers)
    acc = HiddenStateAccountant(orders=ORDERS).compose(ev)
    with pytest.warns(sbcd.SbcdAssumptionWarning, match=f"paper_assumptions=True is not applied .*{num_layers} blocks"):
        report = acc.explain(1e-5)
    assert report.analysis == sbcd.COMPOSITION_NAME
    thm = {a.name: a for a in report.analyses}[sbcd.THM_4_5_NAME]
    assert thm.epsilon is None
    for words in ("recomputes", "x_d", "u_d", "expansive", "discontinuous", "one block", "docs/dp_sbcd.md"):
        assert words in thm.reason
    assert thm.reason == sbcd.multi_block_reason(num_layers)
    np.testing.assert_allclose(acc.get_rdp(ORDERS), sbcd.composition_rdp(ev, ORDERS))
    assert report.epsilon == pytest.approx(report.composition_epsilon, rel=1e-12)
    expected = {2: 17.444765190540437, 3: 22.68139767052469}[num_layers]
    assert HiddenStateAccountant().compose(ev).get_epsilon(1e-5) == pytest.approx(expected, rel=1e-9)


def test_multi_block_paper_assumptions_off_gives_the_same_number_silently():
    on = HiddenStateAccountant().compose(_digits(2)).explain(1e-5)
    off = _no_sbcd_warning(lambda: HiddenStateAccountant().compose(_digits(2, paper_assumptions=False)).explain(1e-5))
    assert off.epsilon == on.epsilon and off.analysis == sbcd.COMPOSITION_NAME
    thm = {a.name: a for a in off.analyses}[sbcd.THM_4_5_NAME]
    assert thm.reason == sbcd.multi_block_reason(2)


def test_paper_assumptions_off_reports_composition_only():
    ev = _event(steps=60, num_layers=1, paper_assumptions=False)
    acc = HiddenStateAccountant().compose(ev)
    report = acc.explain(1e-5)
    thm = [a for a in report.analyses if a.name == sbcd.THM_4_5_NAME][0]
    assert thm.epsilon is None and "paper_assumptions" in thm.reason
    assert report.analysis == sbcd.COMPOSITION_NAME
    on = HiddenStateAccountant().compose(_event(steps=60, num_layers=1)).get_epsilon(1e-5)
    assert acc.get_epsilon(1e-5) > on


def test_composes_with_other_events():
    from dp_accounting import dp_event

    ev = _event()
    one = HiddenStateAccountant().compose(ev).get_epsilon(1e-5)
    two = HiddenStateAccountant().compose(dp_event.ComposedDpEvent([ev, ev])).get_epsilon(1e-5)
    assert two > one


def test_long_run_in_log_space():
    """A million steps with strong contraction and with expansion stay finite and fast."""
    ev = sbcd.DpSbcdRunDpEvent(
        dataset_size=100_000,
        batch_size=100,
        steps=1_000_000,
        num_layers=2,
        step_size=0.5,
        rho=1.0,
        noise=1e-3,
        regularizer="l2",
        regularization=1.0,
    )
    vals = sbcd.thm_4_5_rdp(ev, ORDERS)
    assert np.all(np.isfinite(vals)) and np.all(vals > 0)
    ev2 = ev.replace(step_size=(3.0,), regularizer="none", steps=20_000)  # L_F = 2
    vals2 = sbcd.thm_4_5_rdp(ev2, ORDERS)
    assert not np.any(np.isnan(vals2))
    assert np.all(vals2 <= sbcd.composition_rdp(ev2, ORDERS) * (1 + 1e-12))


# ----------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kw,param",
    [
        (dict(step_size=0.0), "step_size"),
        (dict(step_size=-1.0), "step_size"),
        (dict(rho=0.0), "rho"),
        (dict(rho=(1.0, -2.0)), "rho"),
        (dict(noise=(0.0,)), "noise"),
        (dict(noise=(-1e-3,)), "noise"),
        (dict(noise=(1e-3, 1e-3)), "noise"),  # neither per-epoch nor per-step
        (dict(regularization=-0.1), "regularization"),
        (dict(regularizer="elastic"), "regularizer"),
        (dict(variant="newton"), "variant"),
        (dict(sampling="poisson"), "sampling"),
        (dict(variant="appendix_c"), "radius"),
        (dict(batch_size=100), "batch_size"),
        (dict(gamma=0.0), "gamma"),
        (dict(step_size=(0.1, 0.2, 0.3)), "step_size"),
        (dict(step_size="fast"), "step_size"),
        (dict(noise=()), "noise"),
        (dict(rho=float("nan")), "rho"),
        (dict(noise=(float("inf"),)), "noise"),
        (dict(steps=0), "steps"),
        (dict(num_layers=0), "num_layers"),
    ],
)
def test_bad_parameters(kw, param):
    with pytest.raises(ParameterError) as err:
        _event(**kw)
    assert err.value.parameter == param


# ------------------------------------------------- one schedule definition (issue 9)
def test_event_refuses_a_schedule_of_one_batch():
    """DpSbcdRunDpEvent accepted cyclic with n = 10, b = 6 (one batch), which TrainingRunDpEvent
    rejects; both now follow the core's check_schedule."""
    with pytest.raises(ParameterError) as err:
        _event(dataset_size=10, batch_size=6, steps=3, sampling=CYCLIC)
    assert err.value.parameter == "batch_size" and "two batches" in str(err.value)


def _accepts(make) -> bool:
    try:
        make()
    except ParameterError as err:
        assert err.parameter == "batch_size"
        return False
    return True


@pytest.mark.parametrize("sampling", PARTITIONS)
def test_event_accepts_exactly_the_schedules_a_training_run_accepts(sampling):
    for n in range(1, 14):
        for b in range(1, 15):
            sbcd_ok = _accepts(lambda: _event(dataset_size=n, batch_size=b, steps=2, sampling=sampling))
            run_ok = _accepts(
                lambda: TrainingRunDpEvent(
                    dataset_size=n,
                    batch_size=b,
                    steps=2,
                    noise_multiplier=1.0,
                    clip_norm=1.0,
                    learning_rate=0.1,
                    sampling=sampling,
                )
            )
            assert sbcd_ok == run_ok, (n, b, sampling)
            if sbcd_ok:
                assert _event(dataset_size=n, batch_size=b, steps=2, sampling=sampling).steps_per_epoch == n // b


def test_event_defaults_and_top_level_export():
    assert sbcd.SBCD_SAMPLINGS == (SHUFFLE_PARTITION, CYCLIC) and set(sbcd.SBCD_SAMPLINGS) == set(PARTITIONS)
    ev = DpSbcdRunDpEvent(dataset_size=60, batch_size=10, steps=6, num_layers=1, step_size=0.1, rho=1.0, noise=0.01)
    assert ev.sampling == SHUFFLE_PARTITION and DpSbcdRunDpEvent is sbcd.DpSbcdRunDpEvent
    assert math.isfinite(HiddenStateAccountant().compose(ev).get_epsilon(1e-5))  # registered by the accountant


def test_schedules():
    eta, l = 0.1, 3
    assert sbcd.constant(0.5).values(eta, 4, l) == (0.5,) * 4
    assert sbcd.linear_decay(1.0, 0.25).values(eta, 6, l) == (1.0, 1.0, 1.0, 0.75, 0.75, 0.75)
    assert sbcd.increase(1.0, 0.5).values(eta, 4, l)[-1] == 1.5
    vals = sbcd.decay_then_constant(1.0, 0.1, 2).values(eta, 5 * l, l)
    assert vals[-1] == pytest.approx(0.8) and vals[2 * l] == pytest.approx(0.8)
    fn = sbcd.as_schedule(lambda e, k, j: e * (1 + j))
    assert fn.values(eta, 3, l) == pytest.approx((0.1, 0.2, 0.3))
    assert sbcd.compress_noise([0.1] * 6, 3) == (0.1,)
    assert sbcd.compress_noise([0.1] * 3 + [0.2] * 3, 3) == (0.1, 0.2)
    assert len(sbcd.compress_noise([0.1, 0.2, 0.3], 3)) == 3
    with pytest.raises(ParameterError) as err:
        sbcd.linear_decay(0.001, 0.0003).values(eta, 5 * l, l)  # paper's decay crosses 0 at k = 4
    assert err.value.parameter == "noise" and "k=4" in str(err.value)
    with pytest.raises(ParameterError):
        sbcd.constant(0.0)
    with pytest.raises(ParameterError):
        sbcd.as_schedule("loud")
    with pytest.raises(ParameterError):
        sbcd.as_schedule(lambda e, k, j: float("nan")).values(eta, 2, l)


def test_event_noise_representations_agree():
    l = 6
    per_step = tuple([0.01] * l + [0.02] * l + [0.03] * l)
    a = _event(noise=per_step)
    b = _event(noise=(0.01, 0.02, 0.03))
    np.testing.assert_array_equal(a.noise_per_step(), b.noise_per_step())
    np.testing.assert_allclose(sbcd.thm_4_5_rdp(a, ORDERS), sbcd.thm_4_5_rdp(b, ORDERS))


def test_the_network_refusal_does_not_promise_dp_sbcd_a_hidden_state_number():
    """The refusal of a network for DP-SGD sent users to "use DP-SBCD for ReLU networks", which for
    two or more blocks now gets a composition bound, not a hidden-state one (issue 27)."""
    from hidden_state_accountants.recording import LayerFacts, ModelFacts, model_refusal

    layers = [("fc1", "affine", True), ("relu", "other", False), ("fc2", "affine", True)]
    mlp = ModelFacts(
        layers=[LayerFacts(name=n, kind=k, trainable=t) for n, k, t in layers], complete=True, description="the MLP"
    )
    reason = model_refusal(mlp)
    assert "use DP-SBCD" not in reason
    assert "DP-SBCD trains ReLU networks with a composition bound too, not a hidden-state one" in reason
