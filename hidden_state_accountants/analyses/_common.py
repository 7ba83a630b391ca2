"""What every analysis needs: the order grid, the PLD discretisation, the neighbouring relation,
shared condition checks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

from hidden_state_accountants.errors import NO_GEOMETRY
from hidden_state_accountants.events import TrainingRunDpEvent
from hidden_state_accountants.schedules import visits_per_record
from hidden_state_accountants.rdp import DEFAULT_ORDERS
from hidden_state_accountants.relations import REPLACE_ONE, NeighborRel


@dataclass(frozen=True)
class Context:
    """``neighboring_relation``: dp_accounting's REPLACE_ONE (default, the papers') or
    ADD_OR_REMOVE_ONE; the registry only runs an analysis under a relation it declares."""

    orders: Tuple[float, ...] = DEFAULT_ORDERS
    discretization: float = 1e-3
    neighboring_relation: NeighborRel = REPLACE_ONE


def hidden_state_preconditions(run: TrainingRunDpEvent) -> Optional[str]:
    """Reason no hidden-state theorem applies to ``run`` at all, or ``None``."""
    if run.geometry is None and not run.hidden_state_refusal:
        return NO_GEOMETRY
    reason = run.hidden_state_reason()  # the recording layer's refusal, or the clip against the geometry
    if reason:
        return reason
    if not run.is_constant:
        return (
            "the learning rate or noise multiplier changes during training; the hidden-state "
            "theorems assume both constant"
        )
    return None


def need_strong_convexity(run: TrainingRunDpEvent) -> Optional[str]:
    if run.geometry.strong_convexity <= 0:
        return "needs a strongly convex loss (strong_convexity > 0)"
    if math.log1p(-min(run.learning_rate * run.geometry.strong_convexity, 0.5)) == 0.0:
        return "learning_rate * strong_convexity underflows: the contraction 1 - lr*m is 1 in floating point"
    return None


def need_secret_batches(run: TrainingRunDpEvent) -> Optional[str]:
    """The analyses that average over the record's random position need the draw secret."""
    if not run.secret_batches:
        return (
            "the batches' randomness is public (secret_batches=False): an adversary knows the record's "
            "positions, so only the bounds for the worst position apply"
        )
    return None


def log_abs_one_minus(x: float) -> float:
    """``log |1 - x|`` without cancellation for tiny ``x`` (``-inf`` at ``x = 1``)."""
    if x == 1.0:
        return -math.inf
    return math.log1p(-x) if x < 1.0 else math.log(x - 1.0)


def need_diameter(run: TrainingRunDpEvent) -> Optional[str]:
    if run.geometry.diameter is None:
        return "needs projection onto a bounded convex set (declare its diameter)"
    return None


def need_two_batches(run: TrainingRunDpEvent) -> Optional[str]:
    if run.dataset_size // run.batch_size < 2:
        return f"needs n/b >= 2, got {run.dataset_size}/{run.batch_size}"
    return None


def lr_below(run: TrainingRunDpEvent, limit: float, what: str, strict: bool = True) -> Optional[str]:
    lr = run.learning_rate
    ok = lr < limit if strict else lr <= limit
    if not ok:
        op = "<" if strict else "<="
        return f"needs learning_rate {op} {what} = {limit:.6g}, got {lr:.6g}"
    return None


def first_reason(*reasons: Optional[str]) -> Optional[str]:
    for r in reasons:
        if r:
            return r
    return None


def epochs_visited(run: TrainingRunDpEvent) -> int:
    """Visits of the most-visited record under a fixed order (a partial last epoch counts)."""
    return visits_per_record(run.steps, run.steps_per_epoch)


def log_pow(c: float, k: float) -> float:
    """``log(c**k)`` for ``0 <= c``, finite for huge ``k``."""
    if c == 0:
        return -math.inf if k > 0 else 0.0
    return k * math.log(c)
