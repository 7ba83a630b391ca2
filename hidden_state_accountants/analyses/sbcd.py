"""DP-SBCD: differentially private stochastic block coordinate descent for ReLU networks.

Paper: *Differentially Private Network Training under Hidden State Assumption* (ICLR 2025
submission, arXiv:2407.08233). A ReLU network ``theta_D s(theta_{D-1} ... s(theta_0 x_0))`` is
trained on the Lagrangian (eq. 3)::

    F(theta, x, u) = R(theta_D x_D; y) + gamma/2 sum_{d<D} (||x_{d+1} - s(u_d)||^2 + ||u_d - theta_d x_d||^2)

by block coordinate descent over layers with per-example auxiliary variables ``x_d, u_d``
(Algorithm 2). Each weight block ``theta_d`` is a convex sub-problem updated by the noisy
proximal step (eq. 8)::

    theta_d <- Prox_{eta, r_d}( theta_d - eta grad F(theta_d) + N(0, 2 eta o(eta, k, j) I) )

This module is the framework-free analysis: the event :class:`DpSbcdRunDpEvent`, the bounds
(Thm 4.5, proved here for a one-block run only, and a composition bound that holds for every run)
and the noise schedules ``o(eta, k, j)``. It imports nothing above it: the registry
(:mod:`hidden_state_accountants.analyses.registry`) lists :func:`composition` and :func:`thm_4_5` for
the event, as it lists a training run's analyses, and the trainers' shared part is
:class:`hidden_state_accountants.sbcd_training.SbcdTrainerBase`.
The trainers live in ``hidden_state_accountants.pytorch.sbcd`` (PyTorch, no Opacus needed) and
``hidden_state_accountants.keras.sbcd`` (Keras).

>>> ev = DpSbcdRunDpEvent.from_epochs(dataset_size=600, batch_size=200, epochs=5, num_layers=2,
...                                   step_size=0.5, rho=1.0, noise=1e-3, regularizer="l2",
...                                   regularization=0.05)
>>> ev.steps, ev.steps_per_epoch
(15, 3)
>>> DpSbcdRunDpEvent(dataset_size=10, batch_size=6, steps=3, num_layers=1, step_size=0.1,
...                  rho=1.0, noise=1e-3, sampling=CYCLIC)  # doctest: +IGNORE_EXCEPTION_DETAIL
Traceback (most recent call last):
ParameterError: batch_size: cyclic needs at least two batches ...

What is computed
----------------
Per layer ``d`` with step ``eta_d``, sensitivity ``S_d``, Lipschitz constants ``L_F`` (gradient
step, Lemma 4.1) and ``L_T`` (proximal map, Lemma 4.2), and per step ``t`` the noise ``o_t``:

* LSI sequence (Lemma A.3, written as a recursion on ``v_t = 1/c_t``)::

      v_0 = 0 (point-mass initialisation, c_0^0 = inf),   v_{t+1} = L_T^2 (L_F^2 v_t + 2 eta o_t)

* Cor. 4.4, per step, on ``A = sup_alpha eps(alpha)/alpha``: a step whose batch holds the
  differing record adds ``eta S^2 / (4 b^2 o_t)`` (case 2); any other step multiplies by::

      f_t = (1 + c_t 2 eta o_t / L_F^2)^{-1} = L_F^2 L_T^2 v_t / v_{t+1}

* Thm 4.5 / eq. (29): with the record in batch ``j0`` of every epoch,
  ``A(j0) = sum_k unit_k * prod_{t > t_k, t not a j0-step} f_t``; the product telescopes
  (eq. 28), which is how it is evaluated here (cumulative sums of ``log f_t``).
* Layers: ``A_total(j0) = sum_d A_d(j0)`` (the paper composes the sub-problems by summing). The
  formula functions below keep the sum; the registered analysis :func:`thm_4_5` evaluates them
  only for one block (see "Where Thm 4.5 applies").
* Eq. (30): with a partition drawn at random once, ``j0`` is uniform and
  ``eps(alpha) = log( sum_{j0} (b/n) e^{(alpha-1) alpha A_total(j0)} + (n - l b)/n ) / (alpha-1)``
  (the ``n mod b`` records left out of the partition never influence training); with a fixed
  order (``cyclic``) the worst position, ``alpha max_{j0} A_total(j0)``.

Everything is evaluated in log space (``logaddexp.accumulate`` for the LSI recursion,
``logsumexp`` for the sums and the mixture).

Re-derived or corrected formulas (the PDF text is garbled or wrong in places)
------------------------------------------------------------------------------
1. **Exponent of the decay factor.** Cor. 4.4 and Thm 4.5 raise the factor to ``-1/L_T^2``.
   For ``L_T < 1`` (L2 regularisation, ``Prox = theta/(1 + eta lambda)``) this understates
   the Renyi divergence: for a linear-Gaussian chain the exact divergence decays by exactly
   ``(1 + c 2 eta o / L_F^2)^{-1}`` per step (the prox is a bijective scaling, under which
   Renyi divergence is invariant), so ``(...)^{-1/L_T^2}`` is strictly smaller than the truth
   (``tests/core/test_sbcd_accountant.py::test_paper_exponent_understates_linear_gaussian``). We use
   exponent ``-1`` (Ye & Shokri Lemma 3.2 applied to ``F``, then data processing through the
   prox ``T``) and keep ``L_T`` in the LSI recursion of Lemma A.3, which is correct (Vempala &
   Wibisono Lemmas 16/17). For ``L_T = 1`` the two coincide.
2. **``L_T``.** Lemma 4.2 proves ``L_T <= 2``; the proximal map of a convex function is
   firmly non-expansive, so ``L_T <= 1`` always, and ``1/(1 + eta lambda)`` for L2.
3. **``L_F``.** Lemma 4.1 with ``omega = 0``: the sub-problem Hessian ``mean x x^T`` is singular
   whenever the batch does not span the input space, and a data-dependent ``omega`` cannot be
   used by an accountant. So ``L_F = max(1, eta beta - 1)`` with ``beta = gamma rho^2``
   (Lemma 3.1). Consequence: **without L2 regularisation the bound does not converge**
   (``L_F L_T = 1``: the decay is harmonic, the bound grows about half as fast as
   composition). The converging curves of the paper's Section 4.3 need ``L_F L_T < 1``.
4. **Sensitivity.** ``S_g = gamma rho`` (text after Assumption 4.3) is not implied by Lemma
   3.1: the per-example gradient ``gamma (theta x_i - U_i) x_i^T`` is bounded only if the
   residual is. The optimizers clip each example's residual so that its gradient has norm
   ``<= gamma rho / 2``; replacing one record then moves the batch-mean gradient by at most
   ``gamma rho / b``, which is what case 2 of Cor. 4.4 uses. The residual ``R_i`` is projected
   onto a Frobenius ball of radius ``rho / (2 ||P_i||_F)``, which does not depend on ``theta``
   (``P_i``: the example's input or im2col matrix), so the clipped gradient is the gradient of a
   Huber loss of the residual: the sub-problem stays convex and ``gamma rho^2``-smooth and
   Lemma 4.1 still applies (docs/dp_sbcd.md, "Audit"; clipping a convolution's gradient by its
   own norm would not be a gradient field).
5. **Mixture over the position.** The layers share one partition, so the position ``j0`` is
   the same for every layer: we sum the layers *before* the mixture of eq. (30). Summing
   each layer's already-mixed bound is not justified and can be smaller.
6. **Appendix C variant.** Its privacy argument treats ``(I + eta x^T x)^{-1}`` as a weight
   decay that "does not increase the privacy loss". At the step whose batch holds the
   differing record that matrix depends on the record, so the argument fails there. The
   optimizers make the variant analysable by (a) adding the noise *after* the
   preconditioner, (b) clipping each example's data term ``gamma U_i x_i^T`` to
   ``gamma rho / 2`` and (c) projecting ``theta_d`` onto a Frobenius ball of radius ``R_d``.
   Then one record moves the update by at most ``eta S_d / b`` with
   ``S_d = gamma rho^2 R + gamma rho + eta gamma^2 rho^3 / 2`` (derivation in
   :func:`appendix_c_sensitivity`), ``L_F <= 1`` (the preconditioner has norm ``<= 1``), and the
   same recursion applies. The paper's ``S_g = gamma rho`` is *not* valid for the variant.

Where Thm 4.5 applies (docs/dp_sbcd.md, "Audit")
-------------------------------------------------
* **One block** (``num_layers == 1``: a linear model of the clipped inputs): there are no
  auxiliary variables. Given the partition, each step is ``T(F_t(theta) + N(0, 2 eta o_t I))``
  with ``F_t`` the gradient step of the batch's clipped (Huber) loss, ``L_F``-Lipschitz
  (Lemma 4.1 with ``omega = 0``, the clip audited in docs/dp_sbcd.md), and ``T`` the
  ``L_T``-Lipschitz prox; the two neighbouring runs apply the same maps except at the steps that
  use the differing record, where they differ by at most ``eta S / b``. From the common point
  mass, Lemma A.3's recursion gives both runs' LSI constants (Gaussian convolutions and
  Lipschitz push-forwards: Ye & Shokri Lemma 3.1, Vempala & Wibisono Lemmas 16/17), and Cor. 4.4
  / Thm 4.5 follow as Ye & Shokri's Lemma 3.2 / Thm 3.3 do for noisy mini-batch gradient
  descent. This is the only case :func:`thm_4_5` reports.
* **Two or more blocks**: :func:`thm_4_5` is not applicable, whatever ``paper_assumptions``
  says. Algorithm 2 recomputes the block's inputs ``x_d`` (eq. 4) and auxiliary variables
  ``u_d`` (eq. 6) from ``theta_d`` just before the ``theta_d`` step, so the map run on
  ``theta_d``, everything else fixed, is expansive (output block) or discontinuous (hidden
  blocks: eq. 6 jumps where its branches tie), not the ``L_F L_T``-Lipschitz map Lemma A.3 and
  Cor. 4.4 are proved for. The other blocks and the auxiliary variables depend on the whole
  dataset, the differing record included, so the two runs apply different maps at every step,
  not only at the record's steps; and the parameter distribution is a mixture over them, for
  which LSI is not implied (the flaw Ye & Shokri, footnote 2, point out in Ryffel et al.). The
  paper's per-layer analysis ("valid for arbitrary values of other parameters", layers summed)
  assumes all three away.
* **Composition** (``dp_sbcd_composition``) holds for every run: given every block's earlier
  iterates, a record's auxiliary variables are a function of the record and those iterates, so
  each step of each block is a Gaussian mechanism with the clipped sensitivity ``eta S / b``
  (the same in both runs at the steps that do not use the differing record), composed
  adaptively over the whole trajectory. It is the best valid bound of a multi-block network.
* **Batch schedule**: the records must be split into ``n // b`` batches once (randomly for
  ``shuffle_partition``, fixed for ``cyclic``) and visited in the same order every epoch, and
  the noise schedule must not depend on the data. The optimizers do this; a hand-built event
  is the caller's claim.

``paper_assumptions`` (the name is historical: it used to switch on the paper's per-layer and LSI
assumptions for networks, which are no longer accepted) now only matters for one block: ``True``
(the default) reports Thm 4.5 there, ``False`` only the composition bound. A multi-block run with
``paper_assumptions=True`` gets a :class:`SbcdAssumptionWarning` saying why Thm 4.5 is not applied.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Callable, List, Optional, Sequence, Tuple

import attr
import numpy as np
from dp_accounting import dp_event
from scipy import special

from hidden_state_accountants import schedules as sch
from hidden_state_accountants import validation as v
from hidden_state_accountants.analyses import _common as cm
from hidden_state_accountants.analyses.analysis_info import analysis
from hidden_state_accountants.bounds import Bound, NotApplicable, RdpBound
from hidden_state_accountants.errors import SbcdAssumptionWarning  # re-exported
from hidden_state_accountants.schedules import CYCLIC, SHUFFLE_PARTITION

CITE = "DP-SBCD (arXiv:2407.08233)"
REGULARIZERS: Tuple[str, ...] = ("none", "l2", "l1")
VARIANTS: Tuple[str, ...] = ("proximal_gradient", "appendix_c")
SBCD_SAMPLINGS: Tuple[str, ...] = (SHUFFLE_PARTITION, CYCLIC)
"""The schedules Thm 4.5 covers: one partition into ``n // b`` batches, visited in order every epoch."""

