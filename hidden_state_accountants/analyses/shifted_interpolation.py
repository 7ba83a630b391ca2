"""Per-position shifted-interpolation bounds, derived in docs/derivations.md from Bok, Su &
Altschuler's argument (*Shifted Interpolation for Differential Privacy*, ICML 2024,
arXiv:2403.00278, Lemma 3.2 and Thm 3.3, the argument behind their Thms 4.5 and 4.6).

Their argument proves Thm 4.5 for the record in the last batch of a fixed order. Re-derived
here (docs/derivations.md, section 2) for a record used at ANY set of steps: in units where
one step's noise has standard deviation ``nu = lr z C / b`` and one use of the differing record
moves a step by ``s = lr 2C / b`` (framework DP-SGD, docs/design.md section 1), the run is
``mu``-GDP with ``mu = (2/z) sqrt(E)``, where the *energy* ``E`` is that of the lower convex hull
of the uses' *corners* (cumulative payment capacity, cumulative injected shift, both discounted
to the last step; :func:`corner_energy`). For the record last in every epoch it is exactly
Thm 4.5; moving a use later never lowers it and removing one never raises it (section 2.3).

On top of that, the batches are drawn independently of the data, so conditional on the draw
the run is a fixed-order run, and the hockey-stick divergence is jointly convex: ``delta(eps)``
is at most the average of the conditional ``delta_{G(mu)}(eps)`` over the draw
(:class:`~hidden_state_accountants.bounds.MixtureGdpBound`); in RDP, Ye & Shokri (NeurIPS
2022, arXiv:2203.05363) Lemma 4.1. The analyses:

* ``si_position_average`` (+ ``_rdp``, ``_constrained``): ``shuffle_partition``, the record's
  batch uniform and the same every epoch (section 4.1).
* ``si_reshuffle_average`` (+ ``_rdp``): ``reshuffle``, the last epochs' positions averaged, the
  earlier ones at their worst (section 3), also with a kept short batch (section 3.5).
* ``si_reshuffle_worst`` (+ ``_constrained``): ``reshuffle`` at its worst visit pattern, valid
  for any positions and public batches; with a partial last epoch it is LARGER than Thm 4.5
  with ``E = ceil(t/l)``, which does not hold there (section 2.4).
* ``affine_exact_average``: only for a declared geometry with ``M = m`` and no projection
  (every per-example map affine): the exact Gaussian of each batch pattern, averaged
  (section 4.2).

Everything is in log space; uses discounted by less than ``exp(-LUMP)`` are lumped into a start
of the interpolation (a restriction of the interpolation schedules, so never optimistic).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
from scipy import special

from hidden_state_accountants import fdp
from hidden_state_accountants.analyses import _common as cm
from hidden_state_accountants.analyses.analysis_info import analysis
from hidden_state_accountants.bounds import (
    Bound,
    GdpBound,
    MixtureGdpBound,
    NotApplicable,
    RdpBound,
    mixture_components,
)
from hidden_state_accountants.errors import ParameterError
from hidden_state_accountants.events import TrainingRunDpEvent
from hidden_state_accountants.schedule_laws import schedule_law
from hidden_state_accountants.schedules import (
    CYCLIC,
    DROPPED,
    FULL,
    KEPT_BATCH_SIZE,
    KEPT_OWN_SIZE,
    RESHUFFLE,
    SAMPLINGS,
    SHUFFLE_PARTITION,
)

BOK = "Bok, Su & Altschuler (2024)"
YS = "Ye & Shokri (2022)"
LUMP = 300.0
"""Uses discounted by ``c^d < exp(-LUMP)`` start the interpolation (their noise is not used)."""
RANDOM_EPOCHS = 2
"""Epochs whose positions ``reshuffle`` averages over exactly (fewer when that is too many patterns)."""
MAX_PATTERNS = 4096
"""Visit patterns evaluated per bound (each a small convex hull)."""
EXACT_OPTIONS = 2048
"""Positions per epoch evaluated one by one; beyond, the older ones are grouped (rounded later)."""
MAX_OPTIONS = 4096
MAX_STARTS = 256
"""Starting points of the interpolation tried by the constrained bounds (any start is valid)."""
EXACT_LAW_STEPS = 10**5
"""The affine analysis builds the law of a random batch pattern up to this many steps (and
up to this many batch positions)."""


# ============================================================================ the energy
@dataclass(frozen=True)
class StepModel:
    """A run seen from its end: ``steps`` steps of ``spe`` per epoch, each contracting by
    ``c = exp(log_c)``; a use ``d`` steps before the end injects ``c^d s_d`` and that step adds
    capacity ``c^{2d} nu_d^2`` (units of a full step). ``short_scale`` is ``s = nu`` of the kept
    short batch (the last step of every whole epoch) when it is divided by its own size."""

    steps: int
    spe: int
    log_c: float
    short_scale: float = 1.0

    def is_short(self, d: int) -> bool:
        return self.short_scale != 1.0 and d % self.spe == self.steps % self.spe

    def log_injection(self, d: int) -> float:
        if self.log_c == -math.inf:
            return math.log(self.short_scale if self.is_short(d) else 1.0) if d == 0 else -math.inf
        return d * self.log_c + (math.log(self.short_scale) if self.is_short(d) else 0.0)

    def _geometric(self, lc2: float, k: int) -> float:
        """``sum_{i<k} exp(i lc2)``."""
        if k <= 0:
            return 0.0
        if lc2 == 0.0:
            return float(k)
        if lc2 == -math.inf:
            return 1.0
        return -math.expm1(k * lc2) / -math.expm1(lc2)

    def capacity(self, d_lo: int, d_hi: int) -> float:
        """``sum_{d_lo <= d < d_hi} c^{2d} nu_d^2``: what the steps in that range can pay."""
        if d_hi <= d_lo:
            return 0.0
        lc2 = 2.0 * self.log_c
        start = 1.0 if d_lo == 0 else (0.0 if lc2 == -math.inf else math.exp(d_lo * lc2))
        out = start * self._geometric(lc2, d_hi - d_lo)
        if self.short_scale != 1.0:
            first = d_lo + (self.steps - d_lo) % self.spe  # the first short step at or after d_lo
            if first < d_hi:
                count = (d_hi - 1 - first) // self.spe + 1
                at = 1.0 if first == 0 else (0.0 if lc2 == -math.inf else math.exp(first * lc2))
                out += (self.short_scale**2 - 1.0) * at * self._geometric(self.spe * lc2, count)
        return out

    @property
    def cut(self) -> float:
        """Uses further back than this are lumped into a start there."""
        if self.log_c == 0.0:
            return math.inf
        return math.floor(LUMP / -self.log_c) if self.log_c > -math.inf else 0


Corner = Tuple[int, float]  # (steps before the end, log discounted injection)


def corner_energy(model: StepModel, corners: Sequence[Corner]) -> float:
    """Energy of the cheapest interpolation schedule for uses at ``corners``
    (docs/derivations.md 2.1-2.2): the lower convex hull of the points (capacity so far,
    injection so far), one per use just before it, and the end; ``sum (Delta y)^2/(Delta x)``
    over its edges. Corners further back than ``model.cut`` are moved to it (a start of the
    interpolation carrying their contracted shifts: a restriction, never optimistic)."""
    acc = {}
    cut = model.cut
    for d, li in corners:
        if li == -math.inf:
            continue  # no injection: never a hull vertex
        key = int(min(d, cut))
        acc[key] = float(np.logaddexp(acc[key], li)) if key in acc else li
    if not acc:
        return 0.0
    ds = sorted(acc, reverse=True)
    dx = [model.capacity((ds[i + 1] if i + 1 < len(ds) else -1) + 1, d + 1) for i, d in enumerate(ds)]
    dy = [math.exp(acc[d]) for d in ds]
    xs = np.concatenate([[0.0], np.cumsum(dx)])
    ys = np.concatenate([[0.0], np.cumsum(dy)])
    hull = fdp.lower_hull(xs, ys, keep_within=1e-12)
    energy = 0.0
    for a, b in zip(hull[:-1], hull[1:]):
        width = math.fsum(dx[a:b])  # summed, not differenced: no cancellation
        rise = math.fsum(dy[a:b])
        if rise > 0:
            energy += rise * rise / width if width > 0 else math.inf
    return energy


def chain(model: StepModel, d_last: int, count: int, period: int) -> List[Corner]:
    """Corners of ``count`` uses ``period`` steps apart, the most recent ``d_last`` steps
    before the end, compressed to two: the segments between consecutive uses of such a chain
    are copies of each other scaled by ``c^period`` in injection and ``c^{2 period}`` in
    capacity, so their slopes decrease towards the end (a concave chain) and no interior use
    is a hull vertex (docs/derivations.md 2.2). The first corner carries all injections but
    the last. Exact, O(1) for any ``count``."""
    if count <= 0:
        return []
    last = (d_last, model.log_injection(d_last))
    if count == 1 or model.log_c == -math.inf:
        return [last]
    log_s = last[1] - d_last * model.log_c  # the chain's (common) shift
    if model.log_c == 0.0:
        log_rest = log_s + math.log(count - 1)
    else:
        lc = model.log_c
        log_rest = (
            log_s
            + (d_last + period) * lc
            + math.log(-math.expm1(period * (count - 1) * lc))
            - math.log(-math.expm1(period * lc))
        )
    return [(d_last + (count - 1) * period, log_rest), last]


def constrained_energy(
    model: StepModel, older: Optional[Tuple[int, int, int]], recent: Sequence[int], debt: float
) -> float:
    """The best over starting points of the interpolation (Bok et al.'s ``tau``, the argument
    of their Thm 4.6, re-derived for any visit pattern: docs/derivations.md 2.3) for uses at
    the chain ``older = (d_last, count, period)`` and at the distances ``recent`` (all with a
    full step's shift), when both iterates stay in a set of diameter ``debt`` (in units of a
    use's shift ``s``). A start right after a use carries ``min(debt, contracted earlier
    shifts)``; any start is valid, so trying only the last :data:`MAX_STARTS` is sound."""
    recent = sorted(recent, reverse=True)
    if older is not None and older[1] > MAX_STARTS:  # the latest chain members are tried as starts
        d_last, count, period = older
        keep = MAX_STARTS
        recent = [d_last + i * period for i in range(keep - 1, -1, -1)] + recent
        older = (d_last + keep * period, count - keep, period)
    elif older is not None:
        d_last, count, period = older
        recent = [d_last + i * period for i in range(count - 1, -1, -1)] + recent
        older = None
    base = chain(model, *older) if older else []
    best = corner_energy(model, base + [(d, model.log_injection(d)) for d in recent])
    log_debt = math.log(debt) if debt > 0 else -math.inf
    carried = [li for _, li in base]
    for i, d in enumerate(recent):
        carried.append(model.log_injection(d))
        if d < 1:
            continue
        d0 = d - 1  # start with the step right after this use
        start = min(float(special.logsumexp(carried)), log_debt + (d0 + 1) * model.log_c)
        later = [(x, model.log_injection(x)) for x in recent[i + 1 :]]
        best = min(best, corner_energy(model, [(d0, start)] + later))
    return best


def _log_geometric(log_r: np.ndarray, k: np.ndarray) -> np.ndarray:
    """``log sum_{j<k} r^j`` elementwise (``k >= 1``, ``r = exp(log_r) <= 1``)."""
    log_r, k = np.broadcast_arrays(np.asarray(log_r, dtype=float), np.asarray(k, dtype=float))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        general = np.log(-np.expm1(k * log_r)) - np.log(-np.expm1(log_r))
    return np.where(log_r == 0.0, np.log(k), np.where(log_r == -np.inf, 0.0, general))


def chain_constrained_energies(
    model: StepModel, last: Sequence[int], visits: Sequence[int], period: int, debt: float
) -> np.ndarray:
    """:func:`constrained_energy` for one chain per entry (``older = (last, visits, period)``, no
    other uses), all entries and starts at once (docs/derivations.md 2.3).

    The same minimum over the same starts (right after each of the latest :data:`MAX_STARTS`
    uses; a start further back than ``model.cut`` is skipped, which can only raise the
    minimum) and the start-free energy of the whole chain: after a start the later uses are a
    chain, whose interior uses are never hull vertices (2.2), so each start is a hull of at
    most four points, evaluated in closed form on arrays. Needs no kept short batch
    (``model.short_scale == 1``), as the constrained bounds do."""
    if model.short_scale != 1.0:
        raise ValueError("chain_constrained_energies: dropped short batches only")
    last = np.asarray(last, dtype=np.int64)
    visits = np.asarray(visits, dtype=np.int64)
    out = np.array(
        [corner_energy(model, chain(model, int(m), int(v), period)) if v else 0.0 for m, v in zip(last, visits)]
    )
    starts = int(min(MAX_STARTS, visits.max(initial=0)))
    if starts == 0:
        return out
    lc = model.log_c
    m = last[:, None].astype(float)
    i = np.arange(starts, dtype=float)[None, :]
    v = visits[:, None].astype(float)
    d_i = m + i * period  # the use after which the interpolation starts
    ok = (i < np.minimum(v, MAX_STARTS)) & (d_i >= 1) & (d_i - 1 <= model.cut)
    lcp = period * lc if lc > -math.inf else -math.inf

    def log_pow(k):  # log c^k, with 0 * (-inf) = 0
        return np.where(k == 0, 0.0, k * lc) if lc == -math.inf else k * lc

    def cap(a, b):  # sum_{a <= d < b} c^{2d}, b > a
        return np.exp(log_pow(2 * a) + _log_geometric(2 * lc, np.maximum(b - a, 1)))

    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        carried = log_pow(d_i) + _log_geometric(lcp, np.maximum(v - i, 1))  # every use from this one back
        z = np.minimum(carried, (math.log(debt) if debt > 0 else -math.inf) + log_pow(d_i))
        mid = np.where(i >= 2, log_pow(m + period) + _log_geometric(lcp, np.maximum(i - 1, 1)), -np.inf)
        dy = np.stack([np.exp(z), np.exp(mid), np.where(i >= 1, np.exp(log_pow(m)), 0.0)])
        prev = np.where(i >= 2, m + (i - 1) * period, m)  # the oldest later corner
        w_start = np.where(i >= 1, cap(prev + 1, d_i), cap(np.zeros_like(d_i), d_i))
        w_mid = np.where(i >= 2, cap(m + 1, prev + 1), 0.0)
        w_last = np.where(i >= 1, cap(np.zeros_like(d_i), m + 1), 0.0)
        dx = np.stack([w_start, w_mid, w_last])
        energy = _hull_energy(dx, dy)
    energy = np.where(ok, energy, np.inf)
    return np.minimum(out, np.min(energy, axis=1))


def _hull_energy(dx: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """:func:`corner_energy`'s hull energy for the points ``(0, 0)`` and the cumulative sums of
    up to three segments ``(dx_k, dy_k)`` (a segment with ``dx = dy = 0`` is absent), on
    arrays: Andrew's monotone chain with :func:`fdp.lower_hull`'s test and margin."""
    present = (dx > 0) | (dy > 0)
    xs = np.cumsum(dx, axis=0)
    ys = np.cumsum(dy, axis=0)
    zero = np.zeros_like(xs[0])
    px = [zero, xs[0], xs[1], xs[2]]
    py = [zero, ys[0], ys[1], ys[2]]

    def above(a, b, c):  # fdp.lower_hull: drop b if it lies on or above the segment a -> c
        up = (py[b] - py[a]) * (px[c] - px[a])
        chord = (py[c] - py[a]) * (px[b] - px[a])
        return up >= chord + 1e-12 * (np.abs(up) + np.abs(chord))

    # Andrew's chain over 0, 1, 2, 3 (3 the end): point 1 (2) is interior when a present
    # segment follows it; an interior point is popped when it lies on or above the next chord
    cand1, cand2 = present[0] & (present[1] | present[2]), present[1] & present[2]
    keep1 = cand1 & ~(cand2 & above(0, 1, 2))
    keep2 = cand2 & ~np.where(keep1, above(1, 2, 3), above(0, 2, 3))
    keep1 = keep1 & ~(~keep2 & above(0, 1, 3))
    # energy of the path 0 -> (1) -> (2) -> 3 over the kept vertices, widths summed segment by segment
    seg_x = [dx[0], dx[1], dx[2]]
    seg_y = [dy[0], dy[1], dy[2]]
    energy = np.zeros_like(xs[0])
    run_x, run_y = seg_x[0], seg_y[0]
    for k, keep in ((1, keep1), (2, keep2)):
        close = keep
        energy = (
            energy
            + np.where(close & (run_y > 0), run_y * run_y / np.where(run_x > 0, run_x, 1.0), 0.0)
            + np.where(close & (run_y > 0) & (run_x <= 0), np.inf, 0.0)
        )
        run_x = np.where(close, seg_x[k], run_x + seg_x[k])
        run_y = np.where(close, seg_y[k], run_y + seg_y[k])
    energy = (
        energy
        + np.where(run_y > 0, run_y * run_y / np.where(run_x > 0, run_x, 1.0), 0.0)
        + np.where((run_y > 0) & (run_x <= 0), np.inf, 0.0)
    )
    return energy


def _buckets(first: int, last: int, exact: int = EXACT_OPTIONS, total: int = MAX_OPTIONS) -> List[Tuple[int, int]]:
    """``(representative, count)`` covering the distances ``first..last``: one by one up to
    ``exact``, then in geometrically growing groups represented by their most recent member
    (moving a use later never lowers the energy: docs/derivations.md 2.3), ``total`` in all."""
    n = last - first + 1
    if n <= total:
        return [(first + i, 1) for i in range(n)]
    out = [(first + i, 1) for i in range(exact)]
    groups = total - exact
    ratio = (n / exact) ** (1.0 / groups)
    lo = exact
    while lo < n:
        hi = min(n, max(lo + 1, int(math.ceil(lo * ratio))))
        out.append((first + lo, hi - lo))
        lo = hi
    return out


# ======================================================================== the run's shape
def _model(run: TrainingRunDpEvent, log_c: float) -> StepModel:
    scale = 1.0
    if run.last_batch == KEPT_OWN_SIZE:
        scale = run.batch_size / (run.dataset_size % run.batch_size)
    return StepModel(run.steps, run.steps_per_epoch, log_c, scale)


def _log_c(run: TrainingRunDpEvent) -> float:
    g, lr = run.geometry, float(run.learning_rate)
    return max(cm.log_abs_one_minus(lr * g.strong_convexity), cm.log_abs_one_minus(lr * g.smoothness))


def _strongly_convex(run: TrainingRunDpEvent) -> Optional[str]:
    """Bok Thm 4.5's conditions: m-strongly convex, M-smooth, ``0 < lr < 2/M`` (Lemma 2.8)."""
    return cm.hidden_state_preconditions(run) or cm.first_reason(
        cm.need_strong_convexity(run), cm.lr_below(run, 2.0 / run.geometry.smoothness, "2/M"), _kept_short(run)
    )


