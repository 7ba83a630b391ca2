"""``HiddenStatePrivacyCallback``: hidden-state epsilon in Keras' logs, and a budget stop.

The callback only reads facts and hands them to the core's recording layer
(:mod:`hidden_state_accountants.recording`), which decides what they back, as for every other
framework: each optimiser step from the TF-Privacy optimizer (:mod:`.optimizers`), the model's
layers and the inputs of its trainable layer (:mod:`.model`), the loss ``fit`` minimises, and what
``fit`` trains on (:mod:`.data`). docs/tf_privacy.md lists every fact read and what each setting meets.

At the end of every epoch it writes ``epsilon`` (the best valid bound for the steps taken)
and ``epsilon_composition`` (every iterate released) into the epoch's logs, so the progress
bar, ``History``, ``TensorBoard`` and ``CSVLogger`` record them. List it *before* those
callbacks (Keras' own progress bar and ``History`` always come last).
"""

from __future__ import annotations

import itertools
import json
import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

import attr
import numpy as np
import tensorflow as tf

from hidden_state_accountants import BatchSchedule, LossGeometry, ParameterError, TrainingRunDpEvent
from hidden_state_accountants import validation as v
from hidden_state_accountants.accountant import PrivacyReport
from hidden_state_accountants.calibration import run_differences
from hidden_state_accountants.checkpoint import RunState, check_continues, open_run, refusal, seal_run
from hidden_state_accountants.errors import HiddenStateWarning
from hidden_state_accountants.events import CROSS_ENTROPY_ON_LOGITS
from hidden_state_accountants.keras.data import (
    accounted_delta,
    check_dataset_last_batch,
    check_dataset_sampling,
    keras_schedule,
)
from hidden_state_accountants.keras.features import largest_input_norm, trainable_dense
from hidden_state_accountants.recording import (
    Claim,
    RunRecorder,
    StepFacts,
    batch_records,
    check_batch_source,
    check_initial_weights,
    check_position,
)
from hidden_state_accountants.schedules import BALLS_IN_BINS, DROPPED, RESHUFFLE, check_last_batch, check_schedule
from hidden_state_accountants.statement import render_statement

from .calibration import FLOAT32_MARGIN, compute_hidden_state_noise, planned_run
from .data import (
    FitData,
    continue_batch_source,
    fit_batch_source,
    fit_data,
    share_batch_source_across_workers,
)
from .model import loaded_weights, model_facts
from .optimizers import DPOptimizerSettings, read_dp_optimizer_settings, read_replicas, step_facts
from .regularization import projection_facts
from .statement import RELATION, host_paragraphs

_DP_MODEL_MODULE = "tensorflow_privacy.privacy.keras_models.dp_keras_model"

STATE_ATTRIBUTE = "hidden_state_privacy"
"""The attribute of the model under which the callback's state is tracked (and so saved with
the model by ``tf.train.Checkpoint``, ``model.save_weights`` in the TensorFlow format,
``ModelCheckpoint(save_weights_only=True)`` and ``BackupAndRestore``)."""

_STATE_FORMAT = "hidden_state_accountants.tf_privacy.HiddenStatePrivacyCallback"
_STATE_VERSION = 4  # 3: the model's feature clip in the claim, the largest feature norm of the steps; 4: the
# core Claim (relation, what was observed about the data), the largest feature norm in the core's state
_SUBJECT = "the hidden-state privacy state"
_HOW_TO_RESUME = (
    "to resume a run, restore the callback's state together with the model and its optimizer: it is saved "
    "with the model (tf.train.Checkpoint(model=model), model.save_weights in the TensorFlow format, "
    "ModelCheckpoint(save_weights_only=True) or BackupAndRestore, with the callback passed to fit), and restored "
    "into a new callback passed to the resumed fit (see 'Resuming a run' in the TF-Privacy adapter's guide)"
)


class PrivacyBudgetExceeded(RuntimeError):
    """Raised before a step that would take the run past ``target_epsilon`` when stopping at
    an epoch boundary is no longer possible (the budget is spent at the start of ``fit``, or
    another callback changed the learning rate mid-run)."""


