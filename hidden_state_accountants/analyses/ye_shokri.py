"""Ye & Shokri (2022), *Differentially Private Learning Needs Hidden State*.

RDP of noisy mini-batch gradient descent (their Algorithm 1): the step is
``theta <- theta - eta * g(theta; B) + sqrt(2 eta sigma^2) N(0, I)``, the loss is
``lambda``-strongly convex and ``beta``-smooth, ``S_g`` is the gradient sensitivity and
``eta < 2/(lambda + beta)``. From framework DP-SGD (docs/design.md, section 1)::

    sigma^2 = lr z^2 C^2 / (2 b^2),   S_g = 2 C,   so  alpha eta S_g^2 / (4 sigma^2 b^2) = 2 alpha / z^2

(their Cor. 5.3). With ``l = n/b`` batches per epoch (``n mod b`` records are dropped
each epoch, footnote 3, so ``l = floor(n/b)``) and ``rho = (1 - eta lambda)^2``::

    eps_0^j(alpha) = (alpha eta S_g^2 / (4 sigma^2 b^2)) * rho^{j-1} / sum_{s<j} rho^s ,  j = 1..l

Everything is evaluated in log space (their footnote 4): ``rho^k`` as ``exp(k log rho)``,
``1 - rho^k`` with ``expm1`` and the mixtures with ``logsumexp``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
from scipy import optimize, special

from hidden_state_accountants.analyses import _common as cm
from hidden_state_accountants.analyses import poisson_hidden_state as ph
from hidden_state_accountants.analyses.analysis_info import analysis
from hidden_state_accountants.bounds import Bound, NotApplicable, RdpBound
from hidden_state_accountants.events import TrainingRunDpEvent
from hidden_state_accountants.relations import sensitivity_factor
from hidden_state_accountants.schedules import CYCLIC, SHUFFLE_PARTITION, WITHOUT_REPLACEMENT

CITE = "Ye & Shokri (2022)"
# Iterations of the Thm 4.3 recursion after which the remaining orders take their
# certified upper bounds (valid always; exact to TOLERANCE unless the run is extremely long).
MAX_ITERATIONS = 200_000
# Relative gap between certified lower and upper ends at which an order stops iterating.
TOLERANCE = 1e-7
# Below this many active orders the recursion runs on Python floats (less call overhead).
SCALAR_BELOW = 6


def _paper_parameters(run: TrainingRunDpEvent):
    """(eta, sigma^2, S_g, b, lambda, beta) in the paper's notation."""
    b, C, z, eta = run.batch_size, run.clip_norm, run.noise_multiplier, run.learning_rate
    sigma2 = eta * z * z * C * C / (2.0 * b * b)
    return eta, sigma2, 2.0 * C, b, run.geometry.strong_convexity, run.geometry.smoothness


def _unit(run: TrainingRunDpEvent, orders: np.ndarray) -> np.ndarray:
    """``alpha eta S_g^2 / (4 sigma^2 b^2)``: RDP of one step that uses the differing record."""
    eta, sigma2, sg, b, _, _ = _paper_parameters(run)
    with np.errstate(divide="ignore", over="ignore"):  # sigma^2 underflows to 0 at z ~ 1e-160: inf
        return orders * eta * sg * sg / (4.0 * sigma2 * b * b)


def _log_rho(run: TrainingRunDpEvent) -> float:
    eta, _, _, _, lam, _ = _paper_parameters(run)
    return 2.0 * math.log1p(-eta * lam)


def _conditions(run: TrainingRunDpEvent, require_two_batches: bool = True) -> Optional[str]:
    reason = cm.hidden_state_preconditions(run)
    if reason:
        return reason
    g = run.geometry
    return cm.first_reason(
        cm.need_strong_convexity(run),
        cm.lr_below(run, 2.0 / (g.strong_convexity + g.smoothness), "2/(lambda+beta)"),
        cm.need_two_batches(run) if require_two_batches else None,
    )


