"""PyTorch training tools, installed as ``hidden_state_accountants.pytorch``.

What makes the papers' assumptions true in a PyTorch training loop, with torch alone
(``pip install "hidden-state-accountants[torch]"``; Opacus is not needed):

* batch samplers that follow the core's schedules (:mod:`.samplers`: fixed-size shuffled or
  cyclic batches, balls-in-bins, a full batch), each with its secret seed;
* :class:`~.features.FeatureClip`, a first layer that enforces the feature bound of
  :meth:`LossGeometry.logistic_regression <hidden_state_accountants.LossGeometry.logistic_regression>`,
  and :class:`~.features.FeatureNormMonitor`, which measures a layer's inputs in training (the
  Opacus accountant checks the bound with it where no ``FeatureClip`` enforces it);
* :class:`~hidden_state_accountants.pytorch.sbcd.DPSBCD`: DP-SBCD, differentially private block
  coordinate descent for ReLU networks (*Differentially Private Network Training under Hidden
  State Assumption*, ICLR 2025 submission, arXiv:2407.08233), with its accountant. See
  ``docs/dp_sbcd.md``.

The accounting itself (the ``"hidden_state"`` accountant, the engine, the projection hook for
Opacus' DP optimizer) is the Opacus adapter, ``hidden_state_accountants.opacus``, which re-exports
the samplers and ``FeatureClip``.
"""

from .features import FeatureClip, FeatureNormMonitor, clip_features
from .samplers import (
    BallsInBinsBatchSampler,
    EmptyBatchCollate,
    balls_in_bins_loader,
    CyclicBatchSampler,
    FullBatchSampler,
    HiddenStateBatchSampler,
    ReshuffleBatchSampler,
    ShufflePartitionBatchSampler,
    WithoutReplacementBatchSampler,
    has_secret_generator,
    sampler_from_state_dict,
    secret_shuffle,
)
from .sbcd import DPSBCD, UnsupportedLayerError, parse_model

__all__ = [
    "DPSBCD",
    "UnsupportedLayerError",
    "parse_model",
    "FeatureClip",
    "clip_features",
    "FeatureNormMonitor",
    "HiddenStateBatchSampler",
    "CyclicBatchSampler",
    "ShufflePartitionBatchSampler",
    "ReshuffleBatchSampler",
    "WithoutReplacementBatchSampler",
    "FullBatchSampler",
    "BallsInBinsBatchSampler",
    "EmptyBatchCollate",
    "balls_in_bins_loader",
    "secret_shuffle",
    "has_secret_generator",
    "sampler_from_state_dict",
]
