"""Which models a declared geometry holds for: the clipped per-example map the frameworks really run
(docs/derivations.md section 18).

Every hidden-state analysis uses that one step ``theta -> theta - lr (m_reg theta + k/b clip_C(grad l(theta)))``
is ``c = max(|1 - lr m|, |1 - lr M|)``-Lipschitz, which holds when ``clip_C o grad l`` is the gradient of a
convex ``M_loss``-smooth function. The tests take finite differences (float64, central) of the clipped
per-example gradient and of the step at points where the clip binds: a symmetric positive semi-definite
Jacobian below the declared smoothness where the claim is proved (two classes, squared loss, a clip that
cannot bind), and the published counterexample where it is not (five classes, a binding clip).
"""

from __future__ import annotations

import math
import warnings

import attr
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hidden_state_accountants import HiddenStateAccountant, LossGeometry, ParameterError, TrainingRunDpEvent
from hidden_state_accountants.events import cross_entropy_smoothness, nonbinding_clip_norm
from hidden_state_accountants.recording import (
    Claim,
    CompositionFallbackWarning,
    LayerFacts,
    ModelFacts,
    StepFacts,
)
from hidden_state_accountants.schedules import BatchSchedule

# ----------------------------------------------------------------------------- the maps


def softmax_ce_grad(theta: np.ndarray, x: np.ndarray, y: int, k: int) -> np.ndarray:
    """Per-example gradient of softmax cross-entropy of an affine map with a bias, ``theta`` the
    ``k x (d + 1)`` matrix row-major (class ``j``: weights, then its bias)."""
    xt = np.append(x, 1.0)
    z = theta.reshape(k, -1) @ xt
    p = np.exp(z - z.max())
    p /= p.sum()
    p[y] -= 1.0
    return np.outer(p, xt).ravel()


def sigmoid_ce_grad(theta: np.ndarray, x: np.ndarray, y: int) -> np.ndarray:
    """One logit with a sigmoid (binary): ``theta`` the weights, then the bias."""
    xt = np.append(x, 1.0)
    u = theta @ xt
    return (1.0 / (1.0 + math.exp(-u)) - y) * xt


def squared_loss_grad(theta: np.ndarray, x: np.ndarray, target: np.ndarray) -> np.ndarray:
    """``|W (x, 1) - target|^2 / 2`` with several outputs."""
    xt = np.append(x, 1.0)
    return np.outer(theta.reshape(len(target), -1) @ xt - target, xt).ravel()


def clip(g: np.ndarray, c: float, margin: float = 0.0) -> np.ndarray:
    """``g min(1, c / (|g| + margin))``: TF-Privacy's clip (``margin = 0``) and Opacus' (``1e-6``)."""
    return g * min(1.0, c / (np.linalg.norm(g) + margin))


def jacobian(f, theta: np.ndarray, h: float = 1e-6) -> np.ndarray:
    d = theta.size
    out = np.empty((d, d))
    for i in range(d):
        e = np.zeros(d)
        e[i] = h
        out[:, i] = (f(theta + e) - f(theta - e)) / (2 * h)
    return out


def step_lipschitz(jac: np.ndarray, lr: float, m_reg: float, scale: float) -> float:
    """Operator norm of the Jacobian of ``theta -> theta - lr (m_reg theta + scale g(theta))`` (``scale``:
    the record's share ``k/b`` of the batch mean)."""
    d = len(jac)
    return float(np.linalg.norm(np.eye(d) - lr * (m_reg * np.eye(d) + scale * jac), 2))


def symmetric_eigenvalues(jac: np.ndarray) -> np.ndarray:
    return np.linalg.eigvalsh((jac + jac.T) / 2)


# ------------------------------------------------------------------ the counterexample

COUNTEREXAMPLE = np.array([6.0757, -9.3391, 0.2565, -1.491, -0.8791, -0.3554, -0.6554, -0.5791, -1.1588, 2.0476])
"""5 classes, one feature plus a bias, x = 1, label 0: class j has weight theta[2j], bias theta[2j + 1]."""


def test_five_classes_with_a_binding_clip_make_the_step_expansive():
    """The issue's counterexample: clip 1 binds, the clipped field is not monotone, and the step is
    expansive where every analysis assumed it contracts by c = 1 - lr m = 0.995."""
    x, lr, m_reg = np.array([1.0]), 0.5, 0.01
    assert np.linalg.norm(softmax_ce_grad(COUNTEREXAMPLE, x, 0, 5)) > 1.0  # the clip binds
    jac = jacobian(lambda t: clip(softmax_ce_grad(t, x, 0, 5), 1.0), COUNTEREXAMPLE)
    assert symmetric_eigenvalues(jac).min() == pytest.approx(-0.0139, abs=2e-4)
    geometry = LossGeometry.logistic_regression(1.0, m_reg, num_classes=5)
    c = geometry.contraction_factor(lr)
    assert c == pytest.approx(0.995)
    for share, expected in ((1.0, 1.0024), (2.0, 1.0109), (3.98, 1.0316)):
        lipschitz = step_lipschitz(jac, lr, m_reg, share)
        assert lipschitz == pytest.approx(expected, abs=2e-4) and lipschitz > 1.0 > c
    # and the accountant refuses the claim there, naming the classes, the clip and the clip that would do
    reason = geometry.clipped_map_refusal(1.0)
    assert "5 classes" in reason and "clip norm 1," in reason and "clip norm >= 2" in reason


