"""The composition window (docs/derivations.md section 19): a converged hidden-state bound for an
L2-regularised class certifies at best composition over about 2/(lr m_reg) steps.

The full-batch affine instance is computed in closed form (its last iterate is one Gaussian mechanism); Bok et
al.'s Thm 4.2 is exact there, so the package's converged noise must sit between composition's over the two
whole numbers of steps around the window. A hidden-state bound below the window would fail these tests.
"""

import math
import warnings

import pytest

from hidden_state_accountants import (
    CompositionFallbackWarning,
    HiddenStateAccountant,
    LossGeometry,
    ParameterError,
    TrainingRunDpEvent,
    calibrate_noise_multiplier,
)
from hidden_state_accountants.lower_bounds import composition_window

N, LR, L2, DELTA = 10_000, 1.78, 0.003, 1e-5  # the full-batch example


def affine_mu(steps: int, z: float, c: float) -> float:
    """GDP ``mu`` of the last iterate of full-batch training on the affine instance (replace-one: the record's
    constant gradient moves from ``C e`` to ``-C e``): shift ``lr (2C/n) sum c^j`` over noise
    ``lr (zC/n) sqrt(sum c^(2j))``."""
    s1 = sum(c**j for j in range(steps))
    s2 = sum(c ** (2 * j) for j in range(steps))
    return (2.0 / z) * s1 / math.sqrt(s2)


def test_the_affine_instance_converges_to_composition_over_the_window():
    c, z = 1 - LR * L2, 3.0
    window = composition_window(LR, L2)
    assert window == pytest.approx((1 + c) / (1 - c), rel=1e-12) == pytest.approx(2 / (LR * L2) - 1, rel=1e-12)
    limit = (2.0 / z) * math.sqrt(window)  # composition of `window` full-batch steps: (2/z) sqrt(T)
    mus = [affine_mu(t, z, c) for t in (10, 100, 1000, 10_000)]
    assert mus == sorted(mus) and mus[-1] == pytest.approx(limit, rel=1e-9)


def _run(steps: int, geometry=None) -> TrainingRunDpEvent:
    return TrainingRunDpEvent(
        dataset_size=N,
        batch_size=N,
        steps=steps,
        noise_multiplier=1.0,
        clip_norm=1.0,
        learning_rate=LR,
        sampling="full",
        geometry=geometry,
        l2_regularization=L2,
    )


@pytest.mark.parametrize("relation", ["REPLACE_ONE", "ADD_OR_REMOVE_ONE"])
def test_the_converged_hidden_state_noise_is_compositions_over_the_window(relation):
    """eps 0.3: converged Bok Thm 4.2 needs z 434.45 (replace-one), composition over 373 / 374 steps 434.09 /
    434.67 (the window is 373.5 steps); composition over the whole run would need far more."""
    geometry = LossGeometry(smoothness=0.5, strong_convexity=L2)
    window = composition_window(LR, L2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompositionFallbackWarning)
        z = {
            name: calibrate_noise_multiplier(run, 0.3, DELTA, neighboring_relation=relation, rel_tol=1e-6)
            for name, run in (
                ("hidden", _run(20_000, geometry)),
                ("below", _run(math.floor(window))),
                ("above", _run(math.ceil(window))),
                ("whole run", _run(20_000)),
            )
        }
    assert z["hidden"].analysis == "bok_thm4.2"
    hidden = z["hidden"].noise_multiplier
    assert z["below"].noise_multiplier * (1 - 1e-5) <= hidden <= z["above"].noise_multiplier * (1 + 1e-5)
    assert z["whole run"].noise_multiplier > 7 * hidden


def test_a_hidden_state_epsilon_at_convergence_is_never_below_the_window():
    """At a fixed noise, the converged hidden-state epsilon is at least composition's over floor(window) steps."""
    geometry = LossGeometry(smoothness=0.5, strong_convexity=L2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompositionFallbackWarning)
        for z in (100.0, 434.45, 2000.0):
            hidden = HiddenStateAccountant().compose(_run(20_000, geometry).replace(noise_multiplier=z))
            window = HiddenStateAccountant().compose(
                _run(math.floor(composition_window(LR, L2))).replace(noise_multiplier=z)
            )
            assert hidden.get_epsilon(DELTA) >= window.get_epsilon(DELTA) * (1 - 1e-9)


def test_the_window_needs_a_contraction():
    with pytest.raises(ParameterError, match="^learning_rate: needs learning_rate \\* l2_regularization < 2"):
        composition_window(2.0, 1.0)
    with pytest.raises(ParameterError, match="^l2_regularization: must be > 0"):
        composition_window(0.5, 0.0)
