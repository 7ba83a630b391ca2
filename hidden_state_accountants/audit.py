"""Empirical privacy audit: a statistical *lower* bound on epsilon from simulated training runs.

The audit runs the training algorithm many times on two neighbouring datasets, tests which one
produced the final parameters, and turns the test's error rates into a lower bound on epsilon
that holds with the stated confidence. A reported (upper) bound below an audited lower bound
would prove the accountant wrong.

Two constructions, both in the framework parametrisation of docs/design.md, section 1 (everything
happens along one coordinate; the others have identical laws on both datasets):

* ``"strongly_convex"`` (quadratic loss, in clipped form): every record has the per-example map
  ``g_i(theta) = c_i + m theta``, unconstrained, ``m`` from the run's geometry, with the worst
  known neighbouring pair (:mod:`hidden_state_accountants.exact`): for fixed-size batches
  every ``c_i = -C`` in D' and one of them ``+C`` in D (D' is then one Gaussian, D a mixture
  with doubled shifts); for ``poisson`` the others 0 and the record ``+C`` in D, ``-C`` in D'.
* ``"constrained"`` (Altschuler & Talwar Thm 4.1, linear losses on an interval): the same
  linear contributions with ``m = 0``, every iterate projected onto ``[-D/2, D/2]`` with ``D``
  the declared diameter. The random walk is clamped; no closed form exists.

The unconstrained construction is simulated in closed form (:func:`simulate`), the projected
one step by step; both are bounded up front (:func:`check_work`).

The test rejects "D" when the final coordinate exceeds a threshold. The threshold is chosen on
one half of the runs and its false positive/negative rates are bounded on the other half with
Clopper-Pearson intervals (each at confidence ``1 - (1-confidence)/2``). An (eps, delta)-DP
mechanism satisfies ``FPR + e^eps FNR >= 1 - delta`` and the same with the roles swapped, so

    eps >= max( log((1 - delta - FNR_hi) / FPR_hi), log((1 - delta - FPR_hi) / FNR_hi) ).

>>> from hidden_state_accountants import LossGeometry, TrainingRunDpEvent
>>> run = TrainingRunDpEvent(dataset_size=100, batch_size=100, steps=50, noise_multiplier=0.5,
...                          clip_norm=1.0, learning_rate=0.5, sampling="full",
...                          geometry=LossGeometry(strong_convexity=0.5, smoothness=0.5))
>>> result = audit(run, repetitions=20000, seed=0)
>>> 0 < result.epsilon_lower <= result.epsilon_reported
True
"""

from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np
from scipy import stats
from tqdm import tqdm

from hidden_state_accountants.relations import REPLACE_ONE
from hidden_state_accountants import validation as v
from hidden_state_accountants.accountant import accountant_with
from hidden_state_accountants.events import TrainingRunDpEvent
from hidden_state_accountants.schedule_laws import Linear  # the short batches' scale and extra noise
from hidden_state_accountants.schedules import BALLS_IN_BINS, DROPPED, POISSON, RESHUFFLE

# Schedules with one fresh position of the record per epoch (a uniform slot; balls-in-bins: a uniform step).
_PER_EPOCH = (RESHUFFLE, BALLS_IN_BINS)

CONSTRUCTIONS = ("strongly_convex", "constrained")


@dataclass
class AuditResult:
    """Audited lower bound next to the accountant's reported upper bound."""

    epsilon_lower: float
    epsilon_reported: float
    analysis: str
    delta: float
    confidence: float
    construction: str
    repetitions: int
    threshold: float
    false_positive_rate: float
    false_negative_rate: float

    @property
    def consistent(self) -> bool:
        """True when the reported bound is at least the audited lower bound."""
        return self.epsilon_reported >= self.epsilon_lower

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {"consistent": self.consistent}


