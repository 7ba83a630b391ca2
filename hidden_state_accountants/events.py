"""The training-run ``DpEvent`` and the loss geometry a user declares for it.

The update rule (docs/design.md, section 1) is framework DP-SGD with flat clipping and mean
reduction::

    theta <- Proj_K(theta - lr * [(1/b) sum_{i in B} clip_C(grad l_i(theta))
                                  + m_reg * theta + (z*C/b) * xi])

with ``z`` the noise multiplier, ``C`` the clip norm, ``b`` the batch size, ``n`` the
dataset size. The neighbouring relation (REPLACE_ONE, the papers', or ADD_OR_REMOVE_ONE) is the
accountant's parameter, not the event's.
"""

from __future__ import annotations

import copy
import math
import sys
from collections import Counter
from typing import Dict, Optional, Tuple, Union

import attr
import numpy as np
from dp_accounting import dp_event

from hidden_state_accountants import validation as v
from hidden_state_accountants.schedules import (
    CYCLIC,
    DROPPED,
    MAX_STEPS,
    POISSON,
    WITHOUT_REPLACEMENT,
    check_epoch_steps,
    check_last_batch,
    check_schedule,
    steps_per_epoch,
)

CROSS_ENTROPY_ON_LOGITS = "cross_entropy_on_logits"

LOSSES: Dict[str, str] = {
    CROSS_ENTROPY_ON_LOGITS: (
        "softmax cross-entropy with one-hot or integer labels on the trainable layer's outputs (logits), "
        "or sigmoid cross-entropy on its one output (binary), one unweighted loss per example"
    ),
}
"""The losses a :class:`LossGeometry` can be derived from (``LossGeometry.loss``), with what each
assumes. An adapter that can see the training loss compares it with this; where it cannot, the
report says the loss is the user's claim."""


def cross_entropy_smoothness(feature_norm_bound: float) -> float:
    """``(R^2 + 1) / 2``: the smoothness of cross-entropy on the logits of an affine map with a bias,
    for features of norm ``<= R`` (Ye & Shokri 2022, Prop. 5.1: ``||(x, 1)||^2 <= R^2 + 1`` times the
    largest eigenvalue ``1/2`` of the softmax Hessian ``diag(p) - p p^T``; the sigmoid's ``p (1 - p)``
    is at most ``1/4``). Raises naming ``feature_norm_bound`` when it overflows.

    >>> cross_entropy_smoothness(1.0)
    1.0
    """
    r = v.nonnegative_float("feature_norm_bound", feature_norm_bound)
    beta = (r * r + 1.0) / 2.0
    if not math.isfinite(beta):
        raise v.ParameterError(
            "feature_norm_bound",
            f"must be at most {math.sqrt(sys.float_info.max):.4g} (R^2 and the smoothness "
            f"(R^2 + 1)/2 must be a finite number), got {feature_norm_bound!r}",
        )
    return beta


def nonbinding_clip_norm(feature_norm_bound: float) -> float:
    """``sqrt(2 (R^2 + 1))``: no per-example gradient of softmax cross-entropy on the logits of an affine
    map with a bias reaches this norm, for features of norm ``<= R`` (``|p - e_y| <= sqrt(2) (1 - p_y) <
    sqrt(2)`` and ``||(x, 1)|| <= sqrt(R^2 + 1)``), so a clip norm at least this large never binds and the
    clipped step is a plain gradient step (docs/derivations.md section 18).

    >>> nonbinding_clip_norm(1.0)
    2.0
    """
    beta = cross_entropy_smoothness(feature_norm_bound)  # (R^2 + 1) / 2
    t = 2.0 * math.sqrt(beta)
    return t if t * t == 4.0 * beta else math.nextafter(t, math.inf)  # never rounded below the threshold


