"""``PrivacyEngine(accountant="hidden_state")``: Opacus accounting by the core's best valid bound.

The accountant is an Opacus ``IAccountant`` and only reads: :meth:`~OpacusHiddenStateAccountant.configure`
turns what Opacus cannot see (the geometry, the sampler, the model) into the core's
:class:`~hidden_state_accountants.recording.Claim`, and at every optimizer step it reads what the
DP optimizer did into :class:`~hidden_state_accountants.recording.StepFacts` for the claim's
:class:`~hidden_state_accountants.recording.RunRecorder`, which decides what they back and reports
(the adapter policy is stated once, in :mod:`hidden_state_accountants.recording`). Its host default
is Opacus' ADD_OR_REMOVE_ONE, under the core's relation rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import attr
from opacus.accountants.accountant import IAccountant
from opacus.optimizers import DPOptimizer

from hidden_state_accountants import LossGeometry, PrivacyReport, TrainingRunDpEvent
from hidden_state_accountants import validation as v
from hidden_state_accountants.checkpoint import RunState, open_run, refusal, seal_run
from hidden_state_accountants.recording import (
    BatchSourceFacts,
    Claim,
    RunRecorder,
    StepFacts,
    check_batch_source,
    check_position,
    claim_for_source,
)
from hidden_state_accountants.pytorch.features import FeatureNormMonitor
from hidden_state_accountants.pytorch.samplers import HiddenStateBatchSampler, sampler_from_state_dict
from hidden_state_accountants.relations import ADD_OR_REMOVE_ONE, schedule_reason
from hidden_state_accountants.statement import render_statement

from .facts import (
    LOSS_UNSEEN,
    OPACUS_CLIP_MARGIN,
    batches_handed_out,
    count_poisson_batches,
    feature_facts,
    loader_facts,
    model_facts,
    optimizer_facts,
    step_facts,
)

__all__ = [
    "OpacusHiddenStateAccountant",
    "HiddenStateCalibration",
    "MECHANISM",
    "CALIBRATION_KWARG",
    "sampler_from_checkpoint",
]

MECHANISM = "hidden_state"
STATE_VERSION = 6  # 5: the model's feature clip in the claim; 6: the core Claim (relation, what was observed
# about the data) and the largest feature norm of the steps
CALIBRATION_KWARG = "hidden_state_calibration"
"""The keyword of ``make_private_with_epsilon`` that carries a :class:`HiddenStateCalibration`."""
_FRESH = Claim(default_relation=ADD_OR_REMOVE_ONE)  # an unconfigured accountant's claim (Opacus' fresh one)
_KEEP: Any = object()  # configure(neighboring_relation=...) omitted: keep the relation set so far
_STATE_FORMAT = "hidden_state_accountants.opacus"
_SUBJECT = "the hidden-state accountant state"
_HINTS = {
    "data_loader": "build the loader as DataLoader(dataset, batch_sampler=sampler) and pass "
    "poisson_sampling=False to make_private",
    "batch_size": "Opacus divides by expected_batch_size = int(n / len(data_loader)); pass optimizer=... to "
    "configure(), which sets it to the batch size of the sampler or loader",
    "feature_norm_bound": "hso.FeatureClip(R) right before the trainable nn.Linear enforces the bound (read from "
    "the model's structure at configure); without it, configure(model=...) checks the inputs "
    "of every batch",
}
_POISSON_LOADER = BatchSourceFacts(
    schedule=None,
    poisson=True,
    description="Opacus' DPDataLoader (Poisson sampling), which make_private puts in place of the data loader "
    "unless poisson_sampling=False",
)


@dataclass(frozen=True)
class HiddenStateCalibration:
    """What Opacus' calibration cannot see (made by :meth:`OpacusHiddenStateAccountant.calibration_kwargs`):
    the claim (planned) and the planned step, whose noise multiplier is what Opacus searches for;
    with Opacus' Poisson loader its divisor is Opacus' ``int(n / len(data_loader))``, known once
    the rate is."""

    claim: Claim
    step: StepFacts

    def recorder(self, noise_multiplier: float, sample_rate: float, steps: int) -> RunRecorder:
        """The planned run of Opacus' hypothetical ``(noise_multiplier, sample_rate, steps)``."""
        s, q = self.claim.schedule, sample_rate
        step = attr.evolve(self.step, noise_multiplier=noise_multiplier, sampling_probability=q)
        if s is None:  # Opacus' Poisson loader: an epoch is len(data_loader) = 1/q steps
            steps_per_epoch = round(1 / q)
            if self.claim.dataset_size is not None:  # Opacus' expected_batch_size, computed as make_private does
                step = attr.evolve(step, divisor=int(self.claim.dataset_size * q))
        else:
            check_batch_source(
                s, BatchSourceFacts(schedule=s, description="Opacus' data loader", steps_per_epoch=round(1 / q))
            )
            steps_per_epoch = s.steps_per_epoch
        epochs = steps * q  # Opacus' int(epochs / sample_rate) can land one step short of whole epochs
        if abs(epochs - round(epochs)) < 1e-6:
            steps = max(steps, round(epochs) * steps_per_epoch)
        return self.claim.recorder([(step, steps)])


