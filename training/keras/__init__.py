"""Keras training tools, installed as ``hidden_state_accountants.keras``.

What makes the papers' assumptions true in a Keras (Keras 2) training run, with TensorFlow alone
(``pip install "hidden-state-accountants[keras]"``; TF-Privacy is not needed):

* :func:`~.data.batched_dataset`: ``tf.data`` pipelines of the core's batch schedules, each with
  its secret seed;
* :class:`~.features.FeatureClip` (a layer that enforces the feature bound of
  :meth:`LossGeometry.logistic_regression <hidden_state_accountants.LossGeometry.logistic_regression>`),
  :func:`~.features.largest_input_norm` (the inputs of the trainable layer on the data, checked
  where no clip enforces the bound) and :class:`~.projection.L2BallProjection` (projection onto an
  L2 ball after every step);
* :class:`~hidden_state_accountants.keras.sbcd.DPSBCD`: DP-SBCD, differentially private block
  coordinate descent for ReLU networks (*Differentially Private Network Training under Hidden
  State Assumption*, ICLR 2025 submission, arXiv:2407.08233), with its accountant. See
  ``docs/dp_sbcd.md``.

The accounting for TF-Privacy (the Keras callback, calibration, the privacy statement) is the
TF-Privacy adapter, ``hidden_state_accountants.tf_privacy``, which re-exports the tools above but
DP-SBCD; ``hidden_state_accountants.tf_privacy.sbcd`` is this package's ``sbcd`` module under its
former name.
"""

from .data import DATASET_SAMPLINGS, batched_dataset, dataset_schedule, partition_indices
from .features import FeatureClip, clip_feature_norms, largest_input_norm
from .projection import L2BallProjection
from .sbcd import DPSBCD, UnsupportedLayerError, parse_model

__all__ = [
    "DPSBCD",
    "UnsupportedLayerError",
    "parse_model",
    "batched_dataset",
    "partition_indices",
    "dataset_schedule",
    "clip_feature_norms",
    "DATASET_SAMPLINGS",
    "FeatureClip",
    "L2BallProjection",
    "largest_input_norm",
]
