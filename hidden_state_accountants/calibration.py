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
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import attr
from scipy import optimize

from hidden_state_accountants import fdp
from hidden_state_accountants import validation as v
from hidden_state_accountants.accountant import HiddenStateAccountant, PrivacyReport, accountant_with, normalised
from hidden_state_accountants.analyses import registry
from hidden_state_accountants.analyses._common import Context
from hidden_state_accountants.bounds import Bound
from hidden_state_accountants.events import TrainingRunDpEvent
from hidden_state_accountants.errors import CalibrationWarning  # re-exported
from hidden_state_accountants.relations import schedule_reason
from hidden_state_accountants.selection import (
    NONE,
    RDP_POINTWISE_MIN,
    bound_epsilon,
    pointwise_rdp_minimum,
    select_best,
)
from hidden_state_accountants.schedules import (
    EPOCH_ORDERS,
    FULL,
    MAX_STEPS,
    UNBOUNDED_STEPS,
    visits_per_record,
)  # re-exported


@dataclass
class NoiseCalibration:
    """The smallest noise multiplier found whose epsilon is at most the target."""

    noise_multiplier: float
    epsilon: float
    analysis: str
    evaluations: int
    # certified within rel_tol of the smallest noise (else a CalibrationWarning was issued)
    converged: bool = True


@dataclass
class EpochBudget:
    """How many epochs fit in a budget.

    ``unlimited`` is True when a bound that never decreases with training length stays
    below the budget for an unbounded run (then ``epochs`` is ``None``); otherwise
    ``epochs`` is the largest whole number of epochs such that every run of at most that many
    epochs fits the budget (0 if not even one fits) and ``epsilon`` its cost
    (:func:`max_epochs_within_budget`).
    """

    epochs: Optional[int]
    epsilon: float
    unlimited: bool
    limit_epsilon: float
    analysis: str
    evaluations: int
    # epsilon after one epoch more than ``epochs`` (the first over the budget), when evaluated
    next_epsilon: Optional[float] = None
    # the accountant's report after ``epochs`` (after one epoch when none fits; of an unbounded
    # run when ``unlimited``), with every analysis and its reason
    report: Optional[PrivacyReport] = None
    # the analysis giving ``limit_epsilon``
    limit_analysis: str = "none"
    # False when the epoch-by-epoch check beyond the monotone bounds' prefix stopped (MAX_SCAN)
    # before finding the first epoch over the budget: longer runs may fit too
    complete: bool = True


def accountant_context(accountant_kwargs) -> Context:
    """The accountant's order grid and PLD discretisation (validated by the accountant; an unknown
    keyword is refused by name)."""
    return accountant_with(accountant_kwargs).context


# The noise range searched.
_Z_MIN, _Z_MAX = 1e-8, 1e150
RDP_MIN = RDP_POINTWISE_MIN
# An analysis evaluated faster than this counts as cheap (closed forms).
CHEAP_SECONDS = 0.02


class _Candidates:
    """Every analysis of the run as a function of the noise multiplier, cached per value.

    The accountant reports the smallest epsilon over its analyses and over the pointwise
    minimum of their RDP curves (``rdp_pointwise_min``; the rule is
    :func:`~hidden_state_accountants.selection.select_best`, shared with the accountant). Each of
    these is non-increasing in the noise, so the smallest noise whose best epsilon meets a target
    is the smallest over the candidates of the noise each one needs alone. That lets the search run on the cheap
    analyses first and touch an expensive one (a long PLD composition, dp_accounting's
    sampled-Gaussian RDP) only where it could do better.
    """

    def __init__(self, run: TrainingRunDpEvent, delta: float, ctx: Context):
        self.run = normalised(run.replace(noise_multiplier=1.0))
        self.delta, self.ctx = delta, ctx
        # only the analyses proved for the accountant's neighbouring relation (as analyze_training_run),
        # of the schedule analysed (a Poisson run using every record is full-batch training)
        sampling = self.run.sampling
        self.infos = [
            i for i in registry.analyses_for(sampling) if not i.relation_reason(ctx.neighboring_relation, sampling)
        ]
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
            best = pointwise_rdp_minimum([self.bound(i.name, z) for i in self.infos], self.ctx.orders, self.delta)
            return math.inf if best is None else best.epsilon
        return bound_epsilon(self.bound(name, z), self.delta)

    def best(self, z: float) -> Tuple[float, str]:
        """The accountant's choice at ``z`` among the candidates already computed there
        (those not computed there need more noise than ``z`` to meet the target; the pointwise
        minimum counts once every analysis is computed there)."""
        computed = [self.bounds[(i.name, z)] for i in self.infos if (i.name, z) in self.bounds]
        best = select_best(computed, self.delta, self.ctx.orders, pointwise=len(computed) == len(self.infos))
        return (best.epsilon, best.analysis) if math.isfinite(best.epsilon) else (math.inf, NONE)


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