def eps0(run: TrainingRunDpEvent, orders: np.ndarray, j: np.ndarray) -> np.ndarray:
    """``eps_0^j(alpha)`` for every order (rows) and ``j`` (columns), eq. below Thm 3.3."""
    lr = _log_rho(run)
    j = np.asarray(j, dtype=float)
    # rho^{j-1} / sum_{s<j} rho^s = rho^{j-1} (1 - rho) / (1 - rho^j)
    factor = np.exp((j - 1) * lr) * (-math.expm1(lr)) / (-np.expm1(j * lr))
    return _unit(run, np.asarray(orders, dtype=float))[:, None] * factor[None, :]


def _first_term(run: TrainingRunDpEvent, orders: np.ndarray, epochs: int) -> np.ndarray:
    """``eps_0^{floor(l/2)} (1 - rho^{(K-1)(l - floor(l/2))}) / (1 - rho^{l - floor(l/2)})`` (eq. 3, eq. 5)."""
    l = run.steps_per_epoch
    h = l // 2
    lr = _log_rho(run)
    if epochs <= 1:
        return np.zeros(len(orders))
    ratio = math.expm1((epochs - 1) * (l - h) * lr) / math.expm1((l - h) * lr)
    return eps0(run, orders, np.array([h]))[:, 0] * ratio


