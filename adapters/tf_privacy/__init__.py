"""TF-Privacy / Keras adapter, installed as ``hidden_state_accountants.tf_privacy``.

Add one callback to ``model.fit`` and Keras reports the hidden-state epsilon each epoch::

    from hidden_state_accountants import LossGeometry
    from hidden_state_accountants.tf_privacy import (
        DecoupledL2DPKerasSGDOptimizer, HiddenStatePrivacyCallback, batched_dataset)

    # a clip that cannot bind (>= sqrt(2 (R^2 + 1)) = 2 at R = 1): a multi-class model needs it
    opt = DecoupledL2DPKerasSGDOptimizer(l2_norm_clip=2.0, noise_multiplier=1.0,
                                         l2_regularization=0.01, learning_rate=0.5)
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=tf.keras.losses.Reduction.NONE))
    ds = batched_dataset(x, y, batch_size=64, sampling="shuffle_partition")  # a secret seed
    cb = HiddenStatePrivacyCallback(
        geometry=LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=0.01),
        sampling="shuffle_partition", dataset_size=len(x), batch_size=64, delta=1e-5)
    model.fit(ds, epochs=20, callbacks=[cb])   # logs: epsilon, epsilon_composition

The adapter: :class:`HiddenStatePrivacyCallback` (reads the optimizer, the model and what ``fit``
trains on; the core's recording layer decides; budget stop), :func:`compute_hidden_state_noise`
(the hidden-state ``compute_noise``), :func:`compute_hidden_state_privacy_statement` (model-card
text), and the readers :func:`model_facts` and :func:`projection_diameter`. The Keras training tools
(:mod:`hidden_state_accountants.keras`: ``batched_dataset``, ``FeatureClip``, ``L2BallProjection``,
``DecoupledL2DPKerasSGDOptimizer``) are re-exported here. See ``docs/tf_privacy.md``.
"""

from hidden_state_accountants.keras.data import (
    DATASET_SAMPLINGS,
    batched_dataset,
    dataset_schedule,
    partition_indices,
)
from hidden_state_accountants.keras.decoupled_l2 import DecoupledL2DPKerasSGDOptimizer
from hidden_state_accountants.keras.features import FeatureClip, clip_feature_norms, largest_input_norm
from hidden_state_accountants.keras.projection import L2BallProjection

from .calibration import compute_hidden_state_noise, planned_run, recorded_noise_multiplier
from .callback import STATE_ATTRIBUTE, CalibratedRun, EpochPrivacy, HiddenStatePrivacyCallback, PrivacyBudgetExceeded
from .model import install as _install_load_tracking
from .model import model_facts
from .optimizers import DPOptimizerSettings, read_dp_optimizer_settings
from .regularization import inside_clipping_regularizers, projection_diameter, projection_facts
from .statement import compute_hidden_state_privacy_statement

_install_load_tracking()  # Model.load_weights and load_model tell the callback that weights came from storage

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
