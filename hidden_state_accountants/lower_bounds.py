"""The best known LOWER bound beside the reported bound (issue 19): how far the guarantee is from what
some run of the declared class really reaches.

A lower bound is never a privacy guarantee. Nothing that computes a bound, selects one, calibrates noise or
counts a budget reads it: only :class:`~hidden_state_accountants.accountant.PrivacyReport` shows it, and only
when asked (``report.lower_bound``, ``to_table``, ``to_dict``).

The value is the exact epsilon of the affine construction of docs/derivations.md 1.1 with the worst known
neighbouring pair (:mod:`hidden_state_accountants.exact`): constant clipped per-example gradients (data
curvature 0) and the L2 term once per step, so every step contracts by ``1 - lr kappa`` whatever the batch.
It is an *instance* of the declared class when ``m <= kappa <= M``; ``kappa`` is the declared L2 strength
(``l2_regularization``), or ``m`` when none is declared. Larger curvatures reach more (docs/derivations.md
5a.6) but only in the limit of long runs, because clipped gradients are bounded; they are not shown here.

=====================================  ============================================  ===========================
schedule                               computed by                                   sized before by
=====================================  ============================================  ===========================
poisson                                :func:`exact.poisson_lower_bound_resolved`    :data:`FOURIER_WORK`
cyclic, shuffle_partition              :func:`exact.shuffled_lower_bound`            :data:`PARTITION_BATCHES`
reshuffle                              :func:`exact.shuffled_lower_bound`            :data:`GRID_WORK`
full, without_replacement, BiB         :func:`exact.affine_lower_bound`              :data:`GRID_WORK`
=====================================  ============================================  ===========================

(BiB: balls_in_bins; the last three rows with ``curvature=kappa``; ``full`` is a Gaussian and always
fits). Mixtures over the secret draws are enumerated up to :data:`MAX_ATOMS` atoms, else put on a grid whose lower law is certified
(docs/derivations.md 1.2; the value stays a lower bound, the grid is chosen so that it rounds away at most
:data:`GRID_LOSS` of the largest shift). Each query is sized from the run alone, before any work, so that it
takes at most about half a second on one core (measured on a loaded 2-core machine); a larger run gets
``None`` with the reason.

>>> from hidden_state_accountants import LossGeometry, TrainingRunDpEvent
>>> run = TrainingRunDpEvent(dataset_size=60000, batch_size=255, steps=4700, noise_multiplier=1.0, clip_norm=1.0,
...     learning_rate=0.5, sampling="poisson", sampling_probability=1 / 235, l2_regularization=0.01,
...     geometry=LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=0.01, num_classes=2))
>>> lower = best_known_lower_bound(run, 1e-5, "ADD_OR_REMOVE_ONE")
>>> round(lower.epsilon, 3)
0.313
>>> best_known_lower_bound(run.replace(geometry=None), 1e-5).epsilon is None
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

import numpy as np

from hidden_state_accountants import exact
from hidden_state_accountants import validation as v
from hidden_state_accountants.analyses import random_allocation as ra
from hidden_state_accountants.analyses._common import hidden_state_preconditions
from hidden_state_accountants.analyses.chourasia import required_initial_std
from hidden_state_accountants.errors import ParameterError
from hidden_state_accountants.events import TrainingRunDpEvent
from hidden_state_accountants.relations import NeighborRel, parse_relation, schedule_reason
from hidden_state_accountants.schedule_laws import Linear
from hidden_state_accountants.schedules import (
    BALLS_IN_BINS,
    CYCLIC,
    FULL,
    KEPT_OWN_SIZE,
    POISSON,
    RESHUFFLE,
    SHUFFLE_PARTITION,
    WITHOUT_REPLACEMENT,
)

FOURIER_WORK = 1e7
"""Poisson: the most :func:`exact.poisson_lower_bound_work` computed (50-80 ns each: about 0.5-0.8 s)."""
PARTITION_BATCHES = {CYCLIC: 2_000_000, SHUFFLE_PARTITION: 500_000}
"""The most batches per epoch of a partition (its law has one atom per batch: 0.1 s / 0.25 s at these sizes)."""
MAX_ATOMS = 8192
"""A mixture of at most this many atoms is enumerated; beyond, its certified lower grid law is used."""
GRIDS = (1 << 14, 1 << 12)
"""Grid sizes of the lower law, the finer first (it rounds less away; 0.1-0.3 s at issue 19's sizes)."""
GRID_WORK = 1.2e8
"""The most work for a mixture, in grid-cell operations (4-8 ns each: at most about 0.5-0.9 s):
:data:`PART_OVERHEAD` per independent contribution (an epoch of ``reshuffle`` / ``balls_in_bins``, a step of
``without_replacement``) and, per contribution kept on the grid, (cells it spans + 2) x (grid points)."""
PART_OVERHEAD = 25_000
"""One contribution's Python overhead in those units (built and walked one by one: 50-110 microseconds)."""
GRID_LOSS = 1 / 4
"""The most of the largest shift the lower grid law may round away (it stays a lower bound; this keeps it close)."""

PAIRS = {"worst": "+C vs -C, others -C", "mirror": "+C vs -C, others 0", "half": "+C vs absent, others 0"}
"""The worst known pairs (:data:`exact.CONSTRUCTIONS`): the record's clipped gradient in the two datasets."""


@dataclass(frozen=True)
class LowerBound:
    """The best known lower bound (``epsilon``), or ``None`` with the reason (``note``).

    ``note`` names the construction and what it rests on; it is shown with the value, which is labelled as a
    lower bound and never as the guarantee."""

    epsilon: Optional[float]
    note: str


@dataclass(frozen=True)
class _Computation:
    """A lower bound that fits the budget: how to compute it and what to call it."""

    compute: Callable[[], Union[float, Tuple[float, bool]]]
    label: str


def best_known_lower_bound(
    run: TrainingRunDpEvent, delta: float, relation: Union[str, NeighborRel] = "REPLACE_ONE"
) -> LowerBound:
    """The best known lower bound on the epsilon of ``run`` at ``delta`` under ``relation``, or ``None`` with
    the reason; never raises for a valid run (a construction that is refused says why in the note)."""
    plan = plan_lower_bound(run, delta, relation)
    if isinstance(plan, LowerBound):
        return plan
    try:
        value = plan.compute()
    except ParameterError as err:  # the construction refused a case the plan let through
        return LowerBound(None, f"not computed: {err}")
    if isinstance(value, tuple):  # Poisson: (value, resolved)
        value, resolved = value
        if not resolved:
            if value <= 0.0:
                return LowerBound(
                    None,
                    "not resolved: the construction's Neyman-Pearson threshold lies where its "
                    "densities are below 1e-12 (a large epsilon), beyond the Fourier inversion",
                )
            return LowerBound(
                value,
                plan.label + "; the threshold lies partly beyond the resolved densities, so "
                "this is below the construction's exact value",
            )
    return LowerBound(float(value), plan.label)


def plan_lower_bound(
    run: TrainingRunDpEvent, delta: float, relation: Union[str, NeighborRel] = "REPLACE_ONE"
) -> Union[_Computation, LowerBound]:
    """What :func:`best_known_lower_bound` will compute (decided from the run's size, before any work), or the
    :class:`LowerBound` ``None`` with the reason it will not."""
    rel = parse_relation(relation, "relation")
    if not isinstance(delta, (int, float)) or not 0.0 < delta < 1.0:
        return LowerBound(None, f"delta must lie strictly between 0 and 1 for a lower bound, got {delta!r}")
    reason = hidden_state_preconditions(run)
    if reason is not None and run.sampling == BALLS_IN_BINS:
        return _allocation(run, delta, reason)
    if reason is not None:
        return LowerBound(None, f"no hidden-state claim to compare with ({reason})")
    reason = schedule_reason(rel, run.sampling)
    if reason is not None:
        return LowerBound(None, f"no analysis covers {run.sampling} under {rel.name}, so no construction is shown")
    g = run.geometry
    if g.diameter is not None:
        return LowerBound(
            None,
            "with a projection (diameter) the affine construction leaves the domain; no exact "
            "construction is computed here (the audit's constrained construction is slower)",
        )
    if g.lsi_constant is not None:
        return LowerBound(
            None, "a declared LSI constant restricts the class beyond what the construction is checked against"
        )
    kappa, curvature = _curvature(run)
    if kappa is None:
        return LowerBound(None, curvature)
    init_variance = 0.0
    if run.gaussian_initialization:
        if run.sampling not in (FULL, WITHOUT_REPLACEMENT, BALLS_IN_BINS) or g.strong_convexity <= 0:
            return LowerBound(
                None,
                "a declared Gaussian initialisation restricts the class; the construction "
                f"for {run.sampling} starts from a fixed point",
            )
        init_variance = (
            required_initial_std(
                dataset_size=run.dataset_size,
                noise_multiplier=float(run.noise_multiplier),
                clip_norm=run.clip_norm,
                learning_rate=float(run.learning_rate),
                strong_convexity=g.strong_convexity,
            )
            ** 2
        )
        curvature += ", Gaussian start as declared"
    pairs = " / ".join(PAIRS[k] for k in exact.constructions_for(run.sampling, rel.name))
    construction = f"affine construction, an instance of the declared class ({curvature}); pair {pairs}"
    return _SIZERS[run.sampling](run, delta, rel.name, kappa, init_variance, construction)


def _curvature(run: TrainingRunDpEvent) -> Tuple[Optional[float], str]:
    """``(kappa, how it was chosen)``, or ``(None, why there is no instance)``."""
    g, m_reg, lr = run.geometry, run.l2_regularization, float(run.learning_rate)
    if m_reg is None:
        kappa, text = g.strong_convexity, f"L2 = m = {g.strong_convexity:g} once per step, no L2 declared"
    elif g.strong_convexity <= m_reg <= g.smoothness:
        kappa, text = m_reg, f"L2 {m_reg:g} once per step"
    else:
        return None, (
            f"the construction has data curvature 0, so its strong convexity is the L2 strength "
            f"{m_reg:g}, outside the declared [m, M] = [{g.strong_convexity:g}, {g.smoothness:g}]"
        )
    if lr * kappa > 1.0:
        return None, f"lr x curvature = {lr * kappa:g} > 1: the construction's step alternates in sign (not computed)"
    return kappa, text


# ------------------------------------------------------------------------ sizing per schedule
def _full(run, delta, relation, kappa, init_variance, construction) -> _Computation:
    return _Computation(
        lambda: exact.affine_lower_bound(run, delta, relation=relation, curvature=kappa, init_variance=init_variance),
        f"{construction}; exact (a Gaussian)",
    )


def _poisson(run, delta, relation, kappa, init_variance, construction):
    candidate = run if run.l2_regularization is not None else run.replace(l2_regularization=kappa)
    try:
        work = exact.poisson_lower_bound_work(candidate)
    except ParameterError as err:
        return LowerBound(None, f"not computed: {err}")
    if work > FOURIER_WORK:
        return _too_large(f"{work:.3g} Fourier terms (at most {FOURIER_WORK:.0e} fit in a second)")
    return _Computation(
        lambda: exact.poisson_lower_bound_resolved(candidate, delta, relation),
        f"{construction}; exact over the secret Poisson draws (Fourier inversion)",
    )


def _partition(run, delta, relation, kappa, init_variance, construction):
    limit = PARTITION_BATCHES[run.sampling]
    if run.steps_per_epoch > limit:
        return _too_large(f"{run.steps_per_epoch} batches per epoch (at most {limit})")
    if run.sampling == CYCLIC:
        how = "exact at the worst batch position (a Gaussian)"
    elif run.secret_batches:
        how = "exact over the secret partition"
    else:
        how = "exact at the worst batch position (public batches; a Gaussian)"
    return _Computation(
        lambda: exact.shuffled_lower_bound(run, delta, relation=relation, curvature=kappa), f"{construction}; {how}"
    )


def _mixture(run, delta, relation, kappa, init_variance, construction):
    """``reshuffle``, ``balls_in_bins``, ``without_replacement``: a law of independent contributions, enumerated
    when small, else the certified lower end of a grid sized so that the rounding loses little."""
    T = run.steps
    parts = T if run.sampling == WITHOUT_REPLACEMENT else -(-T // run.steps_per_epoch)
    if parts * PART_OVERHEAD > GRID_WORK:
        kind = "steps" if run.sampling == WITHOUT_REPLACEMENT else "epochs"
        return _too_large(
            f"{parts} {kind}, each an independent part of the mixture (at most {int(GRID_WORK // PART_OVERHEAD)})"
        )
    maxima, spread, values = _contributions(run, 1.0 - float(run.learning_rate) * kappa)
    draws = "the secret draws" if run.secret_batches else "the draws (public batches: still below the truth)"
    # the count bounds the atoms exact_law enumerates; max_atoms 0 makes it take the grid
    atoms, grid = (MAX_ATOMS if math.log(values) * parts <= math.log(MAX_ATOMS) else 0), exact.LOWER_BOUND_GRID
    if run.sampling == RESHUFFLE and not run.secret_batches:
        how = "exact at the worst visit pattern (public batches; a Gaussian)"
    elif atoms:
        how = f"exact over {draws} (enumerated)"
    else:
        grid = _grid_for(maxima, spread, values)
        if isinstance(grid, LowerBound):
            return grid
        how = f"over {draws}: the certified lower end of a {grid}-point grid"
    if run.sampling == RESHUFFLE:
        compute = lambda: exact.shuffled_lower_bound(
            run, delta, relation=relation, curvature=kappa, grid_points=grid, max_atoms=atoms
        )
    else:
        compute = lambda: exact.affine_lower_bound(
            run,
            delta,
            relation=relation,
            curvature=kappa,
            init_variance=init_variance,
            grid_points=grid,
            max_atoms=atoms,
        )
    return _Computation(compute, f"{construction}; {how}")


def _contributions(run: TrainingRunDpEvent, c: float) -> Tuple[np.ndarray, float, int]:
    """The independent contributions to ``S`` (an epoch, or a step of ``without_replacement``) from the run's
    sizes alone, no law built: each one's largest value, the fraction of it its nonzero values spread over
    (``1 - c^(spe - 1)`` for an epoch), and at most how many values one has."""
    T = run.steps
    if run.sampling == WITHOUT_REPLACEMENT:
        return Linear(run, c).power(T - 1 - np.arange(T)), 0.0, 2
    spe = run.steps_per_epoch
    epochs = -(-T // spe)
    last = np.minimum((np.arange(epochs) + 1) * spe, T)  # one past each epoch's last step
    scale = 1.0
    if run.last_batch == KEPT_OWN_SIZE and run.dataset_size % run.batch_size:
        scale = run.batch_size / (run.dataset_size % run.batch_size)  # a short batch's larger shift
    model = Linear(run, c)
    return scale * model.power(T - last), 1.0 - float(model.power(spe - 1)), spe + 1


def _grid_for(maxima: np.ndarray, spread: float, values: int) -> Union[int, LowerBound]:
    """The first grid of :data:`GRIDS` whose work fits :data:`GRID_WORK` and on which the lower law loses at
    most :data:`GRID_LOSS` of the largest shift. With cells of ``h = sum / (points - 8)``
    (:meth:`Linear.grid_law`) a contribution below one cell is dropped (it loses all of itself) and a kept
    one is rounded down (by less than ``h``), spanning about ``spread max / h`` cells (each a pass over the grid,
    and two more to start and keep the result)."""
    total = float(np.sum(maxima))
    why = "the certified grid would round too much away (too many contributions of similar size)"
    for points in GRIDS:
        h = total / (points - 8)
        small = maxima < h
        kept = maxima[~small]
        if float(np.sum(maxima[small])) + kept.size * h > GRID_LOSS * total:
            continue
        cells = np.minimum(values, spread * kept / h + 3)
        work = float(np.sum(cells + 2)) * points + maxima.size * PART_OVERHEAD
        if work <= GRID_WORK:
            return points
        why = (
            f"a certified grid of {points} points over {kept.size} contributions ({work:.3g} operations, "
            f"at most {GRID_WORK:.2g})"
        )
    return _too_large(why)


ALLOCATION_EPOCHS = 2000
"""The most epochs whose allocation lower bound is composed (about half a second per thousand)."""


def _allocation(run: TrainingRunDpEvent, delta: float, reason: str) -> Union[_Computation, LowerBound]:
    """``balls_in_bins`` with no hidden-state claim (``reason``): the reported bound is the composition (every
    iterate released), and its construction is the dominating pair itself, which linear queries attain
    (Chua et al., AISTATS 2025, sec. 3): the exact allocation pair composed, computed from below
    (:func:`.random_allocation.lower_epsilon`; under REPLACE_ONE its remove direction, which a record with a
    zero clipped gradient reaches)."""
    if not run.secret_batches:
        return LowerBound(None, f"no hidden-state claim ({reason}) and public draws: the composition is not amplified")
    if not run.is_constant:
        return LowerBound(None, f"no hidden-state claim ({reason}); the allocation construction needs a constant noise")
    spe = run.steps_per_epoch
    epochs = -(-run.steps // spe)
    if epochs > ALLOCATION_EPOCHS:
        return _too_large(f"{epochs} epochs (at most {ALLOCATION_EPOCHS})")
    if run.steps % spe:
        epochs -= 1  # a partial last epoch is left out (only more private)
        if not epochs:
            return LowerBound(None, "a single partial epoch: the construction is shown for whole epochs")
    z = float(run.noise_multiplier)
    return _Computation(
        lambda: ra.lower_epsilon(z, spe, epochs, delta),
        f"no hidden-state claim ({reason}): the exact random-allocation pair of {epochs} whole epochs, linear "
        "queries with every iterate released (what the composition bound covers), computed from below",
    )


def _too_large(what: str) -> LowerBound:
    return LowerBound(None, f"too large to compute in under a second: {what}")


_SIZERS = {
    FULL: _full,
    POISSON: _poisson,
    CYCLIC: _partition,
    SHUFFLE_PARTITION: _partition,
    RESHUFFLE: _mixture,
    BALLS_IN_BINS: _mixture,
    WITHOUT_REPLACEMENT: _mixture,
}


def composition_window(learning_rate: float, l2_regularization: float) -> float:
    """``(1 + c) / (1 - c)`` with ``c = 1 - lr m_reg``, about ``2 / (lr m_reg)``: the number of composed steps
    whose privacy a converged hidden-state bound for an L2-regularised class can at best match
    (docs/derivations.md section 19).

    The class contains affine per-example maps (a linear loss plus the L2 term), whose last iterate of full-batch
    training is one Gaussian mechanism with ``mu_T^2 = (2/z)^2 (sum_{j<T} c^j)^2 / sum_{j<T} c^(2j)``, increasing
    in ``T`` to ``(2/z)^2 (1 + c) / (1 - c)``: exactly composition of this many full-batch steps. So no valid bound
    for the class reports less at convergence, and the noise it needs for a budget is at least composition's over
    this window. A lower bound on what any analysis can give, never a guarantee.

    >>> round(composition_window(0.5, 0.01), 3)  # MNIST-scale: 399 steps, 1.7 epochs of 235 steps
    399.0
    """
    lr = v.positive_float("learning_rate", learning_rate)
    m = v.positive_float("l2_regularization", l2_regularization)
    x = lr * m  # 1 - c
    if not x < 2.0:
        raise ParameterError("learning_rate", f"needs learning_rate * l2_regularization < 2, got {x:g}")
    return (2.0 - x) / x


__all__ = ["LowerBound", "best_known_lower_bound", "plan_lower_bound", "composition_window"]
