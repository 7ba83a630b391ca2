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

from dataclasses import dataclass
import weakref
from typing import Any, Dict, List, Optional, Tuple

import attr
import torch
from opacus.accountants.accountant import IAccountant
from opacus.optimizers import DPOptimizer

from hidden_state_accountants import HiddenStateAccountant, LossGeometry, PrivacyReport, TrainingRunDpEvent
from hidden_state_accountants import validation as v
from hidden_state_accountants.recording import (
    BatchSourceFacts,
    LayerFacts,
    ModelFacts,
    RunRecorder,
    StepFacts,
    check_batch_source,
    check_position,
    open_state,
    seal_state,
    unseal_state,
)
from hidden_state_accountants.relations import ADD_OR_REMOVE_ONE, REPLACE_ONE, parse_relation, schedule_reason
from hidden_state_accountants.schedules import POISSON, BatchSchedule

from .facts import (
    LOSS_UNSEEN,
    feature_monitor,
    loader_facts,
    model_facts,
    optimizer_facts,
    step_facts,
    step_values,
    unwrap_model,
)
from .samplers import HiddenStateBatchSampler, sampler_from_state_dict

__all__ = ["OpacusHiddenStateAccountant", "HiddenStateCalibration", "MECHANISM", "sampler_from_checkpoint"]

MECHANISM = "hidden_state"
STATE_VERSION = 3  # 3: sealed with the core's digest, with the steps and the seed's secrecy
_CALIBRATION_KWARG = "hidden_state_calibration"
_HINTS = {
    "data_loader": "build the loader as DataLoader(dataset, batch_sampler=sampler) and pass "
                   "poisson_sampling=False to make_private",
    "batch_size": "Opacus divides by expected_batch_size = int(n / len(data_loader)); pass optimizer=... to "
                  "configure(), which sets it to the sampler's batch size",
    "feature_norm_bound": "hso.FeatureClip(R) right before the trainable nn.Linear enforces the bound (read from "
                          "the model's structure at configure); without it, configure(model=...) checks the inputs "
                          "of every batch",
}


