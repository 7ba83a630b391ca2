"""Input checks that fail with one line naming the parameter and the condition."""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

import numpy as np

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
        raise ParameterError(name, f"must be at most {maximum:.3g}{why}, got {count_text(value)}")
    return int(value)


def count_text(value: int) -> str:
    """A (possibly huge) integer in three significant digits, never an ``OverflowError``.

    >>> count_text(12345), count_text(10**400)
    ('1.23e+04', 'about 1e400')
    """
    return f"{float(value):.3g}" if abs(value) < 10**300 else f"about 1e{len(str(abs(int(value)))) - 1}"


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


def real_vector(name: str, values: Any, *, low: float, high: float = math.inf) -> np.ndarray:
    """A non-empty one-dimensional sequence of finite real numbers in ``[low, high]``, as a float
    array; anything else (a string, a scalar, a nested list, NaN, a value out of range) raises
    naming ``name``.

    >>> real_vector("alphas", [0, 0.5, 1], low=0.0, high=1.0).tolist()
    [0.0, 0.5, 1.0]
    """
    interval = f"[{low:g}, {high:g}]" if math.isfinite(high) else f">= {low:g}"
    wanted = f"must be a non-empty 1-D sequence of finite numbers {'in ' if math.isfinite(high) else ''}{interval}"
    if isinstance(values, (str, bytes)):
        raise ParameterError(name, f"{wanted}, got {values!r}")
    try:
        array = np.asarray(values)
    except (TypeError, ValueError):  # ragged nesting
        raise ParameterError(name, f"{wanted}, got {values!r}") from None
    if array.ndim != 1 or array.size == 0 or array.dtype.kind not in "iuf":
        raise ParameterError(name, f"{wanted}, got {values!r}")
    array = array.astype(float)
    bad = ~(np.isfinite(array) & (array >= low) & (array <= high))
    if np.any(bad):
        raise ParameterError(name, f"{wanted}, got {float(array[bad][0])!r}")
    return array