@attr.s(frozen=True, slots=True, kw_only=True)
class LossGeometry:
    """A declared claim about the per-example update map ``g_i(theta) = clip_C(grad l_i) + m_reg*theta``.

    Attributes:
      smoothness: ``M``, the Lipschitz constant of ``g_i`` (the loss is ``M``-smooth).
      strong_convexity: ``m`` with ``0 <= m <= M``; ``m = 0`` claims convexity only.
      diameter: ``D``, the diameter of the convex set the parameters are projected onto
        after every step, or ``None`` when the run is unconstrained.
      lsi_constant: optional log-Sobolev constant ``c`` that the user asserts holds for the
        parameter distributions throughout training (Chourasia et al. Thm 2 only).
      feature_norm_bound: ``R``, the bound on the L2 norm of every input of the trainable layer
        that the smoothness was derived for, or ``None`` when the geometry does not depend on it.
        The data decides it, so the adapters enforce it (a feature clip in the model) or check it
        on every batch before its step (:class:`~hidden_state_accountants.recording.RunRecorder`).
      loss: the loss the constants were derived from (a key of :data:`LOSSES`), or ``None``.
        Set by :meth:`logistic_regression`; needs ``feature_norm_bound`` and a smoothness of at
        least what that loss gives plus ``strong_convexity``.
      num_classes: with ``loss``, the number of classes (2 for a binary model: one sigmoid logit or a
        softmax over two), or ``None`` when not known (the adapters read it from the model). The
        constants hold for the *clipped* per-example map only for two classes, or for any number when
        the clip cannot bind (:meth:`clipped_map_refusal`, docs/derivations.md section 18).

    A geometry given by its constants alone (``LossGeometry(smoothness=..., ...)``) cannot be
    observed from a training run: it is the user's claim, and the adapters' reports say so. It is a
    claim about the clipped map: it holds for a per-example loss of one linear form of the parameters
    (binary logistic regression, a scalar GLM, Huber or squared-loss regression with one output),
    for squared-loss regression with several outputs, and for any smooth convex loss whose clip never
    binds; not for softmax cross-entropy over three or more classes with a clip that can bind.
    Declaring a geometry the training code does not enforce (feature clipping, L2
    regularisation outside clipping, projection) makes every hidden-state number meaningless.
    """

    smoothness: float = attr.ib()
    strong_convexity: float = attr.ib(default=0.0)
    diameter: Optional[float] = attr.ib(default=None)
    lsi_constant: Optional[float] = attr.ib(default=None)
    feature_norm_bound: Optional[float] = attr.ib(default=None)
    loss: Optional[str] = attr.ib(default=None)
    num_classes: Optional[int] = attr.ib(default=None)

    def __attrs_post_init__(self):
        object.__setattr__(self, "smoothness", v.positive_float("smoothness", self.smoothness))
        object.__setattr__(self, "strong_convexity", v.nonnegative_float("strong_convexity", self.strong_convexity))
        if self.strong_convexity > self.smoothness:
            raise v.ParameterError(
                "strong_convexity",
                f"must be <= smoothness ({self.smoothness:g}), got {self.strong_convexity:g}",
            )
        if self.diameter is not None:
            object.__setattr__(self, "diameter", v.positive_float("diameter", self.diameter))
        if self.lsi_constant is not None:
            object.__setattr__(self, "lsi_constant", v.positive_float("lsi_constant", self.lsi_constant))
        if self.feature_norm_bound is not None:
            object.__setattr__(
                self, "feature_norm_bound", v.nonnegative_float("feature_norm_bound", self.feature_norm_bound)
            )
        if self.num_classes is not None and self.loss is None:
            raise v.ParameterError(
                "num_classes",
                "applies to a geometry derived from a loss (LossGeometry.logistic_regression), not to one given "
                "by its constants",
            )
        if self.loss is not None:
            if self.loss not in LOSSES:
                raise v.ParameterError("loss", f"must be None or one of {', '.join(LOSSES)}, got {self.loss!r}")
            if self.feature_norm_bound is None:
                raise v.ParameterError(
                    "feature_norm_bound",
                    f"is needed with loss={self.loss!r} (its smoothness depends on the feature norm)",
                )
            if self.num_classes is not None:
                k = v.positive_int("num_classes", self.num_classes)
                if k < 2:
                    raise v.ParameterError("num_classes", f"must be at least 2 (a binary model has 2), got {k}")
                object.__setattr__(self, "num_classes", k)
            needed = self.loss_smoothness + self.strong_convexity
            if self.smoothness < needed * (1 - 1e-12):
                raise v.ParameterError(
                    "smoothness",
                    f"{self.smoothness:g} is below {needed:g}, what loss={self.loss!r} with "
                    f"feature_norm_bound={self.feature_norm_bound:g} and strong_convexity={self.strong_convexity:g} "
                    "gives",
                )

    @property
    def loss_smoothness(self) -> Optional[float]:
        """The smoothness of the loss alone (no L2 term) for ``feature_norm_bound``, when the
        geometry was derived from a loss; else ``None``."""
        if self.loss is None:
            return None
        return cross_entropy_smoothness(self.feature_norm_bound)

    @classmethod
    def logistic_regression(
        cls,
        feature_norm_bound: float,
        l2_regularization: float,
        diameter: Optional[float] = None,
        num_classes: Optional[int] = None,
    ) -> "LossGeometry":
        """Geometry of L2-regularised logistic regression with a bias (softmax over ``num_classes``
        logits, or one sigmoid logit for two classes).

        Ye & Shokri (2022) Prop. 5.1/5.2: with features clipped to ``||x|| <= R`` and the
        regulariser ``m_reg`` applied outside per-example clipping, the per-example map is
        ``m_reg``-strongly convex and ``((R^2 + 1)/2 + m_reg)``-smooth (eq. 10, eq. 11). Prop. 5.2
        (the *clipped* gradient keeps those constants) is proved here for two classes only, where the
        gradient is a function of one linear form; for three or more classes a clip that can bind makes
        the clipped field non-monotone, and the constants hold only when the clip cannot bind
        (``clip_norm >= sqrt(2 (R^2 + 1))``, :meth:`clipped_map_refusal`; docs/derivations.md section 18).
        ``num_classes=None`` (unknown) is treated as three or more; the adapters read it from the model.
        The geometry remembers what the data must satisfy (``feature_norm_bound``) and the loss it assumes
        (cross-entropy on logits), so that the adapters can enforce or check them.

        >>> LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=0.01, num_classes=2)
        LossGeometry(smoothness=1.01, strong_convexity=0.01, diameter=None, lsi_constant=None, feature_norm_bound=1.0, loss='cross_entropy_on_logits', num_classes=2)
        """
        beta = cross_entropy_smoothness(feature_norm_bound)
        m_reg = v.nonnegative_float("l2_regularization", l2_regularization)
        smoothness = beta + m_reg
        if not math.isfinite(smoothness):
            raise v.ParameterError(
                "l2_regularization",
                f"makes the smoothness (R^2 + 1)/2 + l2_regularization overflow, got {l2_regularization!r}",
            )
        return cls(
            smoothness=smoothness,
            strong_convexity=m_reg,
            diameter=diameter,
            feature_norm_bound=float(feature_norm_bound),
            loss=CROSS_ENTROPY_ON_LOGITS,
            num_classes=num_classes,
        )

    def clipped_map_refusal(self, clip_norm: float, clip_margin: float = 0.0) -> Optional[str]:
        """Why the declared constants are not proved for the clipped per-example map
        ``clip_C(grad l_i) + m_reg theta`` with this clip, or ``None`` when they are.

        Only a geometry derived from a loss is checked (one given by its constants is the user's
        claim). Softmax cross-entropy over three or more classes (or an unknown number) needs a clip
        that cannot bind: ``clip_norm - clip_margin >= sqrt(2 (R^2 + 1))`` (:func:`nonbinding_clip_norm`),
        where ``clip_margin`` is how far below ``clip_norm`` the framework's clip starts rescaling
        (Opacus divides by the norm plus 1e-6). Two classes need nothing (docs/derivations.md section 18).

        >>> g = LossGeometry.logistic_regression(1.0, 0.01, num_classes=5)
        >>> g.clipped_map_refusal(2.0) is None, g.clipped_map_refusal(1.0)[:40]
        (True, 'softmax cross-entropy over 5 classes wit')
        """
        if self.loss is None or self.num_classes == 2:
            return None
        needed = nonbinding_clip_norm(self.feature_norm_bound)
        if clip_norm - clip_margin >= needed:
            return None
        classes = "an undeclared number of" if self.num_classes is None else str(self.num_classes)
        margin = f" (the framework's clip rescales from {clip_margin:g} below its clip norm)" if clip_margin else ""
        fix = "" if self.num_classes is not None else " (or declare num_classes=2 for a binary model)"
        return (
            f"softmax cross-entropy over {classes} classes with clip norm {clip_norm:.6g}, which can bind for "
            f"features of norm <= {self.feature_norm_bound:g}: a clipped gradient of three or more classes is not "
            f"monotone, so the declared m and M do not hold for the clipped step (Ye & Shokri's Prop. 5.2 holds "
            f"for two classes; docs/derivations.md section 18); the claim holds with clip norm >= "
            f"{needed + clip_margin:.7g}{margin}{fix}"
        )

    def rescaled(self, scale: float) -> "LossGeometry":
        """The geometry in units where lengths are divided by ``scale`` (``D -> D/scale``,
        LSI ``c -> c scale^2``; ``m``, ``M`` unchanged). Never rounds towards a tighter claim:
        a diameter that overflows becomes ``inf`` (the constrained bounds are then vacuous) and
        an LSI constant that underflows becomes 0 (the LSI bound then takes its limit, which is
        larger), values a user could not declare but the analyses handle. What the constants were
        derived from (feature bound, loss, classes) has no meaning in the new units and is dropped:
        check :meth:`clipped_map_refusal` before rescaling."""
        new = copy.copy(self)
        for name in ("feature_norm_bound", "loss", "num_classes"):
            object.__setattr__(new, name, None)
        if self.diameter is not None:
            # an underflow to 0 would claim a point; the smallest positive diameter is larger
            object.__setattr__(new, "diameter", max(self.diameter / scale, 5e-324))
        if self.lsi_constant is not None:
            # an overflow to inf would claim unbounded concentration; the largest float is weaker
            object.__setattr__(new, "lsi_constant", min(self.lsi_constant * scale * scale, 1.7976931348623157e308))
        return new

    def contraction_factor(self, learning_rate: float) -> float:
        """``c = max(|1 - lr*m|, |1 - lr*M|)``, the Lipschitz constant of one GD step (Bok Lemma 2.8)."""
        lr = learning_rate
        return max(abs(1.0 - lr * self.strong_convexity), abs(1.0 - lr * self.smoothness))


