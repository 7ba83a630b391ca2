"""``PrivacyEngine(accountant="hidden_state")``: Opacus accounting by the core's best valid bound.

The accountant is an Opacus ``IAccountant`` and only reads: at every optimizer step it reads
what the DP optimizer did into the core's :class:`~hidden_state_accountants.recording.StepFacts`
and hands them to a :class:`~hidden_state_accountants.recording.RunRecorder`, which decides
what they back (the policy is stated once, in :mod:`hidden_state_accountants.recording`):

* contradictions known before training (momentum, Adam, per-layer clipping or ``sum``
  reduction with a declared geometry; ``learning_rate >= 2/smoothness``; ``strong_convexity``
  above ``weight_decay``; a model that is not one linear map of its features) raise
  :class:`~hidden_state_accountants.ParameterError` at :meth:`~OpacusHiddenStateAccountant.configure`
  (when given the optimizer) or at the first step;
* changes during training (lr, noise, clip norm, ``weight_decay``, projection) fall back to
  composition, with one :class:`~hidden_state_accountants.recording.CompositionFallbackWarning`
  per reason and the reason in :meth:`~OpacusHiddenStateAccountant.explain`'s notes;
* without :meth:`~OpacusHiddenStateAccountant.configure`, the composition bound of Opacus'
  Poisson sampling at Opacus' exact sample rate.

``get_epsilon`` is exactly :class:`~hidden_state_accountants.HiddenStateAccountant`'s number for
the recorder's event, under Opacus' own convention ADD_OR_REMOVE_ONE by default (so that on the
same run its composition number equals Opacus' RDP/PRV accountants), or the relation given with
``neighboring_relation``. The package's fixed-size samplers are not covered under
ADD_OR_REMOVE_ONE (an added record displaces others); with them the default reports REPLACE_ONE
and says so in the notes. Every report names its relation.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import attr
from opacus import PrivacyEngine
from opacus.accountants.accountant import IAccountant
from opacus.optimizers import DPOptimizer

from hidden_state_accountants import HiddenStateAccountant, LossGeometry, PrivacyReport, TrainingRunDpEvent
from hidden_state_accountants import validation as v
from hidden_state_accountants.checkpoint import RunState, open_run, refusal, seal_run
from hidden_state_accountants.recording import (
    BatchSourceFacts,
    ModelFacts,
    RunRecorder,
    StepFacts,
    check_batch_source,
    check_position,
)
from hidden_state_accountants.relations import (
    ADD_OR_REMOVE_ONE,
    REPLACE_ONE,
    NeighborRel,
    parse_relation,
    schedule_reason,
)
from hidden_state_accountants.schedules import POISSON, BatchSchedule

from .facts import (
    LOSS_UNSEEN,
    feature_monitor,
    loader_facts,
    model_facts,
    optimizer_facts,
    step_facts,
    step_values,
)
from .samplers import HiddenStateBatchSampler, sampler_from_state_dict

__all__ = ["OpacusHiddenStateAccountant", "HiddenStateCalibration", "CalibrationClaim", "MECHANISM",
           "sampler_from_checkpoint", "resolve_relation"]

MECHANISM = "hidden_state"
STATE_VERSION = 5  # 4: the core's RunState (checkpoint module), bound to the model weights saved with it;
# 5: the model's feature clip in the claim (and the geometry's feature bound and loss)
_CALIBRATION_KWARG = "hidden_state_calibration"
_KEEP: Any = object()  # configure(neighboring_relation=...) omitted: keep the relation set so far
_HINTS = {
    "data_loader": "build the loader as DataLoader(dataset, batch_sampler=sampler) and pass "
                   "poisson_sampling=False to make_private",
    "batch_size": "Opacus divides by expected_batch_size = int(n / len(data_loader)); pass optimizer=... to "
                  "configure(), which sets it to the sampler's batch size",
    "feature_norm_bound": "hso.FeatureClip(R) right before the trainable nn.Linear enforces the bound (read from "
                          "the model's structure at configure); without it, configure(model=...) checks the inputs "
                          "of every batch",
}


def resolve_relation(explicit: Optional[NeighborRel], sampling: str) -> Tuple[NeighborRel, Optional[str]]:
    """The relation the accountant reports a run of ``sampling`` under, and why it is not Opacus'
    ADD_OR_REMOVE_ONE when it is not: ``explicit`` if given, else ADD_OR_REMOVE_ONE wherever the
    schedule is covered under it and REPLACE_ONE otherwise (this package's fixed-size samplers)."""
    if explicit is not None:
        return explicit, None
    reason = schedule_reason(ADD_OR_REMOVE_ONE, sampling)
    if reason:
        return REPLACE_ONE, (f"reported under REPLACE_ONE, not Opacus' ADD_OR_REMOVE_ONE: the {sampling} schedule "
                             f"is {reason}")
    return ADD_OR_REMOVE_ONE, None


@dataclass(frozen=True)
class CalibrationClaim:
    """What a calibrated noise multiplier was calibrated for: everything the accountant's epsilon
    depends on besides the step (noise, rate, learning rate, clip norm, L2, projection).

    ``schedule`` ``None`` is Opacus' Poisson loader; ``dataset_size`` counts only there and with
    a geometry (the Poisson hidden-state analyses read ``n``). A fresh, unconfigured accountant,
    the one Opacus' ``get_noise_multiplier`` builds by name, claims :data:`DEFAULT_CLAIM`.
    """

    relation: NeighborRel
    schedule: Optional[BatchSchedule]
    geometry: Optional[LossGeometry]
    assume_convex_model: bool = False
    gaussian_initialization: bool = False
    dataset_size: Optional[int] = None

    def describe(self) -> str:
        if self.schedule is None:
            batches = "Opacus' Poisson sampling"
            if self.geometry is not None:
                batches += f" of n={self.dataset_size} records"
        else:
            batches = f"the {self.schedule!r}"
        what = "composition only" if self.geometry is None else f"the declared {self.geometry}"
        flags = [f for f in ("assume_convex_model", "gaussian_initialization") if getattr(self, f)]
        return f"{batches}, {what}{''.join(f', {f}' for f in flags)}, under {self.relation.name}"


DEFAULT_CLAIM = CalibrationClaim(relation=ADD_OR_REMOVE_ONE, schedule=None, geometry=None)


@dataclass(frozen=True)
class HiddenStateCalibration:
    """The configuration Opacus' calibration call cannot see (made by
    :meth:`OpacusHiddenStateAccountant.calibration_kwargs`): the claim, the relation, and the
    planned step (its noise multiplier is what Opacus searches for; with Opacus' Poisson loader
    its divisor is Opacus' ``int(n / len(data_loader))``, known once the rate is)."""

    schedule: Optional[BatchSchedule]
    geometry: Optional[LossGeometry]
    model: Optional[ModelFacts]
    assume_convex_model: bool
    gaussian_initialization: bool
    step: StepFacts
    neighboring_relation: Optional[NeighborRel] = None  # None: the accountant's default rule
    dataset_size: Optional[int] = None  # n of Opacus' Poisson loader (needed with a geometry)

    def recorder(self) -> RunRecorder:
        return RunRecorder(schedule=self.schedule, geometry=self.geometry, model=self.model,
                           assume_convex_model=self.assume_convex_model,
                           gaussian_initialization=self.gaussian_initialization,
                           dataset_size=self.dataset_size if self.schedule is None else None, planned=True)

    @property
    def claim(self) -> CalibrationClaim:
        return _claim(self.neighboring_relation, self.schedule, self.geometry, self.assume_convex_model,
                      self.gaussian_initialization, self.dataset_size)


def _claim(explicit, schedule, geometry, assume_convex_model, gaussian_initialization,
           dataset_size) -> CalibrationClaim:
    relation, _ = resolve_relation(explicit, POISSON if schedule is None else schedule.sampling)
    return CalibrationClaim(relation=relation, schedule=schedule, geometry=geometry,
                            assume_convex_model=assume_convex_model and geometry is not None,
                            gaussian_initialization=gaussian_initialization and geometry is not None,
                            dataset_size=dataset_size if schedule is None and geometry is not None else None)


class _Mechanism:
    """``mechanism()``, Opacus' name of the accountant, on the class as on an instance. Called on
    a configured accountant by ``PrivacyEngine.make_private_with_epsilon`` (the only place where
    Opacus calls it on an instance), it first checks that the calibration Opacus is about to run
    calibrates this accountant's claim (:meth:`OpacusHiddenStateAccountant._check_calibration_call`)."""

    def __get__(self, obj, cls=None):
        if obj is None:
            return _mechanism

        def mechanism() -> str:
            frame = sys._getframe(1)
            try:
                obj._check_calibration_call(frame)
            finally:
                del frame
            return MECHANISM

        return mechanism


def _mechanism() -> str:
    return MECHANISM


class OpacusHiddenStateAccountant(IAccountant):
    """Opacus accountant reporting the core's hidden-state (last-iterate) bound.

    Registered as ``"hidden_state"`` when :mod:`hidden_state_accountants.opacus` is imported::

        engine = PrivacyEngine(accountant="hidden_state")
        model, optimizer, loader = engine.make_private(..., poisson_sampling=False)
        engine.accountant.configure(geometry=..., sampler=sampler, model=model, optimizer=optimizer)

    ``get_epsilon(delta)`` equals ``HiddenStateAccountant(neighboring_relation=self.relation())
    .compose(self.training_run()).get_epsilon(delta)``.

    Args:
      neighboring_relation: ``None`` (default): Opacus' ADD_OR_REMOVE_ONE wherever the run's
        schedule is covered under it (Opacus' Poisson loader, full batch), REPLACE_ONE with a note
        for this package's fixed-size samplers. ``"REPLACE_ONE"`` / ``"ADD_OR_REMOVE_ONE"``
        (or dp_accounting's ``NeighboringRelation``): that relation, whatever the schedule.
        ``configure(neighboring_relation=...)`` sets it too.

    With Opacus' default Poisson loader (no sampler), ``configure(geometry=..., model=...,
    optimizer=..., dataset_size=len(dataset))`` enables the Poisson hidden-state analyses (the
    weight decay must be declared in the geometry and be positive, or a diameter projected onto).
    """

    def __init__(self, neighboring_relation=None) -> None:
        self.neighboring_relation = None if neighboring_relation is None else parse_relation(neighboring_relation)
        self.dataset_size: Optional[int] = None
        self.geometry: Optional[LossGeometry] = None
        self.sampler: Optional[HiddenStateBatchSampler] = None
        self.loader_schedule: Optional[BatchSchedule] = None  # DataLoader(shuffle=True): torch draws it
        self.model: Optional[ModelFacts] = None
        self.assume_convex_model = False
        self.gaussian_initialization = False
        self._recorder = RunRecorder(schedule=None)
        self._facts: Tuple[Any, Optional[StepFacts]] = (None, None)  # the last step read, by its raw values
        self._cache: Tuple[Any, Optional[PrivacyReport]] = (None, None)
        # the claim make_private_with_epsilon is calibrating for (set by mechanism(), moved to
        # _calibrated_claim by get_optimizer_hook_fn once make_private builds the optimizer)
        self._pending_claim: Optional[CalibrationClaim] = None
        self._calibrated_claim: Optional[CalibrationClaim] = None
        self._features = None  # a FeatureNormMonitor when the feature bound is checked per batch

    # ------------------------------------------------------------------- IAccountant
    mechanism = _Mechanism()

    def __len__(self) -> int:
        return self._recorder.steps

    @property
    def history(self) -> List[Tuple[float, float, int]]:
        """Opacus' view of the ledger: ``(noise_multiplier, sample_rate, steps)`` runs."""
        return _history(self._recorder)

    @history.setter
    def history(self, value) -> None:
        """Replaces the ledger by steps known only by noise and rate, as Opacus' own accountants
        take it (e.g. ``get_noise_multiplier``'s hypothetical runs); :meth:`step` continues it."""
        self._recorder.reset()
        for z, q, steps in value or ():
            if int(steps) > 0:
                self._recorder.record(StepFacts(noise_multiplier=z, sample_rate=q), int(steps))

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Records a step known only by its noise and sample rate (no optimizer to read: the
        learning rate and clip norm are unknown, so only composition covers it)."""
        self._recorder.record(StepFacts(noise_multiplier=noise_multiplier, sample_rate=sample_rate))

    def get_optimizer_hook_fn(self, sample_rate: float):
        # make_private builds the optimizer: with the noise calibrated for the pending claim, or
        # (plain make_private) with the user's own noise
        self._calibrated_claim, self._pending_claim = self._pending_claim, None

        def hook_fn(optim: DPOptimizer) -> None:
            self._record(optim, sample_rate)

        hook_fn.accountant, hook_fn.sample_rate = self, sample_rate  # read back by configure()
        return hook_fn

    def get_epsilon(self, delta: float, *args, **kwargs) -> float:
        """Best valid epsilon at ``delta`` under :meth:`relation`; see :meth:`explain`."""
        return self.explain(delta, **kwargs).epsilon

    # ------------------------------------------------------------------ configuration
    def configure(
        self,
        *,
        geometry: Optional[LossGeometry] = None,
        sampler: Optional[HiddenStateBatchSampler] = None,
        model=None,
        optimizer: Optional[DPOptimizer] = None,
        assume_convex_model: bool = False,
        gaussian_initialization: bool = False,
        data_loader=None,
        dataset_size: Optional[int] = None,
        neighboring_relation: Any = _KEEP,
    ) -> "OpacusHiddenStateAccountant":
        """Declares what Opacus cannot see; call before training (and before loading a checkpoint).

        Args:
          geometry: the :class:`LossGeometry` of the per-example map ``clip_C(grad l_i) + m*theta``
            (e.g. ``ProjectionHook.logistic_regression_geometry``); ``None``: composition only.
          sampler: the batch sampler the ``DataLoader`` draws from (``batch_sampler=sampler``,
            ``make_private(..., poisson_sampling=False)``); needed for any hidden-state claim.
          model: the trained ``nn.Module`` (``GradSampleModule``/DDP wrappers are unwrapped); a
            geometry is accepted only for one linear layer of fixed features, which the core
            checks from the model's structure.
          optimizer: the ``DPOptimizer`` returned by ``make_private`` (recommended): its setup is
            checked now instead of at the first step, and its ``expected_batch_size`` is set to
            the sampler's batch size per rank (Opacus' own, ``int(n / len(loader))``, differs
            when ``b`` does not divide ``n``).
          assume_convex_model: accept the geometry for any model on your word that the loss is
            convex in the trainable parameters (the report says so).
          gaussian_initialization: declares Chourasia et al.'s initialisation (see the core).
          data_loader: instead of ``sampler``, the ``DataLoader`` itself: one over a sampler of
            this package, or a plain ``DataLoader(dataset, batch_size=b, shuffle=True,
            drop_last=...)``, recognised as ``sampling="reshuffle"`` drawn by torch (a kept short
            batch is divided by ``b``; its randomness counts as secret only after
            :func:`~.samplers.secret_shuffle`, see :func:`~.facts.loader_facts`). One process only.
          dataset_size: ``len(dataset)``; with Opacus' Poisson loader (no sampler) a geometry needs it
            (the Poisson hidden-state analyses cap the other records' batch size, whose law depends
            on ``n``; the divisor is the optimizer's ``expected_batch_size``).
          neighboring_relation: the relation every number is reported (and calibrated) under:
            ``"REPLACE_ONE"`` or ``"ADD_OR_REMOVE_ONE"`` (or dp_accounting's ``NeighboringRelation``);
            ``None``: the default (Opacus' ADD_OR_REMOVE_ONE where the schedule is covered under it,
            REPLACE_ONE with a note for this package's fixed-size samplers); omitted: the relation
            set so far (by the constructor or an earlier ``configure``).

        Calibration: configure *before* ``make_private_with_epsilon`` and pass it
        ``**engine.accountant.calibration_kwargs(...)``; a call without them on a configured
        accountant is refused, and so is a ``configure`` after it that changes the claim the
        noise was calibrated for (see :meth:`calibration_kwargs`).

        >>> from hidden_state_accountants.opacus import CyclicBatchSampler
        >>> acc = OpacusHiddenStateAccountant().configure(sampler=CyclicBatchSampler(100, 10))
        >>> acc.sampler.sampling, len(acc)
        ('cyclic', 0)
        """
        if len(self):
            raise v.ParameterError("configure", f"called after {len(self)} steps; configure before training")
        explicit = self.neighboring_relation
        if neighboring_relation is not _KEEP:
            explicit = None if neighboring_relation is None else parse_relation(neighboring_relation)
        if sampler is not None and not isinstance(sampler, HiddenStateBatchSampler):
            raise v.ParameterError(
                "sampler", f"must be a sampler of hidden_state_accountants.opacus, got {type(sampler).__name__} "
                "(for DataLoader(shuffle=True) pass the loader as data_loader=...)")
        loader_schedule = None
        if data_loader is not None:
            if sampler is not None:
                raise v.ParameterError("data_loader", "give the sampler or the data loader, not both")
            source = loader_facts(data_loader)
            if isinstance(data_loader.batch_sampler, HiddenStateBatchSampler):
                sampler = data_loader.batch_sampler
            elif source.schedule is None:
                raise v.ParameterError(
                    "data_loader", f"its batches follow no schedule of this package ({source.description}); use "
                    "DataLoader(dataset, batch_size=b, shuffle=True) or batch_sampler=<a sampler of this package>, "
                    "and make_private(..., poisson_sampling=False)")
            else:
                check_batch_source(source.schedule, source)  # e.g. one permutation per rank is refused
                loader_schedule = source.schedule
        schedule = sampler.schedule if sampler is not None else loader_schedule
        facts = None if model is None else model_facts(model)
        recorder = RunRecorder(schedule=schedule, geometry=geometry,
                               model=facts, assume_convex_model=assume_convex_model,
                               gaussian_initialization=gaussian_initialization,
                               dataset_size=dataset_size if schedule is None else None)
        if optimizer is not None:
            hook = getattr(optimizer, "step_hook", None)
            if not isinstance(optimizer, DPOptimizer) or getattr(hook, "accountant", None) is not self:
                raise v.ParameterError("optimizer", "must be the DPOptimizer that this accountant's PrivacyEngine."
                                       "make_private returned (its steps are recorded here)")
            if schedule is not None:
                # Opacus' sample rate is 1 / len(data_loader): the loader must run the schedule's epoch
                check_batch_source(schedule, BatchSourceFacts(
                    schedule=schedule, description="Opacus' data loader",
                    steps_per_epoch=round(1 / hook.sample_rate)))
                optimizer.expected_batch_size = schedule.batch_size / getattr(optimizer, "world_size", 1)
            recorder.check(step_facts(optimizer, hook.sample_rate, accumulation=1))
        claim = _claim(explicit, schedule, geometry, assume_convex_model, gaussian_initialization,
                       recorder.dataset_size)
        calibrated = self._calibrated_claim
        if calibrated is not None and claim != calibrated:
            raise v.ParameterError(
                "configure", f"make_private_with_epsilon calibrated the noise multiplier for {calibrated.describe()}; "
                f"this configuration claims {claim.describe()}, so the run would not meet its target. Configure the "
                "accountant before make_private_with_epsilon and pass it **engine.accountant.calibration_kwargs("
                "optimizer=..., max_grad_norm=...), or use make_private with a noise_multiplier of your own")
        self.neighboring_relation = explicit
        self.geometry, self.sampler, self.model = geometry, sampler, facts
        self.loader_schedule = loader_schedule
        self.assume_convex_model, self.gaussian_initialization = assume_convex_model, gaussian_initialization
        self.dataset_size = recorder.dataset_size
        self._recorder = recorder
        self._features = feature_monitor(model, recorder, self._features)
        return self

    @property
    def schedule(self) -> Optional[BatchSchedule]:
        """The batch schedule accounted: the sampler's, the recognised loader's, or ``None`` (Poisson)."""
        return self.sampler.schedule if self.sampler is not None else self.loader_schedule

    def relation(self, run: Optional[TrainingRunDpEvent] = None):
        """The neighbouring relation the numbers are reported under (see the class docstring), and
        the note saying why it is not the default ADD_OR_REMOVE_ONE, if it is not."""
        schedule = self.schedule
        sampling = run.sampling if run is not None else (POISSON if schedule is None else schedule.sampling)
        return resolve_relation(self.neighboring_relation, sampling)

    @property
    def claim(self) -> CalibrationClaim:
        """What this accountant's numbers claim, besides the steps: what a noise multiplier is
        calibrated for."""
        return _claim(self.neighboring_relation, self.schedule, self.geometry, self.assume_convex_model,
                      self.gaussian_initialization, self.dataset_size)

    def calibration_kwargs(self, *, optimizer, max_grad_norm: float) -> Dict[str, HiddenStateCalibration]:
        """Keyword arguments that carry this configuration into ``make_private_with_epsilon``.

        Opacus calibrates with a *fresh* accountant built by name (``get_noise_multiplier(...,
        accountant="hidden_state")``), which knows nothing of this one; it forwards extra keyword
        arguments of ``make_private_with_epsilon`` to that accountant's ``get_epsilon`` (and to
        the DP optimizer, which ignores them). So: configure first, then pass these::

            engine.accountant.configure(geometry=geometry, sampler=sampler, model=model)
            model, optimizer, loader = engine.make_private_with_epsilon(
                module=model, optimizer=optimizer, data_loader=loader, target_epsilon=1.0,
                target_delta=1e-5, epochs=20, max_grad_norm=1.0, poisson_sampling=False,
                **engine.accountant.calibration_kwargs(optimizer=optimizer, max_grad_norm=1.0))
            engine.accountant.configure(geometry=geometry, sampler=sampler, model=model, optimizer=optimizer)

        The calibrated run then reports at most the target after the planned epochs, under the
        configured relation, with the smallest noise the best valid analysis allows (within
        Opacus' ``epsilon_tolerance``, 0.01 unless passed to ``make_private_with_epsilon``). It
        works on every path the accountant accepts: this package's samplers, a
        ``DataLoader(shuffle=True)`` (``configure(data_loader=...)``), and Opacus' Poisson
        loader (with ``configure(geometry=..., model=..., dataset_size=len(dataset))`` the
        Poisson hidden-state analyses, whose divisor is Opacus' ``int(n / len(data_loader))``).

        ``optimizer`` is the base optimizer; its learning rate, ``weight_decay`` and momentum
        are read now and checked against the claim. A declared diameter is taken as the
        projection to come (the training run is checked for it).

        Raises:
          ParameterError: what the core finds wrong with the planned step for the claim
            (``momentum``, ``learning_rate``, ``geometry``...), or ``neighboring_relation`` when
            no analysis of the schedule holds under the configured relation.
        """
        schedule = self.schedule
        relation, _ = self.relation()
        sampling = POISSON if schedule is None else schedule.sampling
        reason = schedule_reason(relation, sampling)
        if reason:
            raise v.ParameterError("neighboring_relation", f"nothing to calibrate for: no analysis of the {sampling} "
                                                           f"schedule holds under {relation.name} ({reason})")
        base = optimizer.original_optimizer if isinstance(optimizer, DPOptimizer) else optimizer
        step = StepFacts(noise_multiplier=0.0, clip_norm=v.positive_float("max_grad_norm", max_grad_norm),
                         divisor=None if schedule is None else schedule.batch_size,
                         projection_diameter=None if self.geometry is None else self.geometry.diameter,
                         **optimizer_facts(base))
        spec = HiddenStateCalibration(schedule=schedule, geometry=self.geometry, model=self.model,
                                      assume_convex_model=self.assume_convex_model,
                                      gaussian_initialization=self.gaussian_initialization, step=step,
                                      neighboring_relation=self.neighboring_relation,
                                      dataset_size=self.dataset_size if schedule is None else None)
        # contradictions surface now, not inside Opacus' search (Poisson: at a whole-number divisor)
        spec.recorder().check(step if schedule is not None else attr.evolve(step, sample_rate=0.5, divisor=1))
        return {_CALIBRATION_KWARG: spec}

    def _check_calibration_call(self, frame) -> None:
        """Called by :attr:`mechanism` with its caller's frame. When the caller is Opacus'
        ``make_private_with_epsilon``, about to calibrate with a fresh accountant: refuses a call
        that would calibrate another claim than this accountant's (no :meth:`calibration_kwargs`
        on a configured accountant, or ones made for another configuration), and remembers the
        claim, which a later :meth:`configure` must keep."""
        engine = frame.f_locals.get("self") if frame.f_code.co_name == "make_private_with_epsilon" else None
        if not isinstance(engine, PrivacyEngine) or engine.accountant is not self:
            return
        kwargs = frame.f_locals.get("kwargs")
        spec = kwargs.get(_CALIBRATION_KWARG) if isinstance(kwargs, dict) else None
        claim = self.claim
        loader = frame.f_locals.get("data_loader")
        n = len(loader.dataset) if claim.dataset_size is not None and hasattr(loader, "dataset") else None
        if n is not None and n != claim.dataset_size:  # Opacus divides by int(len(dataset) / len(data_loader))
            raise v.ParameterError(
                "dataset_size", f"the accountant is configured with dataset_size={claim.dataset_size}, but the data "
                f"loader's dataset has {n} records; configure dataset_size=len(dataset)")
        if spec is None and claim != DEFAULT_CLAIM:
            raise v.ParameterError(
                "calibration_kwargs", f"make_private_with_epsilon calibrates with a fresh accountant, which knows "
                f"only {DEFAULT_CLAIM.describe()}, but this accountant claims {claim.describe()}; pass "
                "**engine.accountant.calibration_kwargs(optimizer=optimizer, max_grad_norm=...) to "
                "make_private_with_epsilon")
        if spec is not None:
            if not isinstance(spec, HiddenStateCalibration):
                raise v.ParameterError(_CALIBRATION_KWARG, f"must come from calibration_kwargs(), got {spec!r}")
            if spec.claim != claim:
                raise v.ParameterError(
                    "calibration_kwargs", f"were made for {spec.claim.describe()}, but the accountant now claims "
                    f"{claim.describe()}; call calibration_kwargs() after the last configure()")
        self._pending_claim = claim

    # ---------------------------------------------------------------------- recording
    def _record(self, optim: DPOptimizer, sample_rate: float) -> None:
        try:
            if self.sampler is not None:
                check_position(self.sampler.position, len(self) + 1, f"the configured {type(self.sampler).__name__}")
            if self._features is not None:  # the batch's inputs, before the base optimizer's step
                largest = self._features.take(int(getattr(optim, "world_size", 1)))
                if largest is not None:
                    self._recorder.check_feature_norm(largest, f"the batch of step {len(self)}")
            self._recorder.record(self._read(optim, sample_rate))
        except v.ParameterError as err:  # the core's refusal, with how to fix it in Opacus
            if err.parameter not in _HINTS:
                raise
            raise v.ParameterError(err.parameter, f"{err.reason}; {_HINTS[err.parameter]}") from None

    def _read(self, optim: DPOptimizer, sample_rate: float) -> StepFacts:
        """:func:`step_facts`, built again only when a value changed (it runs at every step)."""
        values = step_values(optim, sample_rate)
        if values != self._facts[0]:
            self._facts = (values, StepFacts(**values))
        return self._facts[1]

    # ----------------------------------------------------------------------- the run
    def _run_recorder(self, spec: Optional[HiddenStateCalibration]) -> RunRecorder:
        """The recorder to account: this one, or, for Opacus' calibration, the hypothetical run
        ``[(sigma, sample_rate, steps)]`` it wrote into :attr:`history`, under ``spec``."""
        if spec is None:
            return self._recorder
        if not isinstance(spec, HiddenStateCalibration):
            raise v.ParameterError(_CALIBRATION_KWARG, f"must come from calibration_kwargs(), got {spec!r}")
        if len(self.history) != 1:
            raise v.ParameterError("history", "calibration expects one (noise, sample_rate, steps) entry")
        z, q, steps = self.history[0]
        s = spec.schedule
        step = attr.evolve(spec.step, noise_multiplier=z, sample_rate=q)
        if s is None:  # Opacus' Poisson loader: an epoch is len(data_loader) = 1/q steps
            steps_per_epoch = round(1 / q)
            if spec.dataset_size is not None:  # Opacus' expected_batch_size, computed as make_private does
                step = attr.evolve(step, divisor=int(spec.dataset_size * q))
        else:
            check_batch_source(s, BatchSourceFacts(schedule=s, description="Opacus' data loader",
                                                   steps_per_epoch=round(1 / q)))
            steps_per_epoch = s.steps_per_epoch
        epochs = steps * q  # Opacus' int(epochs / sample_rate) can land one step short of whole epochs
        if abs(epochs - round(epochs)) < 1e-6:
            steps = max(steps, round(epochs) * steps_per_epoch)
        recorder = spec.recorder()
        recorder.record(step, steps)
        return recorder

    def training_run(self) -> TrainingRunDpEvent:
        """The core event for the steps recorded so far (what :meth:`get_epsilon` accounts)."""
        return self._recorder.run(warn=False)

    def explain(self, delta: float, **kwargs) -> PrivacyReport:
        """The core's report: every analysis with its epsilon or why it does not apply, the
        reasons for a composition fallback and the recorder's notes."""
        spec = kwargs.pop(_CALIBRATION_KWARG, None)
        recorder = self._run_recorder(spec)
        if not recorder.steps:
            return HiddenStateAccountant(neighboring_relation=self.relation()[0]).explain(delta)  # no steps: epsilon 0
        run = recorder.run(warn=spec is None)  # the recorder warns once per reason
        # Opacus' calibration: the relation of the configuration it calibrates for
        relation, note = (self.relation(run) if spec is None else
                          resolve_relation(spec.neighboring_relation, run.sampling))
        key = (run, float(delta), relation)
        if self._cache[0] != key:
            report = HiddenStateAccountant(neighboring_relation=relation).compose(run).explain(delta)
            report.notes.extend(recorder.notes() + ([note] if note else []))
            self._cache = (key, report)
        return self._cache[1]

    def composition_epsilon(self, delta: float) -> float:
        """The best composition bound for the same run (valid even if every iterate is released)."""
        return self.explain(delta).composition_epsilon

    # -------------------------------------------------------------------- checkpoints
    def state_dict(self, destination=None, *, weights_digest: Optional[str] = None):
        """Opacus' ``history`` and, under ``"hidden_state"``, the core's sealed
        :class:`~hidden_state_accountants.checkpoint.RunState` (ledger, configuration, the
        sampler's schedule with its seed) and the sampler's class, in plain Python types
        (``torch.save``-able). It holds the sampler's seed: keep it as private as the data.

        ``weights_digest`` (:func:`~hidden_state_accountants.checkpoint.weights_digest` of the
        module state saved next to it) binds the state to those weights;
        ``PrivacyEngine.save_checkpoint`` passes it, and ``load_checkpoint`` refuses the state
        next to other weights."""
        out = {} if destination is None else destination
        out["mechanism"] = self.mechanism()
        out["history"] = self.history
        run = RunState.of(self._recorder, neighboring_relation=self.neighboring_relation, weights_digest=weights_digest,
                          subject=_SUBJECT)
        out["hidden_state"] = seal_run(run, fmt=_STATE_FORMAT, version=STATE_VERSION,
                                       sampler=None if self.sampler is None else type(self.sampler).__name__)
        return out

    def load_state_dict(self, state_dict) -> None:
        """Restores the ledger; a configured accountant keeps its configuration (checked to be the
        checkpoint's) and moves its sampler to the steps trained, an unconfigured one takes the
        checkpoint's. A state with only Opacus' ``history`` loads like Opacus' accountants (into
        an accountant without a sampler).

        Everything is checked before anything changes (:func:`~hidden_state_accountants.checkpoint.open_run`:
        the digest, the format and types, the ledger replayed under the claim; then the
        configuration and Opacus' ``history`` against the ledger). ``PrivacyEngine.load_checkpoint``
        also checks the model's weights and the optimizer's state before it applies any part of the
        file (see :mod:`hidden_state_accountants.opacus.checkpoint`).

        Raises:
          ParameterError: ``checkpoint`` (or ``sampler``, ``geometry``, ...) with what does not hold.
        """
        self._prepare_load(state_dict)[0]()

    def _prepare_load(self, state_dict) -> Tuple[Callable[[], None], Optional[RunState]]:
        """Checks ``state_dict`` entirely; returns what applies it (assignments only: it cannot fail)
        and its run state (``None`` for Opacus' history alone)."""
        if not isinstance(state_dict, dict) or "history" not in state_dict or \
                state_dict.get("mechanism") != self.mechanism():
            got = state_dict.get("mechanism") if isinstance(state_dict, dict) else type(state_dict).__name__
            raise refusal(_SUBJECT, f"is of {got!r} (with a history); only a state of the {self.mechanism()!r} "
                                    "accountant loads here")
        hs = state_dict.get("hidden_state")
        if hs is None:
            return self._prepare_history_only(state_dict["history"]), None
        if isinstance(hs, dict) and "digest" not in hs and hs.get("version") != STATE_VERSION:
            raise refusal(_SUBJECT, f"has version {hs.get('version')!r} without an integrity digest; this version "
                                    f"of the package reads version {STATE_VERSION} (sealed)")
        run, extra = open_run(hs, fmt=_STATE_FORMAT, version=STATE_VERSION, subject=_SUBJECT, extra=("sampler",))
        if run is None:
            raise refusal(_SUBJECT, "holds no run")
        steps, stored, sampler_class = run.steps, run.recorder, extra["sampler"]
        loader_schedule = stored.schedule if stored.schedule is not None and stored.schedule.external else None
        if (sampler_class is not None) != (stored.schedule is not None and loader_schedule is None) or \
                not isinstance(sampler_class, (str, type(None))):
            raise refusal(_SUBJECT, f"has sampler={sampler_class!r} for the schedule {stored.schedule!r} (a sampler "
                                    "class goes with a schedule of this package, and only with one)")
        if self.loader_schedule is not None:  # configured with DataLoader(shuffle=True)
            if loader_schedule is None:
                raise v.ParameterError("data_loader", "the checkpoint was not taken with DataLoader(shuffle=True) "
                                                      "batches; it cannot continue this loader")
            # the loader starts a fresh epoch: the run must have stopped at an epoch's end
            check_batch_source(loader_schedule, BatchSourceFacts(
                schedule=self.loader_schedule, description="the DataLoader (which starts a fresh epoch)",
                next_step=0), steps)
        relation = self.neighboring_relation
        if run.neighboring_relation is not None:
            if relation not in (None, run.neighboring_relation):
                raise v.ParameterError("neighboring_relation", f"the checkpoint was taken under "
                                       f"{run.neighboring_relation.name}, this accountant reports {relation.name}")
            relation = run.neighboring_relation
        if self.sampler is not None or self.loader_schedule is not None or self.geometry is not None:
            sampler, run = self.sampler, self._configured_run(run, sampler_class)
        else:
            sampler = None
            if sampler_class is not None:
                try:
                    sampler = sampler_from_state_dict({"class": sampler_class, **stored.schedule.describe(),
                                                       "position": steps},
                                                      seed_is_secret=stored.schedule.seed_is_secret)
                except v.ParameterError as err:
                    raise refusal(_SUBJECT, f"has an invalid sampler ({err})") from None
        recorder = run.recorder
        recorder.check_loss(None, LOSS_UNSEEN)
        if _history(recorder) != _as_history(state_dict["history"]):
            raise refusal(_SUBJECT, "has an Opacus history that is not its ledger's")

        def apply() -> None:
            self.geometry, self.model, self.dataset_size = recorder.geometry, recorder.model, recorder.dataset_size
            self.assume_convex_model = recorder.assume_convex_model
            self.gaussian_initialization = recorder.gaussian_initialization
            self.loader_schedule, self.neighboring_relation = loader_schedule, relation
            if sampler is not None:
                sampler.set_position(steps)  # the batch after the last one trained on
            self.sampler, self._recorder, self._cache = sampler, recorder, (None, None)

        return apply, run

    def _configured_run(self, run: RunState, sampler_class: Optional[str]) -> RunState:
        """``run`` under this accountant's configuration, after checking that it is the checkpoint's."""
        stored = run.recorder
        if sampler_class is None and self.sampler is not None:
            raise v.ParameterError("sampler", "the checkpoint was taken without a sampler (Poisson sampling "
                                              "or a DataLoader(shuffle=True))")
        if sampler_class is not None and self.sampler is None:
            raise v.ParameterError("sampler", "the checkpoint was taken with a sampler of this package; configure "
                                              "the accountant with it (see sampler_from_checkpoint)")
        if self.sampler is not None:  # the same schedule (the position stays where it is)
            self.sampler.load_state_dict({"class": sampler_class, **stored.schedule.describe(),
                                          "position": self.sampler.position})
        if self.schedule is None and None not in (self.dataset_size, stored.dataset_size) \
                and self.dataset_size != stored.dataset_size:
            raise v.ParameterError("dataset_size", f"the checkpoint was taken with dataset_size={stored.dataset_size}, "
                                                   f"this accountant is configured with {self.dataset_size}")
        if self.geometry != stored.geometry:
            if None not in (self.geometry, stored.geometry) and stored.geometry.feature_norm_bound is None \
                    and self.geometry.feature_norm_bound is not None:
                raise v.ParameterError(
                    "geometry", "the checkpoint's geometry has no feature_norm_bound (it was declared by its "
                    "constants), so its steps are not known to respect "
                    f"feature_norm_bound={self.geometry.feature_norm_bound:g}; train again, or configure the "
                    "geometry by its constants (LossGeometry(smoothness=..., strong_convexity=..., ...), "
                    "reported as your claim)")
            raise v.ParameterError("geometry", f"the checkpoint was taken with {stored.geometry}, this accountant "
                                   f"is configured with {self.geometry}")
        for name in ("assume_convex_model", "gaussian_initialization"):
            if getattr(self, name) != getattr(stored, name):
                raise v.ParameterError(name, f"the checkpoint was taken with {name}={getattr(stored, name)}, this "
                                             f"accountant is configured with {getattr(self, name)}")
        if None not in (self.model, stored.model) and self.model != stored.model:
            raise v.ParameterError("model", f"the checkpoint was taken with {stored.model.description or 'a model'} "
                                            f"of another structure than the configured one")
        schedule = self.sampler.schedule if self.sampler is not None else stored.schedule
        claim = RunRecorder(schedule=schedule, geometry=self.geometry,
                            model=self.model if self.model is not None else stored.model,
                            assume_convex_model=self.assume_convex_model,
                            gaussian_initialization=self.gaussian_initialization,
                            dataset_size=None if schedule is not None else (self.dataset_size or stored.dataset_size))
        return RunState(claim, ledger=stored.ledger_state(), steps=run.steps,
                        neighboring_relation=run.neighboring_relation, weights_digest=run.weights_digest,
                        subject=_SUBJECT)

    def _prepare_history_only(self, history) -> Callable[[], None]:
        """Opacus' own format, ``[(noise_multiplier, sample_rate, steps), ...]``: steps known only
        by noise and rate, which only Poisson composition covers."""
        if self.schedule is not None:
            raise v.ParameterError("sampler", "the checkpoint holds only Opacus' history (no hidden-state ledger "
                                              "or batch schedule); it cannot continue the configured sampler")
        entries = _as_history(history)
        if entries is None:
            raise refusal(_SUBJECT, "has a history that is not a list of (noise_multiplier, sample_rate, steps): "
                                    f"{history!r}")
        recorder = RunRecorder(schedule=None)
        try:
            for z, q, count in entries:
                recorder.record(StepFacts(noise_multiplier=z, sample_rate=q), count)
        except v.ParameterError as err:
            raise refusal(_SUBJECT, f"has a history that does not hold ({err})") from None

        def apply() -> None:
            self._recorder, self._cache = recorder, (None, None)

        return apply


def sampler_from_checkpoint(checkpoint, *, num_replicas: Optional[int] = None,
                            rank: Optional[int] = None) -> HiddenStateBatchSampler:
    """The batch sampler of a checkpointed run, at the step where it stopped: how to resume a run
    whose sampler drew a secret seed (``seed=None``), which a new process cannot draw again.

    ``checkpoint`` is what ``PrivacyEngine.save_checkpoint`` wrote (``torch.load(path)``) or the
    accountant's :meth:`~OpacusHiddenStateAccountant.state_dict`. The state is checked as by
    ``load_state_dict``; the seed stays secret if it was drawn secretly (the checkpoint holds it:
    keep it as private as the data)::

        checkpoint = torch.load(path, weights_only=False)
        sampler = sampler_from_checkpoint(checkpoint)
        loader = DataLoader(dataset, batch_sampler=sampler)
        ...  # make_private(..., poisson_sampling=False), configure(sampler=sampler, ...)
        engine.load_checkpoint(path=path, module=model, optimizer=optimizer)
    """
    state = checkpoint.get("privacy_accountant_state_dict", checkpoint) if isinstance(checkpoint, dict) else None
    hs = state.get("hidden_state") if isinstance(state, dict) else None
    if hs is None:
        raise v.ParameterError("checkpoint", "holds no hidden-state accountant state (saved with another accountant, "
                                             "or with Opacus' history only)")
    run, extra = open_run(hs, fmt=_STATE_FORMAT, version=STATE_VERSION, subject=_SUBJECT, extra=("sampler",))
    if run is None or not isinstance(extra["sampler"], str):
        raise v.ParameterError("checkpoint", "holds no batch sampler (the run used Poisson sampling or a DataLoader)")
    schedule = run.schedule
    return sampler_from_state_dict({"class": extra["sampler"], **schedule.describe(), "position": run.steps},
                                   num_replicas=num_replicas, rank=rank, seed_is_secret=schedule.seed_is_secret)


_STATE_FORMAT = "hidden_state_accountants.opacus"
_SUBJECT = "the hidden-state accountant state"


def _history(recorder: RunRecorder) -> List[Tuple[float, float, int]]:
    out: List[Tuple[float, float, int]] = []
    for step, count in recorder.ledger:
        key = (step.noise_multiplier, step.sample_rate)
        if out and out[-1][:2] == key:
            out[-1] = (*key, out[-1][2] + count)
        else:
            out.append((*key, count))
    return out


def _as_history(history) -> Optional[List[Tuple[Any, Any, Any]]]:
    """Opacus' history as a list of 3-tuples, or ``None`` when it is not one."""
    if not isinstance(history, (list, tuple)) or not all(
            isinstance(h, (list, tuple)) and len(h) == 3 for h in history):
        return None
    return [tuple(h) for h in history]