# Work limits, checked before anything is simulated (one line naming the parameter otherwise).
MAX_REPETITIONS = 10**7
"""Simulated trainings per dataset: a few arrays of this many floats (80 MB each)."""
MAX_DRAWS = 2 * 10**10
"""Random numbers drawn over the whole audit (repetitions x steps simulated one by one; for the
closed forms, repetitions x the inclusions that matter). About a minute per 10^9."""
# Above this many draws a progress bar is shown on stderr (unless progress=False).
PROGRESS_DRAWS = 2 * 10**8
# Random numbers drawn per chunk (memory: 8 bytes each).
_CHUNK = 2**22
# Maps composed per chunk by the projected construction's reduction (cache-sized).
_REDUCE_CHUNK = 2**17
# Contributions a^e below this (relative to the largest, a^0 = 1) are dropped from the
# Poisson/without-replacement closed form: far below float resolution of the result.
_NEGLIGIBLE = 2.0**-60


def _geometric(a: float, k) -> np.ndarray:
    """``sum_{i<k} a^i`` elementwise (``k`` may be 0 or huge), for ``-1 < a <= 1``."""
    k = np.asarray(k, dtype=float)
    if a == 1.0:
        return k
    if a == 0.0:
        return np.where(k > 0, 1.0, 0.0)
    with np.errstate(under="ignore"):
        return (1.0 - np.power(a, k)) / (1.0 - a)


def _contraction(run: TrainingRunDpEvent, construction: str) -> float:
    """``a = 1 - lr m`` of the linear construction's step ``theta -> a theta - lr (c I + noise)``."""
    m = run.geometry.strong_convexity if construction == "strongly_convex" else 0.0
    return 1.0 - run.learning_rate * m


def _inclusion_window(run: TrainingRunDpEvent, a: float) -> int:
    """Steps back from the end that matter for the Poisson/without-replacement closed form."""
    if a == 1.0 or run.steps == 0:
        return run.steps
    if a == 0.0:
        return 1
    return int(min(run.steps, math.ceil(math.log(_NEGLIGIBLE) / math.log(abs(a))) + 1))