class OpacusHiddenStateAccountant(IAccountant):
    """Opacus accountant reporting the core's hidden-state (last-iterate) bound.

    Registered as ``"hidden_state"`` when :mod:`hidden_state_accountants.opacus` is imported::

        engine = PrivacyEngine(accountant="hidden_state")
        model, optimizer, loader = engine.make_private(..., poisson_sampling=False)
        engine.accountant.configure(geometry=..., sampler=sampler, model=model, optimizer=optimizer)

    ``get_epsilon(delta)`` equals ``HiddenStateAccountant(neighboring_relation=accountant.claim.relation()[0])
    .compose(accountant.training_run()).get_epsilon(delta)``.

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
        self.sampler: Optional[HiddenStateBatchSampler] = None
        # len(data_loader.dataset) of the loader make_private was given (the engine wrappers tell it)
        self.loader_dataset_size: Optional[int] = None
        self._recorder = attr.evolve(_FRESH, neighboring_relation=neighboring_relation).recorder()
        self._features: Optional[FeatureNormMonitor] = None  # when the feature bound is checked per batch
        # the claim make_private_with_epsilon is calibrating for (the engine wrapper sets it; moved to
        # _calibrated by get_optimizer_hook_fn once make_private builds the optimizer)
        self._pending: Optional[Claim] = None
        self._calibrated: Optional[Claim] = None
        # the DataLoader make_private returned (the one to iterate), and for Opacus' Poisson one its batch
        # sampler, which counts the batches it hands out, with the steps it has to hand out on top
        self._loader: Any = None
        self._poisson_batches: Optional[Tuple[Any, int]] = None
        self._adopted = False  # the claim is the loader's schedule and nothing declared (check_data_loader)

    # ------------------------------------------------------------------- IAccountant
    @classmethod
    def mechanism(cls) -> str:
        return MECHANISM

    def __len__(self) -> int:
        return self._recorder.steps

    @property
    def claim(self) -> Claim:
        """What the numbers are accounted under (:class:`~hidden_state_accountants.recording.Claim`)."""
        return self._recorder.claim

    @property
    def history(self) -> List[Tuple[float, float, int]]:
        """Opacus' view of the ledger: ``(noise_multiplier, sample_rate, steps)`` runs."""
        return _history(self._recorder)

    @history.setter
    def history(self, value) -> None:
        """Replaces the ledger by steps known only by noise and rate, as Opacus' own accountants
        take it (e.g. ``get_noise_multiplier``'s hypothetical runs); :meth:`step` continues it."""
        self._recorder = self.claim.recorder(
            (StepFacts(noise_multiplier=z, sampling_probability=q), int(steps))
            for z, q, steps in value or ()
            if int(steps) > 0
        )

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Records a step known only by its noise and sample rate (no optimizer to read: the
        learning rate and clip norm are unknown, so only composition covers it)."""
        self._recorder.record(StepFacts(noise_multiplier=noise_multiplier, sampling_probability=sample_rate))

    def get_optimizer_hook_fn(self, sample_rate: float):
        # make_private builds the optimizer: with the noise calibrated for the pending claim, or
        # (plain make_private) with the user's own noise
        self._calibrated, self._pending = self._pending, None

        def hook_fn(optim: DPOptimizer) -> None:
            self._record(optim, sample_rate)

        hook_fn.accountant, hook_fn.sample_rate = self, sample_rate  # read back by configure()
        return hook_fn

    def get_epsilon(self, delta: float, *args, **kwargs) -> float:
        """Best valid epsilon at ``delta`` under the claim's relation; see :meth:`explain`."""
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
            ``make_private(..., poisson_sampling=False)``); without it (and without ``data_loader``)
            the steps are Opacus' Poisson sampling, whose hidden-state claim needs ``dataset_size``.
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
            on ``n``; the divisor is the optimizer's ``expected_batch_size``). Checked against the
            data loader's dataset once ``make_private`` has seen it.
          neighboring_relation: the relation every number is reported (and calibrated) under:
            ``"REPLACE_ONE"`` or ``"ADD_OR_REMOVE_ONE"`` (or dp_accounting's ``NeighboringRelation``);
            ``None``: the default (Opacus' ADD_OR_REMOVE_ONE where the schedule is covered under it,
            REPLACE_ONE with a note for this package's fixed-size samplers); omitted: the relation
            set so far (by the constructor or an earlier ``configure``).

        Calibration: configured *before* ``make_private_with_epsilon``, the engine calibrates this
        claim (see :meth:`calibration_kwargs`); a ``configure`` after it that changes the claim
        the noise was calibrated for is refused.

        >>> from hidden_state_accountants.opacus import CyclicBatchSampler
        >>> acc = OpacusHiddenStateAccountant().configure(sampler=CyclicBatchSampler(100, 10))
        >>> acc.claim.schedule.sampling, len(acc)
        ('cyclic', 0)
        """
        if len(self):
            raise v.ParameterError("configure", f"called after {len(self)} steps; configure before training")
        explicit = self.claim.neighboring_relation if neighboring_relation is _KEEP else neighboring_relation
        if sampler is not None and not isinstance(sampler, HiddenStateBatchSampler):
            raise v.ParameterError(
                "sampler",
                f"must be a sampler of hidden_state_accountants.opacus, got {type(sampler).__name__} "
                "(for DataLoader(shuffle=True) pass the loader as data_loader=...)",
            )
        schedule = None if sampler is None else sampler.schedule
        if data_loader is not None:
            if sampler is not None:
                raise v.ParameterError("data_loader", "give the sampler or the data loader, not both")
            source = loader_facts(data_loader)
            if isinstance(data_loader.batch_sampler, HiddenStateBatchSampler):
                sampler, schedule = data_loader.batch_sampler, source.schedule
            elif source.schedule is None:
                raise v.ParameterError(
                    "data_loader",
                    f"its batches follow no schedule of this package ({source.description}); use "
                    "DataLoader(dataset, batch_size=b, shuffle=True) or batch_sampler=<a sampler of this package>, "
                    "and make_private(..., poisson_sampling=False)",
                )
            else:
                check_batch_source(source.schedule, source)  # e.g. one permutation per rank is refused
                schedule = source.schedule
        if self._loader is not None:  # the loader make_private returned: what it is decides the schedule (core)
            schedule = claim_for_source(Claim(schedule=schedule), _unpositioned(self._loader)).schedule
            bs = self._loader.batch_sampler
            if sampler is None and schedule is not None and isinstance(bs, HiddenStateBatchSampler):
                sampler = bs
        if schedule is None:
            _check_dataset_size(dataset_size, self.loader_dataset_size)
        facts = None if model is None else model_facts(model)
        layer, unobservable = feature_facts(model)
        claim = Claim(
            schedule=schedule,
            geometry=geometry,
            model=facts,
            assume_convex_model=assume_convex_model,
            gaussian_initialization=gaussian_initialization,
            dataset_size=dataset_size,
            neighboring_relation=explicit,
            default_relation=ADD_OR_REMOVE_ONE,
            feature_unobservable=unobservable,
            loss=(None, LOSS_UNSEEN),
        )
        recorder = claim.recorder()
        if optimizer is not None:
            hook = getattr(optimizer, "step_hook", None)
            if not isinstance(optimizer, DPOptimizer) or getattr(hook, "accountant", None) is not self:
                raise v.ParameterError(
                    "optimizer",
                    "must be the DPOptimizer that this accountant's PrivacyEngine."
                    "make_private returned (its steps are recorded here)",
                )
            if schedule is not None:
                # Opacus' sample rate is 1 / len(data_loader): the loader must run the schedule's epoch
                check_batch_source(
                    schedule,
                    BatchSourceFacts(
                        schedule=schedule,
                        description="Opacus' data loader",
                        steps_per_epoch=round(1 / hook.sample_rate),
                    ),
                )
                optimizer.expected_batch_size = schedule.batch_size / getattr(optimizer, "world_size", 1)
            recorder.check(step_facts(optimizer, hook.sample_rate, accumulation=1))
        calibrated = self._calibrated
        if calibrated is not None and claim.accounted() != calibrated.accounted():
            raise v.ParameterError(
                "configure",
                f"make_private_with_epsilon calibrated the noise multiplier for {calibrated.describe()}; "
                f"this configuration claims {claim.describe()}, so the run would not meet its target. Configure the "
                "accountant before make_private_with_epsilon, or use make_private with a noise_multiplier of your own",
            )
        if self._features is not None:
            self._features.detach()
        self.sampler, self._recorder, self._adopted = sampler, recorder, False
        self._features = FeatureNormMonitor(layer) if claim.needs_feature_checks else None
        return self

    def calibration_kwargs(self, *, optimizer, max_grad_norm: float) -> Dict[str, HiddenStateCalibration]:
        """Keyword arguments that carry this configuration into ``make_private_with_epsilon``.

        Opacus calibrates with a *fresh* accountant built by name (``get_noise_multiplier(...,
        accountant="hidden_state")``), which knows nothing of this one; it forwards extra keyword
        arguments of ``make_private_with_epsilon`` to that accountant's ``get_epsilon`` (and to
        the DP optimizer, which ignores them). On an engine whose accountant is this one,
        ``make_private_with_epsilon`` passes them itself (made from its ``optimizer`` and
        ``max_grad_norm``), so configuring first is enough::

            engine.accountant.configure(geometry=geometry, sampler=sampler, model=model)
            model, optimizer, loader = engine.make_private_with_epsilon(
                module=model, optimizer=optimizer, data_loader=loader, target_epsilon=1.0,
                target_delta=1e-5, epochs=20, max_grad_norm=1.0, poisson_sampling=False)
            engine.accountant.configure(geometry=geometry, sampler=sampler, model=model, optimizer=optimizer)

        (Passing ``**engine.accountant.calibration_kwargs(optimizer=..., max_grad_norm=...)`` explicitly
        works too; kwargs made for another configuration are refused.) The calibrated run then reports
        at most the target after the planned epochs, under the configured relation, with the smallest
        noise the best valid analysis allows (within Opacus' ``epsilon_tolerance``, 0.01 unless passed
        to ``make_private_with_epsilon``). It works on every path the accountant accepts: this
        package's samplers, a ``DataLoader(shuffle=True)`` (``configure(data_loader=...)``), and
        Opacus' Poisson loader (with ``configure(geometry=..., model=..., dataset_size=len(dataset))``
        the Poisson hidden-state analyses, whose divisor is Opacus' ``int(n / len(data_loader))``).

        ``optimizer`` is the base optimizer; its learning rate, ``weight_decay`` and momentum
        are read now and checked against the claim. A declared diameter is taken as the
        projection to come (the training run is checked for it).

        Raises:
          ParameterError: what the core finds wrong with the planned step for the claim
            (``momentum``, ``learning_rate``, ``geometry``...), or ``neighboring_relation`` when
            no analysis of the schedule holds under the configured relation.
        """
        claim = self.claim
        relation = claim.relation()[0]
        reason = schedule_reason(relation, claim.sampling)
        if reason:
            raise v.ParameterError(
                "neighboring_relation",
                f"nothing to calibrate for: no analysis of the "
                f"{claim.sampling} schedule holds under {relation.name} "
                f"({reason})",
            )
        base = optimizer.original_optimizer if isinstance(optimizer, DPOptimizer) else optimizer
        schedule = claim.schedule
        step = StepFacts(
            noise_multiplier=0.0,
            clip_norm=v.positive_float("max_grad_norm", max_grad_norm),
            clip_margin=OPACUS_CLIP_MARGIN,
            divisor=None if schedule is None else schedule.batch_size,
            projection_diameter=None if claim.geometry is None else claim.geometry.diameter,
            **optimizer_facts(base),
        )
        planned = attr.evolve(claim, planned=True)
        # contradictions surface now, not inside Opacus' search (Poisson: at a whole-number divisor)
        planned.recorder().check(
            step if schedule is not None else attr.evolve(step, sampling_probability=0.5, divisor=1)
        )
        return {CALIBRATION_KWARG: HiddenStateCalibration(claim=planned, step=step)}

    def calibration_for(
        self,
        *,
        data_loader,
        optimizer,
        max_grad_norm,
        spec: Optional[HiddenStateCalibration] = None,
        poisson_sampling: bool = True,
    ) -> Optional[HiddenStateCalibration]:
        """What ``make_private_with_epsilon`` on this accountant's engine passes Opacus' calibration
        (:mod:`.engine` calls it first): ``spec`` after checking it was made for this claim, or
        :meth:`calibration_kwargs`' when none was given and the claim is not the one a fresh
        accountant has (``None``: Opacus' own calibration is this claim's). Remembers the claim, which
        a later :meth:`configure` must keep."""
        self.check_data_loader(data_loader, poisson_sampling=poisson_sampling)
        claim = self.claim
        if spec is None and claim.accounted() != _FRESH.accounted():
            spec = self.calibration_kwargs(optimizer=optimizer, max_grad_norm=max_grad_norm)[CALIBRATION_KWARG]
        elif spec is not None and not isinstance(spec, HiddenStateCalibration):
            raise v.ParameterError(CALIBRATION_KWARG, f"must come from calibration_kwargs(), got {spec!r}")
        elif spec is not None and spec.claim.accounted() != claim.accounted():
            raise v.ParameterError(
                "calibration_kwargs",
                f"were made for {spec.claim.describe()}, but the accountant now claims "
                f"{claim.describe()}; call calibration_kwargs() after the last configure()",
            )
        self._pending = claim
        return spec

    def check_data_loader(self, data_loader, *, poisson_sampling: bool = True) -> None:
        """What ``make_private`` (and ``make_private_with_epsilon``) is given, before it runs: remembers the
        size of the data loader's dataset and checks the configured Poisson ``dataset_size`` against it (Opacus
        divides by ``int(len(dataset) / len(data_loader))``, and the Poisson hidden-state analyses read ``n``);
        and makes the claim the batches' (the core's ``claim_for_source``): Opacus' ``DPDataLoader`` with
        ``poisson_sampling=True``, else ``data_loader`` itself. Without a declared schedule, a loader that is
        not Poisson sampling is accounted as what it is (``DataLoader(shuffle=True)``: ``reshuffle``; in data
        order: ``cyclic``; over a sampler of this package: its schedule), or refused when it is none; a
        declared schedule must be the loader's."""
        dataset = getattr(data_loader, "dataset", None)
        try:
            n = None if dataset is None else len(dataset)
        except TypeError:  # an iterable dataset has no length
            n = None
        _check_dataset_size(self.claim.dataset_size, n)
        self.loader_dataset_size = n
        claim = claim_for_source(
            self.claim, _POISSON_LOADER if poisson_sampling else _unpositioned(data_loader), len(self)
        )
        if claim is not self.claim:  # no schedule was declared: the loader's
            bs = data_loader.batch_sampler
            self.sampler = bs if isinstance(bs, HiddenStateBatchSampler) else None
            self._recorder, self._adopted = claim.recorder(), True

    def watch_data_loader(self, data_loader) -> None:
        """Remembers the ``DataLoader`` that ``make_private`` returned, the one to iterate: :meth:`configure`
        reads its batches from it, and when it is Opacus' Poisson ``DPDataLoader`` every step is checked to
        have drawn a batch from it (its batch sampler counts them): a loop over the loader passed to
        ``make_private`` trains on batches of a fixed size, which Poisson accounting would under-report."""
        self._loader = data_loader
        sampler = count_poisson_batches(data_loader)
        self._poisson_batches = None if sampler is None else (sampler, len(self) - batches_handed_out(sampler))

    def _check_poisson_batches(self) -> None:
        """The step about to be recorded drew its batch from the ``DPDataLoader`` (see :meth:`watch_data_loader`)."""
        if self._poisson_batches is None or self.claim.schedule is not None:
            return
        sampler, ahead = self._poisson_batches
        try:
            check_position(batches_handed_out(sampler) + ahead, len(self) + 1, "the DPDataLoader make_private returned")
        except v.ParameterError as err:
            raise v.ParameterError(
                err.parameter,
                f"{err.reason}; iterate that loader: the accountant assumes its Poisson batches, and the loader "
                "passed to make_private has batches of a fixed size",
            ) from None

    def _continue_batches(self, steps: int) -> None:
        """After a restored ledger of ``steps`` steps, the DPDataLoader's next batch is the next step's."""
        if self._poisson_batches is not None:
            sampler = self._poisson_batches[0]
            self._poisson_batches = (sampler, steps - batches_handed_out(sampler))

    # ---------------------------------------------------------------------- recording
    def _record(self, optim: DPOptimizer, sample_rate: float) -> None:
        self._check_poisson_batches()
        try:
            if self.sampler is not None:
                check_position(self.sampler.position, len(self) + 1, f"the configured {type(self.sampler).__name__}")
            if self._features is not None:  # the batch's inputs, before the base optimizer's step
                largest = self._features.take(int(getattr(optim, "world_size", 1)))
                if largest is not None:
                    self._recorder.check_feature_norm(largest, f"the batch of step {len(self)}")
            self._recorder.record(step_facts(optim, sample_rate))
        except v.ParameterError as err:  # the core's refusal, with how to fix it in Opacus
            if err.parameter not in _HINTS:
                raise
            raise v.ParameterError(err.parameter, f"{err.reason}; {_HINTS[err.parameter]}") from None

    # ----------------------------------------------------------------------- the run
    def training_run(self) -> TrainingRunDpEvent:
        """The core event for the steps recorded so far (what :meth:`get_epsilon` accounts)."""
        return self._recorder.run(warn=False)

    def explain(self, delta: float, **kwargs) -> PrivacyReport:
        """The core's report (:meth:`RunRecorder.report <hidden_state_accountants.recording.RunRecorder.report>`):
        every analysis with its epsilon or why it does not apply, the reasons for a composition fallback
        and the notes. For Opacus' calibration (``hidden_state_calibration=...``), the report of the
        hypothetical run it wrote into :attr:`history`, under the calibrated claim."""
        spec = kwargs.pop(CALIBRATION_KWARG, None)
        if spec is None:
            return self._recorder.report(delta)
        if not isinstance(spec, HiddenStateCalibration):
            raise v.ParameterError(CALIBRATION_KWARG, f"must come from calibration_kwargs(), got {spec!r}")
        if len(self.history) != 1:
            raise v.ParameterError("history", "calibration expects one (noise, sample_rate, steps) entry")
        return spec.recorder(*self.history[0]).report(delta, warn=False)

    def privacy_statement(self, delta: float, include_analyses: bool = False) -> str:
        """The model-card text for the steps recorded so far
        (:func:`~hidden_state_accountants.statement.render_statement`: what was run, both numbers, what
        the claim rests on)."""
        if not len(self):
            raise ValueError("no training step has been accounted yet")
        return render_statement(self._recorder, delta, include_analyses=include_analyses)

    def composition_epsilon(self, delta: float) -> float:
        """The best composition bound for the same run (valid even if every iterate is released)."""
        return self.explain(delta).composition_epsilon

    # -------------------------------------------------------------------- checkpoints
    def state_dict(self, destination=None, *, weights_digest: Optional[str] = None):
        """Opacus' ``history`` and, under ``"hidden_state"``, the core's sealed
        :class:`~hidden_state_accountants.checkpoint.RunState` (the claim with the sampler's
        schedule and its seed, the ledger) and the sampler's class, in plain Python types
        (``torch.save``-able). It holds the sampler's seed: keep it as private as the data.

        ``weights_digest`` (:func:`~hidden_state_accountants.checkpoint.weights_digest` of the
        module state saved next to it) binds the state to those weights;
        ``PrivacyEngine.save_checkpoint`` passes it, and ``load_checkpoint`` refuses the state
        next to other weights."""
        out = {} if destination is None else destination
        out["mechanism"] = self.mechanism()
        out["history"] = self.history
        run = RunState.of(self._recorder, weights_digest=weights_digest, subject=_SUBJECT)
        out["hidden_state"] = seal_run(
            run,
            fmt=_STATE_FORMAT,
            version=STATE_VERSION,
            sampler=None if self.sampler is None else type(self.sampler).__name__,
        )
        return out

    def load_state_dict(self, state_dict) -> None:
        """Restores the ledger; a configured accountant keeps its configuration (checked to be the
        checkpoint's) and moves its sampler to the steps trained, an unconfigured one takes the
        checkpoint's. A state with only Opacus' ``history`` loads like Opacus' accountants (into
        an accountant without a sampler).

        Everything is checked before anything changes (:func:`~hidden_state_accountants.checkpoint.open_run`:
        the digest, the format and types, the ledger replayed under the claim; then
        :meth:`RunState.continued <hidden_state_accountants.checkpoint.RunState.continued>` against the
        configuration, and Opacus' ``history`` against the ledger). ``PrivacyEngine.load_checkpoint``
        also checks the model's weights and the optimizer's state before it applies any part of the
        file (see :mod:`hidden_state_accountants.opacus.engine`).

        Raises:
          ParameterError: ``checkpoint`` (or ``sampler``, ``geometry``, ...) with what does not hold.
        """
        self.check_state_dict(state_dict)[0]()

    def check_state_dict(self, state_dict) -> Tuple[Callable[[], None], Optional[RunState]]:
        """Checks ``state_dict`` entirely; returns what applies it (assignments only: it cannot fail)
        and its run state (``None`` for Opacus' history alone)."""
        if not isinstance(state_dict, dict) or "history" not in state_dict or state_dict.get("mechanism") != MECHANISM:
            got = state_dict.get("mechanism") if isinstance(state_dict, dict) else type(state_dict).__name__
            raise refusal(
                _SUBJECT, f"is of {got!r} (with a history); only a state of the {MECHANISM!r} accountant loads here"
            )
        hs = state_dict.get("hidden_state")
        if hs is None:
            return self._check_history_only(state_dict["history"]), None
        if isinstance(hs, dict) and "digest" not in hs and hs.get("version") != STATE_VERSION:
            raise refusal(
                _SUBJECT,
                f"has version {hs.get('version')!r} without an integrity digest; this version "
                f"of the package reads version {STATE_VERSION} (sealed)",
            )
        run, extra = open_run(hs, fmt=_STATE_FORMAT, version=STATE_VERSION, subject=_SUBJECT, extra=("sampler",))
        if run is None:
            raise refusal(_SUBJECT, "holds no run")
        stored, sampler_class, claim = run.claim, extra["sampler"], self.claim
        if self._adopted:  # only the schedule is known, the loader's: the checkpoint's claim on that schedule
            claim = attr.evolve(stored, schedule=claim.schedule, neighboring_relation=claim.neighboring_relation)
        from_loader = stored.schedule is not None and sampler_class is None  # a plain DataLoader's batches
        if not isinstance(sampler_class, (str, type(None))) or (
            not (stored.schedule.external or not stored.schedule.is_random)  # torch's reshuffle, or data order
            if from_loader
            else sampler_class is not None and (stored.schedule is None or stored.schedule.external)
        ):
            raise refusal(
                _SUBJECT,
                f"has sampler={sampler_class!r} for the schedule {stored.schedule!r} (a sampler "
                "class goes with a schedule of this package, and only with one)",
            )
        if claim.schedule is not None and self.sampler is None:  # configured with a plain DataLoader
            if not from_loader:
                raise v.ParameterError(
                    "data_loader",
                    "the checkpoint was not taken with a plain DataLoader's batches (DataLoader(shuffle=True) or "
                    "in data order); it cannot continue this loader",
                )
            # the loader starts a fresh epoch: the run must have stopped at an epoch's end
            check_batch_source(
                stored.schedule,
                BatchSourceFacts(
                    schedule=claim.schedule, description="the DataLoader (which starts a fresh epoch)", next_step=0
                ),
                run.steps,
            )
            claim = attr.evolve(claim, schedule=stored.schedule)  # the run's law, drawn as secretly as it was
        sampler = self.sampler
        if claim.schedule is not None or claim.geometry is not None:  # configured: its claim continues the run
            if sampler_class is None and sampler is not None:
                raise v.ParameterError(
                    "sampler",
                    "the checkpoint was taken without a sampler (Poisson sampling or a DataLoader(shuffle=True))",
                )
            if sampler_class is not None and sampler is None:
                raise v.ParameterError(
                    "sampler",
                    "the checkpoint was taken with a sampler of this package; configure "
                    "the accountant with it (see sampler_from_checkpoint)",
                )
            if sampler is not None:  # the same schedule (the position stays where it is)
                sampler.load_state_dict(
                    {"class": sampler_class, **stored.schedule.describe(), "position": sampler.position}
                )
        else:  # unconfigured: the checkpoint's claim, with this accountant's relation if it names one
            claim = attr.evolve(stored, neighboring_relation=claim.neighboring_relation)
            if sampler_class is not None:
                sampler = _sampler_of(stored, sampler_class, run.steps)
            if self._loader is not None:  # Opacus' Poisson loader (any other made the claim its own)
                claim = claim_for_source(claim, loader_facts(self._loader), run.steps)
        run = run.continued(claim)
        if _history(run.recorder) != _as_history(state_dict["history"]):
            raise refusal(_SUBJECT, "has an Opacus history that is not its ledger's")

        def apply() -> None:
            if sampler is not None:
                sampler.set_position(run.steps)  # the batch after the last one trained on
            self.sampler, self._recorder, self._adopted = sampler, run.recorder, False
            self._continue_batches(run.steps)

        return apply, run

    def _check_history_only(self, history) -> Callable[[], None]:
        """Opacus' own format, ``[(noise_multiplier, sample_rate, steps), ...]``: steps known only
        by noise and rate, which only Poisson composition covers."""
        if self.claim.schedule is not None:
            raise v.ParameterError(
                "sampler",
                "the checkpoint holds only Opacus' history (no hidden-state ledger "
                "or batch schedule); it cannot continue the configured sampler",
            )
        entries = _as_history(history)
        if entries is None:
            raise refusal(
                _SUBJECT, f"has a history that is not a list of (noise_multiplier, sample_rate, steps): {history!r}"
            )
        try:
            recorder = attr.evolve(_FRESH, neighboring_relation=self.claim.neighboring_relation).recorder(
                (StepFacts(noise_multiplier=z, sampling_probability=q), count) for z, q, count in entries
            )
        except v.ParameterError as err:
            raise refusal(_SUBJECT, f"has a history that does not hold ({err})") from None

        def apply() -> None:
            self._recorder = recorder
            self._continue_batches(recorder.steps)

        return apply