@dataclass(frozen=True)
class HiddenStateCalibration:
    """The configuration Opacus' calibration call cannot see (made by
    :meth:`OpacusHiddenStateAccountant.calibration_kwargs`): the claim, and the planned step
    (its noise multiplier is what Opacus searches for)."""

    schedule: BatchSchedule
    geometry: Optional[LossGeometry]
    model: Optional[ModelFacts]
    assume_convex_model: bool
    gaussian_initialization: bool
    step: StepFacts

    def recorder(self) -> RunRecorder:
        return RunRecorder(schedule=self.schedule, geometry=self.geometry, model=self.model,
                           assume_convex_model=self.assume_convex_model,
                           gaussian_initialization=self.gaussian_initialization, planned=True)


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
        self._model_hook = None  # see _watch_model
        self._features = None  # a FeatureNormMonitor when the feature bound is checked per batch
        self._weights_before_load = None
        self._restoring = False

    # ------------------------------------------------------------------- IAccountant
    @classmethod
    def mechanism(cls) -> str:
        return MECHANISM

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

        >>> from hidden_state_accountants.opacus import CyclicBatchSampler
        >>> acc = OpacusHiddenStateAccountant().configure(sampler=CyclicBatchSampler(100, 10))
        >>> acc.sampler.sampling, len(acc)
        ('cyclic', 0)
        """
        if len(self):
            raise v.ParameterError("configure", f"called after {len(self)} steps; configure before training")
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
        self.geometry, self.sampler, self.model = geometry, sampler, facts
        self.loader_schedule = loader_schedule
        self.assume_convex_model, self.gaussian_initialization = assume_convex_model, gaussian_initialization
        self.dataset_size = recorder.dataset_size
        self._recorder = recorder
        self._features = feature_monitor(model, recorder, self._features)
        self._watch_model(model)
        return self

    @property
    def schedule(self) -> Optional[BatchSchedule]:
        """The batch schedule accounted: the sampler's, the recognised loader's, or ``None`` (Poisson)."""
        return self.sampler.schedule if self.sampler is not None else self.loader_schedule

    def relation(self, run: Optional[TrainingRunDpEvent] = None):
        """The neighbouring relation the numbers are reported under (see the class docstring), and
        the note saying why it is not the default ADD_OR_REMOVE_ONE, if it is not."""
        if self.neighboring_relation is not None:
            return self.neighboring_relation, None
        schedule = self.schedule
        sampling = run.sampling if run is not None else (POISSON if schedule is None else schedule.sampling)
        reason = schedule_reason(ADD_OR_REMOVE_ONE, sampling)
        if reason:
            return REPLACE_ONE, (f"reported under REPLACE_ONE, not Opacus' ADD_OR_REMOVE_ONE: the {sampling} schedule "
                                 f"is {reason}")
        return ADD_OR_REMOVE_ONE, None

    def calibration_kwargs(self, *, optimizer, max_grad_norm: float) -> Dict[str, HiddenStateCalibration]:
        """Keyword arguments that carry this configuration into ``make_private_with_epsilon``.

        Opacus calibrates with a *fresh* accountant built by name; it forwards extra keyword
        arguments of ``make_private_with_epsilon`` to that accountant's ``get_epsilon`` (and to
        the DP optimizer, which ignores them)::

            engine.accountant.configure(geometry=geometry, sampler=sampler, model=model)
            model, optimizer, loader = engine.make_private_with_epsilon(
                module=model, optimizer=optimizer, data_loader=loader, target_epsilon=1.0,
                target_delta=1e-5, epochs=20, max_grad_norm=1.0, poisson_sampling=False,
                **engine.accountant.calibration_kwargs(optimizer=optimizer, max_grad_norm=1.0))
            engine.accountant.configure(geometry=geometry, sampler=sampler, model=model, optimizer=optimizer)

        ``optimizer`` is the base optimizer; its learning rate, ``weight_decay`` and momentum
        are read now and checked against the claim. A declared diameter is taken as the
        projection to come (the training run is checked for it). Without a sampler there is
        nothing to carry: the fresh accountant calibrates for Opacus' Poisson rate.
        """
        schedule = self.schedule
        if schedule is None:
            return {}
        base = optimizer.original_optimizer if isinstance(optimizer, DPOptimizer) else optimizer
        step = StepFacts(noise_multiplier=0.0, clip_norm=v.positive_float("max_grad_norm", max_grad_norm),
                         divisor=schedule.batch_size,
                         projection_diameter=None if self.geometry is None else self.geometry.diameter,
                         **optimizer_facts(base))
        spec = HiddenStateCalibration(schedule=schedule, geometry=self.geometry, model=self.model,
                                      assume_convex_model=self.assume_convex_model,
                                      gaussian_initialization=self.gaussian_initialization, step=step)
        spec.recorder().check(step)  # contradictions surface now, not inside Opacus' search
        return {_CALIBRATION_KWARG: spec}

    # ---------------------------------------------------------------------- recording
    def _record(self, optim: DPOptimizer, sample_rate: float) -> None:
        self._weights_before_load = None  # a load of the weights alone: nothing to put back
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
            raise v.ParameterError(err.parameter, f"{str(err).split(': ', 1)[1]}; {_HINTS[err.parameter]}") from None

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
        check_batch_source(s, BatchSourceFacts(schedule=s, description="Opacus' data loader",
                                               steps_per_epoch=round(1 / q)))
        epochs = steps * q  # Opacus' int(epochs / sample_rate) can land one step short of whole epochs
        if abs(epochs - round(epochs)) < 1e-6:
            steps = max(steps, round(epochs) * s.steps_per_epoch)
        recorder = spec.recorder()
        recorder.record(attr.evolve(spec.step, noise_multiplier=z, sample_rate=q), steps)
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
        relation, note = self.relation(run)
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
    def state_dict(self, destination=None):
        """Ledger and configuration in plain Python types (``torch.save``-able), sealed with the
        core's integrity digest (:func:`~hidden_state_accountants.recording.seal_state`). It holds
        the sampler's seed: keep it as private as the data."""
        out = {} if destination is None else destination
        out["mechanism"] = self.mechanism()
        out["history"] = self.history
        out["hidden_state"] = seal_state({
            "format": _STATE_FORMAT,
            "version": STATE_VERSION,
            "steps": len(self),
            "ledger": self._recorder.ledger_state(),
            "geometry": None if self.geometry is None else attr.asdict(self.geometry),
            "model": None if self.model is None else {
                "layers": [attr.asdict(layer) for layer in self.model.layers],
                "complete": self.model.complete, "description": self.model.description,
                "feature_clip_norm": self.model.feature_clip_norm},
            "assume_convex_model": self.assume_convex_model,
            "gaussian_initialization": self.gaussian_initialization,
            "dataset_size": self.dataset_size,
            # the schedule continues at the number of batches trained on, whatever was prefetched
            "sampler": None if self.sampler is None else {
                **self.sampler.describe(), "position": len(self),
                "seed_is_secret": self.sampler.schedule.seed_is_secret},
            # DataLoader(shuffle=True): the law only (torch draws it; a fresh secret seed continues it)
            "loader_schedule": None if self.loader_schedule is None else self.loader_schedule.describe(),
        })
        return out

    def load_state_dict(self, state_dict) -> None:
        """Restores the ledger; a configured accountant keeps its configuration (checked to be the
        checkpoint's) and moves its sampler to the steps trained, an unconfigured one takes the
        checkpoint's. A state with only Opacus' ``history`` loads like Opacus' accountants (into
        an accountant without a sampler).

        Everything is checked before anything changes: the digest (a hand-edited or corrupted
        state is refused), the format and types, the ledger against the claim (replayed through
        the core's :class:`RunRecorder`), the sampler's position against the ledger's steps and
        Opacus' ``history`` against the ledger. If the accountant was configured with the model
        and the refused state came through ``PrivacyEngine.load_checkpoint`` (which loads the
        model's weights first), the weights are put back as they were before the load.

        Raises:
          ParameterError: ``checkpoint`` (or ``sampler``, ``geometry``) with what does not hold.
        """
        try:
            self._load_checked(state_dict)
        except Exception:
            self._restore_weights()
            raise
        finally:
            self._weights_before_load = None

    def _load_checked(self, state_dict) -> None:
        def bad(what: str) -> v.ParameterError:
            return v.ParameterError("checkpoint", f"{_SUBJECT} {what}")

        if not isinstance(state_dict, dict) or "history" not in state_dict or \
                state_dict.get("mechanism") != self.mechanism():
            got = state_dict.get("mechanism") if isinstance(state_dict, dict) else type(state_dict).__name__
            raise bad(f"is of {got!r} (with a history); only a state of the {self.mechanism()!r} accountant loads here")
        hs = state_dict.get("hidden_state")
        if hs is None:
            self._load_history_only(state_dict["history"], bad)
            return
        if isinstance(hs, dict) and "digest" not in hs and hs.get("version") != STATE_VERSION:
            raise bad(f"has version {hs.get('version')!r} without an integrity digest; this version of the package "
                      f"reads version {STATE_VERSION} (sealed)")
        payload = open_state(hs, subject=_SUBJECT, fmt=_STATE_FORMAT, version=STATE_VERSION, keys=_STATE_KEYS)
        steps = payload["steps"]
        for flag in ("assume_convex_model", "gaussian_initialization"):
            if not isinstance(payload[flag], bool):
                raise bad(f"has {flag}={payload[flag]!r}; must be true or false")
        dataset_size = payload["dataset_size"]
        if dataset_size is not None and (isinstance(dataset_size, bool) or not isinstance(dataset_size, int)
                                         or dataset_size < 1):
            raise bad(f"has dataset_size={dataset_size!r}; must be a positive integer or null")
        try:
            geometry = None if payload["geometry"] is None else LossGeometry(**payload["geometry"])
            model = payload["model"]
            model = None if model is None else ModelFacts(
                layers=[LayerFacts(**layer) for layer in model["layers"]], complete=model["complete"],
                description=model["description"], feature_clip_norm=model.get("feature_clip_norm"))
        except (TypeError, ValueError, KeyError) as err:
            raise bad(f"has an invalid geometry or model ({err})") from None
        saved = payload["sampler"]
        if saved is not None:
            if not isinstance(saved, dict) or not isinstance(saved.get("seed_is_secret"), bool):
                raise bad("has a sampler entry without seed_is_secret")
            position = saved.get("position")
            if position != steps or isinstance(position, bool) or not isinstance(position, int):
                raise bad(f"puts its sampler at position {position!r} but its ledger has {steps} steps (the "
                          "sampler continues at the batch after the last one trained on)")

        stored_loader = payload["loader_schedule"]
        if stored_loader is not None:
            if saved is not None:
                raise bad("has both a sampler and a DataLoader schedule")
            try:
                stored_loader = BatchSchedule.from_description(stored_loader)
            except v.ParameterError as err:
                raise bad(f"has an invalid DataLoader schedule ({err})") from None
            if not stored_loader.external:
                raise bad("has a DataLoader schedule not drawn by the framework")
        loader_schedule = stored_loader
        if self.loader_schedule is not None:  # configured with DataLoader(shuffle=True)
            if stored_loader is None:
                raise v.ParameterError("data_loader", "the checkpoint was not taken with DataLoader(shuffle=True) "
                                                      "batches; it cannot continue this loader")
            # the loader starts a fresh epoch: the run must have stopped at an epoch's end
            check_batch_source(stored_loader, BatchSourceFacts(
                schedule=self.loader_schedule, description="the DataLoader (which starts a fresh epoch)",
                next_step=0), steps)
        configured = self.sampler is not None or self.loader_schedule is not None or self.geometry is not None
        if configured:  # must be this configuration
            if saved is None and self.sampler is not None:
                raise v.ParameterError("sampler", "the checkpoint was taken without a sampler (Poisson sampling "
                                                  "or a DataLoader(shuffle=True))")
            if saved is not None and self.sampler is None:
                raise v.ParameterError("sampler", "the checkpoint was taken with a sampler of this package; configure "
                                                  "the accountant with it (see sampler_from_checkpoint)")
            if self.schedule is None and None not in (self.dataset_size, dataset_size) \
                    and self.dataset_size != dataset_size:
                raise v.ParameterError("dataset_size", f"the checkpoint was taken with dataset_size={dataset_size}, "
                                                       f"this accountant is configured with {self.dataset_size}")
            if self.sampler is not None:
                position = self.sampler.position
                self.sampler.load_state_dict(saved)  # checks it is the same schedule
                self.sampler.set_position(position)  # moved only once everything holds
            if self.geometry != geometry:
                if geometry is not None and self.geometry is not None and "feature_norm_bound" not in \
                        payload["geometry"] and self.geometry.feature_norm_bound is not None:
                    raise v.ParameterError(
                        "geometry", "the checkpoint was written before feature norms were enforced or checked (its "
                        "geometry has no feature_norm_bound), so its steps are not known to respect "
                        f"feature_norm_bound={self.geometry.feature_norm_bound:g}; train again, or configure the "
                        "geometry by its constants (LossGeometry(smoothness=..., strong_convexity=..., ...), "
                        "reported as your claim)")
                raise v.ParameterError("geometry", f"the checkpoint was taken with {geometry}, this accountant "
                                       f"is configured with {self.geometry}")
            for name in ("assume_convex_model", "gaussian_initialization"):
                if getattr(self, name) != payload[name]:
                    raise v.ParameterError(name, f"the checkpoint was taken with {name}={payload[name]}, this "
                                                 f"accountant is configured with {getattr(self, name)}")
            if model is not None and "feature_clip_norm" not in payload["model"]:  # written before it was read
                clip = None if self.model is None else self.model.feature_clip_norm
                model = attr.evolve(model, feature_clip_norm=clip)
            if self.model is not None and model is not None and self.model != model:
                raise v.ParameterError("model", f"the checkpoint was taken with {model.description or 'a model'} "
                                                f"of another structure than the configured one")
            sampler, model = self.sampler, self.model
            config = (self.geometry, self.assume_convex_model, self.gaussian_initialization)
            dataset_size = self.dataset_size if self.dataset_size is not None else dataset_size
        else:
            try:
                sampler = None if saved is None else sampler_from_state_dict(
                    {k: x for k, x in saved.items() if k != "seed_is_secret"}, seed_is_secret=saved["seed_is_secret"])
            except v.ParameterError as err:
                raise bad(f"has an invalid sampler ({err})") from None
            config = (geometry, payload["assume_convex_model"], payload["gaussian_initialization"])
        schedule = sampler.schedule if sampler is not None else loader_schedule
        try:
            recorder = RunRecorder(schedule=schedule, geometry=config[0], model=model,
                                   assume_convex_model=config[1], gaussian_initialization=config[2],
                                   dataset_size=dataset_size if schedule is None else None)
        except v.ParameterError as err:
            raise bad(f"has a claim that does not hold ({err})") from None
        recorder.check_loss(None, LOSS_UNSEEN)
        recorder.replay(payload["ledger"], steps, _SUBJECT)
        if _history(recorder) != _as_history(state_dict["history"]):
            raise bad("has an Opacus history that is not its ledger's")
        # everything holds: apply
        self.geometry, self.assume_convex_model, self.gaussian_initialization = config
        self.model, self._recorder, self.loader_schedule = model, recorder, loader_schedule
        self.dataset_size = recorder.dataset_size
        if self.sampler is not None:
            self.sampler.set_position(steps)
        self.sampler = sampler
        self._cache = (None, None)

    def _load_history_only(self, history, bad) -> None:
        """Opacus' own format, ``[(noise_multiplier, sample_rate, steps), ...]``: steps known only
        by noise and rate, which only Poisson composition covers."""
        if self.schedule is not None:
            raise v.ParameterError("sampler", "the checkpoint holds only Opacus' history (no hidden-state ledger "
                                              "or batch schedule); it cannot continue the configured sampler")
        entries = _as_history(history)
        if entries is None:
            raise bad(f"has a history that is not a list of (noise_multiplier, sample_rate, steps): {history!r}")
        recorder = RunRecorder(schedule=None)
        try:
            for z, q, count in entries:
                recorder.record(StepFacts(noise_multiplier=z, sample_rate=q), count)
        except v.ParameterError as err:
            raise bad(f"has a history that does not hold ({err})") from None
        self._recorder, self._cache = recorder, (None, None)

    # --------------------------------------------------- the model's weights on a refused load
    def _watch_model(self, model) -> None:
        """``PrivacyEngine.load_checkpoint`` loads the model's weights before this accountant's
        state: keep a copy of them when a load starts, so a refused state can put them back."""
        if self._model_hook is not None:
            self._model_hook.remove()
            self._model_hook = None
        if model is None:
            return
        target = unwrap_model(model)
        me = weakref.ref(self)

        def before_load(module, *args, **kwargs) -> None:
            acc = me()
            if acc is not None and acc._weights_before_load is None and not acc._restoring:
                with torch.no_grad():
                    acc._weights_before_load = (module, {k: t.detach().clone() for k, t in module.state_dict().items()})

        self._model_hook = target.register_load_state_dict_pre_hook(before_load)

    def _restore_weights(self) -> None:
        saved = self._weights_before_load
        if saved is None:
            return
        module, weights = saved
        self._restoring = True
        try:
            module.load_state_dict(weights)
        finally:
            self._restoring = False