def _constrained(run: TrainingRunDpEvent) -> Optional[str]:
    """Bok Thm 4.6's conditions: convex, M-smooth, projection onto a set of diameter ``D``, ``lr <= 2/M``."""
    reason = cm.hidden_state_preconditions(run) or cm.first_reason(
        cm.need_diameter(run), cm.lr_below(run, 2.0 / run.geometry.smoothness, "2/M", strict=False)
    )
    if reason is None and run.last_batch != DROPPED:
        reason = "the constrained bounds are derived for dropped short batches only"
    return reason


def _kept_short(run: TrainingRunDpEvent) -> Optional[str]:
    """A short batch divided by ``b`` contracts like a full one only if the L2 term lies in
    ``[m, M]``, which the declared geometry forces when there is no projection and which the
    recorded L2 strength shows otherwise (docs/derivations.md 3.5)."""
    if run.last_batch != KEPT_BATCH_SIZE or run.geometry.diameter is None:
        return None
    m, M, m_reg = run.geometry.strong_convexity, run.geometry.smoothness, run.l2_regularization
    if m_reg is None:
        return (
            "a kept short batch divided by b with a projection: its contraction depends on the L2 strength, "
            "which is not recorded (l2_regularization)"
        )
    if not m * (1 - 1e-12) <= m_reg <= M * (1 + 1e-12):
        return (
            f"a kept short batch divided by b with a projection contracts like the others only if the L2 "
            f"strength lies in [m, M] = [{m:g}, {M:g}], got l2_regularization={m_reg:g}"
        )
    return None


