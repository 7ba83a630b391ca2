"""L2 regularisation outside clipping and projection onto an L2 ball.

The analysed update is ``theta <- Proj_K(theta - lr*[(1/b) sum clip_C(grad l_i) + m_reg*theta + noise])``:

* the L2 term ``m_reg*theta`` is added *after* per-example clipping and noise. A Keras
  ``kernel_regularizer`` (or any ``model.losses`` term) is added by Keras to every
  per-example loss, so TF-Privacy clips it with the data gradient: that is not the analysed
  update. :class:`DecoupledL2DPKerasSGDOptimizer` adds the term outside clipping and noise;
  :func:`inside_clipping_regularizers` finds the Keras regularisers to warn about.
* ``Proj_K`` is applied after every step. :class:`L2BallProjection` is a Keras constraint,
  which every Keras optimiser applies to its variable right after each update, rescaling a hair
  inside the ball (the core's rounding rule, :mod:`hidden_state_accountants.projection`); with one
  on every trainable variable the parameters stay in a product of balls, a convex set whose
  diameter :func:`projection_diameter` reports (the core's
  :func:`~hidden_state_accountants.projection.ball_product_diameter`).
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import tensorflow as tf
from tensorflow_privacy.privacy.dp_query import gaussian_query
from tensorflow_privacy.privacy.optimizers.dp_optimizer_keras import GenericDPSGDOptimizer

from hidden_state_accountants import ParameterError
from hidden_state_accountants.projection import ball_product_diameter, inside_factor

from .model import dtype_eps


class DecoupledL2DPKerasSGDOptimizer(GenericDPSGDOptimizer):
    """``DPKerasSGDOptimizer`` plus an L2 term ``l2_regularization * theta`` outside clipping.

    The gradient it applies is TF-Privacy's (per-example clipped, summed, noised, divided by
    the number of microbatches) plus ``l2_regularization * theta`` for *every* trainable
    variable, biases included: strong convexity ``m = l2_regularization`` of the update map
    needs the term on all parameters (Ye & Shokri, "Differentially Private Learning Needs Hidden
    State (Or Much Faster Convergence)", NeurIPS 2022, arXiv:2203.05363, Prop. 5.1/5.2).

    Args:
      l2_norm_clip: ``C``.
      noise_multiplier: ``z``; the noise on the sum of clipped gradients is ``N(0, (zC)^2)``.
      l2_regularization: ``m_reg >= 0``.
      num_microbatches: ``None`` (one example per microbatch, what the accountant assumes).
      gradient_accumulation_steps: must stay 1 for the accountant.
      **kwargs: passed to ``tf.keras.optimizers.legacy.SGD`` (``learning_rate``, ...).

    Under ``tf.distribute.MirroredStrategy`` / ``MultiWorkerMirroredStrategy`` with ``R``
    replicas, each replica adds noise of variance ``(zC)^2 / R`` to the clipped sum of its
    part of the batch and ``l2_regularization * theta / R``, and divides by the global number
    of microbatches; Keras sums the replicas' gradients, so the update is exactly the
    one-device step on the global batch (TF-Privacy's own optimizers are not: each replica
    adds the full noise and divides by its local batch).
    """

    shares_step_over_replicas = True
    """The step is split over data-parallel replicas so that their sum is the accounted one."""

    def __init__(
        self,
        l2_norm_clip: float,
        noise_multiplier: float,
        l2_regularization: float,
        num_microbatches: Optional[int] = None,
        gradient_accumulation_steps: int = 1,
        **kwargs,
    ):
        m = float(l2_regularization)
        if not (math.isfinite(m) and m >= 0):
            raise ParameterError("l2_regularization", f"must be a finite number >= 0, got {l2_regularization!r}")
        query = gaussian_query.GaussianSumQuery(l2_norm_clip, l2_norm_clip * noise_multiplier)
        super().__init__(
            query,
            num_microbatches=num_microbatches,
            gradient_accumulation_steps=gradient_accumulation_steps,
            **kwargs,
        )
        self._l2_regularization = m
        self._l2_norm_clip = float(l2_norm_clip)
        self._noise_multiplier = float(noise_multiplier)

    @property
    def l2_regularization(self) -> float:
        return self._l2_regularization

    def _add_l2(self, grad, var, replicas: int = 1):
        if grad is None:
            grad = tf.zeros_like(var)
        grad = tf.convert_to_tensor(grad)  # IndexedSlices -> dense: the L2 term touches every entry
        if self._l2_regularization == 0.0:
            return grad
        # each replica adds its share; Keras sums the replicas' gradients
        share = self._l2_regularization / replicas
        return grad + tf.cast(share, var.dtype) * tf.convert_to_tensor(var)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        context = tf.distribute.get_replica_context()
        replicas = context.num_replicas_in_sync if context is not None else 1
        if replicas == 1:
            grads_and_vars = super()._compute_gradients(loss, var_list, grad_loss=grad_loss, tape=tape)
        else:
            grads_and_vars = self._replica_gradients(loss, var_list, tape, context)
        return [(self._add_l2(g, v, replicas), v) for g, v in grads_and_vars]

    def _replica_gradients(self, loss, var_list, tape, context):
        """One replica's share of the global DP-SGD step (Keras sums the replicas' gradients).

        TF-Privacy's own step adds the full noise ``N(0, (zC)^2)`` on every replica and divides
        by the replica's number of microbatches, so the summed update has ``R`` times the
        signal and ``R sqrt(R)`` times the noise of the accounted one. Here each replica adds
        ``N(0, (zC)^2 / R)`` to its clipped sum and divides by the global number of
        microbatches: the sum over replicas is exactly ``(sum_i clip(g_i) + N(0, (zC)^2)) / b``.
        """
        self._was_dp_gradients_called = True
        if not callable(loss) and tape is None:
            raise ValueError("`tape` is required when a `Tensor` loss is passed.")
        tape = tape if tape is not None else tf.GradientTape()
        with tape:
            if callable(loss):
                if not callable(var_list):
                    tape.watch(var_list)
                loss = loss()
            local = tf.shape(input=loss)[0] if self._num_microbatches is None else self._num_microbatches
            microbatch_losses = tf.reduce_mean(tf.reshape(loss, [local, -1]), axis=1)
            if callable(var_list):
                var_list = var_list()
        var_list = tf.nest.flatten(var_list)
        query = self._dp_sum_query
        replicas = context.num_replicas_in_sync
        share = self._global_state._replace(stddev=self._global_state.stddev / math.sqrt(replicas))
        sample_params = query.derive_sample_params(share)
        with tf.keras.backend.name_scope(self._name + "/gradients"):
            jacobians = tape.jacobian(microbatch_losses, var_list, unconnected_gradients="zero")
            sample_state = query.initial_sample_state(var_list)

            def body(i, state):
                return i + 1, query.accumulate_record(sample_params, state, [j[i] for j in jacobians])

            _, sample_state = tf.while_loop(lambda i, _: i < local, body, [tf.constant(0), sample_state])
            noised, _, _ = query.get_noised_result(sample_state, share)
            total = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(local, tf.float32))
            grads = [g / tf.cast(total, g.dtype) for g in noised]
        return list(zip(grads, var_list))

    def get_gradients(self, loss, params):
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            raise ParameterError(
                "optimizer", "get_gradients (TF1 graph mode) does not support several replicas; use Keras 2's fit"
            )
        grads = super().get_gradients(loss, params)
        return [self._add_l2(g, p) for g, p in zip(grads, params)]

    def get_config(self):
        config = super().get_config()
        config.update(
            l2_regularization=self._l2_regularization,
            l2_norm_clip=self._l2_norm_clip,
            noise_multiplier=self._noise_multiplier,
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config.pop("global_state", None)  # TF-Privacy's query state, rebuilt from clip and noise
        return super().from_config(config, custom_objects=custom_objects)


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


def inside_clipping_regularizers(model: tf.keras.Model) -> List[str]:
    """Descriptions of loss terms Keras adds to every per-example loss (so TF-Privacy clips them).

    Lists each layer's ``kernel_regularizer`` / ``bias_regularizer`` /
    ``activity_regularizer`` and, if no layer explains them, the count of ``model.losses``.
    """
    found = []
    for layer in model.submodules:
        if not isinstance(layer, tf.keras.layers.Layer):
            continue
        for attr in (
            "kernel_regularizer",
            "bias_regularizer",
            "activity_regularizer",
            "depthwise_regularizer",
            "pointwise_regularizer",
            "recurrent_regularizer",
            "beta_regularizer",
            "gamma_regularizer",
            "embeddings_regularizer",
        ):
            if getattr(layer, attr, None) is not None:
                found.append(f"{layer.name}.{attr}")
    if not found:
        n = len(model.losses)
        if n:
            found.append(f"{n} term(s) in model.losses (add_loss)")
    return found