def _check_run(run) -> TrainingRunDpEvent:
    if not isinstance(run, TrainingRunDpEvent):
        raise v.ParameterError("run", f"must be a TrainingRunDpEvent (the run to calibrate), got {run!r}")
    return run


def check_relation(run: TrainingRunDpEvent, ctx: Context) -> None:
    """The refusal when no analysis holds for the run's schedule under the accountant's relation
    (the fixed-size schedules under ADD_OR_REMOVE_ONE), the same for every calibration helper."""
    if not any(
        not i.relation_reason(ctx.neighboring_relation, run.sampling) for i in registry.analyses_for(run.sampling)
    ):
        relation = ctx.neighboring_relation
        raise v.ParameterError(
            "neighboring_relation",
            f"no analysis holds for sampling={run.sampling!r} under "
            f"{relation.name}: {schedule_reason(relation, run.sampling)}",
        )


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

    ``converged`` says whether the result is certified to be within ``rel_tol`` of the
    smallest noise (each analysis non-increasing in the noise): every searched analysis ended
    with an evaluated noise at most ``rel_tol`` below its answer that missed the target. When
    ``max_evaluations`` stops a search first, the result is still within the target but may be
    far above the smallest noise: a :class:`CalibrationWarning` says so, with the bracket.
    """
    run = _check_run(run)
    target_epsilon = v.positive_float("target_epsilon", target_epsilon)
    target_delta = v.probability("target_delta", target_delta)
    max_evaluations = v.positive_int("max_evaluations", max_evaluations)
    rel_tol = v.positive_float("rel_tol", rel_tol)
    if rel_tol >= 1:
        raise v.ParameterError("rel_tol", f"must be < 1, got {rel_tol!r}")
    if not run.is_constant:
        raise v.ParameterError("noise_multiplier", "calibration needs a constant noise multiplier and learning rate")
    ctx = accountant_context(accountant_kwargs)
    check_relation(run, ctx)
    cands = _Candidates(run, target_delta, ctx)
    z0 = noise_estimate(run, target_epsilon, target_delta)
    log_target = math.log(target_epsilon)
    min_step, max_step = math.log1p(rel_tol), math.log(64.0)
    # per searched analysis, the largest evaluated noise that missed the target below its answer
    below: Dict[str, float] = {}

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
        missed = [] if g <= 0 else [math.exp(x)]
        used, at_floor = [0], [False]

        def f(log_z: float) -> float:
            if used[0] >= max_evaluations and (name, math.exp(log_z)) not in cands.bounds:
                raise _Budget()
            used[0] += 1
            value = gap(name, log_z)
            (feasible if value <= 0 else missed).append(math.exp(log_z))
            return value

        def result() -> Optional[float]:
            if not feasible:
                below[name] = max(missed, default=0.0)
                return None
            best = min(feasible)
            # at the bottom of the searched range nothing smaller is sought: the bracket is closed
            below[name] = best if at_floor[0] else max([z for z in missed if z < best], default=0.0)
            return best

        slope = -1.0
        try:
            while True:
                step = -g / slope
                step = math.copysign(min(max_step, max(min_step, abs(step) * 1.1 + min_step)), step if step else -g)
                x_new = x + step
                if x_new < math.log(_Z_MIN):
                    at_floor[0] = True
                    return result()
                if x_new > math.log(_Z_MAX):
                    return result()
                g_new = f(x_new)
                if (g_new > 0) != (g > 0):
                    lo, hi = (x_new, x) if g_new > 0 else (x, x_new)
                    # xtol a quarter step: the last bracket is then narrower than rel_tol
                    optimize.brentq(f, lo, hi, xtol=min_step / 4, maxiter=max_evaluations)
                    break
                if x_new != x and abs(g_new - g) < 1400 and (g_new - g) / (x_new - x) < 0:
                    slope = (g_new - g) / (x_new - x)
                x, g = x_new, g_new
        except (_Budget, RuntimeError):
            pass
        return result()

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
                f"({max_evaluations} evaluations per analysis)",
            )
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
    # the smallest noise lies in (lower, best_z]: no analysis met the target at or below its `below`
    lower = min(below.values(), default=0.0)
    converged = best_z <= lower * (1.0 + rel_tol) * (1.0 + 1e-12)
    if not converged:
        warnings.warn(
            CalibrationWarning(
                f"calibration stopped by max_evaluations={max_evaluations} before closing the bracket: noise "
                f"multiplier {best_z:.6g} meets the target (epsilon {eps:.6g} <= {target_epsilon:g}) but the smallest "
                f"that does lies somewhere in ({lower:.6g}, {best_z:.6g}], not certified within rel_tol={rel_tol:g}; "
                "raise max_evaluations"
            ),
            stacklevel=2,
        )
    return NoiseCalibration(
        noise_multiplier=best_z, epsilon=eps, analysis=name, evaluations=len(cands.noises), converged=converged
    )


def run_differences(run: TrainingRunDpEvent, calibrated: TrainingRunDpEvent) -> List[str]:
    """The fields in which ``run`` differs from the ``calibrated`` run, each with both values, for the
    refusal of a run that does not meet the target it was calibrated for. More noise than calibrated is
    no difference (a framework may store the noise multiplier rounded up).

    >>> from hidden_state_accountants import TrainingRunDpEvent
    >>> a = TrainingRunDpEvent(dataset_size=100, batch_size=10, steps=10, noise_multiplier=1.0,
    ...                        clip_norm=1.0, learning_rate=0.1, sampling="cyclic")
    >>> run_differences(a.replace(learning_rate=0.2, noise_multiplier=2.0), a)
    ['learning_rate 0.2 (calibrated: 0.1)']
    """

    def differs(name: str) -> bool:
        mine, theirs = getattr(run, name), getattr(calibrated, name)
        if name == "geometry" and None not in (mine, theirs) and theirs.num_classes is None:
            # classes the calibration could not see (no model): unknown counts as three or more, so the run's
            # own number of classes can only lower its epsilon
            mine = attr.evolve(mine, num_classes=None)
        return mine < theirs if name == "noise_multiplier" and isinstance(mine, float) else mine != theirs

    return [
        f"{f.name} {getattr(run, f.name)!r} (calibrated: {getattr(calibrated, f.name)!r})"
        for f in attr.fields(TrainingRunDpEvent)
        if differs(f.name)
    ]


class _Budget(Exception):
    pass


def _accountant(ctx: Context) -> HiddenStateAccountant:
    return HiddenStateAccountant(
        orders=ctx.orders, neighboring_relation=ctx.neighboring_relation, pld_discretization=ctx.discretization
    )


def _monotone_epsilon(report: PrivacyReport) -> Tuple[float, str]:
    """The smallest epsilon among the report's analyses flagged ``monotone_in_steps``."""
    values = [
        (a.epsilon, a.name)
        for a in report.analyses
        if a.monotone_in_steps and a.epsilon is not None and not math.isnan(a.epsilon)
    ]
    return min(values, default=(math.inf, "none"))


