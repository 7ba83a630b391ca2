"""Reading the DP-SGD settings out of a TF-Privacy Keras optimizer into core step facts.

TF-Privacy's ``DPKeras*Optimizer`` adds ``N(0, (zC)^2)`` to the sum of the clipped microbatch
gradients and divides by the number of microbatches. An optimizer whose noise cannot be read
(a non-DP optimizer, DP-FTRL, sparse DP optimizers, other DP queries) is refused here; what
the readable settings allow is decided by the core
(:mod:`hidden_state_accountants.recording`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf
from tensorflow_privacy.privacy.dp_query import gaussian_query

from hidden_state_accountants import ParameterError
from hidden_state_accountants.recording import OptimizerKind, ReplicaReduction, StepFacts

_GENERIC_MODULE = "tensorflow_privacy.privacy.optimizers.dp_optimizer_keras"
_VECTORIZED_MODULE = "tensorflow_privacy.privacy.optimizers.dp_optimizer_keras_vectorized"
_SPARSE_MODULE = "tensorflow_privacy.privacy.optimizers.dp_optimizer_keras_sparse"


@dataclass(frozen=True)
class DPOptimizerSettings:
    """What the accountant needs from a TF-Privacy optimizer.

    Attributes:
      name: the optimizer's class name.
      base: the update applied to the noisy gradient (the core's ``OptimizerKind``).
      l2_norm_clip: ``C``.
      noise_multiplier: ``z`` (noise std on the clipped sum divided by ``C``).
      num_microbatches: ``None`` means one example per microbatch.
      gradient_accumulation_steps: optimiser calls per applied update.
      momentum: SGD momentum (0 for plain SGD).
      nesterov: SGD Nesterov flag.
      l2_regularization: the decoupled L2 term added outside clipping (0 if none).
      gradient_postprocessing: Keras ``clipnorm`` / ``clipvalue`` / ``global_clipnorm`` set on
        the noisy gradient, described, or ``None``.
      inverse_time_decay: the legacy ``decay`` argument (``lr / (1 + decay * step)``).
      replica_reduction: how Keras combines the replicas' gradients under a ``tf.distribute``
        strategy (``sum``: the legacy optimizers' default ``gradient_aggregator``), or
        ``None`` for a custom aggregator.
      shares_over_replicas: the optimizer adds ``1/replicas`` of the noise variance and of the
        L2 term on each replica and divides by the global number of microbatches (the
        package's :class:`DecoupledL2DPKerasSGDOptimizer`); TF-Privacy's optimizers apply the
        whole noise and their local divisor on every replica.
    """

    name: str
    base: OptimizerKind
    l2_norm_clip: float
    noise_multiplier: float
    num_microbatches: Optional[int]
    gradient_accumulation_steps: int
    momentum: float
    nesterov: bool
    l2_regularization: float
    gradient_postprocessing: Optional[str]
    inverse_time_decay: float
    replica_reduction: Optional[ReplicaReduction] = ReplicaReduction.SUM
    shares_over_replicas: bool = False


def _is_from(opt, module: str) -> bool:
    return any(c.__module__ == module and c.__name__ == "DPOptimizerClass" for c in type(opt).__mro__)


def _display_name(opt) -> str:
    cls = type(opt)
    if cls.__name__ == "DPOptimizerClass":  # TF-Privacy's generated classes share this name
        return f"TF-Privacy DP {cls.__mro__[1].__name__} optimizer"
    return cls.__name__


def _value(x) -> float:
    if callable(x) and not isinstance(x, (tf.Variable, tf.Tensor)):
        x = x()
    return float(np.asarray(tf.keras.backend.get_value(x)))


def read_dp_optimizer_settings(optimizer) -> DPOptimizerSettings:
    """The DP-SGD settings of a TF-Privacy Keras optimizer.

    Raises:
      ParameterError: for an optimizer that is not a TF-Privacy Gaussian DP-SGD optimizer
        (plain Keras optimizers, DP-FTRL tree aggregation, sparse DP optimizers, other DP
        queries), with the reason.
    """
    if optimizer is None:
        raise ParameterError("optimizer", "the model is not compiled; compile it with a TF-Privacy DP optimizer")
    name = _display_name(optimizer)
    legacy = tf.keras.optimizers.legacy
    if _is_from(optimizer, _SPARSE_MODULE):
        raise ParameterError(
            "optimizer",
            f"{name} (DPSparseKeras*) adds noise when gradients are applied, not per step as accounted; "
            "use DPKerasSGDOptimizer",
        )
    if _is_from(optimizer, _GENERIC_MODULE):
        query = optimizer._dp_sum_query
        if type(query) is not gaussian_query.GaussianSumQuery:
            raise ParameterError(
                "optimizer",
                f"{name} uses the DP query {type(query).__name__}; only the GaussianSumQuery of "
                "DPKeras*Optimizer (independent Gaussian noise each step) is accounted",
            )
        # the global state holds what the optimizer actually uses (set at construction)
        state = optimizer._global_state
        clip = float(np.asarray(state.l2_norm_clip))
        stddev = float(np.asarray(state.stddev))
        noise = stddev / clip if clip > 0 else math.nan
        micro = optimizer._num_microbatches
        accum = int(optimizer.gradient_accumulation_steps)
    elif _is_from(optimizer, _VECTORIZED_MODULE):
        clip = float(optimizer._l2_norm_clip)
        noise = float(optimizer._noise_multiplier)
        micro = optimizer._num_microbatches
        accum = 1
    else:
        if getattr(type(optimizer), "__module__", "").startswith("tensorflow_privacy"):
            raise ParameterError("optimizer", f"{name} is not a TF-Privacy DP-SGD optimizer this adapter can account")
        raise ParameterError(
            "optimizer",
            f"{name} is not a TF-Privacy DP optimizer: training is not differentially private "
            "(compile with tensorflow_privacy.DPKerasSGDOptimizer)",
        )
    if not (math.isfinite(clip) and clip > 0):
        raise ParameterError("l2_norm_clip", f"must be > 0, got {clip!r}")
    if not (math.isfinite(noise) and noise > 0):
        raise ParameterError("noise_multiplier", f"must be > 0 for any privacy guarantee, got {noise!r}")
    if micro is not None:
        micro = int(np.asarray(micro))

    if isinstance(optimizer, legacy.SGD):
        base = OptimizerKind.SGD
        momentum = _value(optimizer._get_hyper("momentum"))
        nesterov = bool(optimizer.nesterov)
    else:  # TF-Privacy's generated DP class derives from the Keras optimizer (Adam, Adagrad, ...)
        cls = type(optimizer)
        base = OptimizerKind.named(cls.__mro__[1].__name__ if cls.__name__ == "DPOptimizerClass" else cls.__name__)
        momentum, nesterov = 0.0, False
    post = [
        f"{k}={getattr(optimizer, k)}"
        for k in ("clipnorm", "clipvalue", "global_clipnorm")
        if getattr(optimizer, k, None) is not None
    ]
    return DPOptimizerSettings(
        name=name,
        base=base,
        l2_norm_clip=clip,
        noise_multiplier=noise,
        num_microbatches=micro,
        gradient_accumulation_steps=accum,
        momentum=momentum,
        nesterov=nesterov,
        l2_regularization=float(getattr(optimizer, "_l2_regularization", 0.0)),
        gradient_postprocessing=", ".join(post) or None,
        inverse_time_decay=float(getattr(optimizer, "_initial_decay", 0.0) or 0.0),
        replica_reduction=_replica_reduction(optimizer),
        shares_over_replicas=bool(getattr(type(optimizer), "shares_step_over_replicas", False)),
    )


def _replica_reduction(optimizer) -> Optional[str]:
    """Keras 2's legacy optimizers sum the replicas' gradients (``all_reduce_sum_gradients``)
    unless given another ``gradient_aggregator``."""
    aggregator = getattr(optimizer, "gradient_aggregator", None)
    if getattr(aggregator, "__name__", None) == "all_reduce_sum_gradients" and getattr(
        aggregator, "__module__", ""
    ).startswith("keras"):
        return ReplicaReduction.SUM
    return None


def read_replicas(model) -> int:
    """The number of replicas the model's ``tf.distribute`` strategy trains on.

    Raises :class:`ParameterError` (``distribute_strategy``) for a strategy whose update has
    not been checked against the accounted one.
    """
    strategy = model.distribute_strategy
    name = type(strategy).__name__
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        raise ParameterError(
            "distribute_strategy",
            f"{name} applies the workers' updates asynchronously, to parameters other workers "
            "have changed since: not the accounted sequence of steps; use MirroredStrategy or "
            "MultiWorkerMirroredStrategy",
        )
    supported = (
        tf.distribute.MirroredStrategy,
        tf.distribute.MultiWorkerMirroredStrategy,
        tf.distribute.OneDeviceStrategy,
    )
    if not (isinstance(strategy, supported) or name == "_DefaultDistributionStrategy"):
        raise ParameterError(
            "distribute_strategy",
            f"{name} is not supported: its update has not been checked against the accounted "
            "one (supported: no strategy, OneDeviceStrategy, MirroredStrategy, MultiWorkerMirroredStrategy)",
        )
    return int(strategy.num_replicas_in_sync)


def step_facts(
    settings: DPOptimizerSettings,
    learning_rate: float,
    *,
    batch_size: int,
    replicas: int = 1,
    projection_diameter: Optional[float] = None,
    other_constraints: Sequence[str] = (),
) -> StepFacts:
    """One step of this optimizer as core :class:`StepFacts` (the core judges them).

    TF-Privacy divides the noisy sum by the number of microbatches (the batch size when
    ``num_microbatches`` is ``None``); Keras applies ``clipnorm``-style options and weight
    constraints to the update after the noise. Under a strategy with ``replicas`` replicas,
    each replica gets ``batch_size / replicas`` records; TF-Privacy's optimizers divide by
    the replica's microbatches, the package's by the global number (``shares_over_replicas``).
    """
    if replicas > 1 and settings.replica_reduction is None:
        raise ParameterError(
            "optimizer",
            f"{settings.name} has a custom gradient_aggregator: how the {replicas} replicas' updates are "
            "combined cannot be read",
        )
    post = [settings.gradient_postprocessing] if settings.gradient_postprocessing else []
    post += [f"the constraint {c}" for c in other_constraints]
    micro = settings.num_microbatches
    if settings.shares_over_replicas:
        divisor, share = (micro * replicas if micro else batch_size), replicas
    else:
        divisor, share = (micro or batch_size / replicas), 1
    return StepFacts(
        noise_multiplier=settings.noise_multiplier,
        clip_norm=settings.l2_norm_clip,
        learning_rate=learning_rate,
        divisor=divisor,
        weight_decay=settings.l2_regularization,
        projection_diameter=projection_diameter,
        optimizer=settings.base,
        momentum=settings.momentum,
        nesterov=settings.nesterov,
        accumulation=settings.gradient_accumulation_steps,
        postprocessing="; ".join(post) or None,
        replicas=replicas,
        replica_reduction=settings.replica_reduction or ReplicaReduction.SUM,
        replica_share=share,
    )
