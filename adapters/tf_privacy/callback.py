"""``HiddenStatePrivacyCallback``: hidden-state epsilon in Keras' logs, and a budget stop.

The callback reads ``l2_norm_clip``, ``noise_multiplier``, ``num_microbatches`` and the
learning rate (schedules, the legacy ``decay`` and changes made by other callbacks included)
from the model's TF-Privacy DP optimizer, counts the optimiser's steps, and at the end of
every epoch writes ``epsilon`` (the best valid bound from the core accountant) and
``epsilon_composition`` (the composition baseline: every iterate released) into the epoch's
logs, so the progress bar, ``History``, ``TensorBoard`` and ``CSVLogger`` record them. List it
*before* those callbacks (Keras' own progress bar and ``History`` always come last).

Everything that the accountant's update rule does not describe is refused with the reason
(DESIGN.md sections 2 to 4); all the math stays in the core.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import tensorflow as tf

from hidden_state_accountants import (
    HiddenStateAccountant,
    LossGeometry,
    ParameterError,
    TrainingRunDpEvent,
)
from hidden_state_accountants import validation as v
from hidden_state_accountants.accountant import PrivacyReport
from hidden_state_accountants.accountant import NO_GEOMETRY
from hidden_state_accountants.schedules import check_schedule, steps_per_epoch

from .data import DATASET_SAMPLINGS
from .optimizers import (
    DPOptimizerSettings,
    check_accountable,
    hidden_state_refusal,
    read_dp_optimizer_settings,
)
from .regularization import (
    inside_clipping_regularizers,
    projection_diameter,
    trainable_layers,
    unprojected_variables,
)
from .statement import statement_for_run

_DP_MODEL_MODULE = "tensorflow_privacy.privacy.keras_models.dp_keras_model"


class PrivacyBudgetExceeded(RuntimeError):
    """Raised before a step that would take the run past ``target_epsilon`` when stopping at
    an epoch boundary is no longer possible (the budget is spent at the start of ``fit``, or
    another callback changed the learning rate mid-run)."""


@dataclass(frozen=True)
class EpochPrivacy:
    """The accounting after one epoch."""

    epoch: int
    steps: int
    epsilon: float
    epsilon_composition: float
    analysis: str


class HiddenStatePrivacyCallback(tf.keras.callbacks.Callback):
    """Adds hidden-state ``epsilon`` and ``epsilon_composition`` to each epoch's logs.

    Args:
      geometry: the declared :class:`LossGeometry` of the per-example update map, or ``None``
        for no hidden-state claim (composition only; a warning says so). If every trainable
        variable carries an :class:`L2BallProjection` and ``geometry.diameter`` is ``None``,
        the projection's diameter is added to the geometry.
      sampling: the batch schedule, which must come from :func:`batched_dataset` with the
        same ``batch_size``: ``"full"``, ``"cyclic"``, ``"shuffle_partition"`` or
        ``"without_replacement"``.
      dataset_size: ``n``, the number of training records.
      batch_size: ``b``; the optimizer must use one example per microbatch.
      delta: the target delta.
      target_epsilon: optional budget. Training stops at the end of the last epoch after
        which one more epoch would exceed it; if not even the next epoch fits when ``fit``
        starts, :class:`PrivacyBudgetExceeded` is raised before any step.
      verbose: 1 prints a line when training starts and when the budget stops it.

    Raises (from ``on_train_begin``, before any step): :class:`ParameterError` naming the
    parameter for every setting the accountant cannot account for.
    """

    def __init__(
        self,
        *,
        geometry: Optional[LossGeometry],
        sampling: str,
        dataset_size: int,
        batch_size: int,
        delta: float,
        target_epsilon: Optional[float] = None,
        verbose: int = 1,
    ):
        super().__init__()
        if sampling not in DATASET_SAMPLINGS:
            extra = (" (Poisson batches have a random size that Keras batching does not produce, and "
                     "TF-Privacy divides by the realised size)" if sampling == "poisson" else "")
            raise ParameterError("sampling", f"must be one of {', '.join(DATASET_SAMPLINGS)}, got {sampling!r}{extra}")
        if geometry is not None and not isinstance(geometry, LossGeometry):
            raise ParameterError("geometry", f"must be a LossGeometry or None, got {geometry!r}")
        self.delta = v.probability("delta", delta)
        self.target_epsilon = None if target_epsilon is None else v.positive_float("target_epsilon", target_epsilon)
        # the core checks n, b and the schedule's own conditions
        self.dataset_size, self.batch_size = check_schedule(dataset_size, batch_size, sampling)
        self.sampling = sampling
        self.steps_per_epoch = steps_per_epoch(self.dataset_size, self.batch_size, sampling)
        self.declared_geometry = geometry
        self.geometry = geometry  # with the projection's diameter once training starts
        self.verbose = int(verbose)

        self.settings: Optional[DPOptimizerSettings] = None
        self.steps = 0
        self.learning_rates: List[float] = []  # one per accounted step
        self.history: List[EpochPrivacy] = []
        self.report: Optional[PrivacyReport] = None
        self.stopped_reason: Optional[str] = None
        self._schedule = None  # a LearningRateSchedule, or None for a variable learning rate
        self._lr_marks: List[Tuple[int, float]] = []  # (first step, value) of a variable rate
        self._report_steps = -1
        self._warned_no_geometry = False
        self._announce_stop = False

    # ----------------------------------------------------------------- Keras hooks
    def on_train_begin(self, logs=None):
        model = self.model
        if any(c.__module__ == _DP_MODEL_MODULE for c in type(model).__mro__):
            raise ParameterError(
                "model",
                f"{type(model).__name__} (TF-Privacy DPModel/DPSequential) is not supported; use a plain "
                "Keras model compiled with DPKerasSGDOptimizer",
            )
        opt = model.optimizer
        settings = read_dp_optimizer_settings(opt)
        check_accountable(settings, self.batch_size)
        if self.settings is not None and (settings.l2_norm_clip, settings.noise_multiplier) != (
            self.settings.l2_norm_clip, self.settings.noise_multiplier
        ):
            raise ParameterError("optimizer", "l2_norm_clip or noise_multiplier changed between fit calls")
        self.settings = settings
        self._check_loss(model)

        iterations = int(opt.iterations.numpy())
        if iterations != self.steps:
            raise ParameterError(
                "optimizer",
                f"has taken {iterations} steps but this callback accounted {self.steps}: steps it did not "
                "see cannot be accounted (use a fresh optimizer, and the same callback for every fit)",
            )
        steps = (self.params or {}).get("steps")
        if steps != self.steps_per_epoch:
            raise ParameterError(
                "steps_per_epoch",
                f"fit runs {steps} steps per epoch but sampling={self.sampling!r} with n={self.dataset_size}, "
                f"b={self.batch_size} has {self.steps_per_epoch}; pass batched_dataset(x, y, "
                f"{self.batch_size}, {self.sampling!r}) to fit without batch_size or steps_per_epoch",
            )

        self.geometry = self._effective_geometry(model, settings)
        regs = inside_clipping_regularizers(model)
        if regs:
            warnings.warn(
                f"{', '.join(regs)}: Keras adds these terms to every per-example loss, so TF-Privacy clips "
                "them together with the data gradient; that is not the L2 term of the analyses (applied "
                "outside clipping). Use DecoupledL2DPKerasSGDOptimizer(l2_regularization=...) instead",
                UserWarning, stacklevel=2,
            )
        if self.geometry is None and not self._warned_no_geometry:
            self._warned_no_geometry = True
            warnings.warn(f"{NO_GEOMETRY}; reporting the composition bound for sampling={self.sampling!r}",
                          UserWarning, stacklevel=2)

        self._read_learning_rate_source(opt, settings)
        planned = (self.params or {}).get("epochs") or 0
        if self._schedule is not None and planned:
            # a schedule is known in advance: check the whole planned run now, before any step
            self._event(self.steps + planned * self.steps_per_epoch)
        else:
            self._event(self.steps + 1)  # the core checks learning_rate < 2/smoothness
        if self.target_epsilon is not None and planned:
            eps_next = self._explain(self.steps + self.steps_per_epoch).epsilon
            if eps_next > self.target_epsilon:
                spent = self.report.epsilon if self.report is not None else 0.0
                raise PrivacyBudgetExceeded(
                    f"target_epsilon: {self.target_epsilon:g} would be exceeded by the next epoch "
                    f"(epsilon {eps_next:.4g} after {self.steps + self.steps_per_epoch} steps; spent so far "
                    f"{spent:.4g}); no step was taken"
                )
        if self.verbose:
            print(self._describe(), flush=True)

    def on_train_batch_begin(self, batch, logs=None):
        if self._schedule is not None:
            return
        lr = self._current_variable_lr()
        if lr == self._lr_marks[-1][1]:
            return
        # another callback changed the learning rate: account it from the next step on
        step = int(self.model.optimizer.iterations.numpy())
        self._lr_marks.append((step, lr))
        if self.geometry is not None:
            self._event(step + 1)  # refuses learning_rate >= 2/smoothness before the step runs
        if self.target_epsilon is not None:
            end = -(-(step + 1) // self.steps_per_epoch) * self.steps_per_epoch  # end of this epoch
            eps = self._explain(end).epsilon
            if eps > self.target_epsilon:
                self.stopped_reason = (
                    f"learning rate changed to {lr:g} at step {step}; the epoch would end at epsilon "
                    f"{eps:.4g} > target_epsilon {self.target_epsilon:g}"
                )
                self._sync()  # account the steps taken so far; fit ends without on_train_end
                raise PrivacyBudgetExceeded(f"target_epsilon: {self.stopped_reason}; the step was not taken")

    def on_epoch_end(self, epoch, logs=None):
        self._sync()
        report = self._report()
        comp = report.composition_epsilon
        if logs is not None:
            logs["epsilon"] = report.epsilon
            logs["epsilon_composition"] = comp
        self.history.append(EpochPrivacy(epoch, self.steps, report.epsilon, comp, report.analysis))
        if self.target_epsilon is None:
            return
        if report.epsilon > self.target_epsilon:  # only if the learning rate changed unforeseen
            self.model.stop_training = True
            self.stopped_reason = f"epsilon {report.epsilon:.4g} exceeds target_epsilon {self.target_epsilon:g}"
            warnings.warn(f"HiddenStatePrivacyCallback: {self.stopped_reason}", UserWarning, stacklevel=2)
            return
        planned = (self.params or {}).get("epochs") or 0
        if epoch + 1 >= planned:
            return  # fit ends anyway; a later fit checks before its first step
        eps_next = self._explain(self.steps + self.steps_per_epoch).epsilon
        if eps_next > self.target_epsilon:
            self.model.stop_training = True
            self.stopped_reason = (
                f"stopping after epoch {epoch + 1} at epsilon {report.epsilon:.4g}: one more epoch would "
                f"reach {eps_next:.4g} > target_epsilon {self.target_epsilon:g}"
            )
            self._announce_stop = bool(self.verbose)  # printed after Keras' epoch line

    def on_train_end(self, logs=None):
        if self._announce_stop:
            self._announce_stop = False
            print(f"HiddenStatePrivacyCallback: {self.stopped_reason}", flush=True)
        self._sync()  # a partial epoch if another callback stopped mid-epoch
        if self.steps and self._report_steps != self.steps:
            report = self._report()
            if self.target_epsilon is not None and report.epsilon > self.target_epsilon:
                warnings.warn(
                    f"HiddenStatePrivacyCallback: final epsilon {report.epsilon:.4g} exceeds target_epsilon "
                    f"{self.target_epsilon:g}", UserWarning, stacklevel=2,
                )

    # ----------------------------------------------------------------- results
    @property
    def epsilon(self) -> float:
        """The best valid epsilon for the steps taken so far (0 before any)."""
        if not self.steps:
            return 0.0
        return self._report().epsilon

    def run_event(self) -> TrainingRunDpEvent:
        """The core event for the steps taken so far."""
        if not self.steps:
            raise ValueError("no training step has been accounted yet")
        return self._event(self.steps)

    def privacy_statement(self, include_analyses: bool = False) -> str:
        """The model-card text (see :func:`compute_hidden_state_privacy_statement`) for this run."""
        return statement_for_run(self.run_event(), self.delta, include_analyses=include_analyses)

    # ----------------------------------------------------------------- internals
    def _check_loss(self, model) -> None:
        loss = getattr(model, "loss", None)
        if loss is None:
            return
        for item in tf.nest.flatten(loss):
            if item is None:
                continue
            if isinstance(item, tf.keras.losses.Loss):
                if item.reduction == tf.keras.losses.Reduction.NONE:
                    continue
                problem = f"{type(item).__name__} has reduction={item.reduction!r}"
            else:
                problem = f"{getattr(item, '__name__', item)!r} is reduced to the batch mean by Keras"
            raise ParameterError(
                "loss",
                f"{problem}; TF-Privacy clips per example only with one loss per example: use e.g. "
                "tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, "
                "reduction=tf.keras.losses.Reduction.NONE)",
            )

    def _effective_geometry(self, model, settings: DPOptimizerSettings) -> Optional[LossGeometry]:
        geom = self.declared_geometry
        if geom is None:
            return None
        refusal = hidden_state_refusal(settings)
        if refusal is not None:
            raise ParameterError(*refusal)
        layers = trainable_layers(model)
        if len(layers) > 1:
            raise ParameterError(
                "geometry",
                f"declared for a model with {len(layers)} trainable layers ({', '.join(layers)}): a "
                "composition of layers is not convex in its parameters, so no hidden-state analysis "
                "applies (DESIGN section 2); use geometry=None for composition",
            )
        m_reg = settings.l2_regularization
        if geom.strong_convexity > m_reg * (1 + 1e-9):
            raise ParameterError(
                "geometry",
                f"strong_convexity={geom.strong_convexity:g} but the optimizer adds L2 regularisation "
                f"{m_reg:g} outside clipping; clipped per-example gradients give no strong convexity of "
                f"their own (DESIGN section 2: m = m_reg), use DecoupledL2DPKerasSGDOptimizer("
                f"l2_regularization={geom.strong_convexity:g})",
            )
        if m_reg > geom.strong_convexity * (1 + 1e-9):
            warnings.warn(
                f"geometry.strong_convexity={geom.strong_convexity:g} is below the optimizer's "
                f"l2_regularization={m_reg:g}: valid but loose; geometry.smoothness must include the L2 "
                f"term (LossGeometry.logistic_regression(..., l2_regularization={m_reg:g}))",
                UserWarning, stacklevel=3,
            )
        diameter = projection_diameter(model)  # raises for constraints that are not L2 balls
        if geom.diameter is None:
            if diameter is not None:
                geom = LossGeometry(smoothness=geom.smoothness, strong_convexity=geom.strong_convexity,
                                    diameter=diameter, lsi_constant=geom.lsi_constant)
            return geom
        if diameter is None:
            raise ParameterError(
                "geometry",
                f"diameter={geom.diameter:g} is declared but these trainable variables are not projected "
                f"(give each an L2BallProjection constraint): {', '.join(unprojected_variables(model))}",
            )
        if diameter > geom.diameter:
            raise ParameterError(
                "geometry",
                f"diameter={geom.diameter:g} is smaller than the diameter {diameter:.6g} of the set the "
                "L2BallProjection constraints project onto",
            )
        return geom

    def _read_learning_rate_source(self, opt, settings: DPOptimizerSettings) -> None:
        lr = opt._get_hyper("learning_rate")
        if isinstance(lr, tf.keras.optimizers.schedules.LearningRateSchedule):
            self._schedule = lr
            self._lr_marks = []
            return
        if callable(lr) and not isinstance(lr, (tf.Variable, tf.Tensor)):
            raise ParameterError(
                "learning_rate",
                "a callable learning rate cannot be read per step; use a "
                "tf.keras.optimizers.schedules.LearningRateSchedule",
            )
        self._schedule = None
        value = self._current_variable_lr()
        if not self._lr_marks or self._lr_marks[-1][1] != value:
            self._lr_marks.append((self.steps, value))

    def _current_variable_lr(self) -> float:
        value = self.model.optimizer._get_hyper("learning_rate")
        return float(np.float32(tf.keras.backend.get_value(value)))

    def _base_lr(self, step: int) -> float:
        if self._schedule is not None:
            return float(np.float32(self._schedule(tf.cast(step, tf.float32)).numpy()))
        lr = self._lr_marks[0][1]
        for first, value in self._lr_marks:  # marks are few: one per change
            if first > step:
                break
            lr = value
        return lr

    def _lr(self, step: int) -> float:
        """The step size the legacy optimizer uses at 0-based ``step`` (its ``_decayed_lr``)."""
        lr = np.float32(self._base_lr(step))
        decay = self.settings.inverse_time_decay if self.settings else 0.0
        if decay > 0.0:
            lr = lr / (np.float32(1.0) + np.float32(decay) * np.float32(step))
        return float(lr)

    def _lrs(self, steps: int) -> List[float]:
        """Per-step learning rates for ``steps`` steps: recorded, then predicted."""
        start = len(self.learning_rates)
        return self.learning_rates[:steps] + self._lr_range(start, steps)

    def _lr_range(self, start: int, stop: int) -> List[float]:
        if stop <= start:
            return []
        if self._schedule is not None and stop - start > 8:
            values = self._schedule_values(start, stop)
            if values is not None:
                return values
        return [self._lr(i) for i in range(start, stop)]

    def _schedule_values(self, start: int, stop: int) -> Optional[List[float]]:
        """The schedule evaluated on a vector of steps, if it supports that (most built-in
        schedules do); checked against scalar evaluation at both ends."""
        try:
            base = np.asarray(self._schedule(tf.range(start, stop, dtype=tf.float32)), dtype=np.float32)
        except Exception:  # noqa: BLE001 - fall back to one call per step
            return None
        if base.shape != (stop - start,):
            return None
        decay = self.settings.inverse_time_decay if self.settings else 0.0
        if decay > 0.0:
            steps = np.arange(start, stop, dtype=np.float32)
            base = base / (np.float32(1.0) + np.float32(decay) * steps)
        values = [float(x) for x in base.astype(np.float32)]
        if values[0] != self._lr(start) or values[-1] != self._lr(stop - 1):
            return None
        return values

    def _sync(self) -> None:
        if self.model is None or self.settings is None:
            return
        now = int(self.model.optimizer.iterations.numpy())
        if now > self.steps:
            self.learning_rates.extend(self._lr_range(self.steps, now))
            self.steps = now

    def _event(self, steps: int) -> TrainingRunDpEvent:
        lrs = self._lrs(steps)
        lr = lrs[0] if all(x == lrs[0] for x in lrs) else tuple(lrs)
        return TrainingRunDpEvent(
            dataset_size=self.dataset_size, batch_size=self.batch_size, steps=steps,
            noise_multiplier=self.settings.noise_multiplier, clip_norm=self.settings.l2_norm_clip,
            learning_rate=lr, sampling=self.sampling, geometry=self.geometry,
        )

    def _explain(self, steps: int) -> PrivacyReport:
        with warnings.catch_warnings():
            if self.geometry is None:  # warned once in on_train_begin
                warnings.simplefilter("ignore", UserWarning)
            return HiddenStateAccountant().compose(self._event(steps)).explain(self.delta)

    def _report(self) -> PrivacyReport:
        if self._report_steps != self.steps:
            self.report = self._explain(self.steps)
            self._report_steps = self.steps
        return self.report

    def _describe(self) -> str:
        s = self.settings
        if self._schedule is not None:
            lr = f"schedule {type(self._schedule).__name__}"
        else:
            lr = f"{self._lr_marks[-1][1]:g}"
        geom = self.geometry
        g = ("none (composition only)" if geom is None else
             f"m={geom.strong_convexity:g}, M={geom.smoothness:g}, D={geom.diameter if geom.diameter is None else f'{geom.diameter:.4g}'}")
        budget = f", target_epsilon={self.target_epsilon:g}" if self.target_epsilon is not None else ""
        return (
            f"HiddenStatePrivacyCallback: {s.name} z={s.noise_multiplier:g} C={s.l2_norm_clip:g} lr={lr} "
            f"l2={s.l2_regularization:g}; n={self.dataset_size} b={self.batch_size} sampling={self.sampling} "
            f"({self.steps_per_epoch} steps/epoch, {self.dataset_size % self.batch_size if self.sampling != 'full' else 0} "
            f"records dropped per epoch); geometry: {g}; delta={self.delta:g}{budget}"
        )
