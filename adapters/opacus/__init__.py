"""Opacus / PyTorch adapter, installed as ``hidden_state_accountants.opacus``.

Importing it registers the ``"hidden_state"`` accountant with Opacus, so the switch is one
line::

    import hidden_state_accountants.opacus  # registers "hidden_state"
    engine = PrivacyEngine(accountant="hidden_state")

and supplies what makes the hidden-state bounds true: batch samplers following the core's
schedules (:mod:`.samplers`), a projection/regularisation hook (:mod:`.hooks`), and feature
clipping (:mod:`.features`: a ``FeatureClip`` in front of the trainable layer enforces the
geometry's feature bound; without one the accountant checks the layer's inputs on every batch
before its step). For such engines it also makes ``make_private_with_epsilon`` calibrate the
configured claim, and ``save_checkpoint`` / ``load_checkpoint`` check a whole checkpoint before
applying any of it, bind the ledger to the weights it describes, and write atomically
(:mod:`.engine`). The accountant only reads Opacus (:mod:`.facts`); the core's recording layer
decides what the facts back (its policy: :mod:`hidden_state_accountants.recording`). See
``docs/opacus.md``.
"""

from opacus.accountants import create_accountant, register_accountant

from .accountant import MECHANISM, HiddenStateCalibration, OpacusHiddenStateAccountant, sampler_from_checkpoint
from .engine import install as _install_engine
from .engine import load_checkpoint, module_weights_digest, save_checkpoint
from .facts import PROJECTION_ATTR, loader_facts, model_facts, step_facts
from .features import FeatureClip, FeatureNormMonitor, clip_features
from .hooks import ProjectionHook
from .samplers import (
    BallsInBinsBatchSampler,
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


def _register() -> None:
    try:
        register_accountant(MECHANISM, OpacusHiddenStateAccountant)
    except ValueError:  # already registered: by us (a re-import) or by someone else
        existing = type(create_accountant(MECHANISM))
        if existing.__qualname__ != OpacusHiddenStateAccountant.__qualname__:
            raise ImportError(
                f"Opacus already has an accountant named {MECHANISM!r} ({existing.__module__}."
                f"{existing.__qualname__}); refusing to replace it"
            ) from None
        register_accountant(MECHANISM, OpacusHiddenStateAccountant, force=True)


_register()
_install_engine()  # make_private_with_epsilon calibrates the configured claim; checkpoints all or nothing, atomic

__all__ = [
    "OpacusHiddenStateAccountant",
    "HiddenStateCalibration",
    "MECHANISM",
    "HiddenStateBatchSampler",
    "CyclicBatchSampler",
    "ShufflePartitionBatchSampler",
    "ReshuffleBatchSampler",
    "WithoutReplacementBatchSampler",
    "secret_shuffle",
    "has_secret_generator",
    "FullBatchSampler",
    "BallsInBinsBatchSampler",
    "sampler_from_state_dict",
    "sampler_from_checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "module_weights_digest",
    "ProjectionHook",
    "FeatureClip",
    "FeatureNormMonitor",
    "clip_features",
    "PROJECTION_ATTR",
    "model_facts",
    "loader_facts",
    "step_facts",
]
