"""The core's one rule for projections and feature clips: rescale a hair inside the ball (enough for
the dtype's rounding), report the declared ball itself."""

import math

import numpy as np
import pytest

from hidden_state_accountants import ParameterError
from hidden_state_accountants.projection import MARGIN, ball_product_diameter, inside_factor


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_a_point_rescaled_by_the_rule_stays_inside_the_ball_in_its_dtype(dtype):
    """Rounded in the safe direction: the norm (computed in float64), the scale and the product each
    round in ``dtype``, and the result never leaves the ball (the Keras projection used to scale onto
    the ball itself and inflate the reported diameter instead)."""
    rng = np.random.default_rng(0)
    radius, eps = 1.7, float(np.finfo(dtype).eps)
    for size in (1, 10, 10_000):
        for _ in range(20):
            x = (rng.standard_normal(size) * rng.uniform(1, 100)).astype(dtype)
            scale = dtype(radius * inside_factor(eps) / np.linalg.norm(x.astype(np.float64)))
            assert np.linalg.norm((x * scale).astype(np.float64)) <= radius


def test_the_margin_grows_with_the_dtypes_rounding_and_the_diameter_is_exact():
    assert inside_factor(2.0**-52) == inside_factor(2.0**-23) == 1 - MARGIN
    assert inside_factor(2.0**-7) == 1 - 4 * 2.0**-7  # bfloat16
    assert ball_product_diameter([2.5]) == 5.0
    assert ball_product_diameter([0.3, 0.1]) == pytest.approx(2 * math.sqrt(0.1), rel=1e-15)
    for bad in ([], [0.0], [math.inf]):
        with pytest.raises(ParameterError):
            ball_product_diameter(bad)
