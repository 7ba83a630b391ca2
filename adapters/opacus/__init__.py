"""Opacus / PyTorch adapter, installed as ``hidden_state_accountants.opacus``.

Importing it registers the ``"hidden_state"`` accountant with Opacus, so the switch is one
line::

    import hidden_state_accountants.opacus  # registers "hidden_state"
    engine = PrivacyEngine(accountant="hidden_state")

The accountant only reads Opacus (:mod:`.facts`) and the core's recording layer decides what the
facts back (its policy: :mod:`hidden_state_accountants.recording`); for its engines
:mod:`.engine` makes ``make_private_with_epsilon`` calibrate the configured claim and checkpoints
all or nothing. The training tools of :mod:`hidden_state_accountants.pytorch` (samplers,
``FeatureClip``, ``ProjectionHook``: the last imported on first use, as it reads the optimizer
through this adapter) are re-exported here. See ``docs/opacus.md``.
"""

from opacus.accountants import create_accountant, register_accountant

from hidden_state_accountants.pytorch.features import FeatureClip, FeatureNormMonitor, clip_features
from hidden_state_accountants.pytorch.samplers import (
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

from .accountant import MECHANISM, HiddenStateCalibration, OpacusHiddenStateAccountant, sampler_from_checkpoint
from .engine import install as _install_engine
from .engine import load_checkpoint, module_weights_digest, save_checkpoint
from .facts import PROJECTION_ATTR, loader_facts, model_facts, step_facts


def __getattr__(name: str):
    if name == "ProjectionHook":  # on first use: its module imports this adapter's facts
        from hidden_state_accountants.pytorch.projection import ProjectionHook

        return ProjectionHook
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    "EmptyBatchCollate",
    "balls_in_bins_loader",
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
