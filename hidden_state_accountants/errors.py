"""The package's exceptions, warnings and shared messages, in a module that imports nothing else
of the package, so every layer (analyses, recording, calibration, adapters) can use them without
an import circle.

Every warning the package emits is a :class:`HiddenStateWarning`: one filter silences or
escalates them all.

>>> issubclass(CompositionFallbackWarning, HiddenStateWarning), issubclass(HiddenStateWarning, UserWarning)
(True, True)
>>> err = ParameterError("batch_size", "must be <= dataset_size (10), got 12")
>>> err.parameter, str(err)
('batch_size', 'batch_size: must be <= dataset_size (10), got 12')
"""

from __future__ import annotations


class ParameterError(ValueError):
    """A parameter violates a stated condition; ``parameter`` names it, ``reason`` says what
    does not hold (the message without the parameter's name)."""

    def __init__(self, parameter: str, message: str):
        super().__init__(f"{parameter}: {message}")
        self.parameter = parameter
        self.reason = message


class UnsupportedLayerError(ParameterError):
    """The model contains a layer or structure DP-SBCD does not support (both DP-SBCD trainers)."""

    def __init__(self, message: str):
        super().__init__("model", message)


class HiddenStateWarning(UserWarning):
    """Base class of this package's warnings."""


class CompositionFallbackWarning(HiddenStateWarning):
    """A training run is accounted by composition only; the message says why."""


class CalibrationWarning(HiddenStateWarning):
    """A calibration result that is valid (within the target) but not certified to be the
    smallest noise within ``rel_tol``, or an epoch budget not certified to be the largest."""


class SbcdAssumptionWarning(HiddenStateWarning):
    """DP-SBCD's hidden-state bound (Thm 4.5) was asked for (``paper_assumptions=True``) on a run it is
    not proved for (two or more blocks); the message says why, and the composition bound is reported."""


NO_GEOMETRY = (
    "no loss geometry declared: without strong convexity/smoothness or a bounded domain no hidden-state claim is made"
)
"""Why a run without a declared geometry gets no hidden-state claim (reports, notes, warnings)."""


__all__ = [
    "ParameterError",
    "UnsupportedLayerError",
    "HiddenStateWarning",
    "CompositionFallbackWarning",
    "CalibrationWarning",
    "SbcdAssumptionWarning",
    "NO_GEOMETRY",
]
