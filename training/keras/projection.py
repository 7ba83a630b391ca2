"""Projection onto an L2 ball after every step, as a Keras constraint (TensorFlow only).

:class:`L2BallProjection` keeps a weight tensor in an L2 ball after every step; with one on every
trainable variable the parameters stay in a product of balls, whose diameter the TF-Privacy
callback reads (``hidden_state_accountants.tf_privacy.projection_diameter``). It rescales a hair
inside the ball, in float64, by the core's rounding rule (:mod:`hidden_state_accountants.projection`),
so rounding cannot leave a value outside it (:class:`~.features.FeatureClip` follows the same rule).
"""

from __future__ import annotations

import math

import tensorflow as tf

from hidden_state_accountants import ParameterError
from hidden_state_accountants.projection import inside_factor

_EPS = {tf.float16: 2.0**-10, tf.bfloat16: 2.0**-7, tf.float32: 2.0**-23, tf.float64: 2.0**-52}
"""Machine epsilons (numpy's finfo does not know bfloat16)."""


def dtype_eps(dtype) -> float:
    """The machine epsilon of a TensorFlow dtype (0 for integers; bfloat16's for an unknown float)."""
    return _EPS.get(dtype, 2.0**-7) if dtype.is_floating else 0.0


class L2BallProjection(tf.keras.constraints.Constraint):
    """Projects a whole weight tensor onto ``{w : ||w||_2 <= radius}`` after every step.

    Unlike ``tf.keras.constraints.MaxNorm`` (per column) this is the Euclidean projection of
    the tensor as one vector. Use it as ``kernel_constraint=`` and ``bias_constraint=`` on
    every trainable layer; :func:`projection_diameter` then reports the diameter.
    """

    def __init__(self, radius: float):
        r = float(radius)
        if not (math.isfinite(r) and r > 0):
            raise ParameterError("radius", f"must be a finite number > 0, got {radius!r}")
        self.radius = r

    def __call__(self, w):
        # the norm in float64, the target a hair inside the ball: the result never leaves it
        norm = tf.norm(tf.reshape(tf.cast(w, tf.float64), [-1]))
        target = self.radius * inside_factor(dtype_eps(w.dtype))
        scale = tf.minimum(tf.constant(1.0, tf.float64), target / tf.maximum(norm, 1e-300))
        return w * tf.cast(scale, w.dtype)

    def get_config(self):
        return {"radius": self.radius}