def _epoch_window(run: TrainingRunDpEvent, a: float) -> int:
    """Epochs (from the end) whose uses matter for the reshuffle closed form."""
    spe = run.steps_per_epoch
    return min(-(-run.steps // spe), _inclusion_window(run, a) // spe + 2)


def work(run: TrainingRunDpEvent, construction: str, repetitions: int) -> float:
    """Random numbers the audit draws for both datasets, known before simulating."""
    reps = 2.0 * repetitions
    if construction == "constrained":
        per_step = 2 if run.sampling in ("poisson", "without_replacement") else 1
        return reps * (
            run.steps * per_step + (-(-run.steps // run.steps_per_epoch) if run.sampling in _PER_EPOCH else 0)
        )
    if run.sampling in _PER_EPOCH:
        return reps * (_epoch_window(run, _contraction(run, construction)) + 1)
    if run.sampling in ("poisson", "without_replacement"):
        a = _contraction(run, construction)
        if a == 1.0:
            return reps
        return reps * (_expected_inclusions(run, a) + 1)
    return reps


def _expected_inclusions(run: TrainingRunDpEvent, a: float) -> float:
    """Draws per repetition for the Poisson/without-replacement inclusion sum (a generous
    upper end of the number of inclusions in the window, or the window itself)."""
    w = _inclusion_window(run, a)
    q = run.sampling_rate
    return min(float(w), w * q + 10.0 * math.sqrt(w * q) + 10.0) if q < 0.1 else float(w)


def _bar(total: float, enabled: bool, what: str):
    return tqdm(total=total, disable=not enabled, file=sys.stderr, unit_scale=True, leave=False, desc=what)


def _batch_of_slot(run: TrainingRunDpEvent, rng: np.random.Generator, size: int) -> np.ndarray:
    """The record's batch in an order drawn at random: its slot is uniform on the ``n`` records,
    batch ``slot // b``; ``-1`` for the ``n mod b`` slots a dropped short batch leaves unused.
    Balls-in-bins: a uniform step of the epoch."""
    if run.sampling == BALLS_IN_BINS:
        return rng.integers(0, run.steps_per_epoch, size, dtype=np.int64)
    j = rng.integers(0, run.dataset_size, size, dtype=np.int64) // run.batch_size
    return np.where(j < run.steps_per_epoch, j, -1)


def _inclusion_sum(run: TrainingRunDpEvent, a: float, repetitions: int, rng: np.random.Generator, bar) -> np.ndarray:
    """``S = sum_t a^{T-1-t} s_t I_t`` for every repetition, ``I_t`` the differing record's
    inclusion, ``s_t`` the scale of a short batch divided by its own size (1 otherwise)."""
    T = run.steps
    if run.sampling == "full":
        return np.full(repetitions, float(_geometric(a, T)))
    if run.sampling in _PER_EPOCH:
        return _reshuffle_sum(run, a, repetitions, rng, bar)
    if run.sampling in ("cyclic", "shuffle_partition"):
        l = run.steps_per_epoch
        if run.sampling == "cyclic":
            position = np.full(repetitions, l - 1, dtype=np.int64)  # the worst (last) batch
        else:
            position = _batch_of_slot(run, rng, repetitions)  # one partition per run
            position = np.where(position < 0, T + l, position)  # never used
        # visits at t = p, p + l, ...: K = ceil((T - p)/l) of them, the last e_min = (T-1-p) mod l
        # steps before the end; S = a^{e_min} (1 + a^l + ... + a^{l(K-1)})
        visits = np.where(position < T, -((position - T) // l), 0)
        e_min = np.where(position < T, (T - 1 - position) % l, 0).astype(float)
        if a == 0.0:  # only the last step counts
            return ((e_min == 0) & (visits > 0)).astype(float)
        with np.errstate(under="ignore"):
            s = np.power(a, e_min) * _geometric(float(np.power(a, float(l))), visits)
        return np.where(visits > 0, s, 0.0)
    # poisson / without_replacement: I_t iid Bernoulli(q) (a fresh batch every step)
    q = run.sampling_rate
    if a == 1.0:
        return rng.binomial(T, q, repetitions).astype(float)
    window = _inclusion_window(run, a)
    total = np.zeros(repetitions)
    if q < 0.1:
        # the ages e = T-1-t of the inclusions form a Bernoulli process: cumulative
        # sums of Geometric(q) gaps, minus one; only ages below the window matter
        age = np.full(repetitions, -1, dtype=np.int64)
        active = np.arange(repetitions)
        expected = int(_expected_inclusions(run, a))
        while active.size:
            per = max(1, min(expected, _CHUNK // active.size))
            gaps = rng.geometric(q, (active.size, per))
            ages = age[active, None] + np.cumsum(gaps, axis=1)
            inside = ages < window
            with np.errstate(under="ignore"):
                total[active] += np.where(inside, np.power(a, np.minimum(ages, window).astype(float)), 0.0).sum(axis=1)
            age[active] = ages[:, -1]
            bar.update(active.size * per)
            active = active[age[active] < window]
        return total
    done = 0
    while done < window:
        per = max(1, min(window - done, _CHUNK // repetitions))
        ages = np.arange(done, done + per, dtype=float)
        with np.errstate(under="ignore"):
            total += (rng.random((repetitions, per)) < q) @ np.power(a, ages)
        done += per
        bar.update(repetitions * per)
    return total


def _reshuffle_sum(run: TrainingRunDpEvent, a: float, repetitions: int, rng: np.random.Generator, bar) -> np.ndarray:
    """The inclusion sum of ``reshuffle``: in every epoch a fresh uniform slot; epochs whose uses
    are all discounted below ``2^-60`` are skipped."""
    T, spe = run.steps, run.steps_per_epoch
    epochs = -(-T // spe)
    model = Linear(run, a)
    total = np.zeros(repetitions)
    for e in range(epochs - 1, epochs - 1 - _epoch_window(run, a), -1):
        here = min(spe, T - e * spe)
        j = _batch_of_slot(run, rng, repetitions)
        used = (j >= 0) & (j < here)
        d = T - 1 - (e * spe + np.where(used, j, 0))
        with np.errstate(under="ignore"):
            total += np.where(used, model.power(d) * model.scale(d), 0.0)
        bar.update(repetitions)
    return total


def simulate(
    run: TrainingRunDpEvent,
    sign: float,
    repetitions: int,
    construction: str,
    rng: np.random.Generator,
    progress: bool = False,
) -> np.ndarray:
    """Final coordinate of ``repetitions`` independent runs; ``sign`` = +1 for D, -1 for D'.

    ``"strongly_convex"`` (no projection) in closed form: the step is the affine map
    ``theta -> a theta - lr (x C/b) I_t - lr (z C/b) xi_t + (common drift)`` with ``a = 1 - lr m``
    and ``x`` the record's difference from the others (``+2`` in D and 0 in D' for the worst
    pair; ``+1`` / ``-1`` for Poisson's), so from ``theta_0 = 0``, the common drift dropped::

        theta_T = -lr (x C/b) sum_t a^{T-1-t} s_t I_t  +  N(0, (lr z C/b)^2 sum_t a^{2(T-1-t)} s_t^2),

    the noise a single Gaussian per run and the inclusion sum in closed form per schedule
    (a geometric series over the record's visits for ``full`` / ``cyclic`` /
    ``shuffle_partition``; for ``poisson`` / ``without_replacement`` the inclusion ages are a
    Bernoulli process, drawn as sums of geometric gaps, ages where ``|a|^e < 2^-60`` dropped).
    ``"constrained"`` projects every iterate; its steps are composed as clip-and-shift maps
    (:func:`_projected`).
    """
    lr, C, b = run.learning_rate, run.clip_norm, run.batch_size
    noise = run.noise_multiplier * C / b
    a = _contraction(run, construction)
    draws = work(run, construction, repetitions)
    with _bar(
        repetitions * run.steps if construction == "constrained" else draws / 2,
        progress,
        f"audit ({'D' if sign > 0 else 'D prime'})",
    ) as bar:
        if construction == "strongly_convex":
            s = _inclusion_sum(run, a, repetitions, rng, bar)
            sd = lr * noise * math.sqrt(Linear(run, a).variance())
            # random batch sizes: the others at 0 (their random sum is common noise), the record +-1
            x = sign if run.sampling in (POISSON, BALLS_IN_BINS) else (2.0 if sign > 0 else 0.0)
            return -lr * (x * C / b) * s + sd * rng.standard_normal(repetitions)
        return _projected(run, repetitions, rng, bar, lr * noise, lr * sign * C / b)


def _projected(run, repetitions, rng, bar, noise_step, drift):
    """The constrained construction, ``theta <- clip(theta - drift I_t - noise_step xi_t, -D/2, D/2)``,
    vectorised over the steps too.

    Each step is a map ``f(x) = clip(x + c, L, H)``, and such maps are closed under
    composition: ``g(f(x)) = clip(x + c1 + c2, clip(L1 + c2, L2, H2), clip(H1 + c2, L2, H2))``
    for ``f = (c1, L1, H1)`` then ``g = (c2, L2, H2)``. A chunk of steps is composed by pairwise
    reduction (``log2`` of its length in array operations), then applied to the iterate: the
    same final iterate as the step-by-step loop, without a Python iteration per step.
    """
    half = run.geometry.diameter / 2
    l = run.steps_per_epoch
    if run.sampling == "cyclic":
        position = np.full(repetitions, l - 1, dtype=np.int64)  # the worst (last) batch
    elif run.sampling == "shuffle_partition":
        position = _batch_of_slot(run, rng, repetitions)  # one partition per run
    else:
        position = None
    epoch_positions = {}  # reshuffle: the record's batch in each epoch, drawn when first needed
    q = run.sampling_rate
    theta = np.zeros(repetitions)
    # chunks of a power-of-two number of steps, about _REDUCE_CHUNK numbers (cache-sized)
    per_max = 1 << max(0, int(math.log2(max(1, _REDUCE_CHUNK // repetitions))))
    t = 0
    while t < run.steps:
        per = min(run.steps - t, per_max)
        width = 1 << (per - 1).bit_length()  # padded with identity maps (0, -inf, inf)
        c = np.zeros((repetitions, width))
        c[:, :per] = -noise_step * rng.standard_normal((repetitions, per))
        if run.sampling == "full":
            c[:, :per] -= drift
        elif run.sampling in _PER_EPOCH:
            steps = t + np.arange(per, dtype=np.int64)
            for e in np.unique(steps // l):
                if e not in epoch_positions:
                    epoch_positions.clear()  # only the current epoch is needed again
                    epoch_positions[e] = _batch_of_slot(run, rng, repetitions)
                inside = (steps // l) == e
                c[:, :per] -= drift * (inside[None, :] & ((steps % l)[None, :] == epoch_positions[e][:, None]))
        elif position is not None:
            c[:, :per] -= drift * (((t + np.arange(per, dtype=np.int64)) % l)[None, :] == position[:, None])
        else:
            c[:, :per] -= drift * (rng.random((repetitions, per)) < q)
        lo = np.full((repetitions, width), -math.inf)
        hi = np.full((repetitions, width), math.inf)
        lo[:, :per], hi[:, :per] = -half, half
        c, lo, hi = compose_clip_maps(c, lo, hi)
        theta = np.clip(theta + c, lo, hi)
        t += per
        bar.update(per * repetitions)
    return theta


def compose_clip_maps(c: np.ndarray, lo: np.ndarray, hi: np.ndarray):
    """The composition, in column order, of the maps ``x -> clip(x + c, lo, hi)`` in each row
    (the number of columns a power of two), as one such map per row: ``(c, lo, hi)``."""
    rows = c.shape[0]
    while c.shape[1] > 1:
        c, lo, hi = (x.reshape(rows, -1, 2) for x in (c, lo, hi))
        c2, lo2, hi2 = c[:, :, 1], lo[:, :, 1], hi[:, :, 1]  # the later map of each pair
        lo = np.clip(lo[:, :, 0] + c2, lo2, hi2)
        hi = np.clip(hi[:, :, 0] + c2, lo2, hi2)
        c = c[:, :, 0] + c2
    return c[:, 0], lo[:, 0], hi[:, 0]


def check_work(run: TrainingRunDpEvent, construction: str, repetitions: int) -> None:
    """Refuses, with one line naming the parameter, an audit beyond the work limits."""
    if repetitions > MAX_REPETITIONS:
        raise v.ParameterError("repetitions", f"must be <= {MAX_REPETITIONS:.0e} (memory), got {repetitions}")
    draws = work(run, construction, repetitions)
    if draws > MAX_DRAWS:
        least = work(run, construction, 100)
        name = "steps" if least > MAX_DRAWS / 10 else "repetitions"
        raise v.ParameterError(
            name,
            f"the audit would draw {draws:.3g} random numbers ({repetitions} repetitions x {run.steps} steps), "
            f"more than the limit {MAX_DRAWS:.0e}; lower {name}",
        )


def _cp_upper(k: int, n: int, confidence: float) -> float:
    """One-sided Clopper-Pearson upper bound on a binomial rate."""
    if k >= n:
        return 1.0
    return float(stats.beta.ppf(confidence, k + 1, n - k))


def _lower_bound(fpr: float, fnr: float, delta: float) -> float:
    cands = []
    for a, b in ((fpr, fnr), (fnr, fpr)):
        if a > 0 and 1 - delta - b > 0:
            cands.append(math.log((1 - delta - b) / a))
    return max([0.0] + cands)


def audit(
    run: TrainingRunDpEvent,
    *,
    construction: str = "strongly_convex",
    repetitions: int = 100_000,
    delta: float = 1e-5,
    confidence: float = 0.95,
    seed: Optional[int] = 0,
    progress: Optional[bool] = None,
    **accountant_kwargs,
) -> AuditResult:
    """Audits ``run`` with ``repetitions`` simulated trainings per dataset (see module docstring).

    The work is bounded before anything runs (:data:`MAX_REPETITIONS`, :data:`MAX_DRAWS`);
    a longer audit is refused with a ParameterError naming
    ``repetitions`` or ``steps``. ``progress``: a progress bar on stderr (``None``: only
    for long audits, at least :data:`PROGRESS_DRAWS` random numbers).
    """
    if construction not in CONSTRUCTIONS:
        raise v.ParameterError("construction", f"must be one of {', '.join(CONSTRUCTIONS)}, got {construction!r}")
    repetitions = v.positive_int("repetitions", repetitions)
    if repetitions < 100:
        raise v.ParameterError("repetitions", f"must be >= 100 for a meaningful test, got {repetitions}")
    v.probability("delta", delta)
    v.probability("confidence", confidence)
    accountant = accountant_with(accountant_kwargs)  # an unknown keyword is refused before the work
    relation = accountant.neighboring_relation
    if relation != REPLACE_ONE:
        raise v.ParameterError(
            "neighboring_relation",
            "the audit's constructions simulate a replaced record "
            "(a REPLACE_ONE pair), whose empirical epsilon is no lower bound under "
            f"{relation.name}; audit with REPLACE_ONE",
        )
    if run.geometry is None:
        raise v.ParameterError("geometry", "the audit constructions need the run's declared geometry")
    if not run.is_constant:
        raise v.ParameterError("learning_rate", "the audit simulates a constant learning rate and noise")
    if construction == "constrained" and run.geometry.diameter is None:
        raise v.ParameterError("diameter", "the constrained construction projects onto [-D/2, D/2]; declare D")
    if construction == "strongly_convex" and run.geometry.diameter is not None:
        raise v.ParameterError(
            "diameter", "the strongly convex construction is unconstrained; use construction='constrained'"
        )
    if construction == "constrained" and run.last_batch != DROPPED:
        raise v.ParameterError("last_batch", "the constrained construction simulates dropped short batches only")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0):
        raise v.ParameterError("seed", f"must be a non-negative integer or None, got {seed!r}")
    check_work(run, construction, repetitions)
    draws = work(run, construction, repetitions)
    show = draws >= PROGRESS_DRAWS if progress is None else bool(progress)

    rng = np.random.default_rng(seed)
    on_d = simulate(run, +1.0, repetitions, construction, rng, show)  # drifts negative
    on_d_prime = simulate(run, -1.0, repetitions, construction, rng, show)  # drifts positive
    half = repetitions // 2
    one_sided = 1 - (1 - confidence) / 2
    threshold = _choose_threshold(on_d[:half], on_d_prime[:half], delta, one_sided)
    n_eval = repetitions - half
    false_pos = int(np.sum(on_d[half:] > threshold))  # said D' on D
    false_neg = int(np.sum(on_d_prime[half:] <= threshold))  # said D on D'
    fpr_hi, fnr_hi = _cp_upper(false_pos, n_eval, one_sided), _cp_upper(false_neg, n_eval, one_sided)
    report = accountant.compose(run).explain(delta)
    return AuditResult(
        epsilon_lower=_lower_bound(fpr_hi, fnr_hi, delta),
        epsilon_reported=report.epsilon,
        analysis=report.analysis,
        delta=delta,
        confidence=confidence,
        construction=construction,
        repetitions=repetitions,
        threshold=float(threshold),
        false_positive_rate=false_pos / n_eval,
        false_negative_rate=false_neg / n_eval,
    )


def _choose_threshold(on_d: np.ndarray, on_d_prime: np.ndarray, delta: float, confidence: float = 0.975) -> float:
    """The threshold maximising the lower bound on the selection half, with Clopper-Pearson
    error rates (a point estimate favours thresholds deep in a tail, where a handful of runs
    decides and the evaluation half then says little)."""
    n = on_d.size
    tails = np.geomspace(0.5, 10.0 / n, 60)
    # both tails: the worst pair is not symmetric, its mixture shows in D's far tail
    candidates = np.quantile(on_d, np.concatenate([1 - tails, tails]))
    best, best_t = -1.0, float(np.median(on_d))
    for t in candidates:
        fpr = _cp_upper(int(np.sum(on_d > t)), n, confidence)
        fnr = _cp_upper(int(np.sum(on_d_prime <= t)), n, confidence)
        value = _lower_bound(fpr, fnr, delta)
        if value > best:
            best, best_t = value, float(t)
    return best_t
