"""``compute_hidden_state_noise``: the noise multiplier a Keras run needs for a target epsilon.

The hidden-state counterpart of TF-Privacy's ``compute_noise(n, batch_size, target_epsilon,
epochs, delta, noise_lbd)``, which calibrates Poisson sampling by composition. This one
calibrates the run :class:`~.callback.HiddenStatePrivacyCallback` will account: the package's
batch schedule, the declared geometry, the learning rate, clip norm, L2 term and projection,
under REPLACE_ONE (the relation the callback reports). The run is built by the core's
:class:`~hidden_state_accountants.recording.RunRecorder` from the step facts the callback reads
off the optimizer, and calibrated by the core's
:func:`~hidden_state_accountants.calibrate_noise_multiplier`, so (the calibration invariant) the
callback's ``epsilon`` after ``epochs`` epochs of that run is at most ``target_epsilon``, with the
smallest noise the best valid analysis allows (to ``rel_tol``).

>>> from hidden_state_accountants import LossGeometry
>>> settings = dict(sampling="shuffle_partition", learning_rate=0.5, l2_norm_clip=1.0)
>>> geometry = LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=0.01, num_classes=2)
>>> round(compute_hidden_state_noise(1000, 50, 2.0, 10, 1e-5, geometry=geometry, **settings), 2)
3.28
>>> round(compute_hidden_state_noise(1000, 50, 2.0, 10, 1e-5, geometry=None, **settings), 2)  # composition
12.61
"""

from __future__ import annotations

import itertools
from typing import Optional

import numpy as np

from hidden_state_accountants import (
    HiddenStateAccountant,
    LossGeometry,
    ParameterError,
    TrainingRunDpEvent,
    calibrate_noise_multiplier,
)
from hidden_state_accountants import validation as v
from hidden_state_accountants.keras.data import (
    accounted_delta,
    check_dataset_last_batch,
    check_dataset_sampling,
    keras_schedule,
)
from hidden_state_accountants.recording import Claim, OptimizerKind, batch_records
from hidden_state_accountants.schedules import DROPPED, check_last_batch, check_schedule

from .optimizers import DPOptimizerSettings, step_facts
from .statement import RELATION

__all__ = [
    "compute_hidden_state_noise",
    "planned_run",
    "recorded_noise_multiplier",
    "accounted_delta",
    "FLOAT32_MARGIN",
]

# The returned noise is the calibrated one raised by this factor, so that TF-Privacy's float32
# noise (recorded_noise_multiplier) is never below it: two float32 roundings move it by at most
# 2**-23 relative.
FLOAT32_MARGIN = 1.0 + 2.0**-20


def recorded_noise_multiplier(noise_multiplier: float, l2_norm_clip: float) -> float:
    """The noise multiplier the callback reads off ``DPKerasSGDOptimizer(l2_norm_clip,
    noise_multiplier)`` (and :class:`~.regularization.DecoupledL2DPKerasSGDOptimizer`): TF-Privacy
    keeps the clip norm and the noise's standard deviation ``l2_norm_clip * noise_multiplier`` as
    float32, and the noise is their ratio."""
    return float(np.float32(l2_norm_clip * noise_multiplier)) / float(np.float32(l2_norm_clip))


def planned_run(
    n: int,
    batch_size: int,
    epochs: int,
    noise_multiplier: float,
    *,
    sampling: str,
    learning_rate: float,
    l2_norm_clip: float,
    geometry: Optional[LossGeometry],
    l2_regularization: Optional[float] = None,
    last_batch: str = DROPPED,
    secret_batches: bool = True,
    steps_per_epoch: Optional[int] = None,
) -> TrainingRunDpEvent:
    """The core event the callback records for ``epochs`` epochs of a TF-Privacy SGD optimizer
    with these settings (one example per microbatch, one device, a constant learning rate),
    the values as the callback reads them: the learning rate and the clip norm in float32.
    ``l2_regularization``: the L2 term the optimizer adds outside clipping
    (:class:`~.regularization.DecoupledL2DPKerasSGDOptimizer`); ``None``: the geometry's strong
    convexity (0 without a geometry). A declared diameter is taken as the projection to come."""
    sampling = check_dataset_sampling(sampling)
    n, b = check_schedule(n, batch_size, sampling)
    last_batch = check_last_batch(check_dataset_last_batch(last_batch), sampling, n, b)
    epochs = v.positive_int("epochs", epochs)
    if geometry is not None and not isinstance(geometry, LossGeometry):
        raise ParameterError("geometry", f"must be a LossGeometry or None, got {geometry!r}")
    if not isinstance(secret_batches, bool):
        raise ParameterError("secret_batches", f"must be True or False, got {secret_batches!r}")
    if l2_regularization is None:
        l2_regularization = 0.0 if geometry is None else geometry.strong_convexity
    l2_regularization = v.nonnegative_float("l2_regularization", l2_regularization)
    clip = float(np.float32(v.positive_float("l2_norm_clip", l2_norm_clip)))
    lr = float(np.float32(v.positive_float("learning_rate", learning_rate)))
    settings = DPOptimizerSettings(
        name="DecoupledL2DPKerasSGDOptimizer",
        base=OptimizerKind.SGD,
        l2_norm_clip=clip,
        noise_multiplier=v.positive_float("noise_multiplier", noise_multiplier),
        num_microbatches=None,
        gradient_accumulation_steps=1,
        momentum=0.0,
        nesterov=False,
        l2_regularization=l2_regularization,
        gradient_postprocessing=None,
        inverse_time_decay=0.0,
    )
    schedule = keras_schedule(
        n, b, sampling, last_batch=last_batch, secret=secret_batches, steps_per_epoch=steps_per_epoch
    )
    diameter = None if geometry is None else geometry.diameter
    # the model is not seen here: its convexity is the callback's to check when fit starts
    claim = Claim(
        schedule=schedule, geometry=geometry, assume_convex_model=True, default_relation=RELATION, planned=True
    )
    # one epoch; a kept short batch (the last step) is divided by its own size, as TF-Privacy does
    epoch = itertools.groupby(batch_records(schedule, t) for t in range(schedule.steps_per_epoch))
    recorder = claim.recorder(
        (step_facts(settings, lr, batch_size=records, projection_diameter=diameter), len(list(group)))
        for records, group in epoch
    )
    return recorder.run(steps=epochs * schedule.steps_per_epoch, warn=False)


