"""L2 regularisation outside clipping, for TF-Privacy's Keras optimizer.

This is the one Keras training tool that needs TF-Privacy (it extends its optimizer), so
:mod:`hidden_state_accountants.keras` does not import it; the TF-Privacy adapter re-exports it
(``from hidden_state_accountants.tf_privacy import DecoupledL2DPKerasSGDOptimizer``).

The analysed update adds ``m_reg*theta`` *after* per-example clipping and noise. A Keras
``kernel_regularizer`` (or any ``model.losses`` term) is added by Keras to every per-example loss,
so TF-Privacy clips it with the data gradient: that is not the analysed update.
"""

from __future__ import annotations

import math
from typing import Optional

import tensorflow as tf
from tensorflow_privacy.privacy.dp_query import gaussian_query
from tensorflow_privacy.privacy.optimizers.dp_optimizer_keras import GenericDPSGDOptimizer

from hidden_state_accountants import ParameterError


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