def test_the_same_point_is_contractive_when_the_clip_cannot_bind():
    """Clip 2 >= sqrt(2 (R^2 + 1)) at R = 1: the clipped map is the gradient, its Jacobian the Hessian."""
    x, lr, m_reg = np.array([1.0]), 0.5, 0.01
    jac = jacobian(lambda t: clip(softmax_ce_grad(t, x, 0, 5), nonbinding_clip_norm(1.0)), COUNTEREXAMPLE)
    assert np.allclose(jac, jac.T, atol=1e-7)
    assert symmetric_eigenvalues(jac).min() > -1e-8
    assert step_lipschitz(jac, lr, m_reg, 3.98) <= 0.995 + 1e-8


# ------------------------------------------------------------- where the claim is proved

point = st.floats(-6.0, 6.0, allow_nan=False)


def _unit(v: np.ndarray, radius: float) -> np.ndarray:
    n = np.linalg.norm(v)
    return v * (radius / n) if n > 0 else np.full_like(v, radius / math.sqrt(len(v)))


def _check_gradient_of_convex(jac: np.ndarray, smoothness: float) -> None:
    """A symmetric Jacobian with eigenvalues in [0, smoothness]: the gradient of a convex
    ``smoothness``-smooth function (a kink of the clip is skipped by the caller)."""
    assert np.allclose(jac, jac.T, atol=1e-6 * max(1.0, np.abs(jac).max()))
    eig = symmetric_eigenvalues(jac)
    assert eig.min() >= -1e-6 and eig.max() <= smoothness * (1 + 1e-5) + 1e-6


def _off_kink(g: np.ndarray, c: float) -> bool:
    return abs(np.linalg.norm(g) - c) > 1e-3


@given(st.lists(point, min_size=6, max_size=6), st.lists(point, min_size=2, max_size=2), st.integers(0, 1))
def test_two_softmax_logits_keep_the_geometry_under_any_clip(theta, x, y):
    """Two classes: the gradient is a function of one linear form, so the clipped field is a (Huberised)
    convex gradient with the unclipped smoothness (R^2 + 1)/2 (Ye & Shokri Prop. 5.2)."""
    theta, x = np.array(theta), _unit(np.array(x), 1.0)
    for c in (0.05, 0.3, 1.0):
        g = softmax_ce_grad(theta, x, y, 2)
        if _off_kink(g, c):
            _check_gradient_of_convex(
                jacobian(lambda t: clip(softmax_ce_grad(t, x, y, 2), c), theta), cross_entropy_smoothness(1.0)
            )


@given(st.lists(point, min_size=3, max_size=3), st.lists(point, min_size=2, max_size=2), st.integers(0, 1))
def test_one_sigmoid_logit_keeps_the_geometry_under_any_clip(theta, x, y):
    theta, x = np.array(theta), _unit(np.array(x), 1.0)
    for c in (0.05, 0.3, 1.0):
        if _off_kink(sigmoid_ce_grad(theta, x, y), c):
            jac = jacobian(lambda t: clip(sigmoid_ce_grad(t, x, y), c), theta)
            _check_gradient_of_convex(jac, cross_entropy_smoothness(1.0) / 2)  # p (1 - p) <= 1/4


@given(
    st.lists(point, min_size=15, max_size=15),
    st.lists(point, min_size=2, max_size=2),
    st.lists(point, min_size=5, max_size=5),
)
def test_several_classes_keep_the_geometry_when_the_clip_cannot_bind(theta, x, logit_shift):
    """Five classes, features of norm <= 1, clip 2: never binds (the gradient's norm stays below
    sqrt(2 (R^2 + 1)) = 2), so the map is the gradient of softmax cross-entropy."""
    theta, x = np.array(theta), _unit(np.array(x), 1.0)
    theta.reshape(5, 3)[:, 2] += 3 * np.array(logit_shift)  # reach saturated logits too
    for y in range(5):
        g = softmax_ce_grad(theta, x, y, 5)
        assert np.linalg.norm(g) < nonbinding_clip_norm(1.0)
        jac = jacobian(lambda t: clip(softmax_ce_grad(t, x, y, 5), nonbinding_clip_norm(1.0)), theta)
        _check_gradient_of_convex(jac, cross_entropy_smoothness(1.0))


