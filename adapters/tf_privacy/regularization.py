"""What the model says about regularisation and projection, read for the callback.

The analysed update is ``theta <- Proj_K(theta - lr*[(1/b) sum clip_C(grad l_i) + m_reg*theta + noise])``:

* the L2 term ``m_reg*theta`` is added *after* per-example clipping and noise
  (:class:`~hidden_state_accountants.keras.decoupled_l2.DecoupledL2DPKerasSGDOptimizer` does that).
  A Keras ``kernel_regularizer`` (or any ``model.losses`` term) is added by Keras to every
  per-example loss, so TF-Privacy clips it with the data gradient: that is not the analysed
  update; :func:`inside_clipping_regularizers` finds them to warn about.
* ``Proj_K`` is applied after every step: with an
  :class:`~hidden_state_accountants.keras.projection.L2BallProjection` on every trainable variable the
  parameters stay in a product of balls, a convex set whose diameter :func:`projection_diameter`
  reports (the core's :func:`~hidden_state_accountants.projection.ball_product_diameter`).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import tensorflow as tf

from hidden_state_accountants import ParameterError
from hidden_state_accountants.keras.projection import L2BallProjection
from hidden_state_accountants.projection import ball_product_diameter


def _var_name(v) -> str:
    return getattr(v, "path", None) or v.name


def projection_facts(model: tf.keras.Model) -> Tuple[Optional[float], List[str]]:
    """``(diameter, other_constraints)``: the diameter of the set the trainable parameters are
    projected onto (``None`` unless *every* trainable variable carries an
    :class:`L2BallProjection`), and the other Keras constraints, described."""
    radii, missing, others = [], False, []
    for v in model.trainable_variables:
        c = getattr(v, "constraint", None)
        if isinstance(c, L2BallProjection):
            radii.append(c.radius)
        elif c is None:
            missing = True
        else:
            others.append(f"{type(c).__name__} on {_var_name(v)!r}")
    if missing or not radii:
        return None, others
    return ball_product_diameter(radii), others


def projection_diameter(model: tf.keras.Model) -> Optional[float]:
    """Diameter of the set the trainable parameters are projected onto, or ``None``.

    Returns ``2 * sqrt(sum_j r_j^2)`` (the diameter of the product of balls) when *every*
    trainable variable carries an :class:`L2BallProjection` of radius ``r_j``; ``None`` when
    any is unconstrained. Raises :class:`ParameterError` for any other Keras constraint: it
    is not a projection the analyses cover.
    """
    diameter, others = projection_facts(model)
    if others:
        raise ParameterError(
            "constraint",
            f"{others[0]}: only L2BallProjection (projection onto a ball, convex and non-expansive) "
            "is covered by the hidden-state analyses",
        )
    return diameter


_REGULARIZER_ATTRIBUTES = """
    kernel_regularizer bias_regularizer activity_regularizer depthwise_regularizer pointwise_regularizer
    recurrent_regularizer beta_regularizer gamma_regularizer embeddings_regularizer
""".split()


def inside_clipping_regularizers(model: tf.keras.Model) -> List[str]:
    """Descriptions of loss terms Keras adds to every per-example loss (so TF-Privacy clips them).

    Lists each layer's ``kernel_regularizer`` / ``bias_regularizer`` /
    ``activity_regularizer`` and, if no layer explains them, the count of ``model.losses``.
    """
    found = []
    for layer in model.submodules:
        if not isinstance(layer, tf.keras.layers.Layer):
            continue
        for attr in _REGULARIZER_ATTRIBUTES:
            if getattr(layer, attr, None) is not None:
                found.append(f"{layer.name}.{attr}")
    if not found:
        n = len(model.losses)
        if n:
            found.append(f"{n} term(s) in model.losses (add_loss)")
    return found