def _unpositioned(data_loader) -> BatchSourceFacts:
    """:func:`~.facts.loader_facts` without the sampler's position: before training, a checkpoint may
    still move the run (``load_checkpoint`` checks the position then, and every step checks it after)."""
    return attr.evolve(loader_facts(data_loader), next_step=None)


def _check_dataset_size(claimed: Optional[int], n: Optional[int]) -> None:
    if None not in (claimed, n) and claimed != n:  # Opacus divides by int(len(dataset) / len(data_loader))
        raise v.ParameterError(
            "dataset_size",
            f"the accountant is configured with dataset_size={claimed}, but the data loader's "
            f"dataset has {n} records; configure dataset_size=len(dataset)",
        )


def _sampler_of(claim: Claim, sampler_class: str, position: int, **where) -> HiddenStateBatchSampler:
    try:
        return sampler_from_state_dict(
            {"class": sampler_class, **claim.schedule.describe(), "position": position},
            seed_is_secret=claim.schedule.seed_is_secret,
            **where,
        )
    except v.ParameterError as err:
        raise refusal(_SUBJECT, f"has an invalid sampler ({err})") from None


def sampler_from_checkpoint(
    checkpoint, *, num_replicas: Optional[int] = None, rank: Optional[int] = None
) -> HiddenStateBatchSampler:
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
        raise v.ParameterError(
            "checkpoint",
            "holds no hidden-state accountant state (saved with another accountant, or with Opacus' history only)",
        )
    run, extra = open_run(hs, fmt=_STATE_FORMAT, version=STATE_VERSION, subject=_SUBJECT, extra=("sampler",))
    if run is None or not isinstance(extra["sampler"], str):
        raise v.ParameterError("checkpoint", "holds no batch sampler (the run used Poisson sampling or a DataLoader)")
    return _sampler_of(run.claim, extra["sampler"], run.steps, num_replicas=num_replicas, rank=rank)


def _history(recorder: RunRecorder) -> List[Tuple[float, float, int]]:
    out: List[Tuple[float, float, int]] = []
    for step, count in recorder.ledger:
        key = (step.noise_multiplier, step.sampling_probability)
        if out and out[-1][:2] == key:
            out[-1] = (*key, out[-1][2] + count)
        else:
            out.append((*key, count))
    return out


def _as_history(history) -> Optional[List[Tuple[Any, Any, Any]]]:
    """Opacus' history as a list of 3-tuples, or ``None`` when it is not one."""
    if not isinstance(history, (list, tuple)) or not all(isinstance(h, (list, tuple)) and len(h) == 3 for h in history):
        return None
    return [tuple(h) for h in history]
