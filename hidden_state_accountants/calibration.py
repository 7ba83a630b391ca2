"""Calibration: the noise a target (epsilon, delta) needs, and how long a budget lasts.

>>> from hidden_state_accountants import TrainingRunDpEvent, LossGeometry, calibrate_noise_multiplier
>>> run = TrainingRunDpEvent.from_epochs(
...     dataset_size=60000, batch_size=1500, epochs=50, noise_multiplier=1.0, clip_norm=1.0,
...     learning_rate=0.05, sampling="cyclic",
...     geometry=LossGeometry(strong_convexity=0.002, smoothness=1.002))
>>> result = calibrate_noise_multiplier(run, target_epsilon=4.34, target_delta=1e-5)
>>> round(result.noise_multiplier, 2), result.epsilon <= 4.34, result.evaluations <= 20
(3.0, True, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

from scipy import optimize

from hidden_state_accountants import validation as v
from hidden_state_accountants.accountant import HiddenStateAccountant, analyze_training_run
from hidden_state_accountants.analyses._common import Context
from hidden_state_accountants.events import TrainingRunDpEvent

# Steps standing in for "forever" when certifying that a budget is never exhausted.
UNBOUNDED_STEPS = 10**15


@dataclass
class NoiseCalibration:
    """The smallest noise multiplier found whose epsilon is at most the target."""

    noise_multiplier: float
    epsilon: float
    analysis: str
    evaluations: int


@dataclass
class EpochBudget:
    """How many epochs fit in a budget.

    ``unlimited`` is True when a bound that never decreases with training length stays
    below the budget for an unbounded run (then ``epochs`` is ``None``); otherwise
    ``epochs`` is the largest whole number of epochs found within the budget (0 if not
    even one fits) and ``epsilon`` its cost.
    """

    epochs: Optional[int]
    epsilon: float
    unlimited: bool
    limit_epsilon: float
    analysis: str
    evaluations: int


def _epsilon(run: TrainingRunDpEvent, delta: float, **accountant_kwargs) -> Tuple[float, str]:
    report = HiddenStateAccountant(**accountant_kwargs).compose(run).explain(delta)
    return report.epsilon, report.analysis


def calibrate_noise_multiplier(
    run: TrainingRunDpEvent,
    target_epsilon: float,
    target_delta: float,
    *,
    rel_tol: float = 1e-3,
    max_evaluations: int = 20,
    **accountant_kwargs,
) -> NoiseCalibration:
    """Smallest noise multiplier (to ``rel_tol``) with best-valid epsilon <= ``target_epsilon``.

    ``run`` supplies everything but the noise. Epsilon falls as noise grows; the search
    brackets the answer geometrically, then runs Brent's method on ``log z``. The returned
    value is one actually evaluated and found within the target, so the guarantee holds
    even where the bound is not exactly monotone.
    """
    v.positive_float("target_epsilon", target_epsilon)
    v.probability("target_delta", target_delta)
    if not run.is_constant:
        raise v.ParameterError("noise_multiplier", "calibration needs a constant noise multiplier and learning rate")
    evals: List[Tuple[float, float, str]] = []

    def eps_at(z: float) -> float:
        if len(evals) >= max_evaluations:
            raise _Budget()
        e, name = _epsilon(run.replace(noise_multiplier=z), target_delta, **accountant_kwargs)
        evals.append((z, e, name))
        return e

    def gap(log_z: float) -> float:
        e = eps_at(math.exp(log_z))
        return (math.log(e) if e > 0 else -50.0) - math.log(target_epsilon)

    try:
        lo = hi = math.log(run.noise_multiplier)
        g_lo = g_hi = gap(lo)
        step = math.log(4.0)
        while g_hi > 0:  # too little noise: move up
            lo, g_lo = hi, g_hi
            hi += step
            g_hi = gap(hi)
        while g_lo <= 0:  # already enough: move down
            hi, g_hi = lo, g_lo
            lo -= step
            g_lo = gap(lo)
            if lo < math.log(1e-6):
                break
        if g_lo > 0 and g_hi <= 0:
            optimize.brentq(gap, lo, hi, xtol=math.log1p(rel_tol), maxiter=max_evaluations)
    except _Budget:
        pass
    feasible = [(z, e, n) for z, e, n in evals if e <= target_epsilon]
    if not feasible:
        raise v.ParameterError(
            "target_epsilon",
            f"not reached with noise multipliers up to {max(z for z, _, _ in evals):.4g} "
            f"in {len(evals)} evaluations",
        )
    z, e, name = min(feasible)
    return NoiseCalibration(noise_multiplier=z, epsilon=e, analysis=name, evaluations=len(evals))


class _Budget(Exception):
    pass


def limit_epsilon(run: TrainingRunDpEvent, delta: float, ctx: Context = Context()) -> Tuple[float, str]:
    """Epsilon valid for *every* length of this run: the smallest limit, over the bounds that
    never decrease with the number of steps, of an (effectively) unbounded run."""
    spe = run.steps_per_epoch
    long_run = run.replace(steps=(UNBOUNDED_STEPS // spe) * spe)
    best = (math.inf, "none")
    for b in analyze_training_run(long_run, ctx):
        if b.applicable and b.monotone_in_steps:
            if b.kind == "fdp":
                continue  # composition PLDs diverge; no f-DP bound here has a finite limit
            best = min(best, (b.epsilon(delta), b.name))
    return best


def max_epochs_within_budget(
    run: TrainingRunDpEvent,
    target_epsilon: float,
    target_delta: float,
    *,
    max_epochs: int = 100_000,
    **accountant_kwargs,
) -> EpochBudget:
    """The largest whole number of epochs of ``run`` whose best-valid epsilon fits the budget.

    First checks whether the budget is never exhausted (:func:`limit_epsilon`); then
    doubles the number of epochs until the budget is exceeded and bisects, assuming the
    reported epsilon does not decrease with more epochs (true for every bound used in the
    limit; each evaluated point is a valid bound regardless).
    """
    v.positive_float("target_epsilon", target_epsilon)
    v.probability("target_delta", target_delta)
    max_epochs = v.positive_int("max_epochs", max_epochs)
    ctx = Context(**{k: accountant_kwargs[k] for k in ("orders",) if k in accountant_kwargs})
    lim, lim_name = limit_epsilon(run, target_delta, ctx)
    evaluations = 1
    if lim <= target_epsilon:
        return EpochBudget(None, lim, True, lim, lim_name, evaluations)
    spe = run.steps_per_epoch

    def eps(e: int) -> Tuple[float, str]:
        nonlocal evaluations
        evaluations += 1
        return _epsilon(run.replace(steps=e * spe), target_delta, **accountant_kwargs)

    good, good_eps = 0, (0.0, "none")
    e = 1
    bad = None
    while e <= max_epochs:
        val = eps(e)
        if val[0] > target_epsilon:
            bad = e
            break
        good, good_eps = e, val
        if e == max_epochs:
            break
        e = min(2 * e, max_epochs)
    if bad is not None:
        while bad - good > 1:
            mid = (good + bad) // 2
            val = eps(mid)
            if val[0] <= target_epsilon:
                good, good_eps = mid, val
            else:
                bad = mid
    return EpochBudget(good, good_eps[0], False, lim, good_eps[1], evaluations)