@dataclass(frozen=True)
class CalibratedRun:
    """What :meth:`HiddenStatePrivacyCallback.compute_noise` calibrated: ``noise_multiplier`` for
    at most ``target_epsilon`` after ``epochs`` epochs; ``run`` is that run as the core calibrated
    it (at ``noise_multiplier / FLOAT32_MARGIN``, which TF-Privacy's float32 copy never undercuts)."""

    target_epsilon: float
    epochs: int
    noise_multiplier: float
    run: TrainingRunDpEvent


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
        for no hidden-state claim (composition only; a ``CompositionFallbackWarning`` says
        so). If every trainable variable carries an :class:`L2BallProjection` and
        ``geometry.diameter`` is ``None``, the projection's diameter is used.
      sampling: the batch schedule: ``"full"``, ``"cyclic"``, ``"shuffle_partition"``,
        ``"reshuffle"``, ``"without_replacement"`` or ``"balls_in_bins"`` (a :func:`batched_dataset` of it,
        whose batches are padded to ``b`` rows; with no geometry its amplified composition is reported). ``fit`` must train on a
        :func:`batched_dataset` of it (``fit(x, y, batch_size=n)`` also counts as ``full``,
        ``fit(x, y, batch_size=b, shuffle=False)`` with ``b`` dividing ``n`` as ``cyclic``, and
        ``fit(x, y, batch_size=b, shuffle=True)``, Keras' default, as ``reshuffle`` drawn by
        Keras: its short last batch is kept and divided by its own size, and its permutations
        are public if TensorFlow's random seed was set, e.g. by ``tf.random.set_seed`` or
        ``tf.keras.utils.set_random_seed``; the report then says so and only the worst-pattern
        bound applies).
      dataset_size: ``n``, the number of training records.
      batch_size: ``b``.
      delta: the target delta.
      last_batch: for ``reshuffle``, what each epoch does with the last ``n % b`` records:
        ``None`` (the default) takes what the data does (``fit(shuffle=True)`` keeps them as a
        short batch, ``kept_own_size``; a :func:`batched_dataset` drops them unless told
        otherwise); ``"dropped"`` or ``"kept_own_size"`` must match the data.
      steps_per_epoch: for ``balls_in_bins``, the steps of an epoch, a public constant (default
        :func:`~hidden_state_accountants.keras.data.balls_in_bins_steps` of ``dataset_size`` and ``batch_size``);
        the run is accounted at ``delta`` less the chance that a padded batch overflows.
      target_epsilon: optional budget. Training stops at the end of the last epoch after
        which one more epoch would exceed it; if not even the next epoch fits when ``fit``
        starts, :class:`PrivacyBudgetExceeded` is raised before any step.
      assume_convex_model: with a geometry, accept any model on your word that its loss is
        convex in the trainable parameters as declared (the report says so). By default a
        geometry needs a model that is one ``Dense`` layer without activation on fixed
        features, applied last.
      verbose: 1 prints a line when training starts and when the budget stops it.
      public_initial_weights: declares that weights loaded from storage before ``fit``
        (``model.load_weights``, ``load_model``) without the callback's state do not depend on the
        private data (public pre-training); the report's notes then say so. By default such a
        ``fit`` is refused: the weights may carry steps this run's ledger lacks (a run resumed from
        a weights-only file would report its new steps only).

    Raises (from ``on_train_begin``, before any step): :class:`ParameterError` naming the
    parameter for every contradiction known before training, and for data that does not
    follow the declared schedule.

    **Resuming.** The callback's state (the core ledger, the batch schedule with its seed, the
    per-epoch history) is tracked by the model as ``model.hidden_state_privacy`` from the
    first ``fit`` on, so it is saved with the model and restored into a new callback in a
    new process; the resumed ``fit`` continues the ledger and the schedule. A restored state
    is checked (its digest, that it is a run of this callback's schedule, that it accounts
    exactly the optimizer's steps) before any step. The state holds the secret seed of a
    random schedule: keep checkpoints as private as the data.
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
        assume_convex_model: bool = False,
        verbose: int = 1,
        last_batch: Optional[str] = None,
        public_initial_weights: bool = False,
        steps_per_epoch: Optional[int] = None,
    ):
        super().__init__()
        self.sampling = check_dataset_sampling(sampling)
        if geometry is not None and not isinstance(geometry, LossGeometry):
            raise ParameterError("geometry", f"must be a LossGeometry or None, got {geometry!r}")
        for name, flag in (
            ("assume_convex_model", assume_convex_model),
            ("public_initial_weights", public_initial_weights),
        ):
            if not isinstance(flag, bool):
                raise ParameterError(name, f"must be True or False, got {flag!r}")
        self.public_initial_weights = public_initial_weights
        self._weights_note: Optional[str] = None  # the core's note for weights declared public
        self.delta = v.probability("delta", delta)
        self.target_epsilon = None if target_epsilon is None else v.positive_float("target_epsilon", target_epsilon)
        self.dataset_size, self.batch_size = check_schedule(dataset_size, batch_size, sampling)
        if last_batch is not None:
            last_batch = check_last_batch(
                check_dataset_last_batch(last_batch), sampling, self.dataset_size, self.batch_size
            )
        self.last_batch = last_batch
        # as declared; once fit starts, the run's schedule's (a short batch the data keeps adds a step)
        declared = keras_schedule(
            self.dataset_size,
            self.batch_size,
            sampling,
            last_batch=last_batch or DROPPED,
            steps_per_epoch=steps_per_epoch,
        )
        self.epoch_steps = declared.epoch_steps  # balls_in_bins: the steps of an epoch, a public constant
        self.steps_per_epoch = declared.steps_per_epoch
        self.declared_geometry = geometry
        self.assume_convex_model = assume_convex_model
        self.verbose = int(verbose)

        self.settings: Optional[DPOptimizerSettings] = None
        self.replicas = 1  # of the model's tf.distribute strategy, read when fit starts
        self.recorder: Optional[RunRecorder] = None  # the core's ledger, from the first fit on
        self.history: List[EpochPrivacy] = []
        self.report: Optional[PrivacyReport] = None
        self.stopped_reason: Optional[str] = None
        self._facts: Dict[int, StepFacts] = {}  # this fit's step for a batch of each size, learning rate aside
        self._source_description: Optional[str] = None  # what fit trains on, when the framework draws it
        self._schedule = None  # a LearningRateSchedule, or None for a variable learning rate
        self._lr_marks: List[Tuple[int, float]] = []  # (first step, value) of a variable rate
        self._report_steps = -1
        self._epoch_start = 0
        self._announce_stop = False
        # a checked state (run, history), applied before the next step
        self._restored: Optional[Tuple[Optional[RunState], List[EpochPrivacy]]] = None
        self._restore_error: Optional[ParameterError] = None
        self._checkpointed = _CheckpointedState(self)
        self.calibration: Optional[CalibratedRun] = None  # set by compute_noise, checked when fit starts

    # ----------------------------------------------------------------- Keras hooks
    def set_model(self, model):
        super().set_model(model)
        # tracked by the model, so saved and restored with it; a checkpoint restored before
        # fit is applied now (TensorFlow restores a dependency when it is attached)
        setattr(model, STATE_ATTRIBUTE, self._checkpointed)

    def on_train_begin(self, logs=None):
        self._begin()

    def _begin(self):
        model = self.model
        self._raise_restore_error()
        if any(c.__module__ == _DP_MODEL_MODULE for c in type(model).__mro__):
            raise ParameterError(
                "model",
                f"{type(model).__name__} (TF-Privacy DPModel/DPSequential) is not supported; use a plain "
                "Keras model compiled with DPKerasSGDOptimizer",
            )
        opt = model.optimizer
        self.settings = settings = read_dp_optimizer_settings(opt)
        self.replicas = replicas = read_replicas(model)
        _check_loss(model)
        restored, self._restored = self._restored, None
        run = None
        if restored is not None:
            run, history = restored
            self.recorder, self.history, self.report, self._report_steps, self._lr_marks = (
                None,
                list(history),
                None,
                -1,
                [],
            )
        steps = run.steps if run is not None else self.steps
        iterations = int(opt.iterations.numpy())
        if iterations > steps:
            raise ParameterError(
                "optimizer",
                f"has taken {iterations} steps but this callback accounted {steps}: reporting "
                f"{steps} steps as the whole run would under-report its privacy loss; {_HOW_TO_RESUME}",
            )
        if iterations < steps:
            raise ParameterError(
                "optimizer",
                f"has taken {iterations} steps but the callback's state accounts {steps}: the "
                "optimizer was not restored with the callback's state (compile the model with its optimizer "
                "before restoring, and restore model, optimizer and callback state from the same checkpoint)",
            )
        self._check_initial_weights(model, restored=restored is not None)

        accounted = run or (RunState.of(self.recorder) if self.recorder is not None else None)
        if accounted is not None and steps:
            continue_batch_source(model, accounted.schedule, steps)
        share_batch_source_across_workers(model)
        source = fit_batch_source(model)
        schedule = accounted.schedule if accounted is not None else self._declared_schedule(source.schedule)
        check_batch_source(schedule, source, steps)
        self.steps_per_epoch = schedule.steps_per_epoch
        if source.schedule is not None and source.schedule.external:
            self._source_description = source.description
        diameter, others = projection_facts(model)
        # the step as the optimizer takes it, for the full and a kept short batch (TF-Privacy divides by the
        # records it gets)
        self._facts = {
            records: step_facts(
                settings,
                1.0,
                batch_size=records,
                replicas=replicas,
                projection_diameter=diameter,
                other_constraints=others,
            )
            for records in {self.batch_size, batch_records(schedule, schedule.steps_per_epoch - 1)}
        }
        self._read_learning_rate_source(opt)
        claim, checked = self._claim(model, schedule, fit_data(model))
        if run is not None:  # the declared claim (checked to be the run's) on the model being trained
            self.recorder = run.continued(claim).recorder
        elif self.recorder is None:
            self.recorder = claim.recorder()
        else:  # a later fit: this fit's data
            self.recorder.observe(loss=claim.loss, feature_unobservable=claim.feature_unobservable)
        if checked is not None:
            self.recorder.check_feature_norm(*checked, steps=None)  # fit trains on these records only
        planned = (self.params or {}).get("epochs") or 0
        plan = self._upcoming(self.steps, self.steps + max(planned, 1) * self.steps_per_epoch)
        last = [(s, 1) for s, _ in self.recorder.ledger[-1:]]  # a change from the run so far is known now, too
        self.recorder.check_plan(
            [s for s, _ in last + plan], start=self.steps - len(last), counts=[c for _, c in last + plan]
        )
        self._check_calibration()
        if self.target_epsilon is not None and planned:
            eps_next = self._planned(self.steps + self.steps_per_epoch).epsilon
            if eps_next > self.target_epsilon:
                spent = self.report.epsilon if self.report is not None else 0.0
                raise PrivacyBudgetExceeded(
                    f"target_epsilon: {self.target_epsilon:g} would be exceeded by the next epoch (epsilon "
                    f"{eps_next:.4g} after {self.steps + self.steps_per_epoch} steps; spent so far {spent:.4g}); "
                    "no step was taken"
                )
        if self.verbose:
            print(self._describe(), flush=True)

    def _check_initial_weights(self, model, *, restored: bool) -> None:
        """Weights loaded from storage since the run's last ``fit`` (:func:`.model.loaded_weights`) need the
        callback's state restored with them or ``public_initial_weights=True`` (the core's
        :func:`~hidden_state_accountants.recording.check_initial_weights`)."""
        try:
            note = check_initial_weights(loaded_weights(model), restored=restored, public=self.public_initial_weights)
        except ParameterError as err:
            raise ParameterError(
                err.parameter,
                f"{err.reason} with HiddenStatePrivacyCallback(public_initial_weights=True); {_HOW_TO_RESUME}",
            ) from None
        loaded_weights(model, forget=True)  # accounted for: a later fit of this run continues from here
        self._weights_note = note or self._weights_note

    def _claim(self, model, schedule: BatchSchedule, data: FitData) -> Tuple[Claim, Optional[Tuple[float, str]]]:
        """The claim of this fit: the declaration, the model's structure, the loss ``fit`` minimises and
        what the data decides (the inputs of the trainable layer on every record ``fit`` trains on,
        unless a FeatureClip enforces the bound); and ``(largest input norm, where)`` when checked."""
        claim = Claim(
            schedule=schedule,
            geometry=self.declared_geometry,
            model=model_facts(model),
            assume_convex_model=self.assume_convex_model,
            default_relation=RELATION,
            loss=_loss_facts(model, data),
        )
        if not claim.needs_feature_checks:
            return claim, None
        largest, where = largest_input_norm(model, data.features)
        if largest is None:
            return claim.observed(
                feature_unobservable=(
                    f"{where}; put hidden_state_accountants.tf_privacy.FeatureClip(R) right before the trainable Dense "
                    "layer, or train on arrays or a batched_dataset"
                )
            ), None
        return claim, (largest, where)

    def on_epoch_begin(self, epoch, logs=None):
        if self._restored is not None or self._restore_error is not None:
            self._begin()  # restored by a callback after this one (BackupAndRestore): checked again
        self._sync()
        self._epoch_start = self.steps

    def on_train_batch_begin(self, batch, logs=None):
        if self._schedule is not None:
            return
        lr = self._current_variable_lr()
        if lr == self._lr_marks[-1][1]:
            return
        # another callback changed the learning rate: account it from this step on
        step = int(self.model.optimizer.iterations.numpy())
        self._lr_marks.append((step, lr))
        if self.target_epsilon is not None:
            end = -(-(step + 1) // self.steps_per_epoch) * self.steps_per_epoch  # end of this epoch
            eps = self._planned(end).epsilon
            if eps > self.target_epsilon:
                self.stopped_reason = (
                    f"learning rate changed to {lr:g} at step {step}; the epoch would end at "
                    f"epsilon {eps:.4g} > target_epsilon {self.target_epsilon:g}"
                )
                self._sync()  # account the steps taken so far; fit ends without on_train_end
                raise PrivacyBudgetExceeded(f"target_epsilon: {self.stopped_reason}; the step was not taken")

    def on_epoch_end(self, epoch, logs=None):
        # more steps in an epoch than the data has batches: some did not train on it
        check_position(
            self._epoch_start + self.steps_per_epoch, int(self.model.optimizer.iterations.numpy()), "fit's data"
        )
        self._sync()
        report = self._report()
        comp = report.composition_epsilon
        if logs is not None:
            logs["epsilon"] = report.epsilon
            logs["epsilon_composition"] = comp
        self.history.append(EpochPrivacy(epoch, self.steps, report.epsilon, comp, report.analysis))
        if self.target_epsilon is None:
            return
        if report.epsilon > self.target_epsilon:  # only if the run changed unforeseen
            self.model.stop_training = True
            self.stopped_reason = (
                f"epsilon {report.epsilon:.4g} ({report.neighboring_relation}) exceeds "
                f"target_epsilon {self.target_epsilon:g}"
            )
            warnings.warn(f"HiddenStatePrivacyCallback: {self.stopped_reason}", HiddenStateWarning, stacklevel=2)
            return
        if epoch + 1 >= ((self.params or {}).get("epochs") or 0):
            return  # fit ends anyway; a later fit checks before its first step
        eps_next = self._planned(self.steps + self.steps_per_epoch).epsilon
        if eps_next > self.target_epsilon:
            self.model.stop_training = True
            self.stopped_reason = (
                f"stopping after epoch {epoch + 1} at epsilon {report.epsilon:.4g} "
                f"({report.neighboring_relation}): one more epoch would reach {eps_next:.4g} > "
                f"target_epsilon {self.target_epsilon:g}"
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
                    f"HiddenStatePrivacyCallback: final epsilon {report.epsilon:.4g} exceeds "
                    f"target_epsilon {self.target_epsilon:g}",
                    HiddenStateWarning,
                    stacklevel=2,
                )

    # ----------------------------------------------------------------- results
    @property
    def steps(self) -> int:
        """Optimiser steps accounted so far."""
        return 0 if self.recorder is None else self.recorder.steps

    @property
    def geometry(self) -> Optional[LossGeometry]:
        """The declared geometry as the run accounts it (with the projection's diameter once training
        starts), ``None`` without one."""
        accounted = None if self.recorder is None else self.recorder.accounted_geometry
        return self.declared_geometry if accounted is None else accounted

    @property
    def learning_rates(self) -> List[float]:
        """The learning rate of every accounted step."""
        return [s.learning_rate for s, count in (self.recorder.ledger if self.recorder else []) for _ in range(count)]

    @property
    def epsilon(self) -> float:
        """The best valid epsilon for the steps taken so far (0 before any)."""
        return self._report().epsilon if self.steps else 0.0

    def notes(self) -> List[str]:
        """What the claim rests on beyond the numbers (a seed you chose, a convexity you
        asserted, batches drawn by Keras and whether their randomness is secret)."""
        out = self.recorder.notes() if self.recorder else []
        return out + self._extra_notes()

    def _extra_notes(self) -> List[str]:
        """What the callback adds to the core's notes: what ``fit`` trains on when the framework draws it,
        and weights declared public."""
        out = [f"batches: {self._source_description}"] if self._source_description else []
        return out + ([self._weights_note] if self._weights_note else [])

    def compute_noise(
        self,
        target_epsilon: float,
        epochs: int,
        *,
        learning_rate: float,
        l2_norm_clip: float,
        l2_regularization: Optional[float] = None,
        secret_batches: bool = True,
        rel_tol: float = 1e-3,
    ) -> float:
        """The smallest noise multiplier whose run this callback reports at most ``target_epsilon``
        after ``epochs`` epochs: :func:`~.calibration.compute_hidden_state_noise` with this
        callback's schedule, geometry and delta. Build the optimizer with it::

            cb = HiddenStatePrivacyCallback(geometry=geometry, sampling="shuffle_partition",
                                            dataset_size=n, batch_size=b, delta=1e-5)
            z = cb.compute_noise(target_epsilon=1.0, epochs=20, learning_rate=0.5, l2_norm_clip=1.0,
                                 l2_regularization=0.01)
            opt = DecoupledL2DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=z,
                                                 l2_regularization=0.01, learning_rate=0.5)

        The calibration is remembered: when ``fit`` starts, the run it is about to train is
        checked to report at most ``target_epsilon`` after ``epochs`` epochs, and refused before
        any step (``ParameterError`` naming ``compute_noise`` and what differs) if it does not,
        e.g. for another learning rate or L2 term, or batches that turn out to be public.

        With ``sampling="reshuffle"`` and ``batch_size`` not dividing ``dataset_size``, declare
        the callback's ``last_batch`` (``"kept_own_size"`` for ``fit(x, y, shuffle=True)``,
        ``"dropped"`` for a :func:`~.data.batched_dataset`): the calibrated run depends on it.
        """
        last_batch = self.last_batch
        if last_batch is None:
            if self.sampling == RESHUFFLE and self.dataset_size % self.batch_size:
                raise ParameterError(
                    "last_batch",
                    f"the callback leaves it to the data, but the calibrated run depends on it ("
                    f"{self.dataset_size % self.batch_size} records left over per epoch): declare "
                    "last_batch='kept_own_size' for fit(x, y, shuffle=True) or 'dropped' for a batched_dataset",
                )
            last_batch = DROPPED
        settings = dict(
            sampling=self.sampling,
            learning_rate=learning_rate,
            l2_norm_clip=l2_norm_clip,
            geometry=self.declared_geometry,
            l2_regularization=l2_regularization,
            last_batch=last_batch,
            secret_batches=secret_batches,
            steps_per_epoch=self.epoch_steps,
        )
        z = compute_hidden_state_noise(
            self.dataset_size, self.batch_size, target_epsilon, epochs, self.delta, rel_tol=rel_tol, **settings
        )
        # the run as calibrated: at the core's noise, which TF-Privacy's float32 copy of z never undercuts
        run = planned_run(self.dataset_size, self.batch_size, epochs, z / FLOAT32_MARGIN, **settings)
        self.calibration = CalibratedRun(float(target_epsilon), int(epochs), z, run)
        return z

    def _check_calibration(self) -> None:
        """The run ``fit`` is about to train, as planned now, against :meth:`compute_noise`'s."""
        c = self.calibration
        steps = None if c is None else c.epochs * self.steps_per_epoch
        if c is None or steps < self.steps:
            return
        plan = self._upcoming(self.steps, steps)
        eps = self.recorder.report(self._delta(steps), plan=plan, warn=False).epsilon
        if eps <= c.target_epsilon:
            return
        diff = run_differences(self.recorder.run(plan=plan, warn=False), c.run)  # TF-Privacy's float32 z is >=
        raise ParameterError(
            "compute_noise",
            f"calibrated noise multiplier {c.noise_multiplier:.6g} for epsilon <= "
            f"{c.target_epsilon:g} after {c.epochs} epochs, but the run fit is about to train reports {eps:.4g} "
            f"({RELATION.name}) after them: it differs in {'; '.join(diff) or 'nothing the core reads'}. Calibrate "
            "with the optimizer's settings and the data fit trains on; no step was taken",
        )

    def run_event(self) -> TrainingRunDpEvent:
        """The core event for the steps taken so far (with the reason when no hidden-state
        analysis applies)."""
        if not self.steps:
            raise ValueError("no training step has been accounted yet")
        return self.recorder.run()

    def privacy_statement(self, include_analyses: bool = False) -> str:
        """The model-card text (see :func:`compute_hidden_state_privacy_statement`) for this run."""
        if not self.steps:
            raise ValueError("no training step has been accounted yet")
        return render_statement(
            self.recorder,
            self._delta(self.steps),  # as epsilon: less the chance that a padded balls_in_bins batch overflowed
            extra_notes=self._extra_notes(),
            include_analyses=include_analyses,
            host_paragraphs=host_paragraphs(self.recorder.claim.sampling),
        )

    # ----------------------------------------------------------------- resuming
    def privacy_state(self) -> Dict[str, Any]:
        """The callback's state in plain JSON types, sealed with a digest: the core's
        :class:`~hidden_state_accountants.checkpoint.RunState` (the claim with the batch schedule
        and its seed, the ledger, the largest feature norm of its steps) and the per-epoch history.
        It is what the model's checkpoints hold (as ``model.hidden_state_privacy``); keep it as
        private as the data (it holds the schedule's secret seed)."""
        if self._restored is not None:  # restored, not yet applied: that is the state
            run, history = self._restored
        else:
            if tf.executing_eagerly():  # SavedModel serialises in a graph: the steps recorded so far
                self._sync()
            run = None if self.recorder is None else RunState.of(self.recorder, subject=_SUBJECT)
            history = self.history
        return seal_run(run, fmt=_STATE_FORMAT, version=_STATE_VERSION, history=[_encode_epoch(h) for h in history])

    def load_privacy_state(self, state: Dict[str, Any]) -> None:
        """Loads a :meth:`privacy_state` (checked now; applied when ``fit`` starts, before
        any step, where it must account exactly the optimizer's steps).

        Raises :class:`ParameterError` (``checkpoint``, or the declaration's parameter) for a state
        that was edited after it was written, belongs to another kind of object or to a run of
        another schedule or geometry, or does not hold together.
        """
        self._restore_error = None
        self._restored = self._check_state(state)

    def _check_state(self, state) -> Tuple[Optional[RunState], List[EpochPrivacy]]:
        """The state's run (checked and replayed by the core) and history, after checking that the
        run is one of this callback's declaration."""
        run, extra = open_run(state, fmt=_STATE_FORMAT, version=_STATE_VERSION, subject=_SUBJECT, extra=("history",))
        if run is None:
            return None, []
        schedule = run.schedule
        declared = (self.sampling, self.dataset_size, self.batch_size)
        held = (
            (None, None, None) if schedule is None else (schedule.sampling, schedule.dataset_size, schedule.batch_size)
        )
        if held != declared:
            raise refusal(
                _SUBJECT,
                f"is a run of sampling={held[0]!r}, dataset_size={held[1]}, "
                f"batch_size={held[2]}, but this callback was declared with "
                f"sampling={declared[0]!r}, dataset_size={declared[1]}, batch_size={declared[2]}",
            )
        if self.last_batch is not None and schedule.last_batch != self.last_batch:
            raise refusal(
                _SUBJECT,
                f"is a run with last_batch={schedule.last_batch!r}, but this callback was "
                f"declared with last_batch={self.last_batch!r}",
            )
        check_continues(
            run.claim,
            geometry=self.declared_geometry,
            assume_convex_model=self.assume_convex_model,
            neighboring_relation=None,
        )
        if run.claim.relation()[0] != RELATION:
            raise refusal(
                _SUBJECT,
                f"is a run reported under {run.claim.relation()[0].name}; this callback reports {RELATION.name}",
            )
        try:
            history = [_decode_epoch(h) for h in extra["history"]]
        except (TypeError, ValueError, KeyError) as err:
            raise refusal(_SUBJECT, f"has an invalid history ({err!r})") from None
        return run, history

    def _restore_from_checkpoint(self, text: str) -> None:
        """Called by TensorFlow when a checkpoint is restored (errors are raised at the next
        hook, before any step, where Keras shows them)."""
        try:
            state = json.loads(text)
        except ValueError as err:
            self._restore_error = refusal(_SUBJECT, f"is not JSON ({err})")
            return
        except RecursionError:
            self._restore_error = refusal(_SUBJECT, "is JSON nested deeper than any state this callback writes")
            return
        try:
            self.load_privacy_state(state)
        except ParameterError as err:
            self._restored, self._restore_error = None, err

    def _raise_restore_error(self) -> None:
        err, self._restore_error = self._restore_error, None
        if err is not None:
            raise err

    # ----------------------------------------------------------------- internals
    def _declared_schedule(self, data_schedule: Optional[BatchSchedule]) -> BatchSchedule:
        """The data's schedule when it is the declared one (its seed, or the framework's draw
        and whether that is secret, are the data's), else the declared schedule for the core
        to compare with."""
        declared = (self.dataset_size, self.batch_size, self.sampling)
        if (
            data_schedule is not None
            and (data_schedule.dataset_size, data_schedule.batch_size, data_schedule.sampling) == declared
            and self.last_batch in (None, data_schedule.last_batch)
            and (self.sampling != BALLS_IN_BINS or self.steps_per_epoch == data_schedule.steps_per_epoch)
        ):
            return data_schedule
        return keras_schedule(*declared, last_batch=self.last_batch or DROPPED, steps_per_epoch=self.epoch_steps)

    def _read_learning_rate_source(self, opt) -> None:
        lr = opt._get_hyper("learning_rate")
        if isinstance(lr, tf.keras.optimizers.schedules.LearningRateSchedule):
            self._schedule, self._lr_marks = lr, []
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

    def _lr(self, step: int) -> float:
        """The step size the legacy optimizer uses at 0-based ``step`` (its ``_decayed_lr``)."""
        return self._lr_range(step, step + 1)[0]

    def _lr_range(self, start: int, stop: int) -> List[float]:
        """The step sizes of steps ``start .. stop - 1``, in the optimizer's float32 arithmetic."""
        if stop <= start:
            return []
        steps = np.arange(start, stop)
        if self._schedule is None:  # a variable rate: the value marked last before each step
            firsts = np.array([first for first, _ in self._lr_marks])
            values = np.array([value for _, value in self._lr_marks], dtype=np.float32)
            base = values[np.maximum(np.searchsorted(firsts, steps, side="right") - 1, 0)]
        else:
            base = self._schedule_values(start, stop)
        decay = self.settings.inverse_time_decay if self.settings else 0.0
        if decay > 0.0:
            base = base / (np.float32(1.0) + np.float32(decay) * steps.astype(np.float32))
        return base.astype(np.float32).tolist()

    def _schedule_values(self, start: int, stop: int) -> np.ndarray:
        """The schedule on a vector of steps if it supports that (most built-in schedules do,
        checked against scalar evaluation at both ends), else one call per step."""

        def at(step):
            return np.float32(self._schedule(tf.cast(step, tf.float32)).numpy())

        try:
            base = np.asarray(self._schedule(tf.range(start, stop, dtype=tf.float32)), dtype=np.float32)
            if base.shape == (stop - start,) and base[0] == at(start) and base[-1] == at(stop - 1):
                return base
        except Exception:  # noqa: BLE001 - fall back to one call per step
            pass
        return np.array([at(i) for i in range(start, stop)], dtype=np.float32)

    def _upcoming(self, start: int, stop: int) -> Iterable[Tuple[StepFacts, int]]:
        """``(facts, count)`` runs of the steps ``start .. stop - 1`` of this fit (a kept short batch
        with its own divisor where the core's :func:`~hidden_state_accountants.recording.batch_records`
        puts it)."""
        schedule = self.recorder.claim.schedule
        keys = zip(self._lr_range(start, stop), (batch_records(schedule, t) for t in range(start, stop)))
        return [
            (attr.evolve(self._facts[records], learning_rate=lr), len(list(group)))
            for (lr, records), group in itertools.groupby(keys)
        ]

    def _sync(self) -> None:
        """Records the steps the optimizer has taken since the last call."""
        if self.model is None or self.recorder is None:
            return
        for facts, count in self._upcoming(self.steps, int(self.model.optimizer.iterations.numpy())):
            self.recorder.record(facts, count)

    def _planned(self, steps: int) -> PrivacyReport:
        """The report the run would have after ``steps`` steps, the rest of them as planned now (the
        plan was checked in on_train_begin, so nothing warns twice)."""
        return self.recorder.report(self._delta(steps), plan=self._upcoming(self.steps, steps), warn=False)

    def _report(self) -> PrivacyReport:
        if self._report_steps != self.steps:
            self.report = self.recorder.report(self._delta(self.steps))
            self._report_steps = self.steps
        return self.report

    def _delta(self, steps: int) -> float:
        """The delta a run of ``steps`` steps is accounted at (:func:`~hidden_state_accountants.keras.data.
        accounted_delta`: less the chance that a padded balls-in-bins batch overflowed)."""
        return accounted_delta(self.delta, self.recorder.claim.schedule, steps)

    def _describe(self) -> str:
        s, schedule = self.settings, self.recorder.claim.schedule
        lr = f"schedule {type(self._schedule).__name__}" if self._schedule is not None else f"{self._lr_marks[-1][1]:g}"
        geom = self.geometry
        d = "None" if geom is None or geom.diameter is None else f"{geom.diameter:.4g}"
        g = "none (composition only)" if geom is None else f"m={geom.strong_convexity:g}, M={geom.smoothness:g}, D={d}"
        budget = f", target_epsilon={self.target_epsilon:g}" if self.target_epsilon is not None else ""
        replicas = f" on {self.replicas} replicas" if self.replicas > 1 else ""
        if schedule.last_batch != DROPPED:
            left = f"a short batch of {self.dataset_size % self.batch_size} records kept ({schedule.last_batch})"
        else:
            left = f"{schedule.dropped_per_epoch} records dropped per epoch"
        drawn = ""
        if schedule.external:
            drawn = ", drawn by Keras" + ("" if schedule.secret else ", public")
        return (
            f"HiddenStatePrivacyCallback: {s.name}{replicas} z={s.noise_multiplier:g} C={s.l2_norm_clip:g} lr={lr} "
            f"l2={s.l2_regularization:g}; n={self.dataset_size} b={self.batch_size} sampling={self.sampling}"
            f"{drawn} ({self.steps_per_epoch} steps/epoch, {left}); "
            f"geometry: {g}; delta={self.delta:g} ({RELATION.name}){budget}"
        )


def _encode_epoch(h: EpochPrivacy) -> Dict[str, Any]:
    out = asdict(h)
    for key in ("epsilon", "epsilon_composition"):  # JSON has no infinity
        out[key] = out[key] if math.isfinite(out[key]) else repr(out[key])
    return out


def _decode_epoch(d: Dict[str, Any]) -> EpochPrivacy:
    if not isinstance(d, dict) or set(d) != {f for f in EpochPrivacy.__dataclass_fields__}:
        raise ValueError(f"an epoch must be a dict of {sorted(EpochPrivacy.__dataclass_fields__)}, got {d!r}")
    if not all(isinstance(d[k], int) and not isinstance(d[k], bool) and d[k] >= 0 for k in ("epoch", "steps")):
        raise ValueError(f"epoch and steps must be integers >= 0, got {d!r}")
    eps = {k: float(d[k]) for k in ("epsilon", "epsilon_composition")}
    return EpochPrivacy(epoch=d["epoch"], steps=d["steps"], analysis=str(d["analysis"]), **eps)


class _CheckpointedState(tf.train.experimental.PythonState):
    """The callback's state as a checkpointable object (JSON of :meth:`privacy_state`)."""

    def __init__(self, callback: HiddenStatePrivacyCallback):
        super().__init__()
        self._callback = callback

    def serialize(self) -> str:
        return json.dumps(self._callback.privacy_state(), sort_keys=True)

    def deserialize(self, string_value) -> None:
        if hasattr(string_value, "numpy"):
            string_value = string_value.numpy()
        if isinstance(string_value, bytes):
            string_value = string_value.decode("utf-8", errors="replace")
        self._callback._restore_from_checkpoint(string_value)


_CROSS_ENTROPIES = (
    tf.keras.losses.SparseCategoricalCrossentropy,
    tf.keras.losses.CategoricalCrossentropy,
    tf.keras.losses.BinaryCrossentropy,
)


def _loss_facts(model, data: FitData) -> Tuple[str, str]:
    """``(kind, description)`` of the loss ``fit`` minimises, the core ``Claim``'s ``loss``:
    :data:`~hidden_state_accountants.events.CROSS_ENTROPY_ON_LOGITS` for one Keras cross-entropy
    on logits, unweighted (for ``CategoricalCrossentropy`` only on labels whose rows sum to at most 1:
    its Hessian is the softmax Hessian times that sum; ``BinaryCrossentropy`` only on one logit), else
    ``"other"``."""
    losses = [x for x in tf.nest.flatten(getattr(model, "loss", None)) if x is not None]
    if len(losses) != 1:
        return "other", f"{len(losses)} losses in model.loss"
    loss = losses[0]
    name = type(loss).__name__ if isinstance(loss, tf.keras.losses.Loss) else repr(getattr(loss, "__name__", loss))
    if type(loss) not in _CROSS_ENTROPIES:
        return "other", f"the loss {name} in model.loss"
    config = loss.get_config()
    shown = f"{name}(from_logits={config.get('from_logits')}) in model.loss"
    if config.get("from_logits") is not True:
        return "other", (
            f"{shown}, which expects probabilities rather than the logits of a Dense layer without activation,"
        )
    if config.get("axis", -1) != -1:
        return "other", f"{shown} over axis {config['axis']}"
    target = trainable_dense(model)
    if type(loss) is tf.keras.losses.BinaryCrossentropy and target is not None and int(target.units) > 1:
        return "other", (
            f"{shown} on {target.units} logits (multi-label: one binary loss per logit; the geometry covers "
            "a softmax over the classes, or one sigmoid logit)"
        )
    loss_weights = getattr(getattr(model, "compiled_loss", None), "_user_loss_weights", None)
    if loss_weights is not None and any(float(w) != 1.0 for w in tf.nest.flatten(loss_weights)):
        return "other", f"{shown} weighted by compile(loss_weights={loss_weights!r})"
    if data.weights:
        return "other", f"{shown} weighted by the {data.weights}"
    if type(loss) is tf.keras.losses.CategoricalCrossentropy:
        if data.labels is None:
            return "other", f"{shown} on labels that could not be read (its smoothness grows with their sum)"
        labels = np.asarray(data.labels)
        sums = labels.reshape(len(labels), -1).astype(np.float64).sum(axis=1) if len(labels) else np.zeros(1)
        if not (np.all(sums >= 0) and np.all(sums <= 1)):
            return "other", (
                f"{shown} on labels whose rows sum to {sums.min():.6g}..{sums.max():.6g} (the "
                "smoothness (R^2 + 1)/2 holds for rows of non-negative sum at most 1, e.g. one-hot)"
            )
    return CROSS_ENTROPY_ON_LOGITS, f"{shown}, unweighted"


def _check_loss(model) -> None:
    """TF-Privacy clips per example only when the loss has one value per example."""
    for item in tf.nest.flatten(getattr(model, "loss", None)):
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
