"""Opacus / PyTorch adapter, installed as ``hidden_state_accountants.opacus``.

Importing it registers the ``"hidden_state"`` accountant with Opacus, so the switch is one
line::

    import hidden_state_accountants.opacus  # registers "hidden_state"
    engine = PrivacyEngine(accountant="hidden_state")

and supplies what makes the hidden-state bounds true: batch samplers with the schedules the
papers analyse, a projection/regularisation hook, and feature clipping. See ``docs/opacus.md``.
"""

from opacus.accountants import create_accountant, register_accountant

from .accountant import MECHANISM, HiddenStateCalibration, OpacusHiddenStateAccountant
from .hooks import FeatureClip, ProjectionHook, base_optimizer_issue, clip_features, hidden_state_update_issue
from .samplers import (
    CyclicBatchSampler,
    FullBatchSampler,
    HiddenStateBatchSampler,
    ShufflePartitionBatchSampler,
    WithoutReplacementBatchSampler,
    sampler_from_state_dict,
)


def _register() -> None:
    try:
        register_accountant(MECHANISM, OpacusHiddenStateAccountant)
    except ValueError:  # already registered: by us (a re-import) or by someone else
        existing = type(create_accountant(MECHANISM))
        if existing.__qualname__ != OpacusHiddenStateAccountant.__qualname__:
            raise ImportError(
                f"Opacus already has an accountant named {MECHANISM!r} ({existing.__module__}."
                f"{existing.__qualname__}); refusing to replace it") from None
        register_accountant(MECHANISM, OpacusHiddenStateAccountant, force=True)


_register()

__all__ = [
    "OpacusHiddenStateAccountant",
    "HiddenStateCalibration",
    "MECHANISM",
    "HiddenStateBatchSampler",
    "CyclicBatchSampler",
    "ShufflePartitionBatchSampler",
    "WithoutReplacementBatchSampler",
    "FullBatchSampler",
    "sampler_from_state_dict",
    "ProjectionHook",
    "FeatureClip",
    "clip_features",
    "hidden_state_update_issue",
    "base_optimizer_issue",
]
