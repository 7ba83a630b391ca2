"""Composing one step's pessimistic PLD over any number of steps on a bounded grid.

dp_accounting self-composes a PLD by raising its Fourier transform to a power, so the
number of steps costs nothing; the grid does. A ``T``-fold composition near ``G(mu_T)`` has
privacy losses of about ``N(mu_T^2/2, mu_T^2)``, and a grid of a fixed number of points over
their width must get coarser as ``T`` grows. Discretising *one step* on that coarse grid is valid
(every grid is pessimistic) but loose, because a single step's losses are much smaller than
the grid spacing. Instead the steps are composed in blocks:

1. ``k`` steps are composed on a fine grid (recursively, the same way, if even that is large),
2. the block's PLD is moved to the coarse grid by rounding every privacy loss *up* to the
   next grid point,
3. ``m = ceil(T/k)`` blocks are self-composed on the coarse grid, ``m`` the smallest power of
   two for which one block fits on the fine grid.

Why the result is never below the truth: dp_accounting computes
``delta(eps) = infinity_mass + sum_L p_L (1 - e^{eps - L})_+`` (Sommer, Meiser & Mohammadi,
"Privacy loss classes: the central limit theorem in differential privacy", PoPETs 2019;
Koskela, Jalko & Honkela, "Computing tight differential privacy guarantees using FFT",
AISTATS 2020), which is non-decreasing in every loss ``L``; the loss of a composition is the
sum of the steps' losses, so raising the losses of a block raises every ``delta(eps)`` of
every composition containing it (stochastic dominance is preserved by convolution). And
``m k >= T`` steps: composing more steps is never less private than composing fewer (the
extra outputs can be ignored). Rounding adds at most two coarse grid steps per block, i.e. at
most ``2 m`` grid steps in total, a fraction of about ``2 m / MAX_GRID_POINTS`` of the losses' width.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Mapping

import numpy as np
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib


PLD = pld_lib.PrivacyLossDistribution

# Points of the final grid of a long composition (run time and memory; never validity).
MAX_GRID_POINTS = 1_000_000
# Mass each dp_accounting composition may move to infinity (it adds to delta).
_TAIL = 1e-15
# At most this many blocks per level (more levels beyond): each block's rounding costs at
# most two grid steps.
MAX_BLOCKS = 1024


def loss_width(mu: float) -> float:
    """Width of the privacy losses a composition near ``G(mu)`` puts mass on: its losses are
    about ``N(mu^2/2, mu^2)`` and dp_accounting keeps ``mu^2/2 +- 8 mu`` or so (tail mass
    ``1e-15``); the offset ``mu^2/2`` costs no grid points."""
    return 2.0 * (12.0 * mu + 1.0)


def grid_for(mu_estimate: float, base: float) -> float:
    """The discretisation of a composition near ``G(mu_estimate)``: ``base``, or coarser so
    that the grid keeps about ``MAX_GRID_POINTS`` points. ``mu_estimate`` is a CLT guess; it
    sizes the grid only (run time), the PLD stays pessimistic at any size."""
    if not math.isfinite(mu_estimate):
        return math.inf
    return max(base, loss_width(mu_estimate) / MAX_GRID_POINTS)


# A grid coarser than this (one point per nat of privacy loss: epsilon in the billions) is not
# built; the RDP bounds, which hold for any number of steps, cover such runs.
MAX_DISCRETIZATION = 1.0
TOO_COARSE = (
    "not computed as a PLD: the composition's privacy losses span more than "
    f"{MAX_GRID_POINTS:.0e} grid steps of {MAX_DISCRETIZATION:g} (epsilon in the billions); "
    "the RDP bounds cover this run"
)


def _pmfs(pld: PLD):
    """The PLD's PMFs: one for a symmetric PLD (REPLACE_ONE), remove and add otherwise
    (ADD_OR_REMOVE_ONE, the directions kept apart as dp_accounting keeps them)."""
    if pld._symmetric:  # noqa: SLF001
        return (pld._pmf_remove,)  # noqa: SLF001
    return pld._pmf_remove, pld._pmf_add  # noqa: SLF001


def _rebuilt(pmfs) -> PLD:
    return PLD(*pmfs) if len(pmfs) == 2 else PLD(pmfs[0])


def dense(pld: PLD) -> PLD:
    """The same PLD with dense PMFs: dp_accounting's sparse self-composition multiplies
    dictionaries (seconds for a few points, a minute for ten million steps), the dense one
    uses one FFT. Both directions of an asymmetric PLD are converted."""
    pmfs = _pmfs(pld)
    if all(isinstance(p, pld_pmf.DensePLDPmf) for p in pmfs):
        return pld
    return _rebuilt([p.to_dense_pmf() for p in pmfs])


def self_compose(pld: PLD, steps: int) -> PLD:
    """``pld`` composed ``steps`` times, on its grid.

    dp_accounting's one-FFT self-composition sizes its output with a Chernoff bound at a few
    fixed orders, which grows linearly in ``steps`` once ``steps`` is large (320 million
    points for 10^12 steps of a tiny PLD). Then the composition is done by repeated squaring
    with dp_accounting's ``compose`` instead, whose tail truncation (pessimistic: the left
    tail rounds up, the right one goes to infinity) keeps the grid at the real width.
    """
    pld = dense(pld)
    width = 0
    for pmf in _pmfs(pld):
        lower, upper = pld_common.compute_self_convolve_bounds(pmf._probs, steps, _TAIL)  # noqa: SLF001
        width = max(width, upper - lower + 1)
    if width <= 4 * MAX_GRID_POINTS:
        return pld.self_compose(steps, tail_mass_truncation=_TAIL)
    result, power = None, pld
    while steps:
        if steps & 1:
            result = power if result is None else result.compose(power, tail_mass_truncation=_TAIL)
        steps >>= 1
        if steps:
            power = power.compose(power, tail_mass_truncation=_TAIL)
    return result


def coarsen(pld: PLD, factor: int, discretization: float) -> PLD:
    """``pld`` (on a grid ``<= discretization / factor``) on the grid ``discretization``, every
    privacy loss rounded up to the next grid point (pessimistic, see the module docstring), in
    each direction of an asymmetric PLD separately (each direction's ``delta(eps)`` is the same
    non-decreasing function of its own losses)."""
    return _rebuilt([_coarsen_pmf(pmf, factor, discretization) for pmf in _pmfs(dense(pld))])


def _coarsen_pmf(pmf, factor: int, discretization: float):
    d_old = pmf._discretization  # noqa: SLF001
    if d_old * factor > discretization:
        raise ValueError("coarsen: the old grid times the factor must not exceed the new grid")
    idx = pmf._lower_loss + np.arange(len(pmf._probs), dtype=np.int64)  # noqa: SLF001
    # floor(idx/factor) + 1 > idx/factor, so new_idx*discretization >= idx*d_old for negative
    # losses too, although d_old*factor may fall a few ulps short of discretization
    new_idx = idx // factor + 1
    lower = int(new_idx[0])
    probs = np.bincount(new_idx - lower, weights=pmf._probs)  # noqa: SLF001
    return pld_pmf.DensePLDPmf(discretization, lower, probs, pmf._infinity_mass, True)  # noqa: SLF001


def compose_steps(
    single: Callable[[float], PLD], steps: int, clt_mu: Callable[[int], float], discretization: float, base: float
) -> PLD:
    """A pessimistic PLD on the grid ``discretization`` of ``steps`` compositions of one step.

    ``single(d)`` is the step's pessimistic PLD on grid ``d``; ``clt_mu(k)`` a CLT guess of
    the GDP parameter of ``k`` steps (sizes grids only); ``base`` the finest grid wanted. When
    ``discretization`` is less than twice ``base`` the step is self-composed directly
    (dp_accounting); otherwise in blocks, see the module docstring.
    """
    if steps < 1:
        raise ValueError(f"steps: must be >= 1, got {steps}")
    if steps == 1 or discretization < 2.0 * base:
        return self_compose(single(discretization), steps)
    # as few blocks as let one block fit on the fine grid (each block costs a rounding)
    m = 2
    while m < MAX_BLOCKS and m < steps and grid_for(float(clt_mu(-(-steps // m))), base) > base:
        m *= 2
    k = -(-steps // m)
    m = -(-steps // k)  # m k >= steps
    factor = max(1, math.ceil(discretization / grid_for(float(clt_mu(k)), base)))
    # the block on the finest grid it needs (or a bit finer), a hair under discretization/factor
    # so that factor * d_block <= discretization in floats
    d_block = discretization / factor * (1 - 4e-16)
    block = compose_steps(single, k, clt_mu, d_block, base)
    return self_compose(coarsen(block, factor, discretization), m)


# ------------------------------------------------------------------ ledgers of many noise values
NOISE_GROUPS = 16
"""Groups a ledger's noise values are composed in (each group costs one PLD or RDP evaluation)."""
_NOISE_ATOMS = 256  # distinct values beyond this are first lumped into this many equal log-width cells