def limit_report(run: TrainingRunDpEvent, delta: float, ctx: Context = Context()) -> PrivacyReport:
    """The accountant's report for an (effectively) unbounded run of ``run``'s schedule:
    ``UNBOUNDED_STEPS`` steps, whole epochs."""
    _check_run(run)
    spe = run.steps_per_epoch
    long_run = run.replace(steps=max(1, UNBOUNDED_STEPS // spe) * spe)
    return _accountant(ctx).compose(long_run).explain(delta)


def limit_epsilon(run: TrainingRunDpEvent, delta: float, ctx: Context = Context()) -> Tuple[float, str]:
    """Epsilon valid for *every* length of this run: the smallest, over the analyses flagged
    ``monotone_in_steps`` (whose epsilon at ``T`` steps bounds every run of at most ``T`` steps;
    the pointwise RDP minimum counts when all its curves are), of the epsilon of an
    (effectively) unbounded run (:func:`limit_report`). Every kind of bound counts (RDP, GDP,
    f-DP, mixtures, capped): a composition diverges on its own and says so, a converging
    hidden-state bound gives its limit."""
    return _monotone_epsilon(limit_report(run, delta, ctx))


# Epochs checked one by one beyond the prefix that the monotone bounds certify.
MAX_SCAN = 64


def max_epochs_within_budget(
    run: TrainingRunDpEvent,
    target_epsilon: float,
    target_delta: float,
    *,
    max_epochs: int = 100_000,
    **accountant_kwargs,
) -> EpochBudget:
    """The largest whole number of epochs ``E`` (at most ``max_epochs``) such that the run's
    best-valid epsilon fits the budget after *every* number of epochs up to ``E``: training
    may stop at any epoch up to ``E`` and stay within the budget, and ``E + 1`` epochs would
    exceed it (the first epoch that does, minus one). ``next_epsilon`` is the cost of that
    ``(E + 1)``-th epoch when it was evaluated.

    First checks whether the budget is never exhausted (:func:`limit_epsilon`). Then, without
    assuming that the reported epsilon grows with the length (an analysis not flagged
    ``monotone_in_steps``, e.g. one choosing its parameters per length, may dip):

    1. the prefix the monotone bounds certify: the largest ``E`` whose smallest
       ``monotone_in_steps`` epsilon fits (doubling, then bisection: that minimum is
       non-decreasing in the length by the flag's contract); every shorter run fits too;
    2. beyond it, epoch by epoch with the full accountant until the first epoch that exceeds
       the budget, at most ``MAX_SCAN`` epochs; if the scan ends first, the result is the last
       epoch checked and a :class:`CalibrationWarning` says that longer runs may fit.
    """
    run = _check_run(run)
    target_epsilon = v.positive_float("target_epsilon", target_epsilon)
    target_delta = v.probability("target_delta", target_delta)
    max_epochs = v.positive_int("max_epochs", max_epochs)
    ctx = accountant_context(accountant_kwargs)  # the accountant's orders, discretisation and neighbouring relation
    check_relation(run, ctx)
    spe = run.steps_per_epoch
    if max_epochs * spe > MAX_STEPS:
        raise v.ParameterError(
            "max_epochs",
            f"must be at most {MAX_STEPS // spe} ({spe} steps per epoch, at most "
            f"{MAX_STEPS:.0e} steps in all), got {max_epochs}",
        )
    limit = limit_report(run, target_delta, ctx)
    lim, lim_name = _monotone_epsilon(limit)
    if lim <= target_epsilon:
        return EpochBudget(None, lim, True, lim, lim_name, 1, report=limit, limit_analysis=lim_name)
    cache: Dict[int, Tuple[float, str, float, PrivacyReport]] = {}

    def evaluate(e: int) -> Tuple[float, str, float, PrivacyReport]:
        """(reported epsilon, its analysis, smallest epsilon of a monotone bound, report) after ``e`` epochs."""
        if e not in cache:
            report = _accountant(ctx).compose(run.replace(steps=e * spe)).explain(target_delta)
            cache[e] = (report.epsilon, report.analysis, _monotone_epsilon(report)[0], report)
        return cache[e]

    # 1. the prefix certified by the monotone bounds
    certified, over = 0, None
    e = 1
    while True:
        if evaluate(e)[2] > target_epsilon:
            over = e
            break
        certified = e
        if e == max_epochs:
            break
        e = min(2 * e, max_epochs)
    if over is not None:
        while over - certified > 1:
            mid = (certified + over) // 2
            if evaluate(mid)[2] <= target_epsilon:
                certified = mid
            else:
                over = mid
    # 2. beyond it, every epoch checked until the first one over the budget
    good, scanned, complete = certified, 0, True
    while good < max_epochs:
        if good + 1 not in cache:
            if scanned >= MAX_SCAN:
                complete = False
                warnings.warn(
                    CalibrationWarning(
                        f"every run of up to {good} epochs fits epsilon {target_epsilon:g}; longer runs may fit too, "
                        f"but the bound that allows them is not monotone in the number of steps, so each epoch is "
                        f"checked separately and the check stopped after {MAX_SCAN} epochs"
                    ),
                    stacklevel=2,
                )
                break
            scanned += 1
        if evaluate(good + 1)[0] > target_epsilon:
            break
        good += 1
    eps, name = (evaluate(good)[:2]) if good else (0.0, "none")
    nxt = cache[good + 1][0] if good + 1 in cache else None
    return EpochBudget(
        good,
        eps,
        False,
        lim,
        name,
        len(cache) + 1,
        next_epsilon=nxt,
        report=evaluate(max(good, 1))[3],
        limit_analysis=lim_name,
        complete=complete,
    )