@given(
    st.lists(point, min_size=9, max_size=9),
    st.lists(point, min_size=2, max_size=2),
    st.lists(point, min_size=3, max_size=3),
)
def test_squared_loss_with_several_outputs_keeps_the_geometry_under_any_clip(theta, x, target):
    """``clip(r x~^T) = clip_{C/|x~|}(r) x~^T``: the gradient of the convex Huber function of the residual's
    norm, ``|x~|^2``-smooth, whatever the number of outputs (docs/derivations.md 18.3)."""
    theta, x, target = np.array(theta), _unit(np.array(x), 1.0), np.array(target)
    for c in (0.1, 1.0, 5.0):
        g = squared_loss_grad(theta, x, target)
        if _off_kink(g, c):
            jac = jacobian(lambda t: clip(squared_loss_grad(t, x, target), c), theta)
            _check_gradient_of_convex(jac, 2.0)  # |x~|^2 = R^2 + 1


def test_the_nonbinding_clip_is_the_supremum_of_the_gradient_norm():
    """sqrt(2 (R^2 + 1)) is approached (all the mass on one wrong class, |x| = R) and never reached; it
    is never rounded below its value."""
    for r in (0.0, 0.5, 1.0, 3.0, 1e-3, 1e100):
        t = nonbinding_clip_norm(r)
        assert t * t >= 2 * (r * r + 1) * (1 - 1e-16)
    x = np.array([1.0])
    theta = np.zeros(6)
    theta[2], theta[3] = 7.5, 7.5  # class 1's logit 15 at x = 1: p = e_1 up to 3e-7 for a label 0
    g = np.linalg.norm(softmax_ce_grad(theta, x, 0, 3))
    assert 2.0 - 1e-5 < g < 2.0 == nonbinding_clip_norm(1.0)


def test_the_opacus_clip_rescales_just_below_its_clip_norm():
    """Opacus divides by the norm plus 1e-6: at clip 2 = sqrt(2 (R^2 + 1)) it still rescales the gradients
    of norm in (2 - 1e-6, 2), so the claim needs clip 2 + 1e-6 (StepFacts.clip_margin)."""
    theta = np.zeros(6)
    theta[2], theta[3] = 7.5, 7.5
    g = softmax_ce_grad(theta, np.array([1.0]), 0, 3)
    assert 2.0 - 1e-6 < np.linalg.norm(g) < 2.0
    assert np.array_equal(clip(g, 2.0), g)
    assert not np.array_equal(clip(g, 2.0, margin=1e-6), g)
    assert np.array_equal(clip(g, 2.0 + 1e-6, margin=1e-6), g)
    geometry = LossGeometry.logistic_regression(1.0, 0.01, num_classes=3)
    assert geometry.clipped_map_refusal(2.0) is None
    assert "2.000001" in geometry.clipped_map_refusal(2.0, clip_margin=1e-6)
    assert geometry.clipped_map_refusal(2.0 + 1e-6, clip_margin=1e-6) is None


# ------------------------------------------------------------------------ the accountant


def _run(geometry, clip_norm, sampling="poisson"):
    return TrainingRunDpEvent.from_epochs(
        dataset_size=60000,
        batch_size=256,
        epochs=20,
        noise_multiplier=1.0,
        clip_norm=clip_norm,
        learning_rate=0.5,
        sampling=sampling,
        geometry=geometry,
        l2_regularization=0.01,
    )


def _report(run):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompositionFallbackWarning)
        return HiddenStateAccountant(neighboring_relation="ADD_OR_REMOVE_ONE").compose(run).explain(1e-5)


def test_the_accountant_reports_composition_for_a_binding_multiclass_clip():
    """MNIST scale, Poisson, add/remove: 10 classes at clip 1 get composition (the number Opacus' PRV
    prints, up to discretisation), with the reason; an undeclared number of classes too."""
    for classes in (10, None):
        run = _run(LossGeometry.logistic_regression(1.0, 0.01, num_classes=classes), 1.0)
        with pytest.warns(CompositionFallbackWarning, match="classes with clip norm 1"):
            report = HiddenStateAccountant(neighboring_relation="ADD_OR_REMOVE_ONE").compose(run).explain(1e-5)
        assert report.analysis == "composition_poisson_pld" and report.epsilon == pytest.approx(1.571, abs=1e-3)
        assert all(a.epsilon is None for a in report.analyses if a.hidden_state)
        assert any("clip norm >= 2" in n for n in report.notes)