THM_4_5_NAME = "dp_sbcd_thm4.5"
COMPOSITION_NAME = "dp_sbcd_composition"


def multi_block_reason(num_layers: int) -> str:
    """Why Thm 4.5 does not apply to a run of ``num_layers >= 2`` blocks (the report's reason)."""
    return (
        f"not proved for {num_layers} blocks: Algorithm 2 recomputes each block's inputs x_d (eq. 4) and "
        "auxiliary variables u_d (eq. 6) from theta_d just before the theta_d step, so the map run on a block is "
        "expansive (output block) or discontinuous (hidden blocks), not the L_F L_T-Lipschitz map Lemma A.3 and "
        "Cor. 4.4 are proved for, and the other blocks and the auxiliary variables depend on the whole dataset, "
        "differing record included, so neighbouring runs apply different maps at every step; Thm 4.5 is proved "
        "for one block (a linear model) only "
        "(docs/dp_sbcd.md, 'Audit')"
    )


MULTI_BLOCK_WARNING = (
    "paper_assumptions=True is not applied to this {num_layers}-block network: dp_sbcd_thm4.5 is {reason}. "
    "The epsilon is the composition bound dp_sbcd_composition, a valid DP guarantee for the network (every "
    "iterate may be released); pass paper_assumptions=False to report it without this warning."
)