def sampler_from_checkpoint(checkpoint, *, num_replicas: Optional[int] = None,
                            rank: Optional[int] = None) -> HiddenStateBatchSampler:
    """The batch sampler of a checkpointed run, at the step where it stopped: how to resume a run
    whose sampler drew a secret seed (``seed=None``), which a new process cannot draw again.

    ``checkpoint`` is what ``PrivacyEngine.save_checkpoint`` wrote (``torch.load(path)``) or the
    accountant's :meth:`~OpacusHiddenStateAccountant.state_dict`. The digest is checked; the
    seed stays secret if it was drawn secretly (the checkpoint holds it: keep it as private as
    the data)::

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
    payload = unseal_state(hs, "checkpoint")
    saved = payload.get("sampler")
    if not isinstance(saved, dict) or not isinstance(saved.get("seed_is_secret"), bool):
        raise v.ParameterError("checkpoint", "holds no batch sampler (the run used Poisson sampling)")
    return sampler_from_state_dict({k: x for k, x in saved.items() if k != "seed_is_secret"},
                                   num_replicas=num_replicas, rank=rank, seed_is_secret=saved["seed_is_secret"])


_STATE_FORMAT = "hidden_state_accountants.opacus"
_SUBJECT = "the hidden-state accountant state"
_STATE_KEYS = ("steps", "ledger", "geometry", "model", "assume_convex_model", "gaussian_initialization", "sampler",
               "loader_schedule", "dataset_size")


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