@analysis(
    "ye_shokri_thm2.1",
    f"{CITE}, Thm 2.1 (naive baseline)",
    (CYCLIC, SHUFFLE_PARTITION),
    hidden_state=True,
    needs="m > 0, lr < 2/(m+M), n/b >= 2",
)
def thm_2_1(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """Thm 2.1 (naive extension of Chourasia et al. to SGD): with ``eta < 2/(lambda+beta)``,

        eps(alpha) <= alpha S_g^2 / (lambda sigma^2 b^2) * (1 - exp(-lambda eta K / 2)).

    The bound grows with ``K``; we take ``K`` = the number of *steps* (the conservative
    reading, at least the number of epochs). Holds for any fixed batch order, hence for
    ``cyclic`` and ``shuffle_partition``. A baseline: the other Ye & Shokri bounds improve on it.
    """
    reason = _conditions(run)
    if reason:
        return NotApplicable(reason=reason)
    eta, sigma2, sg, b, lam, _ = _paper_parameters(run)
    orders = np.asarray(ctx.orders, dtype=float)
    with np.errstate(divide="ignore", over="ignore"):  # sigma^2 underflows to 0 at z ~ 1e-160: inf
        vals = orders * sg * sg / (lam * sigma2 * b * b) * (-math.expm1(-lam * eta * run.steps / 2.0))
    return RdpBound(orders=ctx.orders, values=vals, monotone_in_steps=True)


def fixed_order_rdp(run: TrainingRunDpEvent, orders: Sequence[float], position: Optional[int] = None) -> np.ndarray:
    """Thm 3.3 (eq. 3) for records in batch ``position`` (0-based ``j_0``), or the worst case.

    ``eps <= eps_0^{floor(l/2)} (1 - rho^{2... (K-1)(l-floor(l/2))}) / (1 - rho^{l-floor(l/2)}) + eps_0^{l - j_0}``.
    The worst position is the last batch, ``j_0 = l - 1`` (``eps_0^1``, one unamplified step).
    ``K = ceil(t/l)``: with a partial last epoch, a record's last visit is followed by
    ``0..l-1`` further steps exactly as in a ``K``-epoch run, and the bound grows with ``K``.
    """
    orders = np.asarray(orders, dtype=float)
    l = run.steps_per_epoch
    j0 = l - 1 if position is None else int(position)
    if not 0 <= j0 < l:
        raise ValueError(f"position: must lie in [0, {l - 1}], got {position}")
    return _first_term(run, orders, cm.epochs_visited(run)) + eps0(run, orders, np.array([l - j0]))[:, 0]


@analysis(
    "ye_shokri_thm3.3",
    f"{CITE}, Thm 3.3 (fixed order, worst position)",
    (CYCLIC, SHUFFLE_PARTITION),
    hidden_state=True,
    needs="m > 0, lr < 2/(m+M), n/b >= 2",
)
def thm_3_3(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """Thm 3.3 at the worst batch position (fixed order: ``cyclic``; also ``shuffle_partition``
    by conditioning on the partition). See :func:`fixed_order_rdp` for any position."""
    reason = _conditions(run)
    if reason:
        return NotApplicable(reason=reason)
    vals = fixed_order_rdp(run, ctx.orders)
    return RdpBound(orders=ctx.orders, values=vals, monotone_in_steps=True)


@analysis(
    "ye_shokri_thm4.2",
    f"{CITE}, Thm 4.2 (shuffle and partition)",
    (SHUFFLE_PARTITION,),
    hidden_state=True,
    needs="m > 0, lr < 2/(m+M), n/b >= 2",
)
def thm_4_2(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """Thm 4.2 (shuffle and partition), eq. (5)::

        eps <= first term of eq. (3) + 1/(alpha-1) log( Avg_{0<=j_0<l} exp((alpha-1) eps_0^{l-j_0}) )

    with the log-average as a ``logsumexp`` (footnote 4 computes a shifted version of the
    same quantity). ``K = ceil(t/l)``: at a partial last epoch the number of steps after a
    record's last visit is still uniform on ``0..l-1`` and the first term grows with ``K``.
    The average over the position needs the partition secret.
    """
    reason = _conditions(run) or cm.need_secret_batches(run)
    if reason:
        return NotApplicable(reason=reason)
    orders = np.asarray(ctx.orders, dtype=float)
    l = run.steps_per_epoch
    second = log_mean_exp_eps0(run, orders, l) / (orders - 1)
    vals = _first_term(run, orders, cm.epochs_visited(run)) + second
    return RdpBound(orders=ctx.orders, values=vals, monotone_in_steps=True)


# Positions j of Thm 4.2's average summed term by term; the rest is bounded in closed form.
# Memory and time are O(len(orders) * HEAD) whatever l = n/b is.
HEAD = 4096


def log_mean_exp_eps0(run: TrainingRunDpEvent, orders: np.ndarray, l: int) -> np.ndarray:
    """``log( (1/l) sum_{j=1}^{l} exp((alpha-1) eps_0^j(alpha)) )`` for every order, never below
    its exact value, in O(1) memory in ``l`` (Ye & Shokri 2022, eq. (5) and footnote 4).

    With ``c = (alpha-1) unit_alpha`` and ``f(j) = rho^{j-1}(1-rho)/(1-rho^j) = (1-rho)/(rho^{1-j} - rho)``
    the terms are ``exp(c f(j))``. The first ``H = min(l, HEAD)`` are summed exactly (a
    ``logsumexp``). For the rest, ``f`` is decreasing on the reals (``rho^{1-x}`` grows) and
    ``0 <= c f(j) <= s = c f(H)`` for ``j > H``, so by convexity of ``exp`` (the chord on
    ``[0, s]``) ``exp(c f(j)) - 1 <= c f(j) (e^s - 1)/s``, and a decreasing function's sum is
    at most its integral::

        sum_{j=H+1}^{l} f(j) <= int_H^l f(x) dx = (1-rho)/(rho log(1/rho)) * log((1-rho^l)/(1-rho^H)).

    Hence ``sum_{j>H} exp(c f(j)) <= (l - H) + (e^s - 1)/f(H) * int_H^l f``: every step
    replaces a quantity by an upper bound, so the result is never below the exact average
    (equal to it when ``l <= HEAD``). ``l`` may be any Python integer (``n = 2**63``).
    """
    orders = np.asarray(orders, dtype=float)
    lr = _log_rho(run)
    h = min(int(l), HEAD)
    c = (orders - 1) * _unit(run, orders)
    js = np.arange(1, h + 1, dtype=float)
    log_f = (js - 1) * lr + math.log(-math.expm1(lr)) - np.log(-np.expm1(js * lr))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        log_c = np.log(c)
        # the average is 1 + (1/l) sum_j (exp(c f(j)) - 1): summing the excesses keeps tiny
        # results exact (log-mean-exp minus log l cancels to a negative value at huge noise)
        parts = [_log_expm1(np.exp(log_c[:, None] + log_f[None, :]))]
        if l > h:
            log_fh = float(log_f[-1])
            s = np.exp(log_c + log_fh)
            # log((e^s - 1)/s), 0 at s = 0
            log_chord = np.where(s == 0, 0.0, _log_expm1(s) - np.log(np.where(s > 0, s, 1.0)))
            # int_H^l f = (1-rho)/(rho log(1/rho)) * log r, log r = log(-expm1(l lr)) - log(-expm1(H lr)) >= 0
            log_r = math.log(-math.expm1(l * lr)) - math.log(-math.expm1(h * lr))
            log_integral = (
                (math.log(-math.expm1(lr)) - lr - math.log(-lr) + math.log(log_r)) if log_r > 0 else -math.inf
            )
            log_tail = log_c + log_chord + log_integral + 1e-12  # + a float rounding margin
            parts.append(log_tail[:, None])
        log_excess = special.logsumexp(np.hstack(parts), axis=1)
        out = np.logaddexp(0.0, log_excess - math.log(l))
    return np.where(np.isnan(out), math.inf, out)  # inf * 0 at vanishing noise: say nothing


def _log_expm1(x: np.ndarray) -> np.ndarray:
    """``log(e^x - 1)`` for ``x >= 0`` (``-inf`` at 0), without overflow."""
    x = np.asarray(x, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return np.where(x > 30.0, x + np.log1p(-np.exp(-np.maximum(x, 30.0))), np.log(np.expm1(np.minimum(x, 30.0))))


def thm_4_3_log_s(run: TrainingRunDpEvent, orders: np.ndarray, steps: int) -> np.ndarray:
    """``log S^0_K(alpha)`` of Thm 4.3's recursion after ``steps`` steps, in log space::

        x_{j+1} = F(x_j) = logaddexp( log(b/n) + (alpha-1) unit_alpha + x_j,  log(1 - b/n) + rho x_j ),
        x_0 = 0.

    ``F`` is increasing and convex with slope ``F' = w + (1-w) rho <= 1`` (``w`` the weight of
    the first term), and ``x_1 >= x_0``. Hence the increments ``d_j = x_{j+1} - x_j`` never
    grow, and over the ``m`` remaining steps ``d_j r_j^i <= d_{j+i} <= d_j r*^i`` with
    ``r_j = F'(x_j)`` and ``r* = F'(x*)`` at the fixed point ``x*`` (``r* = 1`` when there is
    none, i.e. when ``(b/n) e^{(alpha-1) unit} >= 1``). So::

        x_j + d_j sum_{i<=m} r_j^i  <=  x_T  <=  min(x*, x_j + d_j sum_{i<=m} r*^i).

    An order leaves the loop with the upper end once the two ends agree to ``TOLERANCE``
    (relative): exact up to that tolerance, never below the true value.
    """
    orders = np.asarray(orders, dtype=float)
    return recursion_log_s(run.sampling_rate, _log_rho(run), _unit(run, orders), orders, steps)


def recursion_log_s(q: float, log_rho: float, unit: np.ndarray, orders: np.ndarray, steps: int) -> np.ndarray:
    """The recursion of :func:`thm_4_3_log_s` for a rate ``q``, ``log rho`` and per-order ``unit``
    (the RDP of a step holding the differing record); certified as described there.

    Where ``log(q) + (alpha - 1) unit_alpha`` overflows (huge orders or vanishing noise) the
    first step already gives ``x_1 >= log q + (alpha-1) unit = inf``: that order's value is
    ``inf`` (a valid bound) instead of the ``inf - inf = nan`` the iteration would produce."""
    orders = np.asarray(orders, dtype=float)
    unit = np.broadcast_to(np.asarray(unit, dtype=float), orders.shape)
    with np.errstate(over="ignore", invalid="ignore"):
        a_all = math.log(q) + (orders - 1) * unit  # log(q e^{(alpha-1) unit})
    representable = np.isfinite(a_all)
    if not np.all(representable):
        out = np.full(len(orders), math.inf)
        if np.any(representable):
            out[representable] = recursion_log_s(q, log_rho, unit[representable], orders[representable], steps)
        return out
    rho = math.exp(log_rho)
    b = cm.log_abs_one_minus(q)  # -inf at q = 1: every step holds the record, x_T = T (alpha-1) unit
    fixed = np.array([_fixed_point_or_inf(ai, b, rho) for ai in a_all])
    finite = np.isfinite(fixed)
    slope_at_fixed = np.ones(len(orders))
    slope_at_fixed[finite] = _slope(fixed[finite], a_all[finite], b, rho)

    out = np.empty(len(orders))
    active = np.arange(len(orders))
    y = np.zeros(len(orders))
    a = a_all.copy()
    done = 0
    while active.size > SCALAR_BELOW:
        chunk = min(128, steps - done)
        for _ in range(chunk - 1):
            y = np.logaddexp(y + a, y * rho + b)
        last = y
        y = np.logaddexp(y + a, y * rho + b)
        done += chunk
        if done >= steps:
            out[active] = y
            return out
        upper, finished = _certified_end(y, last, a, b, rho, fixed[active], slope_at_fixed[active], steps - done)
        if done >= MAX_ITERATIONS:  # iteration budget spent: the upper ends are valid bounds
            finished[:] = True
        if np.any(finished):
            out[active[finished]] = upper[finished]
            keep = ~finished
            active, y, a = active[keep], y[keep], a[keep]
    # a few slow orders left: plain Python floats avoid numpy's per-call overhead
    for i, yi in zip(active, y):
        out[i] = _iterate_one(float(yi), a_all[i], b, rho, fixed[i], slope_at_fixed[i], steps - done, done)
    return out


def _certified_end(y, last, a, b, rho, fixed, slope_at_fixed, m):
    """Upper end of the bracket on ``x_T`` and whether the bracket is within TOLERANCE."""
    d = y - last
    upper = np.minimum(y + d * _geometric_sum(slope_at_fixed, m), fixed)
    lower = np.maximum(y + d * _geometric_sum(_slope(y, a, b, rho), m), y + m * a)
    finished = np.atleast_1d(upper - lower <= TOLERANCE * np.maximum(1.0, np.abs(upper)))
    return np.atleast_1d(upper * (1 + 1e-12) + 1e-12), finished  # float rounding margin


def _iterate_one(y, a, b, rho, fixed, slope_at_fixed, steps, done):
    """The recursion for one order with scalar math, same certified stopping rule."""
    log1p, exp = math.log1p, math.exp
    while steps > 0:
        chunk = min(128, steps)
        for _ in range(chunk):
            last = y
            u, v = y + a, y * rho + b
            y = u + log1p(exp(v - u)) if u >= v else v + log1p(exp(u - v))
        steps -= chunk
        done += chunk
        if steps == 0:
            return y
        upper, finished = _certified_end(
            np.array([y]), np.array([last]), np.array([a]), b, rho, fixed, slope_at_fixed, steps
        )
        if finished[0] or done >= MAX_ITERATIONS:
            return float(upper[0])
    return y


def _slope(x, a, b, rho):
    """``F'(x) = w + (1 - w) rho`` with ``w = sigmoid((a + x) - (b + rho x))``."""
    w = special.expit((a + x) - (b + rho * x))
    return w + (1.0 - w) * rho


def _geometric_sum(r, m):
    """``sum_{i=1}^{m} r^i`` (``m`` when ``r = 1``), elementwise."""
    r = np.asarray(r, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = r * -np.expm1(m * np.log(r)) / (1.0 - r)
    return np.where(r >= 1.0, float(m), s)


def _fixed_point_or_inf(a, b, rho) -> float:
    """The fixed point of ``F`` above ``x_0 = 0`` (``inf`` when the recursion diverges)."""
    if a >= 0:
        return math.inf
    f = lambda u: float(np.logaddexp(a + u, b + rho * u)) - u
    hi = 1.0
    while f(hi) > 0:
        hi *= 2.0
        if hi > 1e300:
            return math.inf
    root = optimize.brentq(f, 0.0, hi, xtol=1e-15, rtol=1e-15)
    return root + 1e-12 * max(1.0, abs(root))  # a root-finder may stop a hair short


@analysis(
    "ye_shokri_thm4.3",
    f"{CITE}, Thm 4.3 (sampling without replacement)",
    (WITHOUT_REPLACEMENT,),
    hidden_state=True,
    needs="m > 0, lr < 2/(m+M), n/b >= 2",
)
def thm_4_3(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """Thm 4.3 (sampling without replacement), eq. (6): ``eps <= log(S^0_K(alpha)) / (alpha - 1)``
    with the recursion of :func:`thm_4_3_log_s` run for every step."""
    reason = _conditions(run)
    if reason:
        return NotApplicable(reason=reason)
    orders = np.asarray(ctx.orders, dtype=float)
    vals = thm_4_3_log_s(run, orders, run.steps) / (orders - 1)
    return RdpBound(orders=ctx.orders, values=vals, monotone_in_steps=True)


@analysis(
    "ye_shokri_thm4.3_poisson",
    f"{CITE}, Thm 4.3 with b/n -> q for Poisson batches (docs/derivations.md section 10); batch-size cap (sections 6-7)",
    ("poisson",),
    hidden_state=True,
    needs="l2_regularization > 0, lr < 2/(m_reg + M_(K+1))",
    add_or_remove="native",
)
def thm_4_3_poisson(run: TrainingRunDpEvent, ctx: cm.Context) -> Bound:
    """Thm 4.3's recursion for Poisson batches (section 10), conditioned on a cap ``K`` on the other
    records' batch size: ``lambda = m_reg`` (an empty batch is possible), ``beta = M_{K+1} =
    m_reg + ((K+1)/b)(M - m_reg)``, condition ``lr < 2/(lambda + beta)`` so every capped step map is
    ``(1 - lr m_reg)``-Lipschitz, ``rho = (1 - lr m_reg)^2``; the step holding the differing record
    costs ``u_a = 2a/z^2`` (REPLACE_ONE, Cor. 5.3) or ``a/(2 z^2)`` (ADD_OR_REMOVE_ONE). The transfer
    rests on the proof structure the paper's main text describes (Lemma 3.2 per fixed batch
    sequence, Lemma 4.1, Jensen); see section 10 for the caveat."""
    s, reason = ph.poisson_setup(run, ctx)
    if s is None:
        return NotApplicable(reason=reason)
    if s.m_reg is None or s.m_reg <= 0:
        return NotApplicable(reason=ph.NEED_L2)
    if math.log1p(-min(s.lr * s.m_reg, 0.5)) == 0.0:
        return NotApplicable(
            reason="lr * l2_regularization underflows: the contraction 1 - lr m_reg is 1 in floating point"
        )
    target = math.log1p(-s.lr * s.m_reg) if s.lr * s.m_reg < 1 else -math.inf
    admissible = lambda lc: lc <= target + 1e-15 * abs(target)
    orders = np.asarray(ctx.orders, dtype=float)
    with np.errstate(divide="ignore", over="ignore"):  # z^2 underflows at z ~ 1e-160: inf
        unit = orders * sensitivity_factor(ctx.neighboring_relation) ** 2 / (2.0 * s.z * s.z)

    def inner(c) -> Bound:
        beta = s.m_reg + ((c.cap + 1) / s.b) * (s.M - s.m_reg)
        if not s.lr < 2.0 / (s.m_reg + beta):
            return NotApplicable(
                reason=f"needs lr < 2/(lambda + beta) = {2.0 / (s.m_reg + beta):.6g} for batches of "
                f"up to {c.cap + 1} records, got {s.lr:.6g}"
            )
        log_rho = 2.0 * math.log1p(-s.lr * s.m_reg)
        vals = recursion_log_s(s.q, log_rho, unit, orders, s.steps) / (orders - 1)
        return RdpBound(orders=ctx.orders, values=vals, note=f"rho = (1 - lr m_reg)^2, batches of <= {c.cap + 1}")

    return ph.capped(run, ctx, s, admissible, inner)