def compute_hidden_state_noise(
    n: int,
    batch_size: int,
    target_epsilon: float,
    epochs: int,
    delta: float,
    *,
    sampling: str,
    learning_rate: float,
    l2_norm_clip: float,
    geometry: Optional[LossGeometry],
    l2_regularization: Optional[float] = None,
    last_batch: str = DROPPED,
    secret_batches: bool = True,
    rel_tol: float = 1e-3,
    steps_per_epoch: Optional[int] = None,
) -> float:
    """The smallest noise multiplier (to ``rel_tol``) whose run reports at most ``target_epsilon``.

    The hidden-state counterpart of ``tensorflow_privacy.compute_noise(n, batch_size,
    target_epsilon, epochs, delta, noise_lbd)`` (the first five arguments are the same; no
    starting guess is needed): ``epochs`` epochs of ``model.fit`` with a TF-Privacy SGD optimizer
    (:class:`~.regularization.DecoupledL2DPKerasSGDOptimizer` or ``DPKerasSGDOptimizer``, one
    example per microbatch, constant learning rate) on the ``sampling`` schedule, accounted by
    :class:`~.callback.HiddenStatePrivacyCallback` with ``geometry`` under REPLACE_ONE, reports
    ``epsilon <= target_epsilon`` at ``delta``. Pass the callback's own configuration (or use
    :meth:`~.callback.HiddenStatePrivacyCallback.compute_noise`, which does) and build the
    optimizer with the returned noise.

    Args:
      n, batch_size, target_epsilon, epochs, delta: as TF-Privacy's ``compute_noise``.
      sampling: the batch schedule (``"full"``, ``"cyclic"``, ``"shuffle_partition"``,
        ``"reshuffle"``, ``"without_replacement"``).
      learning_rate: the optimizer's (constant) learning rate.
      l2_norm_clip: ``C``.
      geometry: the declared :class:`LossGeometry` (with the projection's diameter, if any), or
        ``None`` (composition).
      l2_regularization: the optimizer's L2 term outside clipping; ``None``: the geometry's
        strong convexity.
      last_batch: ``"dropped"`` (a :func:`~.data.batched_dataset`) or ``"kept_own_size"``
        (``fit(x, y, batch_size=b, shuffle=True)`` with ``b`` not dividing ``n``).
      secret_batches: ``False`` when the batches' randomness is public (``fit(shuffle=True)``
        after ``tf.random.set_seed``).
      rel_tol: the search's relative tolerance on the noise.
      steps_per_epoch: ``balls_in_bins`` only: the steps of an epoch (default
        :func:`~hidden_state_accountants.keras.data.balls_in_bins_steps`); the run is calibrated at
        ``delta`` less its padded batches' overflow probability (:func:`~hidden_state_accountants.keras.data.accounted_delta`).

    Raises:
      ParameterError: naming the parameter for bad input, for a claim the settings contradict
        (e.g. ``learning_rate`` at or above ``2/smoothness``), or ``target_epsilon`` when no
        noise reaches it.
    """
    run = planned_run(
        n,
        batch_size,
        epochs,
        1.0,
        sampling=sampling,
        learning_rate=learning_rate,
        l2_norm_clip=l2_norm_clip,
        geometry=geometry,
        l2_regularization=l2_regularization,
        last_batch=last_batch,
        secret_batches=secret_batches,
        steps_per_epoch=steps_per_epoch,
    )
    target_epsilon = v.positive_float("target_epsilon", target_epsilon)
    delta = accounted_delta(v.probability("delta", delta), run, run.steps)
    found = calibrate_noise_multiplier(run, target_epsilon, delta, rel_tol=rel_tol, neighboring_relation=RELATION)
    z = found.noise_multiplier * FLOAT32_MARGIN
    # what the callback will account: the noise as TF-Privacy's float32 state holds it (the
    # vectorized optimizer keeps it exactly); each is checked, not assumed, to meet the target
    for recorded in sorted({z, recorded_noise_multiplier(z, run.clip_norm)}):
        eps = (
            HiddenStateAccountant(neighboring_relation=RELATION)
            .compose(run.replace(noise_multiplier=recorded))
            .get_epsilon(delta)
        )
        if not eps <= target_epsilon:
            raise ParameterError(
                "target_epsilon",
                f"the calibrated noise {found.noise_multiplier:.6g} gives epsilon "
                f"{found.epsilon:.6g}, but {recorded:.9g} (as TF-Privacy stores it) gives {eps:.6g} > "
                f"{target_epsilon:g}; the bound is not monotone there: ask for a slightly smaller target",
            )
    return z
