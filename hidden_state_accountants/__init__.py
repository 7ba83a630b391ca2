"""Hidden-state (last-iterate) privacy accounting for DP-SGD.

Top-level exports: :class:`HiddenStateAccountant`, a ``dp_accounting.PrivacyAccountant``;
:class:`TrainingRunDpEvent`, the training-run event it accounts (and :class:`DpSbcdRunDpEvent`
for DP-SBCD runs); :class:`LossGeometry`, the declared assumptions; :class:`BatchSchedule`, the batch schedules; the calibration helpers;
and the warning emitted when a run is accounted by composition only. The core never imports
torch or tensorflow; the framework adapters hand their facts to
:mod:`hidden_state_accountants.recording`.
"""

from hidden_state_accountants.accountant import (
    AnalysisReport,
    HiddenStateAccountant,
    PrivacyReport,
    analyze_training_run,
)
from hidden_state_accountants.analyses.sbcd import DpSbcdRunDpEvent  # accounted by HiddenStateAccountant
from hidden_state_accountants.calibration import (
    EpochBudget,
    NoiseCalibration,
    calibrate_noise_multiplier,
    max_epochs_within_budget,
)
from hidden_state_accountants.events import LossGeometry, TrainingRunDpEvent
from hidden_state_accountants.errors import (
    CalibrationWarning,
    CompositionFallbackWarning,
    HiddenStateWarning,
    ParameterError,
)
from hidden_state_accountants.schedules import SAMPLINGS, BatchSchedule

__version__ = "0.1.0.dev0"  # single source: pyproject.toml reads it (CHANGELOG.md)

__all__ = [
    "HiddenStateAccountant",
    "TrainingRunDpEvent",
    "DpSbcdRunDpEvent",
    "LossGeometry",
    "BatchSchedule",
    "CompositionFallbackWarning",
    "CalibrationWarning",
    "HiddenStateWarning",
    "PrivacyReport",
    "AnalysisReport",
    "analyze_training_run",
    "calibrate_noise_multiplier",
    "max_epochs_within_budget",
    "EpochBudget",
    "NoiseCalibration",
    "ParameterError",
    "SAMPLINGS",
]