def noise_groups(counts: Mapping[float, int], max_groups: int) -> Dict[float, int]:
    """The steps of ``counts`` (noise multiplier ``z`` -> number of steps) in at most ``max_groups``
    groups of consecutive noise values, every step of a group at the group's *smallest* noise. A ledger
    of at most ``max_groups`` values is returned as it is.

    Why it is never below the truth: a step with noise ``z`` is a post-processing of the same step with
    noise ``z' <= z`` (add independent ``N(0, (z^2 - z'^2) C^2)`` to its noisy sum), so the ``z'`` step's
    privacy loss dominates the ``z`` step's, for every sampling of the batch, and a composition of
    dominating steps dominates the composition (Dong, Roth & Su 2022, Thm 3.2 for tradeoff functions;
    Mironov 2017, Prop. 1 for RDP; docs/derivations.md section 20). The grouping only decides how much
    is lost: it minimises the added ``sum_t 1/z_t^2`` (the composition's ``mu^2`` in the Gaussian regime)
    over partitions into contiguous groups (dynamic programming over at most 256 cells of equal width in
    ``log z``, each cell at its smallest value), so the work grows linearly with the number of distinct
    values and the cost of the composition with ``max_groups``.

    >>> noise_groups({1.0: 3, 1.01: 1, 2.0: 5}, max_groups=2)
    {1.0: 4, 2.0: 5}
    """
    if len(counts) <= max_groups:
        return dict(counts)
    z = np.array(sorted(counts), dtype=float)
    k = np.array([counts[x] for x in sorted(counts)], dtype=float)
    s = np.square(z[0] / z)  # 1/z^2 relative to the largest (no overflow at tiny noise)
    first = np.arange(z.size)
    if z.size > _NOISE_ATOMS:  # cells of equal width in log z, each starting at its smallest value
        span = math.log(z[-1] / z[0])
        cell = np.minimum((np.log(z / z[0]) / span * _NOISE_ATOMS).astype(np.int64), _NOISE_ATOMS - 1)
        first = np.flatnonzero(np.diff(np.concatenate([[-1], cell])))
    K = np.concatenate([[0.0], np.cumsum(np.add.reduceat(k, first))])
    W = np.concatenate([[0.0], np.cumsum(np.add.reduceat(k * s, first))])
    m = first.size
    i, j = np.arange(m)[:, None], np.arange(1, m + 1)[None, :]
    # cost[i, j - 1]: the 1/z^2 added by cells i..j-1 at cell i's (smallest) value
    cost = np.where(j > i, s[first][:, None] * (K[j] - K[i]) - (W[j] - W[i]), np.inf)
    best = np.concatenate([[0.0], np.full(m, np.inf)])  # best[j]: cells 0..j-1 in exactly g groups
    parents = []
    for _ in range(min(max_groups, m)):  # splitting a group never adds: use every group allowed
        total = best[:-1, None] + cost
        parent = np.argmin(total, axis=0)
        parents.append(parent)
        best = np.concatenate([[np.inf], total[parent, np.arange(m)]])
    bounds, end = [m], m
    for parent in reversed(parents):
        end = int(parent[end - 1])
        bounds.append(end)
    bounds.reverse()  # 0 = bounds[0] < ... < bounds[-1] = m
    return {float(z[first[a]]): int(round(K[b] - K[a])) for a, b in zip(bounds, bounds[1:])}