# --------------------------------------------------------------------------- noise schedules
class NoiseSchedule:
    """``o(eta, k, j)``: the noise level of step ``j`` of epoch ``k`` (variance ``2 eta o``).

    Subclasses implement :meth:`__call__`; :meth:`values` evaluates the schedule on a run and
    checks that every value is a finite number ``> 0``. The schedule must not depend on the
    data (the accountant treats it as public).
    """

    def __call__(self, eta: float, k: int, j: int) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def values(self, eta: float, steps: int, steps_per_epoch: int) -> Tuple[float, ...]:
        """Per-step values ``o_t`` for ``t = 0..steps-1`` (``k = t // l``, ``j = t % l``)."""
        steps = v.positive_int("steps", steps)
        l = v.positive_int("steps_per_epoch", steps_per_epoch)
        out = []
        for t in range(steps):
            k, j = divmod(t, l)
            out.append(check_noise_value(self(eta, k, j), k, j))
        return tuple(out)


def check_noise_value(o, k: int, j: int) -> float:
    """``o(eta, k, j)`` as a float, or a ParameterError naming ``noise``, ``k`` and ``j``."""
    if isinstance(o, bool) or not isinstance(o, numbers.Real) or not math.isfinite(float(o)) or not float(o) > 0:
        raise v.ParameterError("noise", f"o(eta, k={k}, j={j}) must be a finite number > 0, got {o!r}")
    return float(o)


@attr.s(frozen=True, slots=True)
class ConstantNoise(NoiseSchedule):
    """``o(eta, k, j) = value``."""

    value: float = attr.ib(converter=float)

    def __attrs_post_init__(self):
        v.positive_float("noise", self.value)

    def __call__(self, eta, k, j):
        return self.value


