"""Empirical privacy audit: a statistical *lower* bound on epsilon from simulated training runs.

The audit runs the training algorithm many times on two neighbouring datasets, tests which one
produced the final parameters, and turns the test's error rates into a lower bound on epsilon
that holds with the stated confidence. A reported (upper) bound below an audited lower bound
would prove the accountant wrong.

Two constructions, both in the framework parametrisation of docs/design.md, section 1 (everything
happens along one coordinate; the others have identical laws on both datasets):

* ``"strongly_convex"`` (Chourasia et al. Thm 3, quadratic loss, in clipped form): every record
  has the per-example map ``g_i(theta) = c_i + m theta`` with ``c_i = 0``, except the differing
  record: ``c = +C`` in D and ``-C`` in D'. Unconstrained; ``m`` from the run's geometry.
* ``"constrained"`` (Altschuler & Talwar Thm 4.1, linear losses on an interval): the same
  linear contributions with ``m = 0``, every iterate projected onto ``[-D/2, D/2]`` with ``D``
  the declared diameter. The random walk is clamped; no closed form exists.

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
from dataclasses import dataclass
from typing import Optional

import numpy as np
from scipy import stats

from hidden_state_accountants import validation as v
from hidden_state_accountants.accountant import HiddenStateAccountant
from hidden_state_accountants.events import TrainingRunDpEvent

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


def _inclusion(run: TrainingRunDpEvent, t: int, repetitions: int, position: Optional[np.ndarray],
               rng: np.random.Generator) -> np.ndarray:
    """Whether the differing record is in step ``t``'s batch, for every repetition."""
    if run.sampling == "full":
        return np.ones(repetitions, dtype=bool)
    if run.sampling in ("cyclic", "shuffle_partition"):
        return position == t % run.steps_per_epoch
    q = run.sampling_rate  # fresh draw each step: independent inclusions
    return rng.random(repetitions) < q


def simulate(run: TrainingRunDpEvent, sign: float, repetitions: int, construction: str,
             rng: np.random.Generator) -> np.ndarray:
    """Final coordinate of ``repetitions`` independent runs; ``sign`` = +1 for D, -1 for D'.

    Vectorised over repetitions; one Python iteration per training step.
    """
    lr, C, b = run.learning_rate, run.clip_norm, run.batch_size
    noise = run.noise_multiplier * C / b
    m = run.geometry.strong_convexity if construction == "strongly_convex" else 0.0
    half = None if construction == "strongly_convex" else run.geometry.diameter / 2
    if run.sampling == "cyclic":
        position = np.full(repetitions, run.steps_per_epoch - 1)  # the worst (last) batch
    elif run.sampling == "shuffle_partition":
        position = rng.integers(0, run.steps_per_epoch, repetitions)  # one partition per run
    else:
        position = None
    theta = np.zeros(repetitions)
    for t in range(run.steps):
        grad = m * theta + (sign * C / b) * _inclusion(run, t, repetitions, position, rng)
        theta = theta - lr * (grad + noise * rng.standard_normal(repetitions))
        if half is not None:
            np.clip(theta, -half, half, out=theta)
    return theta


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
    **accountant_kwargs,
) -> AuditResult:
    """Audits ``run`` with ``repetitions`` simulated trainings per dataset (see module docstring)."""
    if construction not in CONSTRUCTIONS:
        raise v.ParameterError("construction", f"must be one of {', '.join(CONSTRUCTIONS)}, got {construction!r}")
    repetitions = v.positive_int("repetitions", repetitions)
    if repetitions < 100:
        raise v.ParameterError("repetitions", f"must be >= 100 for a meaningful test, got {repetitions}")
    v.probability("delta", delta)
    v.probability("confidence", confidence)
    if run.geometry is None:
        raise v.ParameterError("geometry", "the audit constructions need the run's declared geometry")
    if not run.is_constant:
        raise v.ParameterError("learning_rate", "the audit simulates a constant learning rate and noise")
    if construction == "constrained" and run.geometry.diameter is None:
        raise v.ParameterError("diameter", "the constrained construction projects onto [-D/2, D/2]; declare D")
    if construction == "strongly_convex" and run.geometry.diameter is not None:
        raise v.ParameterError("diameter", "the strongly convex construction is unconstrained; use construction='constrained'")

    rng = np.random.default_rng(seed)
    on_d = simulate(run, +1.0, repetitions, construction, rng)       # drifts negative
    on_d_prime = simulate(run, -1.0, repetitions, construction, rng)  # drifts positive
    half = repetitions // 2
    threshold = _choose_threshold(on_d[:half], on_d_prime[:half], delta)
    n_eval = repetitions - half
    false_pos = int(np.sum(on_d[half:] > threshold))        # said D' on D
    false_neg = int(np.sum(on_d_prime[half:] <= threshold))  # said D on D'
    one_sided = 1 - (1 - confidence) / 2
    fpr_hi, fnr_hi = _cp_upper(false_pos, n_eval, one_sided), _cp_upper(false_neg, n_eval, one_sided)
    report = HiddenStateAccountant(**accountant_kwargs).compose(run).explain(delta)
    return AuditResult(
        epsilon_lower=_lower_bound(fpr_hi, fnr_hi, delta), epsilon_reported=report.epsilon,
        analysis=report.analysis, delta=delta, confidence=confidence, construction=construction,
        repetitions=repetitions, threshold=float(threshold),
        false_positive_rate=false_pos / n_eval, false_negative_rate=false_neg / n_eval,
    )


def _choose_threshold(on_d: np.ndarray, on_d_prime: np.ndarray, delta: float) -> float:
    """The threshold maximising the point-estimate lower bound on the selection half."""
    n = on_d.size
    candidates = np.quantile(on_d, 1 - np.geomspace(0.5, 10.0 / n, 60))
    best, best_t = -1.0, float(np.median(on_d))
    for t in candidates:
        fpr = max(np.mean(on_d > t), 1.0 / n)
        fnr = max(np.mean(on_d_prime <= t), 1.0 / n)
        value = _lower_bound(fpr, fnr, delta)
        if value > best:
            best, best_t = value, float(t)
    return best_t
