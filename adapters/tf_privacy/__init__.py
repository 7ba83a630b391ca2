"""TF-Privacy / Keras adapter, installed as ``hidden_state_accountants.tf_privacy``.

Add one callback to ``model.fit`` and Keras reports the hidden-state epsilon each epoch::

    from hidden_state_accountants import LossGeometry
    from hidden_state_accountants.tf_privacy import (
        DecoupledL2DPKerasSGDOptimizer, HiddenStatePrivacyCallback, batched_dataset)

    opt = DecoupledL2DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0,
                                         l2_regularization=0.01, learning_rate=0.5)
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=tf.keras.losses.Reduction.NONE))
    ds = batched_dataset(x, y, batch_size=64, sampling="shuffle_partition")  # a secret seed
    cb = HiddenStatePrivacyCallback(
        geometry=LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=0.01),
        sampling="shuffle_partition", dataset_size=len(x), batch_size=64, delta=1e-5)
    model.fit(ds, epochs=20, callbacks=[cb])   # logs: epsilon, epsilon_composition

Pieces: :class:`HiddenStatePrivacyCallback` (reads the optimizer, the model and what ``fit``
trains on, and hands the facts to the core's recording layer, which decides; budget stop);
:func:`batched_dataset` (the core's batch schedules as ``tf.data``);
:class:`DecoupledL2DPKerasSGDOptimizer` (L2 outside clipping) and :class:`L2BallProjection`
(projection, diameter reported to the callback); :class:`FeatureClip` (a layer that enforces the
geometry's feature bound; without it the callback checks the data before training);
:func:`model_facts` (the model's structure as the core sees it);
:func:`compute_hidden_state_privacy_statement` (model-card text);
:func:`compute_hidden_state_noise` (the noise for a target epsilon, the hidden-state
``compute_noise``; also :meth:`HiddenStatePrivacyCallback.compute_noise`).
"""

from .calibration import compute_hidden_state_noise, planned_run, recorded_noise_multiplier
from .callback import STATE_ATTRIBUTE, CalibratedRun, EpochPrivacy, HiddenStatePrivacyCallback, PrivacyBudgetExceeded
from .data import DATASET_SAMPLINGS, batched_dataset, clip_feature_norms, dataset_schedule, partition_indices
from .model import FeatureClip, largest_input_norm, model_facts
from .optimizers import DPOptimizerSettings, read_dp_optimizer_settings
from .regularization import (
    DecoupledL2DPKerasSGDOptimizer,
    L2BallProjection,
    inside_clipping_regularizers,
    projection_diameter,
    projection_facts,
)
from .statement import compute_hidden_state_privacy_statement

__all__ = [
    "HiddenStatePrivacyCallback",
    "PrivacyBudgetExceeded",
    "EpochPrivacy",
    "STATE_ATTRIBUTE",
    "batched_dataset",
    "partition_indices",
    "dataset_schedule",
    "model_facts",
    "FeatureClip",
    "largest_input_norm",
    "clip_feature_norms",
    "DATASET_SAMPLINGS",
    "DecoupledL2DPKerasSGDOptimizer",
    "L2BallProjection",
    "projection_diameter",
    "projection_facts",
    "inside_clipping_regularizers",
    "read_dp_optimizer_settings",
    "DPOptimizerSettings",
    "compute_hidden_state_privacy_statement",
    "compute_hidden_state_noise",
    "planned_run",
    "recorded_noise_multiplier",
    "CalibratedRun",
]