@attr.s(frozen=True, slots=True)
class LinearNoise(NoiseSchedule):
    """``o(eta, k, j) = initial + slope * min(k, until)`` (``until=None``: no cap).

    ``slope < 0`` is a linear decay, ``slope > 0`` an increase; with ``until`` the value stays
    constant from epoch ``until`` on (the paper's decay-then-constant). A value ``<= 0`` at any
    step of the run is an error when the schedule is evaluated.
    """

    initial: float = attr.ib(converter=float)
    slope: float = attr.ib(converter=float)
    until: Optional[int] = attr.ib(default=None)

    def __attrs_post_init__(self):
        v.positive_float("noise", self.initial)
        v.real("slope", self.slope)
        if self.until is not None:
            object.__setattr__(self, "until", int(v.nonnegative_float("until", self.until)))

    def __call__(self, eta, k, j):
        kk = k if self.until is None else min(k, self.until)
        return self.initial + self.slope * kk


@attr.s(frozen=True, slots=True)
class CallableNoise(NoiseSchedule):
    """Wraps any ``fn(eta, k, j) -> float``."""

    fn: Callable[[float, int, int], float] = attr.ib()

    def __attrs_post_init__(self):
        if not callable(self.fn):
            raise v.ParameterError("noise", f"must be callable, got {self.fn!r}")

    def __call__(self, eta, k, j):
        return self.fn(eta, k, j)


def constant(value: float) -> NoiseSchedule:
    """Constant noise ``o(eta, k, j) = value``."""
    return ConstantNoise(value)


def linear_decay(initial: float, rate: float) -> NoiseSchedule:
    """``o = initial - rate * k`` (paper Fig. 2: ``0.001 - 0.0003 k``); must stay ``> 0``."""
    return LinearNoise(initial, -v.nonnegative_float("rate", rate))


def increase(initial: float, rate: float) -> NoiseSchedule:
    """``o = initial + rate * k`` (paper Fig. 2: ``0.0001 + 0.0003 k``)."""
    return LinearNoise(initial, v.nonnegative_float("rate", rate))


def decay_then_constant(initial: float, rate: float, until: int) -> NoiseSchedule:
    """``o = initial - rate * min(k, until)`` (paper Fig. 2: ``0.0005 - 0.00003 k`` up to
    ``k = 10``, then ``0.0002``)."""
    return LinearNoise(initial, -v.nonnegative_float("rate", rate), until=until)


def as_schedule(noise) -> NoiseSchedule:
    """A :class:`NoiseSchedule` from a schedule, a positive number or a callable."""
    if isinstance(noise, NoiseSchedule):
        return noise
    if isinstance(noise, numbers.Real) and not isinstance(noise, bool):
        return ConstantNoise(noise)
    if callable(noise):
        return CallableNoise(noise)
    raise v.ParameterError("noise", f"must be a NoiseSchedule, a number > 0 or a callable o(eta, k, j); got {noise!r}")


def compress_noise(per_step: Sequence[float], steps_per_epoch: int) -> Tuple[float, ...]:
    """The shortest exact representation: ``(o,)`` if constant, per-epoch values if constant
    within every epoch, else the per-step tuple."""
    vals = tuple(float(x) for x in per_step)
    if len(set(vals)) == 1:
        return (vals[0],)
    l = steps_per_epoch
    epochs = [vals[i : i + l] for i in range(0, len(vals), l)]
    if all(len(set(e)) == 1 for e in epochs):
        return tuple(e[0] for e in epochs)
    return vals


# ----------------------------------------------------------------------------------- event
def check_sbcd_schedule(dataset_size, batch_size, sampling) -> Tuple[int, int]:
    """``(n, b)`` for a DP-SBCD schedule: one of :data:`SBCD_SAMPLINGS`, then the core's
    :func:`~hidden_state_accountants.schedules.check_schedule` (the rule every training run
    follows). Raises :class:`~hidden_state_accountants.ParameterError` naming the parameter."""
    if sampling not in SBCD_SAMPLINGS:
        raise v.ParameterError("sampling", f"must be one of {', '.join(SBCD_SAMPLINGS)} for DP-SBCD; got {sampling!r}")
    return sch.check_schedule(dataset_size, batch_size, sampling)


def _float_tuple(name: str):
    """An attrs converter to a tuple of floats that fails with a ParameterError naming ``name``."""

    def convert(value) -> Tuple[float, ...]:
        if value is None and name == "radius":
            return None
        try:
            if isinstance(value, (list, tuple, np.ndarray)):
                out = tuple(float(x) for x in np.asarray(value, dtype=float).ravel())
                if out:
                    return out
            elif isinstance(value, numbers.Real) and not isinstance(value, bool):
                return (float(value),)
        except (TypeError, ValueError):
            pass
        raise v.ParameterError(name, f"must be a number or a non-empty sequence of numbers, got {value!r}")

    return convert


def _per_layer(name: str, values: Tuple[float, ...], layers: int) -> Tuple[float, ...]:
    if len(values) == 1:
        return values * layers
    if len(values) != layers:
        raise v.ParameterError(name, f"needs 1 or num_layers={layers} values, got {len(values)}")
    return values


