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
import time
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np
from scipy import optimize

from hidden_state_accountants import fdp
from hidden_state_accountants import rdp as rdp_tools
from hidden_state_accountants import validation as v
from hidden_state_accountants.accountant import HiddenStateAccountant, analyze_training_run, normalised
from hidden_state_accountants.analyses import registry
from hidden_state_accountants.analyses._common import Context
from hidden_state_accountants.bounds import Bound
from hidden_state_accountants.events import TrainingRunDpEvent
from hidden_state_accountants.relations import schedule_reason
from hidden_state_accountants.schedules import EPOCH_ORDERS, FULL, visits_per_record

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


def _context(accountant_kwargs) -> Context:
    """The accountant's order grid and PLD discretisation (validated by the accountant)."""
    acc = HiddenStateAccountant(**accountant_kwargs)
    return acc._ctx  # noqa: SLF001 (the same context the accountant analyses with)


# The noise range searched.
_Z_MIN, _Z_MAX = 1e-8, 1e150
RDP_MIN = "rdp_pointwise_min"
# An analysis evaluated faster than this counts as cheap (closed forms).
CHEAP_SECONDS = 0.02


class _Candidates:
    """Every analysis of the run as a function of the noise multiplier, cached per value.

    The accountant reports the smallest epsilon over its analyses and over the pointwise
    minimum of their RDP curves (``rdp_pointwise_min``). Each of these is non-increasing in
    the noise, so the smallest noise whose best epsilon meets a target is the smallest over
    the candidates of the noise each one needs alone. That lets the search run on the cheap
    analyses first and touch an expensive one (a long PLD composition, dp_accounting's
    sampled-Gaussian RDP) only where it could do better.
    """

    def __init__(self, run: TrainingRunDpEvent, delta: float, ctx: Context):
        self.run = normalised(run.replace(noise_multiplier=1.0))
        self.delta, self.ctx = delta, ctx
        # only the analyses proved for the accountant's neighbouring relation (as analyze_training_run)
        self.infos = [i for i in registry.analyses_for(run.sampling)
                      if not i.relation_reason(ctx.neighboring_relation, run.sampling)]
        self.bounds: Dict[Tuple[str, float], Bound] = {}
        self.seconds: Dict[str, float] = {}
        self.noises = set()

    def bound(self, name: str, z: float) -> Bound:
        key = (name, z)
        if key not in self.bounds:
            info = registry.get(name)
            self.noises.add(z)
            start = time.perf_counter()
            self.bounds[key] = info.function(self.run.replace(noise_multiplier=z), self.ctx)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        return self.bounds[key]

    def epsilon(self, name: str, z: float) -> float:
        if name == RDP_MIN:
            return self._rdp_min(z)[0]
        b = self.bound(name, z)
        return b.epsilon(self.delta) if b.applicable else math.inf

    def _rdp_min(self, z: float) -> Tuple[float, str]:
        curves = []
        for info in self.infos:
            b = self.bound(info.name, z)
            if b.applicable and b.kind in ("rdp", "gdp"):
                curve = b.rdp(self.ctx.orders)
                if curve is not None:
                    curves.append((info.name, curve))
        if len(curves) < 2:
            return math.inf, "none"
        stack = np.vstack([c for _, c in curves])
        eps, order = rdp_tools.rdp_to_epsilon(self.ctx.orders, np.min(stack, axis=0), self.delta)
        if not math.isfinite(order):
            return math.inf, "none"
        return eps, RDP_MIN

    def best(self, z: float) -> Tuple[float, str]:
        """The accountant's choice at ``z`` among the candidates already computed there
        (those not computed there need more noise than ``z`` to meet the target)."""
        options = [(self.bounds[(i.name, z)].epsilon(self.delta), i.name) for i in self.infos
                   if (i.name, z) in self.bounds and self.bounds[(i.name, z)].applicable]
        if all((i.name, z) in self.bounds for i in self.infos):
            eps, name = self._rdp_min(z)
            if name == RDP_MIN:
                options.append((eps + 1e-12, name))  # the accountant prefers a named analysis on ties
        return min(options) if options else (math.inf, "none")


