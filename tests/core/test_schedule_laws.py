"""The code that a bound and its ground truth share, tested on its own (issue 21).

``affine_exact_average`` (a bound) and :mod:`hidden_state_accountants.exact` (the oracle the
soundness tests compare every bound with) both read the law of a record's weighted visit count
``S = sum_t c^(T-1-t) s_t 1{record in B_t}`` from :mod:`hidden_state_accountants.schedule_laws`,
and the balls-in-bins bound and the oracle both evaluate Gaussian mixtures with
:mod:`hidden_state_accountants.mixture_pair`. A bug there would pass both a bound and its ground
truth, so here each is compared with what it computes from first principles:

* the law of ``S``: every draw of a tiny schedule enumerated as the schedules' definitions say
  (one permutation for ``shuffle_partition``, one per epoch for ``reshuffle``, a subset per step
  for ``without_replacement``, independent coins for ``poisson``, a step per record and epoch for
  ``balls_in_bins``), the record's ``S`` summed step by step, the probabilities added exactly;
* the noise variance ``V`` and ``kappa`` summed step by step;
* the grid laws used beyond ``MAX_ENUM`` atoms: ``S_lo <= S <= S_hi`` in distribution;
* a mixture pair's ``delta(eps)``, ``epsilon(delta)`` and Renyi divergence against numerical
  integration of the densities.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from fractions import Fraction

import numpy as np
import pytest
from scipy import integrate, optimize, special, stats

from hidden_state_accountants import LossGeometry, TrainingRunDpEvent
from hidden_state_accountants import schedule_laws
from hidden_state_accountants.mixture_pair import EPS_PAD, MixturePair
from hidden_state_accountants.schedule_laws import Linear, schedule_law
from hidden_state_accountants.schedules import (
    BALLS_IN_BINS,
    CYCLIC,
    DROPPED,
    FULL,
    KEPT_BATCH_SIZE,
    KEPT_OWN_SIZE,
    POISSON,
    RESHUFFLE,
    SHUFFLE_PARTITION,
    WITHOUT_REPLACEMENT,
)

RECORD = 0  # the differing record; every schedule but cyclic treats all records alike


def make_run(sampling, n, b, steps, *, last_batch=DROPPED, q=None, lr=0.5, m=0.6):
    return TrainingRunDpEvent(
        dataset_size=n,
        batch_size=b,
        steps=steps,
        noise_multiplier=1.3,
        clip_norm=1.0,
        learning_rate=lr,
        sampling=sampling,
        last_batch=last_batch,
        sampling_probability=q,
        geometry=LossGeometry(strong_convexity=m, smoothness=1.0),
    )


# ------------------------------------------------------------------- the draws, enumerated
def _epoch_batches(order, n, b, last_batch):
    """The batches an order of the records is cut into (``n // b`` of size ``b``, plus the short
    one when it is kept) with each batch's scale ``s``."""
    batches = [(order[j * b : (j + 1) * b], 1.0) for j in range(n // b)]
    if last_batch != DROPPED and n % b:
        batches.append((order[(n // b) * b :], b / (n % b) if last_batch == KEPT_OWN_SIZE else 1.0))
    return batches


def draws(run):
    """Every draw of the schedule: ``(probability, [(batch, scale) for each step])``."""
    n, b, T = run.dataset_size, run.batch_size, run.steps
    records = range(n)
    if run.sampling == FULL:
        yield Fraction(1), [(tuple(records), 1.0)] * T
    elif run.sampling in (CYCLIC, SHUFFLE_PARTITION):
        orders = [tuple(records)] if run.sampling == CYCLIC else list(itertools.permutations(records))
        for order in orders:
            batches = _epoch_batches(order, n, b, DROPPED)
            yield Fraction(1, len(orders)), [batches[t % len(batches)] for t in range(T)]
    elif run.sampling == RESHUFFLE:
        spe = len(_epoch_batches(tuple(records), n, b, run.last_batch))
        perms = list(itertools.permutations(records))
        epochs = -(-T // spe)
        for orders in itertools.product(perms, repeat=epochs):
            steps = [batch for order in orders for batch in _epoch_batches(order, n, b, run.last_batch)]
            yield Fraction(1, len(perms) ** epochs), steps[:T]
    elif run.sampling == WITHOUT_REPLACEMENT:
        subsets = list(itertools.combinations(records, b))
        for choice in itertools.product(subsets, repeat=T):
            yield Fraction(1, len(subsets) ** T), [(s, 1.0) for s in choice]
    elif run.sampling == POISSON:
        q = Fraction(run.sampling_rate).limit_denominator(10**6)
        for coins in itertools.product((0, 1), repeat=n * T):
            p = Fraction(1)
            for c in coins:
                p *= q if c else 1 - q
            steps = [(tuple(i for i in records if coins[t * n + i]), 1.0) for t in range(T)]
            yield p, steps
    elif run.sampling == BALLS_IN_BINS:
        spe = n // b
        epochs = -(-T // spe)
        for bins in itertools.product(range(spe), repeat=n * epochs):
            steps = [(tuple(i for i in records if bins[(t // spe) * n + i] == t % spe), 1.0) for t in range(T)]
            yield Fraction(1, spe ** (n * epochs)), steps
    else:
        raise AssertionError(run.sampling)


def brute_force_law(run, c, record=RECORD):
    """The law of ``S`` of ``record``: ``{S rounded: probability}``."""
    law = defaultdict(Fraction)
    T = run.steps
    for p, steps in draws(run):
        s = sum(c ** (T - 1 - t) * scale for t, (batch, scale) in enumerate(steps) if record in batch)
        law[round(s, 12)] += p
    return dict(law)


def brute_force_variance(run, c):
    """``V = sum_t c^(2(T-1-t)) nu_t^2`` with ``nu_t`` the scale of step ``t``'s batch (the same in
    every draw: a kept short batch is the last of its epoch)."""
    _, steps = next(iter(draws(run)))
    return sum(c ** (2 * (run.steps - 1 - t)) * scale**2 for t, (_, scale) in enumerate(steps))


def package_law(law):
    out = defaultdict(float)
    for value, log_w in zip(law.values, law.log_w):
        out[round(float(value), 12)] += math.exp(float(log_w))
    return dict(out)


def assert_same_law(brute, ours):
    assert sorted(brute) == pytest.approx(sorted(ours), abs=1e-11)
    for (x, p), (_, q) in zip(sorted(brute.items()), sorted(ours.items())):
        assert q == pytest.approx(float(p), rel=1e-12, abs=1e-15), x


CASES = [
    # (sampling, n, b, steps, last_batch, q)
    (FULL, 3, 3, 4, DROPPED, None),
    (CYCLIC, 7, 2, 7, DROPPED, None),  # a remainder never used, a partial epoch
    (SHUFFLE_PARTITION, 5, 2, 5, DROPPED, None),  # 120 orders; one record of five never used
    (SHUFFLE_PARTITION, 6, 3, 4, DROPPED, None),
    (RESHUFFLE, 4, 2, 3, DROPPED, None),  # a partial second epoch
    (RESHUFFLE, 5, 2, 3, DROPPED, None),  # a record left out of each epoch
    (RESHUFFLE, 5, 2, 5, KEPT_OWN_SIZE, None),  # the short batch divided by its own size
    (RESHUFFLE, 5, 2, 4, KEPT_BATCH_SIZE, None),
    (WITHOUT_REPLACEMENT, 4, 2, 3, DROPPED, None),
    (POISSON, 3, 1, 3, DROPPED, 0.3),
    (POISSON, 2, 1, 4, DROPPED, None),  # q = b/n
    (BALLS_IN_BINS, 4, 2, 3, DROPPED, None),  # a partial second epoch may miss the record
    (BALLS_IN_BINS, 3, 1, 3, DROPPED, None),
]


@pytest.mark.parametrize("sampling, n, b, steps, last_batch, q", CASES)
@pytest.mark.parametrize("c", [1.0, 0.7])
def test_the_law_of_s_is_the_enumerated_law(sampling, n, b, steps, last_batch, q, c):
    run = make_run(sampling, n, b, steps, last_batch=last_batch, q=q)
    model = Linear(run, c)
    if sampling == CYCLIC:  # a fixed order: each position, and the worst by default
        for j in range(run.steps_per_epoch):
            assert_same_law(brute_force_law(run, c, record=j * b), package_law(model.exact_law(position=j)))
        worst = max(max(brute_force_law(run, c, record=r)) for r in range(n))
        assert package_law(model.exact_law()) == pytest.approx({worst: 1.0})
    else:
        assert_same_law(brute_force_law(run, c), package_law(model.exact_law()))
    assert model.variance() == pytest.approx(brute_force_variance(run, c), rel=1e-12)
    assert model.kappa == pytest.approx((2.0 / 1.3) / math.sqrt(brute_force_variance(run, c)), rel=1e-12)


@pytest.mark.parametrize("sampling, n, b, steps, last_batch, q", [c for c in CASES if c[0] != CYCLIC])
def test_schedule_law_reads_the_contraction_from_the_geometry(sampling, n, b, steps, last_batch, q):
    run = make_run(sampling, n, b, steps, last_batch=last_batch, q=q, lr=0.5, m=0.6)
    law, kappa = schedule_law(run)
    c = 1.0 - 0.5 * 0.6
    assert_same_law(brute_force_law(run, c), package_law(law))
    assert kappa == pytest.approx((2.0 / 1.3) / math.sqrt(brute_force_variance(run, c)), rel=1e-12)


def _tail(law_dict, x):
    return sum(float(p) for v, p in law_dict.items() if v >= x - 1e-12)


@pytest.mark.parametrize(
    "sampling, n, b, steps, last_batch, q",
    [
        (RESHUFFLE, 5, 2, 5, KEPT_OWN_SIZE, None),
        (WITHOUT_REPLACEMENT, 4, 2, 3, DROPPED, None),
        (POISSON, 3, 1, 3, DROPPED, 0.3),
        (BALLS_IN_BINS, 4, 2, 3, DROPPED, None),
    ],
)
def test_beyond_max_enum_the_grid_laws_bracket_the_law(monkeypatch, sampling, n, b, steps, last_batch, q):
    """``S_lo <= S <= S_hi`` in distribution: every tail of the upper law is at least the true
    tail, every tail of the lower law at most; ``schedule_law`` then returns the upper law."""
    run = make_run(sampling, n, b, steps, last_batch=last_batch, q=q)
    c = 1.0 - 0.5 * 0.6
    brute = brute_force_law(run, c)
    monkeypatch.setattr(schedule_laws, "MAX_ENUM", 1)
    model = Linear(run, c)
    assert model.exact_law() is None
    lo, hi = (package_law(law) for law in model.grid_laws(64))
    for x in sorted(set(brute) | set(lo) | set(hi)):
        assert _tail(lo, x) <= _tail(brute, x) + 1e-12 <= _tail(hi, x) + 2e-12, x
    assert sum(hi.values()) == pytest.approx(1.0, abs=1e-12) and sum(lo.values()) == pytest.approx(1.0, abs=1e-12)
    law, _ = schedule_law(run, grid_points=64)
    assert package_law(law) == pytest.approx(hi)


# ---------------------------------------------------------------------------- mixture pairs
PAIRS = {
    "monotone": ([0.0, 1.5, 3.0], [0.2, 0.5, 0.3], [0.0], [1.0]),
    "mirror": ([0.4, 1.2], [0.5, 0.5], [-0.4, -1.2], [0.5, 0.5]),
    "mixed_signs": ([-1.0, 2.0], [0.4, 0.6], [0.0], [1.0]),  # not monotone: the convex-loss branch
    "gaussian": ([1.7], [1.0], [0.0], [1.0]),
}


def _densities(mp, wp, mq, wq):
    p = lambda x: sum(w * stats.norm.pdf(x - m) for m, w in zip(mp, wp))
    q = lambda x: sum(w * stats.norm.pdf(x - m) for m, w in zip(mq, wq))
    return p, q


def _hockey(a, b, eps):
    """``int max(a - e^eps b, 0)``, split where the integrand's sign changes (its kinks)."""
    f = lambda x: a(x) - math.exp(eps) * b(x)
    grid = np.linspace(-40, 40, 8001)
    values = f(grid)
    kinks = [
        optimize.brentq(f, x0, x1, xtol=1e-14)
        for x0, x1, v0, v1 in zip(grid, grid[1:], values, values[1:])
        if v0 * v1 < 0
    ]
    edges = [-40.0, *kinks, 40.0]
    return sum(
        integrate.quad(lambda x: max(f(x), 0.0), lo, hi, limit=200, epsabs=1e-14, epsrel=1e-11)[0]
        for lo, hi in zip(edges, edges[1:])
    )


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_mixture_pair_delta_and_epsilon_match_numerical_integration(name):
    mp, wp, mq, wq = PAIRS[name]
    pair = MixturePair(mp, np.log(wp), mq, np.log(wq))
    p, q = _densities(mp, wp, mq, wq)
    for eps in (0.0, 0.3, 1.0, 2.5):
        truth = max(_hockey(p, q, eps), _hockey(q, p, eps))
        assert pair.delta(eps) == pytest.approx(truth, rel=1e-6, abs=1e-12), eps
    for delta in (1e-2, 1e-4):
        eps = pair.epsilon(delta)
        truth = max(_hockey(p, q, eps), _hockey(q, p, eps))
        assert truth <= delta * (1 + 1e-6)  # epsilon is on the safe side
        below = max(_hockey(p, q, eps - 1e-4), _hockey(q, p, eps - 1e-4))
        assert below > delta  # and not above the smallest by more than the tolerance
        assert eps >= EPS_PAD


@pytest.mark.parametrize("name", ["monotone", "mirror", "gaussian"])
def test_mixture_pair_renyi_matches_numerical_integration(name):
    mp, wp, mq, wq = PAIRS[name]
    pair = MixturePair(mp, np.log(wp), mq, np.log(wq))
    log_p = lambda x: special.logsumexp([math.log(w) + stats.norm.logpdf(x - m) for m, w in zip(mp, wp)])
    log_q = lambda x: special.logsumexp([math.log(w) + stats.norm.logpdf(x - m) for m, w in zip(mq, wq)])
    for a in (2.0, 4.5):
        fwd = integrate.quad(lambda x: math.exp(a * log_p(x) + (1 - a) * log_q(x)), -30, 30, limit=400, epsrel=1e-11)[0]
        rev = integrate.quad(lambda x: math.exp(a * log_q(x) + (1 - a) * log_p(x)), -30, 30, limit=400, epsrel=1e-11)[0]
        truth = max(math.log(fwd), math.log(rev), 0.0) / (a - 1)
        assert float(pair.renyi([a])[0]) == pytest.approx(truth, rel=1e-6)
