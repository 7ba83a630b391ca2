"""Input checks that fail with one line naming the parameter and the condition."""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

from hidden_state_accountants.errors import ParameterError  # re-exported: validation.ParameterError


def positive_int(name: str, value: Any, *, maximum: Optional[int] = None, why: str = "") -> int:
    if isinstance(value, bool):
        raise ParameterError(name, f"must be a positive integer, got {value!r}")
    if not isinstance(value, numbers.Integral):
        if isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
            value = int(value)
        else:
            raise ParameterError(name, f"must be a positive integer, got {value!r}")
    if value < 1:
        raise ParameterError(name, f"must be a positive integer, got {value!r}")
    if maximum is not None and value > maximum:
        shown = f"{float(value):.3g}" if value < 10**300 else f"about 1e{len(str(int(value))) - 1}"
        raise ParameterError(name, f"must be at most {maximum:.3g}{why}, got {shown}")
    return int(value)


def positive_float(name: str, value: Any) -> float:
    x = real(name, value)
    if not x > 0:
        raise ParameterError(name, f"must be > 0, got {value!r}")
    return x


def nonnegative_float(name: str, value: Any) -> float:
    x = real(name, value)
    if x < 0:
        raise ParameterError(name, f"must be >= 0, got {value!r}")
    return x


def real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ParameterError(name, f"must be a finite number, got {value!r}")
    x = float(value)
    if not math.isfinite(x):
        raise ParameterError(name, f"must be a finite number, got {value!r}")
    return x


def probability(name: str, value: Any, *, allow_zero: bool = False, allow_one: bool = False) -> float:
    x = real(name, value)
    low_ok = x >= 0 if allow_zero else x > 0
    high_ok = x <= 1 if allow_one else x < 1
    if not (low_ok and high_ok):
        interval = ("[" if allow_zero else "(") + "0, 1" + ("]" if allow_one else ")")
        raise ParameterError(name, f"must lie in {interval}, got {value!r}")
    return x