def noise_estimate(run: TrainingRunDpEvent, target_epsilon: float, target_delta: float) -> float:
    """A closed-form starting point for the search, independent of the run's own noise: the
    noise at which the schedule's composition baseline is about ``G(mu)`` with
    ``eps_{G(mu)}(delta) = target`` (Dong, Roth & Su 2022, Cor. 2.13):

    * ``full``: ``mu = 2 sqrt(T) / z`` (Bok et al. 2024, Thm 4.1);
    * ``cyclic`` / ``shuffle_partition`` / ``reshuffle``: ``mu = 2 sqrt(E) / z`` (Bok et al. Thm 4.4);
    * ``poisson`` / ``without_replacement``: the CLT of ``C_q(G(2/z))^{(x) T}`` (Bok et al.
      Lemma A.5), solved for ``z``.

    Only where the search starts depends on it; hidden-state bounds can need far less noise.
    """
    g = lambda log_mu: math.log(max(fdp.gdp_epsilon(math.exp(log_mu), target_delta), 1e-300)) - math.log(target_epsilon)
    lo, hi = -30.0, 30.0
    if g(lo) >= 0:
        mu = math.exp(lo)
    elif g(hi) <= 0:
        mu = math.exp(hi)
    else:
        mu = math.exp(optimize.brentq(g, lo, hi, xtol=1e-6))
    if run.sampling == FULL:
        z = 2.0 * math.sqrt(run.steps) / mu
    elif run.sampling in EPOCH_ORDERS:
        z = 2.0 * math.sqrt(visits_per_record(run.steps, run.steps_per_epoch)) / mu
    else:
        q = run.sampling_rate
        def h(log_z):
            clt = float(fdp.subsampled_gaussian_clt_mu(2.0 / math.exp(log_z), q, run.steps))
            return min(700.0, math.log(max(clt, 1e-300)) - math.log(mu)) if not math.isnan(clt) else 700.0

        lo_z, hi_z = math.log(1e-2), math.log(1e12)
        if h(lo_z) <= 0:
            z = 1e-2
        elif h(hi_z) >= 0:
            z = 1e12
        else:
            z = math.exp(optimize.brentq(h, lo_z, hi_z, xtol=1e-6))
    return float(min(max(z, _Z_MIN), _Z_MAX))


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

    ``run`` supplies everything but the noise: the result does not depend on the noise the
    run carries. The search starts from :func:`noise_estimate` and works per analysis
    (see :class:`_Candidates`): the cheapest analyses first, each bracketed geometrically and
    then solved with Brent's method on ``log z``; a costlier analysis is evaluated at the best
    noise found so far and searched only if it meets the target there. ``max_evaluations``
    bounds the evaluations of each analysis. The returned value is one actually evaluated and
    found within the target, so the guarantee holds even where a bound is not exactly
    monotone; ``epsilon`` and ``analysis`` are what the accountant reports at that noise.
    ``evaluations`` counts the noise values at which some analysis was evaluated.
    """
    target_epsilon = v.positive_float("target_epsilon", target_epsilon)
    target_delta = v.probability("target_delta", target_delta)
    max_evaluations = v.positive_int("max_evaluations", max_evaluations)
    rel_tol = v.positive_float("rel_tol", rel_tol)
    if rel_tol >= 1:
        raise v.ParameterError("rel_tol", f"must be < 1, got {rel_tol!r}")
    if not run.is_constant:
        raise v.ParameterError("noise_multiplier", "calibration needs a constant noise multiplier and learning rate")
    cands = _Candidates(run, target_delta, _context(accountant_kwargs))
    if not cands.infos:
        relation = cands.ctx.neighboring_relation
        raise v.ParameterError("neighboring_relation", f"no analysis holds for sampling={run.sampling!r} under "
                               f"{relation.name}: {schedule_reason(relation, run.sampling)}")
    z0 = noise_estimate(run, target_epsilon, target_delta)
    log_target = math.log(target_epsilon)
    min_step, max_step = math.log1p(rel_tol), math.log(64.0)

    def gap(name: str, log_z: float) -> float:
        e = cands.epsilon(name, math.exp(log_z))
        if e == 0:
            return -700.0
        return (math.log(e) if math.isfinite(e) else 700.0) - log_target

    def search(name: str, x: float, g: float) -> Optional[float]:
        """Smallest evaluated noise at which ``name`` meets the target, from ``(log z, gap)``.

        Secant steps in ``(log z, log eps)`` (slope -1, i.e. ``eps ~ 1/z``, until two points
        give one) find a point on the other side of the target, then Brent's method closes
        the bracket to ``rel_tol``."""
        feasible = [math.exp(x)] if g <= 0 else []
        used = [0]

        def f(log_z: float) -> float:
            if used[0] >= max_evaluations and (name, math.exp(log_z)) not in cands.bounds:
                raise _Budget()
            used[0] += 1
            value = gap(name, log_z)
            if value <= 0:
                feasible.append(math.exp(log_z))
            return value

        slope = -1.0
        try:
            while True:
                step = -g / slope
                step = math.copysign(min(max_step, max(min_step, abs(step) * 1.1 + min_step)), step if step else -g)
                x_new = x + step
                if not math.log(_Z_MIN) <= x_new <= math.log(_Z_MAX):
                    return min(feasible) if feasible else None
                g_new = f(x_new)
                if (g_new > 0) != (g > 0):
                    lo, hi = (x_new, x) if g_new > 0 else (x, x_new)
                    optimize.brentq(f, lo, hi, xtol=min_step / 2, maxiter=max_evaluations)
                    break
                if x_new != x and abs(g_new - g) < 1400 and (g_new - g) / (x_new - x) < 0:
                    slope = (g_new - g) / (x_new - x)
                x, g = x_new, g_new
        except (_Budget, RuntimeError):
            pass
        return min(feasible) if feasible else None

    # every analysis once at the estimate; rdp_pointwise_min comes free there
    for info in cands.infos:
        cands.bound(info.name, z0)
    x0 = math.log(z0)
    names = [i.name for i in cands.infos]
    if sum(cands.bounds[(n, z0)].kind in ("rdp", "gdp") for n in names) >= 2:
        names.append(RDP_MIN)
    g0 = {n: gap(n, x0) for n in names}
    # cheap analyses (closed forms) first; within a cost class the smaller epsilon first
    order = sorted(names, key=lambda n: (n == RDP_MIN, cands.seconds.get(n, 0.0) > CHEAP_SECONDS, g0[n]))
    best_z = None
    if not any(g0[n] <= 0 for n in order):
        # nothing meets the target at the estimate: search up with the most promising analysis (the
        # smallest epsilon there, not the cheapest: that one may not apply to the run at all)
        first = min(order, key=lambda n: g0[n])
        best_z = search(first, x0, g0[first])
        if best_z is None:
            raise v.ParameterError(
                "target_epsilon",
                f"not reached with noise multipliers up to {max(cands.noises):.4g} "
                f"({max_evaluations} evaluations per analysis)")
        candidates = [n for n in order if n != first]
    else:
        # an analysis that misses the target at z0 misses it at every smaller noise: skipped
        candidates = [n for n in order if g0[n] <= 0]
    for name in candidates:
        if best_z is None:
            best_z = search(name, x0, g0[name])
            continue
        x = math.log(best_z)
        g = gap(name, x)  # one evaluation tells whether it can do better
        if g <= 0:
            found = search(name, x, g)
            if found is not None and found < best_z:
                best_z = found
    eps, name = cands.best(best_z)
    if name == RDP_MIN:
        eps -= 1e-12
    return NoiseCalibration(noise_multiplier=best_z, epsilon=eps, analysis=name, evaluations=len(cands.noises))


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
    ctx = _context(accountant_kwargs)  # the accountant's orders, discretisation and neighbouring relation
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