def _mixture(pairs: Sequence[Tuple[float, float]], z: float, note: str) -> MixtureGdpBound:
    probs, mus = mixture_components([p for p, _ in pairs], [(2.0 / z) * math.sqrt(e) for _, e in pairs])
    return MixtureGdpBound(probs=probs, mus=mus, note=note)


# ======================================================================= shuffle_partition
def partition_options(
    run: TrainingRunDpEvent, exact: int = EXACT_OPTIONS, total: int = MAX_OPTIONS
) -> List[Tuple[float, int, int]]:
    """``(probability, m, visits)`` of the record's batch in a partition drawn once: uniform over
    the ``n`` slots, the same batch every epoch. With ``m`` the steps after its last use
    (``0 .. l-1``, grouped far back by :func:`_buckets`, each group represented by its most
    recent member, which has the most visits), a batch has ``floor(T/l) + [m < T mod l]`` uses
    ``l`` apart. The ``n - l b`` slots past the last batch are not listed (never used)."""
    n, b, T = run.dataset_size, run.batch_size, run.steps
    l = run.steps_per_epoch
    full, rest = divmod(T, l)
    return [(count * b / n, m, full + (1 if m < rest else 0)) for m, count in _buckets(0, l - 1, exact, total)]


def position_energies(run: TrainingRunDpEvent, model: StepModel) -> List[Tuple[float, float]]:
    """``(probability, energy)`` of the record's batch in a partition drawn once
    (:func:`partition_options`; the never-used slots with energy 0)."""
    n, b, l = run.dataset_size, run.batch_size, run.steps_per_epoch
    out = [
        (p, corner_energy(model, chain(model, m, visits, l)) if visits else 0.0)
        for p, m, visits in partition_options(run)
    ]
    if n - l * b:
        out.append(((n - l * b) / n, 0.0))
    return out