@attr.s(frozen=True, slots=True, kw_only=True)
class DpSbcdRunDpEvent(dp_event.DpEvent):
    """One DP-SBCD training run (Algorithm 2) whose final weights alone are released.

    Attributes:
      dataset_size: ``n``.
      batch_size: ``b``; the records are split into ``l = n // b`` batches once and visited in
        the same order every epoch (``n mod b`` records are left out of training).
      steps: number of mini-batch steps ``T`` (each updates every layer once). Use
        :meth:`from_epochs` to give epochs.
      num_layers: ``D + 1``, the number of weight blocks (Linear / Conv layers).
      step_size: ``eta``, one value or one per layer.
      rho: per layer, the bound on the norm of each example's input to that layer's weight
        update *as the optimizer uses it*: the clipped ``x_d`` with the constant ``1`` of the
        bias appended (``sqrt(rho_x^2 + 1)``), or for a convolution the Frobenius norm of the
        im2col patch matrix. One value or one per layer.
      noise: ``o(eta, k, j)`` as a tuple: one value (constant), one per epoch
        (``ceil(T / l)`` values) or one per step (``T`` values). All ``> 0``.
      gamma: the Lagrangian coefficient ``gamma`` (the paper uses 1). The squared loss of
        the output layer carries the same weight, ``R(z; y) = gamma/2 ||z - y||^2``.
      regularizer: ``"none"``, ``"l2"`` (``r = lambda/2 ||theta||^2``) or ``"l1"``
        (``r = lambda ||theta||_1``), applied by the proximal map to the whole block.
      regularization: ``lambda``, one value or one per layer (``>= 0``).
      sampling: ``SHUFFLE_PARTITION`` (a random partition drawn once: eq. 30) or ``CYCLIC``
        (a fixed partition: the worst batch position), from
        :mod:`hidden_state_accountants.schedules`. ``(dataset_size, batch_size, sampling)`` are
        checked by the same rule as every training run
        (:func:`~hidden_state_accountants.schedules.check_schedule`: at least two batches).
      variant: ``"proximal_gradient"`` (eq. 8) or ``"appendix_c"`` (the closed-form variant,
        made analysable as described in the module docstring).
      radius: Frobenius radius ``R_d`` onto which each block is projected; required for
        ``appendix_c``, optional (and unused by the bound) otherwise.
      paper_assumptions: report the Thm 4.5 hidden-state bound where it is proved, a one-block
        run (``num_layers == 1``); ``False`` reports only the composition bound. With two or more
        blocks Thm 4.5 does not apply whatever this says (the report gives the reason; ``True``
        also warns). The name is historical (module docstring, "Where Thm 4.5 applies").
    """

    dataset_size: int = attr.ib()
    batch_size: int = attr.ib()
    steps: int = attr.ib()
    num_layers: int = attr.ib()
    step_size: Tuple[float, ...] = attr.ib(converter=_float_tuple("step_size"))
    rho: Tuple[float, ...] = attr.ib(converter=_float_tuple("rho"))
    noise: Tuple[float, ...] = attr.ib(converter=_float_tuple("noise"))
    gamma: float = attr.ib(default=1.0)
    regularizer: str = attr.ib(default="none")
    regularization: Tuple[float, ...] = attr.ib(default=0.0, converter=_float_tuple("regularization"))
    sampling: str = attr.ib(default=SHUFFLE_PARTITION)
    variant: str = attr.ib(default="proximal_gradient")
    radius: Optional[Tuple[float, ...]] = attr.ib(default=None, converter=_float_tuple("radius"))
    paper_assumptions: bool = attr.ib(default=True)

    def __attrs_post_init__(self):
        n, b = check_sbcd_schedule(self.dataset_size, self.batch_size, self.sampling)
        t = v.positive_int("steps", self.steps)
        layers = v.positive_int("num_layers", self.num_layers)
        for name, value in (("dataset_size", n), ("batch_size", b), ("steps", t), ("num_layers", layers)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "gamma", v.positive_float("gamma", self.gamma))
        if self.regularizer not in REGULARIZERS:
            raise v.ParameterError("regularizer", f"must be one of {', '.join(REGULARIZERS)}; got {self.regularizer!r}")
        if self.variant not in VARIANTS:
            raise v.ParameterError("variant", f"must be one of {', '.join(VARIANTS)}; got {self.variant!r}")
        eta = _per_layer("step_size", self.step_size, layers)
        rho = _per_layer("rho", self.rho, layers)
        lam = _per_layer("regularization", self.regularization, layers)
        for x in eta:
            v.positive_float("step_size", x)
        for x in rho:
            v.positive_float("rho", x)
        for x in lam:
            v.nonnegative_float("regularization", x)
        object.__setattr__(self, "step_size", eta)
        object.__setattr__(self, "rho", rho)
        object.__setattr__(self, "regularization", lam)
        if self.radius is not None:
            radius = _per_layer("radius", self.radius, layers)
            for x in radius:
                v.positive_float("radius", x)
            object.__setattr__(self, "radius", radius)
        elif self.variant == "appendix_c":
            raise v.ParameterError(
                "radius",
                "the appendix_c variant needs the projection radius of every block "
                "(its sensitivity grows with the weight norm)",
            )
        l = self.steps_per_epoch
        epochs = math.ceil(t / l)
        if len(self.noise) not in (1, epochs, t):
            raise v.ParameterError(
                "noise", f"needs 1 value, one per epoch ({epochs}) or one per step ({t}); got {len(self.noise)}"
            )
        for i, o in enumerate(self.noise):
            if not (math.isfinite(o) and o > 0):
                raise v.ParameterError("noise", f"every o(eta, k, j) must be > 0, got {o!r} at index {i}")
        if not isinstance(self.paper_assumptions, bool):
            raise v.ParameterError("paper_assumptions", f"must be a bool, got {self.paper_assumptions!r}")

    @classmethod
    def from_epochs(cls, *, dataset_size: int, batch_size: int, epochs: int, **kwargs) -> "DpSbcdRunDpEvent":
        """Builds the event from whole epochs (``steps = epochs * (n // b)``)."""
        n = v.positive_int("dataset_size", dataset_size)
        b = v.positive_int("batch_size", batch_size)
        e = v.positive_int("epochs", epochs)
        return cls(dataset_size=n, batch_size=b, steps=e * max(1, n // b), **kwargs)

    @property
    def steps_per_epoch(self) -> int:
        """``l = n // b``."""
        return sch.steps_per_epoch(self.dataset_size, self.batch_size, self.sampling)

    @property
    def epochs(self) -> float:
        return self.steps / self.steps_per_epoch

    def noise_per_step(self) -> np.ndarray:
        """``o_t`` for ``t = 0..T-1``."""
        t, l = self.steps, self.steps_per_epoch
        o = np.asarray(self.noise, dtype=float)
        if len(o) == 1:
            return np.full(t, o[0])
        if len(o) == t:
            return o
        return o[np.arange(t) // l]

    def replace(self, **changes) -> "DpSbcdRunDpEvent":
        return attr.evolve(self, **changes)


# ------------------------------------------------------------------------ layer constants
@attr.s(frozen=True, slots=True)
class LayerConstants:
    """What the bound needs for one sub-problem."""

    eta: float = attr.ib()
    sensitivity: float = attr.ib()  # S_g: replace-one change of the per-example term sum
    lipschitz_f: float = attr.ib()  # L_F (Lemma 4.1)
    lipschitz_t: float = attr.ib()  # L_T (Lemma 4.2, sharpened)
    smoothness: float = attr.ib()  # beta = gamma rho^2 (Lemma 3.1)


def prox_lipschitz(regularizer: str, regularization: float, eta: float) -> float:
    """``L_T``: ``1/(1 + eta lambda)`` for L2, ``1`` otherwise (a prox is non-expansive;
    Lemma 4.2's constant 2 is loose)."""
    if regularizer == "l2":
        return 1.0 / (1.0 + eta * regularization)
    return 1.0


def appendix_c_sensitivity(gamma: float, rho: float, radius: float, eta: float) -> float:
    """``S`` such that one record moves the Appendix C update by at most ``eta S / b``.

    The update (before noise and prox) is ``G(theta) = (theta + eta A) M`` with
    ``A = (1/b) sum_i clip(gamma U_i x_i^T, gamma rho / 2)``, ``Sigma = (gamma/b) sum_i x_i x_i^T``
    and ``M = (I + eta Sigma)^{-1}`` (``||M|| <= 1``); ``theta`` lies in the Frobenius ball of
    radius ``R``. Replacing record ``i0`` changes ``A`` by ``<= gamma rho / b`` and ``Sigma`` by
    ``gamma (x x^T - x' x'^T)/b``, of spectral norm ``<= gamma rho^2 / b`` (a difference of two
    PSD matrices of norm ``<= rho^2``), and ``M - M' = eta M (Sigma' - Sigma) M'``. Hence::

        ||G - G'|| <= ||theta|| ||M - M'|| + eta ||A - A'|| ||M|| + eta ||A'|| ||M - M'||
                   <= (eta / b) (gamma rho^2 R + gamma rho + eta gamma^2 rho^3 / 2).
    """
    return gamma * rho * rho * radius + gamma * rho + eta * gamma * gamma * rho**3 / 2.0


def layer_constants(event: DpSbcdRunDpEvent) -> List[LayerConstants]:
    """``(eta, S, L_F, L_T, beta)`` of every layer's sub-problem (see the module docstring)."""
    out = []
    for d in range(event.num_layers):
        eta, rho, lam = event.step_size[d], event.rho[d], event.regularization[d]
        beta = event.gamma * rho * rho
        l_t = prox_lipschitz(event.regularizer, lam, eta)
        if event.variant == "proximal_gradient":
            sens = event.gamma * rho
            l_f = max(1.0, eta * beta - 1.0)  # Lemma 4.1 with omega = 0
        else:
            sens = appendix_c_sensitivity(event.gamma, rho, event.radius[d], eta)
            l_f = 1.0  # a translation followed by M with ||M|| <= 1
        out.append(LayerConstants(eta, sens, l_f, l_t, beta))
    return out


# --------------------------------------------------------------------------- the recursion
def log_inverse_lsi(o: np.ndarray, eta: float, l_f: float, l_t: float) -> np.ndarray:
    """``log v_t = log(1/c_t)`` for ``t = 0..T`` (Lemma A.3), ``v_0 = 0``.

    ``v_{t+1} = a v_t + g_t`` with ``a = L_F^2 L_T^2`` and ``g_t = 2 eta L_T^2 o_t`` has the closed
    form ``v_t = sum_{s<t} a^{t-1-s} g_s``, evaluated as
    ``t log a + logcumsumexp(log g_s - (s+1) log a)``.
    """
    o = np.asarray(o, dtype=float)
    log_a = 2.0 * (math.log(l_f) + math.log(l_t))
    log_g = math.log(2.0 * eta) + 2.0 * math.log(l_t) + np.log(o)
    s = np.arange(len(o), dtype=float)
    acc = np.logaddexp.accumulate(log_g - (s + 1.0) * log_a)
    t = np.arange(1, len(o) + 1, dtype=float)
    return np.concatenate([[-math.inf], t * log_a + acc])


def log_decay_factors(o: np.ndarray, c: LayerConstants) -> np.ndarray:
    """``log f_t = log(L_F^2 L_T^2) + log v_t - log v_{t+1}`` for ``t = 0..T-1`` (``f_0 = 0``:
    the first step erases any divergence of the common initial point)."""
    lv = log_inverse_lsi(o, c.eta, c.lipschitz_f, c.lipschitz_t)
    log_a = 2.0 * (math.log(c.lipschitz_f) + math.log(c.lipschitz_t))
    out = log_a + lv[:-1] - lv[1:]
    return np.minimum(out, 0.0)  # f_t <= 1 exactly; guards float rounding


def log_unit(o: np.ndarray, c: LayerConstants, batch_size: int) -> np.ndarray:
    """``log(eta S^2 / (4 b^2 o_t))``: Cor. 4.4 case 2, per step."""
    return math.log(c.eta * c.sensitivity**2 / (4.0 * batch_size**2)) - np.log(np.asarray(o, dtype=float))


def layer_log_position_bounds(event: DpSbcdRunDpEvent, c: LayerConstants, hidden_state: bool = True) -> np.ndarray:
    """``log A_d(j0)`` for every batch position ``j0 = 0..l-1``: ``A_d(j0)`` bounds
    ``eps(alpha)/alpha`` of layer ``d``'s sub-problem for a record in batch ``j0`` (Thm 4.5,
    eq. 29 before the mixture), or without decay (``hidden_state=False``: composition).

    ``-inf`` for a position that the run never reaches.
    """
    t_total, l = event.steps, event.steps_per_epoch
    o = event.noise_per_step()
    epochs = math.ceil(t_total / l)
    size = epochs * l
    unit = np.full(size, -math.inf)
    unit[:t_total] = log_unit(o, c, event.batch_size)
    logf = np.zeros(size)
    if hidden_state:
        lf = log_decay_factors(o, c)
        lf[0] = 0.0  # never multiplies anything (no step precedes t = 0)
        logf[:t_total] = lf
    # suffix sums: Q[t] = sum_{s >= t} logf[s]
    q = np.concatenate([np.cumsum(logf[::-1])[::-1], [0.0]])
    grid_f = logf.reshape(epochs, l)
    # E[k, j] = sum_{k' > k} logf[k' l + j]  (the later steps that use the record do not decay it)
    col = np.cumsum(grid_f[::-1], axis=0)[::-1]
    later = np.vstack([col[1:], np.zeros((1, l))])
    t_idx = np.arange(size).reshape(epochs, l)
    log_terms = unit.reshape(epochs, l) + q[t_idx + 1] - later
    return special.logsumexp(log_terms, axis=0)


def log_position_bounds(event: DpSbcdRunDpEvent, hidden_state: bool = True) -> np.ndarray:
    """``log A_total(j0) = log sum_d A_d(j0)``: the layers composed for a fixed position."""
    per_layer = [layer_log_position_bounds(event, c, hidden_state) for c in layer_constants(event)]
    return special.logsumexp(np.vstack(per_layer), axis=0)


def rdp_from_positions(event: DpSbcdRunDpEvent, log_a: np.ndarray, orders: Sequence[float]) -> np.ndarray:
    """RDP at ``orders`` from ``log A_total(j0)`` (eq. 30, or the worst position for ``cyclic``)."""
    orders = np.asarray(orders, dtype=float)
    if np.any(orders <= 1):
        raise v.ParameterError("orders", "every RDP order must be > 1")
    with np.errstate(over="ignore"):
        a = np.exp(log_a)  # A(j0) itself: eps(alpha, j0) = alpha A(j0)
    if event.sampling == CYCLIC:
        return orders * float(np.max(a))
    n, b, l = event.dataset_size, event.batch_size, event.steps_per_epoch
    log_w = math.log(b / n)
    with np.errstate(over="ignore", invalid="ignore"):
        exps = ((orders - 1.0) * orders)[:, None] * a[None, :] + log_w
    dropped = n - l * b
    if dropped > 0:
        exps = np.hstack([exps, np.full((len(orders), 1), math.log(dropped / n))])
    return special.logsumexp(exps, axis=1) / (orders - 1.0)


def thm_4_5_rdp(event: DpSbcdRunDpEvent, orders: Sequence[float]) -> np.ndarray:
    """The formula of Thm 4.5 (corrected as in the module docstring), layers summed, at ``orders``.

    A bound only for one block: for two or more the formula is the paper's, not a proved bound
    (module docstring, "Where Thm 4.5 applies"); :func:`thm_4_5`, the registered analysis,
    refuses those runs."""
    return rdp_from_positions(event, log_position_bounds(event, hidden_state=True), orders)


def composition_rdp(event: DpSbcdRunDpEvent, orders: Sequence[float]) -> np.ndarray:
    """Every iterate of every layer released: the Gaussian steps that use the record, composed
    (no LSI or conditioning assumption); the same mixture over the batch position."""
    return rdp_from_positions(event, log_position_bounds(event, hidden_state=False), orders)


def epoch_contributions(event: DpSbcdRunDpEvent, position: int, layer: int = 0) -> np.ndarray:
    """Each epoch's term of eq. (29) for a record in batch ``position``, for one layer:
    ``unit_k * prod_{later steps} f_t`` (paper Fig. 2a). Index ``k`` = epoch."""
    l = event.steps_per_epoch
    if not 0 <= position < l:
        raise v.ParameterError("position", f"must lie in [0, {l - 1}], got {position}")
    c = layer_constants(event)[layer]
    t_total = event.steps
    o = event.noise_per_step()
    lf = log_decay_factors(o, c)
    lu = log_unit(o, c, event.batch_size)
    steps = np.arange(position, t_total, l)
    out = np.empty(len(steps))
    for i, t in enumerate(steps):
        mask = np.ones(t_total, dtype=bool)
        mask[: t + 1] = False
        mask[steps] = False
        out[i] = math.exp(lu[t] + float(np.sum(lf[mask])))
    return out


# ------------------------------------------------------------------------------ analyses
# Registered for DpSbcdRunDpEvent in hidden_state_accountants.analyses.registry.
@analysis(
    COMPOSITION_NAME,
    f"{CITE}, Cor. 4.4 case 2 composed over every step and layer (RDP composition)",
    SBCD_SAMPLINGS,
    hidden_state=False,
    needs="per-example clipping (the optimizers')",
)
def composition(event: DpSbcdRunDpEvent, ctx: cm.Context) -> Bound:
    """Composition over all steps and layers (every iterate released); no extra assumption."""
    vals = composition_rdp(event, ctx.orders)
    return RdpBound(
        orders=tuple(ctx.orders),
        values=vals,
        monotone_in_steps=True,
        note=f"sensitivity by per-example clipping; sampling {event.sampling}",
    )


@analysis(
    THM_4_5_NAME,
    f"{CITE}, Thm 4.5 / eq. (29)-(30), Lemma A.3, Cor. 4.4 (exponent corrected)",
    SBCD_SAMPLINGS,
    needs="one block (num_layers=1, a linear model) and paper_assumptions=True",
)
def thm_4_5(event: DpSbcdRunDpEvent, ctx: cm.Context) -> Bound:
    """The hidden-state bound of Thm 4.5 (with Lemma A.3 and Cor. 4.4), for a one-block run.

    With two or more blocks the step run on a block is not the map the theorem is proved for
    (module docstring, "Where Thm 4.5 applies"): :class:`NotApplicable` whatever
    ``paper_assumptions`` says, and a :class:`SbcdAssumptionWarning` when it says ``True``.
    """
    if event.num_layers >= 2:
        reason = multi_block_reason(event.num_layers)
        if event.paper_assumptions:
            warnings.warn(
                MULTI_BLOCK_WARNING.format(num_layers=event.num_layers, reason=reason),
                SbcdAssumptionWarning,
                stacklevel=2,
            )
        return NotApplicable(reason=reason)
    if not event.paper_assumptions:
        return NotApplicable(reason="disabled: paper_assumptions=False (only the composition bound is reported)")
    (c,) = layer_constants(event)
    vals = thm_4_5_rdp(event, ctx.orders)
    lf_lt = c.lipschitz_f * c.lipschitz_t
    note = f"one block, L_F*L_T = {lf_lt:.6g}"
    if lf_lt >= 1.0:
        note += "; L_F*L_T >= 1: the bound does not converge (use L2 regularisation)"
    return RdpBound(orders=tuple(ctx.orders), values=vals, note=note)


__all__ = [
    "DpSbcdRunDpEvent",
    "NoiseSchedule",
    "ConstantNoise",
    "LinearNoise",
    "CallableNoise",
    "constant",
    "linear_decay",
    "increase",
    "decay_then_constant",
    "as_schedule",
    "compress_noise",
    "LayerConstants",
    "layer_constants",
    "appendix_c_sensitivity",
    "prox_lipschitz",
    "log_inverse_lsi",
    "log_decay_factors",
    "layer_log_position_bounds",
    "log_position_bounds",
    "rdp_from_positions",
    "thm_4_5_rdp",
    "composition_rdp",
    "epoch_contributions",
    "thm_4_5",
    "composition",
    "SbcdAssumptionWarning",
    "REGULARIZERS",
    "VARIANTS",
    "SBCD_SAMPLINGS",
    "check_sbcd_schedule",
    "check_noise_value",
    "THM_4_5_NAME",
    "COMPOSITION_NAME",
    "multi_block_reason",
]