def test_two_classes_and_a_nonbinding_clip_keep_their_numbers():
    """The hidden-state number of issue 19's table (0.566 from epoch 3 on) stands for two classes at clip 1
    and for ten classes at clip 2: after normalising by the clip the analyses see the same run."""
    binary = _report(_run(LossGeometry.logistic_regression(1.0, 0.01, num_classes=2), 1.0))
    ten = _report(_run(LossGeometry.logistic_regression(1.0, 0.01, num_classes=10), 2.0))
    unknown = _report(_run(LossGeometry.logistic_regression(1.0, 0.01), 2.0))
    assert binary.analysis == ten.analysis == unknown.analysis == "si_poisson"
    assert binary.epsilon == pytest.approx(0.5672, abs=2e-4)
    assert ten.epsilon == pytest.approx(binary.epsilon, rel=1e-9) == unknown.epsilon


def test_a_geometry_by_its_constants_is_the_users_claim_and_says_which_models():
    run = _run(LossGeometry(smoothness=1.01, strong_convexity=0.01), 1.0)
    report = _report(run)
    assert report.analysis == "si_poisson"
    note = next(n for n in report.notes if "declared, not verified" in n)
    assert "3 or more classes only when the clip cannot bind" in note


def test_num_classes_is_checked():
    with pytest.raises(ParameterError, match="num_classes: must be at least 2"):
        LossGeometry.logistic_regression(1.0, 0.01, num_classes=1)
    with pytest.raises(ParameterError, match="num_classes: applies to a geometry derived from a loss"):
        LossGeometry(smoothness=1.0, num_classes=3)


def test_normalising_by_the_clip_keeps_the_verdict():
    """The analyses run in units where the clip is 1 (accountant.normalised); a clip of 3 that cannot
    bind must not be refused there, and a clip of 1.5 that can must stay refused."""
    geometry = LossGeometry.logistic_regression(1.0, 0.01, num_classes=10)
    assert _report(_run(geometry, 3.0, "cyclic")).analysis != "bok_thm4.4"
    refused = _report(_run(geometry, 1.5, "cyclic"))
    assert all(a.epsilon is None for a in refused.analyses if a.hidden_state)


# ------------------------------------------------------------------------ the recording layer

LINEAR5 = ModelFacts(
    layers=[LayerFacts(name="Linear", kind="affine", trainable=True)], complete=True, feature_clip_norm=1.0, outputs=5
)


def _claim(geometry, model=LINEAR5):
    return Claim(
        schedule=BatchSchedule(200, 10, "cyclic"),
        geometry=geometry,
        model=model,
        feature_unobservable=None if model is not None else "not in this test",
        assume_convex_model=model is None,
    )


def _step(clip_norm, margin=0.0):
    return StepFacts(
        noise_multiplier=2.0, clip_norm=clip_norm, learning_rate=0.5, divisor=10, weight_decay=0.01, clip_margin=margin
    )


def test_the_recorder_reads_the_classes_from_the_model_and_falls_back_with_the_reason():
    geometry = LossGeometry.logistic_regression(1.0, 0.01)  # classes not declared: the model's 5
    rec = _claim(geometry).recorder([(_step(1.0), 40)])
    with pytest.warns(CompositionFallbackWarning, match="5 classes with clip norm 1"):
        report = rec.report(1e-5)
    assert report.analysis == "bok_thm4.4"
    ok = _claim(geometry).recorder([(_step(2.0), 40)]).report(1e-5)
    assert ok.analysis != "bok_thm4.4" and ok.epsilon < report.epsilon
    # the framework's clip margin (Opacus) counts
    with pytest.warns(CompositionFallbackWarning, match="2.000001"):
        _claim(geometry).recorder([(_step(2.0, 1e-6), 40)]).report(1e-5)
    binary = attr.evolve(LINEAR5, outputs=1)  # one sigmoid logit
    assert _claim(geometry, binary).recorder([(_step(1.0), 40)]).report(1e-5).analysis != "bok_thm4.4"


def test_declared_classes_must_match_the_model():
    with pytest.raises(ParameterError, match="num_classes: the geometry is declared for 3 classes, but the model"):
        _claim(LossGeometry.logistic_regression(1.0, 0.01, num_classes=3))
    _claim(LossGeometry.logistic_regression(1.0, 0.01, num_classes=2), attr.evolve(LINEAR5, outputs=1))


def test_an_unreadable_model_leaves_the_classes_unknown():
    """``assume_convex_model`` with a model the adapter cannot read: the classes are unknown, so a clip that
    can bind is refused unless the geometry declares two classes."""
    rec = _claim(LossGeometry.logistic_regression(1.0, 0.01), model=None).recorder([(_step(1.0), 40)])
    with pytest.warns(CompositionFallbackWarning, match="undeclared number of classes"):
        assert rec.report(1e-5).analysis == "bok_thm4.4"
    declared = _claim(LossGeometry.logistic_regression(1.0, 0.01, num_classes=2), model=None)
    assert declared.recorder([(_step(1.0), 40)]).report(1e-5).analysis != "bok_thm4.4"