def check_learning_rate(learning_rate: float, geometry: LossGeometry) -> None:
    """Raises naming ``learning_rate`` unless ``learning_rate < 2/smoothness``: every analysis of a
    declared geometry needs a contractive gradient step (Bok et al. Lemma 2.8). The one check of it,
    for an event and for a recorded step before training."""
    if learning_rate >= 2.0 / geometry.smoothness:
        raise v.ParameterError(
            "learning_rate",
            f"must be < 2/smoothness = {2.0 / geometry.smoothness:.6g} for the declared geometry "
            f"(a gradient step is not contractive otherwise), got {learning_rate:.6g}",
        )


Schedule = Union[float, Tuple[float, ...]]


def _float_or_tuple(value):
    if isinstance(value, (list, tuple, np.ndarray)):
        return tuple(float(x) for x in np.asarray(value, dtype=float).ravel())
    return value


@attr.s(frozen=True, slots=True, kw_only=True)
class TrainingRunDpEvent(dp_event.DpEvent):
    """One DP-SGD training run whose final model alone is released.

    Attributes:
      dataset_size: ``n``.
      batch_size: ``b``, the number the clipped sum is divided by (the expected batch size
        for ``poisson``).
      steps: number of optimiser steps ``T``. Use :meth:`from_epochs` to give epochs.
      noise_multiplier: ``z``, or a tuple of per-step values.
      clip_norm: ``C`` (``max_grad_norm`` in Opacus, ``l2_norm_clip`` in TF-Privacy).
      learning_rate: ``lr``, or a tuple of per-step values.
      sampling: the batch schedule, one of :data:`SAMPLINGS`.
      geometry: the declared :class:`LossGeometry`; ``None`` means no hidden-state claim.
      gaussian_initialization: the user declares ``theta_0 ~ Proj_K(N(0, 2 sigma^2/m I))``
        as Chourasia et al. Cor. 1 requires (see
        :func:`hidden_state_accountants.analyses.chourasia.required_initial_std`).
      sampling_probability: ``q`` of ``poisson`` when it is not ``b / n`` (Opacus divides by
        ``int(n q)``); ``None`` means ``b / n``.
      hidden_state_refusal: set by the recording layer when the training code departs from the
        analysed update (momentum, Adam, a clip norm that changes, ...): every hidden-state
        analysis is then listed as not applicable with this reason, whatever the geometry.
      last_batch: for ``reshuffle``, what each epoch does with the last ``n % b`` records of
        its order (:data:`~hidden_state_accountants.schedules.LAST_BATCHES`): ``"dropped"``
        (default), ``"kept_own_size"`` (a short batch divided by its own size: TF-Privacy /
        Keras ``fit``) or ``"kept_batch_size"`` (divided by ``b``: Opacus with
        ``expected_batch_size = b``). An epoch is then ``ceil(n / b)`` steps.
      secret_batches: whether the batches' randomness is secret from the adversary (default).
        ``False`` (e.g. a framework shuffle seeded with a public seed): the analyses that
        average over the record's random position do not apply; the ones for the worst
        position still do. Refused for ``without_replacement`` and ``poisson``.
      l2_regularization: ``m_reg``, the L2 strength applied once per step outside the clipped sum
        (``weight_decay`` of torch / Opacus optimisers), or ``None`` when unknown. The declared
        geometry already includes it; the Poisson hidden-state analyses need it separately, because
        under Poisson sampling the batch size is random and an empty batch contracts only through
        ``m_reg`` (docs/derivations.md section 6).
      epoch_steps: for ``balls_in_bins``, the steps ``t`` each epoch spreads the records over when the
        sampler was given it (a public constant); ``None`` means ``n // b`` of the dataset size, which is
        then treated as public (docs/derivations.md B.1).

    Hidden-state theorems assume a constant step size and noise; with a per-step
    schedule that is not constant only the composition baselines apply.
    """

    dataset_size: int = attr.ib()
    batch_size: int = attr.ib()
    steps: int = attr.ib()
    noise_multiplier: Schedule = attr.ib(converter=_float_or_tuple)
    clip_norm: float = attr.ib()
    learning_rate: Schedule = attr.ib(converter=_float_or_tuple)
    sampling: str = attr.ib()
    geometry: Optional[LossGeometry] = attr.ib(default=None)
    gaussian_initialization: bool = attr.ib(default=False)
    sampling_probability: Optional[float] = attr.ib(default=None)
    hidden_state_refusal: Optional[str] = attr.ib(default=None)
    last_batch: str = attr.ib(default=DROPPED)
    secret_batches: bool = attr.ib(default=True)
    l2_regularization: Optional[float] = attr.ib(default=None)
    epoch_steps: Optional[int] = attr.ib(default=None)

    def __attrs_post_init__(self):
        n, b = check_schedule(self.dataset_size, self.batch_size, self.sampling)
        object.__setattr__(self, "epoch_steps", check_epoch_steps(self.epoch_steps, self.sampling))
        object.__setattr__(self, "last_batch", check_last_batch(self.last_batch, self.sampling, n, b))
        if not isinstance(self.secret_batches, bool):
            raise v.ParameterError("secret_batches", f"must be True or False, got {self.secret_batches!r}")
        if not self.secret_batches and self.sampling in (WITHOUT_REPLACEMENT, POISSON):
            raise v.ParameterError(
                "secret_batches",
                f"{self.sampling} with public batches is not covered (its analyses rest on the draw being secret)",
            )
        t = v.positive_int("steps", self.steps, maximum=MAX_STEPS, why=" (more than any training run takes)")
        object.__setattr__(self, "dataset_size", n)
        object.__setattr__(self, "batch_size", b)
        object.__setattr__(self, "steps", t)
        object.__setattr__(self, "clip_norm", v.positive_float("clip_norm", self.clip_norm))
        if self.sampling_probability is not None:
            if self.sampling != POISSON:
                raise v.ParameterError(
                    "sampling_probability", f"applies to sampling='poisson' only, not {self.sampling!r}"
                )
            q = v.real("sampling_probability", self.sampling_probability)
            if not 0 < q <= 1:
                raise v.ParameterError("sampling_probability", f"must lie in (0, 1], got {self.sampling_probability!r}")
            object.__setattr__(self, "sampling_probability", q)
        if self.l2_regularization is not None:
            object.__setattr__(
                self, "l2_regularization", v.nonnegative_float("l2_regularization", self.l2_regularization)
            )
        if not isinstance(self.gaussian_initialization, bool):
            raise v.ParameterError(
                "gaussian_initialization", f"must be True or False, got {self.gaussian_initialization!r}"
            )
        if self.hidden_state_refusal is not None and not (
            isinstance(self.hidden_state_refusal, str) and self.hidden_state_refusal.strip()
        ):
            raise v.ParameterError("hidden_state_refusal", "must be None or a non-empty reason")
        if self.geometry is not None and not isinstance(self.geometry, LossGeometry):
            raise v.ParameterError("geometry", f"must be a LossGeometry or None, got {self.geometry!r}")
        for name in ("noise_multiplier", "learning_rate"):
            value = getattr(self, name)
            if isinstance(value, tuple):
                if len(value) != t:
                    raise v.ParameterError(name, f"per-step schedule has {len(value)} entries, expected steps={t}")
                for x in value:
                    v.positive_float(name, x)
                if len(set(value)) == 1:  # a constant schedule is a constant
                    object.__setattr__(self, name, value[0])
            else:
                object.__setattr__(self, name, v.positive_float(name, value))
        # a claim that cannot hold is an error; a varying rate already rules out the analyses
        if (
            self.geometry is not None
            and self.hidden_state_refusal is None
            and not isinstance(self.learning_rate, tuple)
        ):
            check_learning_rate(self.learning_rate, self.geometry)

    @classmethod
    def from_epochs(cls, *, dataset_size: int, batch_size: int, epochs: float, **kwargs) -> "TrainingRunDpEvent":
        """Builds the event from a number of epochs (``steps = epochs * steps_per_epoch``)."""
        n = v.positive_int("dataset_size", dataset_size)
        b = v.positive_int("batch_size", batch_size)
        e = v.positive_float("epochs", epochs)
        spe = steps_per_epoch(
            n, b, kwargs.get("sampling", CYCLIC), kwargs.get("last_batch", DROPPED), kwargs.get("epoch_steps") or None
        )
        steps = e * spe
        if not float(steps).is_integer():
            raise v.ParameterError("epochs", f"{e:g} epochs of {spe} steps is not a whole number of steps")
        return cls(dataset_size=n, batch_size=b, steps=int(steps), **kwargs)

    # -- derived quantities ------------------------------------------------------------
    def noise_counts(self) -> Dict[float, int]:
        """Noise multiplier -> number of steps using it (no per-step array for a constant)."""
        if isinstance(self.noise_multiplier, tuple):
            return dict(Counter(self.noise_multiplier))
        return {float(self.noise_multiplier): self.steps}

    @property
    def sampling_rate(self) -> float:
        """``q``: the probability that a given record is in a step's batch (``b / n`` unless
        ``sampling_probability`` says otherwise)."""
        if self.sampling_probability is not None:
            return self.sampling_probability
        return self.batch_size / self.dataset_size

    def hidden_state_reason(self) -> Optional[str]:
        """Why no hidden-state claim is made for this run before any analysis looks at it: the
        recording layer's refusal, or a declared geometry that is not proved for the clipped map with
        this clip norm (:meth:`LossGeometry.clipped_map_refusal`); ``None`` otherwise (also without a
        geometry)."""
        if self.hidden_state_refusal:
            return self.hidden_state_refusal
        return None if self.geometry is None else self.geometry.clipped_map_refusal(self.clip_norm)

    @property
    def is_constant(self) -> bool:
        return not isinstance(self.noise_multiplier, tuple) and not isinstance(self.learning_rate, tuple)

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.dataset_size, self.batch_size, self.sampling, self.last_batch, self.epoch_steps)

    @property
    def epochs(self) -> float:
        return self.steps / self.steps_per_epoch

    def replace(self, **changes) -> "TrainingRunDpEvent":
        """A copy with some fields changed (``attr.evolve``)."""
        return attr.evolve(self, **changes)


__all__ = [
    "TrainingRunDpEvent",
    "LossGeometry",
    "check_learning_rate",
    "LOSSES",
    "CROSS_ENTROPY_ON_LOGITS",
    "cross_entropy_smoothness",
    "nonbinding_clip_norm",
]