def _position_average(run: TrainingRunDpEvent) -> Bound:
    reason = _strongly_convex(run) or cm.need_secret_batches(run)
    if reason:
        return NotApplicable(reason=reason)
    pairs = position_energies(run, _model(run, _log_c(run)))
    # The value for a longer run bounds every shorter one (each batch's uses only get more),
    # which is what monotone_in_steps is used for (the limit of unbounded training).
    return _mixture(pairs, float(run.noise_multiplier), "the record's batch uniform, the same every epoch")


@analysis(
    "si_position_average",
    f"{BOK}, Lemma 3.2/Thm 3.3 per batch position (re-derived: docs/derivations.md 2.2, 4.1); "
    "joint convexity over the uniform position",
    (SHUFFLE_PARTITION,),
    needs="m > 0, lr < 2/M, secret batches",
)
def position_average(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """Shuffle-and-partition: ``delta(eps) <= sum_beta (b/n) delta_{G(mu_beta)}(eps)``.

    Ingredients: Bok et al.'s Lemma 3.2 / Thm 3.3 for the record at batch ``beta`` of a fixed
    order (:func:`corner_energy`; at the last batch it is their Thm 4.5, elsewhere smaller:
    re-derived in docs/derivations.md 2.2), and joint convexity of the hockey-stick divergence
    over the partition, which is drawn once, secretly and independently of the data.
    Conditions as Thm 4.5 (``m > 0``, ``0 < lr < 2/M``, constant rate and noise) and secret
    batches. Never above Thm 4.5 (an average of deltas is at most the largest).
    """
    bound = _position_average(run)
    if bound.applicable:
        bound.monotone_in_steps = True
    return bound


@analysis(
    "si_position_average_rdp",
    f"{BOK}, Lemma 3.2/Thm 3.3 per batch position (docs/derivations.md 4.1); {YS}, Lemma 4.1 over the position",
    (SHUFFLE_PARTITION,),
    needs="m > 0, lr < 2/M, secret batches",
)
def position_average_rdp(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """RDP of :func:`position_average`: each position's ``mu_beta``-GDP gives
    ``(a, a mu_beta^2 / 2)``-RDP, mixed with Ye & Shokri's Lemma 4.1 (the structure of their
    Thm 4.2 with the shifted-interpolation bound per position). For RDP composition."""
    bound = _position_average(run)
    if not bound.applicable:
        return bound
    return RdpBound(orders=ctx.orders, values=bound.rdp(ctx.orders), monotone_in_steps=True)


@analysis(
    "si_position_average_constrained",
    f"{BOK}, Lemma 3.2/Thm 3.3 with a start tau and the diameter (argument of Thm 4.6, re-derived per "
    "position: docs/derivations.md 2.3, 4.1); joint convexity over the uniform position",
    (SHUFFLE_PARTITION,),
    needs="D, lr <= 2/M, secret batches",
)
def position_average_constrained(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """Shuffle-and-partition with projection onto a convex set of diameter ``D`` (convex,
    M-smooth, ``lr <= 2/M``): per batch position, the best start of the interpolation
    (:func:`constrained_energy`, all positions at once: :func:`chain_constrained_energies`),
    averaged in ``delta`` over the uniform position."""
    reason = _constrained(run) or cm.need_secret_batches(run)
    if reason:
        return NotApplicable(reason=reason)
    n, b, l = run.dataset_size, run.batch_size, run.steps_per_epoch
    model = _model(run, min(0.0, _log_c(run)))
    debt = run.geometry.diameter * b / (2.0 * float(run.learning_rate))  # D in units of s (C = 1)
    options = partition_options(run)
    energies = chain_constrained_energies(model, [m for _, m, _ in options], [v for _, _, v in options], l, debt)
    pairs = [(p, float(e)) for (p, _, _), e in zip(options, energies)]
    if n - l * b:
        pairs.append(((n - l * b) / n, 0.0))
    return _mixture(pairs, float(run.noise_multiplier), "projected; the record's batch uniform")


# ============================================================================== reshuffle
def _epoch_options(
    run: TrainingRunDpEvent, model: StepModel, e: int, exact: int = EXACT_OPTIONS, total: int = MAX_OPTIONS
) -> List[Tuple[float, Optional[int]]]:
    """``(probability, distance of the use or None)`` for the record in epoch ``e``: its slot
    is uniform on ``n``; batch ``j`` (``b`` slots) is used ``T-1-(e spe + j)`` steps before the
    end, a kept short batch holds the last ``n mod b`` slots, the rest are not used."""
    n, b, T, spe = run.dataset_size, run.batch_size, run.steps, model.spe
    here = min(spe, T - e * spe)
    short = run.last_batch != DROPPED and here == spe
    full_batches = here - 1 if short else here
    d_latest = T - 1 - (e * spe + here - 1)
    out: List[Tuple[float, Optional[int]]] = []
    used = 0
    if short:
        r = n % b
        out.append((r / n, d_latest))
        used += r
    first = d_latest + (1 if short else 0)
    for d, count in _buckets(first, first + full_batches - 1, exact, total) if full_batches else []:
        out.append((count * b / n, d))
    used += full_batches * b
    if n > used:
        out.append(((n - used) / n, None))
    return out


def reshuffle_patterns(
    run: TrainingRunDpEvent, model: StepModel, random_epochs: int = RANDOM_EPOCHS
) -> Tuple[List[Tuple[float, float]], int]:
    """``(probability, energy)`` of the visit patterns of a reshuffled run: the positions in
    the last ``k <= random_epochs`` epochs averaged exactly (``k`` lowered until there are at
    most :data:`MAX_PATTERNS`), the earlier epochs at their worst position (their last step:
    moving a use later never lowers the energy, docs/derivations.md 2.3, also with a kept
    short batch, whose shift is at least any earlier contracted one, 3.5). Returns the
    patterns and ``k``."""
    T, spe = run.steps, model.spe
    epochs = -(-T // spe)
    k = max(1, min(random_epochs, epochs))
    options = [_epoch_options(run, model, e) for e in range(epochs - k, epochs)]
    while k > 1 and math.prod(len(o) for o in options) > MAX_PATTERNS:
        k -= 1
        options = options[1:]
    fixed = epochs - k
    prefix = chain(model, T - fixed * spe, fixed, spe)
    out = []
    for combo in itertools.product(*options):
        p = math.prod(q for q, _ in combo)
        corners = prefix + [(d, model.log_injection(d)) for _, d in combo if d is not None]
        out.append((p, corner_energy(model, corners)))
    return out, k


def worst_pattern(run: TrainingRunDpEvent, model: StepModel) -> List[Corner]:
    """The worst visit pattern of a reshuffled run (docs/derivations.md 2.3-2.4): the last step
    of every whole epoch and the last step of a partial last epoch, i.e. uses ``0, l', l' + spe,
    ...`` steps before the end (``l'`` the last epoch's length). For whole epochs this is Bok
    Thm 4.5's pattern; with a partial last epoch its last two uses are only ``l'`` apart."""
    T, spe = run.steps, model.spe
    epochs = -(-T // spe)
    last = T - (epochs - 1) * spe
    return chain(model, last, epochs - 1, spe) + [(0, model.log_injection(0))]


def _reshuffle_average(run: TrainingRunDpEvent) -> Bound:
    reason = _strongly_convex(run) or cm.need_secret_batches(run)
    if reason:
        return NotApplicable(reason=reason)
    patterns, k = reshuffle_patterns(run, _model(run, _log_c(run)))
    kept = "" if run.last_batch == DROPPED else f"; short batch {run.last_batch}"
    return _mixture(
        patterns,
        float(run.noise_multiplier),
        f"positions in the last {k} epoch(s) averaged, earlier ones at the worst{kept}",
    )


@analysis(
    "si_reshuffle_average",
    f"{BOK}, Lemma 3.2/Thm 3.3 per visit pattern (re-derived: docs/derivations.md 2.2-2.3, 3.5); "
    "joint convexity over the last epochs' positions",
    (RESHUFFLE,),
    needs="m > 0, lr < 2/M, secret batches",
)
def reshuffle_average(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """Reshuffling (a fresh secret permutation every epoch), f-DP.

    Ingredients: conditional on the permutations the run is a fixed-order run with the record
    at one position per epoch; Bok et al.'s Lemma 3.2 / Thm 3.3 for that visit pattern
    (:func:`corner_energy`, re-derived in docs/derivations.md 2.2; with a kept short batch
    the per-step version of 3.5); the positions of different epochs are independent and
    uniform, so joint convexity of the hockey-stick divergence averages the last epochs'
    ``delta_{G(mu)}`` exactly, the earlier epochs put at their worst (2.3). Conditions as Bok
    Thm 4.5; permutations uniform, independent of the data and secret; every batch ``b``
    records except a kept short batch (``last_batch``). Any number of steps, partial last
    epochs included. Not monotone in the steps (it jumps at epoch starts).
    """
    return _reshuffle_average(run)


@analysis(
    "si_reshuffle_average_rdp",
    f"{BOK}, Lemma 3.2/Thm 3.3 per visit pattern (docs/derivations.md 3.3); {YS}, Lemma 4.1 over the positions",
    (RESHUFFLE,),
    needs="m > 0, lr < 2/M, secret batches",
)
def reshuffle_average_rdp(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """RDP of :func:`reshuffle_average` (each pattern's ``mu``-GDP as ``(a, a mu^2/2)``-RDP,
    mixed by Ye & Shokri's Lemma 4.1: the structure of their Thm 4.2, with the
    shifted-interpolation bound, which is proved for every visit pattern). For RDP composition."""
    bound = _reshuffle_average(run)
    if not bound.applicable:
        return bound
    return RdpBound(orders=ctx.orders, values=bound.rdp(ctx.orders))


@analysis(
    "si_reshuffle_worst",
    f"{BOK}, Thm 4.5's argument at the worst visit pattern (re-derived for partial epochs: "
    "docs/derivations.md 2.3-2.4, 3.5)",
    (RESHUFFLE,),
    needs="m > 0, lr < 2/M",
)
def reshuffle_worst(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """Reshuffling at the worst visit pattern (:func:`worst_pattern`): holds for ANY
    positions, so also for public batches. Whole epochs of dropped short batches: exactly
    Bok Thm 4.5 (which, by docs/derivations.md 2.3, bounds every visit pattern). A partial
    last epoch: larger than Thm 4.5 with ``E = ceil(t/l)`` (2.4). Not monotone in the steps."""
    reason = _strongly_convex(run)
    if reason:
        return NotApplicable(reason=reason)
    model = _model(run, _log_c(run))
    return GdpBound(
        mu=(2.0 / float(run.noise_multiplier)) * math.sqrt(corner_energy(model, worst_pattern(run, model))),
        note="worst visit pattern",
    )


@analysis(
    "si_reshuffle_worst_constrained",
    f"{BOK}, Thm 4.6's argument (start tau, diameter) at the worst visit pattern (re-derived: "
    "docs/derivations.md 2.3-2.4)",
    (RESHUFFLE,),
    needs="D, lr <= 2/M",
)
def reshuffle_worst_constrained(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """Reshuffling with projection onto a convex set of diameter ``D`` (convex, M-smooth,
    ``lr <= 2/M``) at the worst visit pattern, the start of the interpolation optimised
    (:func:`constrained_energy`). Holds for any positions; Thm 4.6's closed form does not
    hold for a partial last epoch (docs/derivations.md 2.4)."""
    reason = _constrained(run)
    if reason:
        return NotApplicable(reason=reason)
    T, spe = run.steps, run.steps_per_epoch
    model = _model(run, min(0.0, _log_c(run)))
    debt = run.geometry.diameter * run.batch_size / (2.0 * float(run.learning_rate))
    epochs = -(-T // spe)
    older = (T - (epochs - 1) * spe, epochs - 1, spe) if epochs > 1 else None
    energy = constrained_energy(model, older, [0], debt)
    return GdpBound(mu=(2.0 / float(run.noise_multiplier)) * math.sqrt(energy), note="worst visit pattern")


# ============================================================== affine per-example maps only
@analysis(
    "affine_exact_average",
    "exact Gaussian per batch pattern when every per-example map is affine (declared M = m, no "
    "projection; docs/derivations.md 4.2) + joint convexity",
    SAMPLINGS,
    needs="M = m (affine maps), no projection, lr < 2/M",
)
def affine_exact_average(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """VALID ONLY WHEN the declared geometry has ``M = m`` and there is no projection.

    Then every per-example map has Jacobian ``m I``: ``g_i(theta) = m theta + v_i`` with
    ``||v_i|| <= C`` (docs/derivations.md 1.3, 4.2), and given the batches the last iterates
    under the two datasets are Gaussians with the same covariance whose means differ by at most
    ``(lr 2C) S``, ``S = sum_t c^{T-1-t} 1{record in B_t} / (divisor of step t)``: exactly
    ``G(kappa |S|)`` whatever the other records are (:mod:`hidden_state_accountants.schedule_laws`).
    The batches are independent of the data, so by joint convexity ``delta(eps)`` is at most
    the average over the schedule's law of ``S`` (rounded up on a grid where it is large); with
    public batches the largest ``|S|``. Not a published theorem: elementary. Exact for
    ``full`` and ``cyclic``.
    """
    reason = cm.hidden_state_preconditions(run)
    g = run.geometry
    if reason is None and g.strong_convexity != g.smoothness:
        reason = "needs affine per-example maps: the declared strong_convexity must equal smoothness"
    if reason is None and g.diameter is not None:
        reason = "a projection makes the per-example maps non-affine"
    if reason is None:
        reason = cm.lr_below(run, 2.0 / g.smoothness, "2/M")
    if reason is None and run.sampling not in (FULL, CYCLIC, SHUFFLE_PARTITION) and run.steps > EXACT_LAW_STEPS:
        reason = f"not computed: the law of the batch pattern of more than {EXACT_LAW_STEPS:.0e} random steps"
    if reason is None and run.steps_per_epoch > EXACT_LAW_STEPS:
        reason = f"not computed: more than {EXACT_LAW_STEPS:.0e} batch positions"
    if reason:
        return NotApplicable(reason=reason)
    try:
        law, kappa = schedule_law(run)
    except ParameterError as err:  # the grid needs c >= 0
        return NotApplicable(reason=f"not computed: {err}")
    shifts = kappa * np.abs(law.values)
    if not run.secret_batches:  # the adversary knows the pattern: its worst case
        return GdpBound(mu=float(np.max(shifts)), note="affine maps; public batches: the worst pattern")
    with np.errstate(under="ignore"):
        weights = np.exp(law.log_w - special.logsumexp(law.log_w))
    probs, mus = mixture_components(weights, shifts)
    return MixtureGdpBound(probs=probs, mus=mus, note="affine maps: each batch pattern's Gaussian is exact")


__all__ = [
    "StepModel",
    "corner_energy",
    "chain",
    "constrained_energy",
    "chain_constrained_energies",
    "partition_options",
    "position_energies",
    "reshuffle_patterns",
    "worst_pattern",
    "position_average",
    "position_average_rdp",
    "position_average_constrained",
    "reshuffle_average",
    "reshuffle_average_rdp",
    "reshuffle_worst",
    "reshuffle_worst_constrained",
    "affine_exact_average",
]
