"""The recording layer: what a training framework did, turned into a training-run event.

Adapters (Opacus, Keras) only *read* their framework and hand the facts over; every
decision about whether those facts back a hidden-state claim is made here, the same way for
every framework:

* :class:`StepFacts`: what one optimiser step did (noise, clip norm, learning rate, the
  number the clipped sum is divided by, L2 outside clipping, projection, optimiser kind,
  momentum, clipping mode, ...).
* :class:`ModelFacts`: the model's structure, layer by layer.
* :class:`BatchSourceFacts`: where the batches come from (a schedule of this package, or a
  description of something else).
* :class:`RunRecorder` keeps a run-length-encoded ledger of steps and turns it into a
  :class:`~hidden_state_accountants.TrainingRunDpEvent` plus the reasons a hidden-state
  analysis does not apply.

The policy, one for every framework:

1. **Contradictions known before training are errors.** With a declared geometry, a model
   that is not one linear map of its features, an update that is not plain DP-SGD (momentum,
   Adam, per-layer clipping, ...), ``strong_convexity`` above the L2 term applied outside
   clipping, a declared diameter without projection, ``learning_rate >= 2/smoothness``, or
   batches that do not come from the declared schedule raise
   :class:`~hidden_state_accountants.ParameterError` naming the parameter, at configuration or
   before the first step is accounted. So does a loss other than the one the geometry was derived
   from (:meth:`RunRecorder.check_loss`), and a model whose feature clip is wider than the declared
   feature bound.
1b. **What the data decides is enforced or checked before each step.** A geometry with a
   ``feature_norm_bound`` holds only if every input of the trainable layer has that norm at most:
   *enforced* when the model's structure shows the package's feature clip (radius ``<=`` the bound)
   feeding the trainable layer (:attr:`ModelFacts.feature_clip_norm`), else *checked*: the adapter
   reports the largest input norm of the data of each step before the step is taken
   (:meth:`RunRecorder.check_feature_norm`), and a step recorded without such a check, or data above
   the bound, is an error naming ``feature_norm_bound`` (with the observed norm). What no adapter can
   observe (a geometry given by its constants, a loss the framework does not show) is the user's claim,
   and :meth:`RunRecorder.notes` says so in every report.
2. **Departures during training end the hidden-state claim.** If the learning rate, noise,
   clip norm, L2 strength or projection changes mid-run, or the update stops being plain
   DP-SGD, the run is accounted by composition (valid for any post-processing of the noisy
   gradients). :class:`CompositionFallbackWarning` is emitted once per reason, and the reason
   is in the report's notes.
3. **No geometry, no hidden-state claim**: composition, with the same warning.
4. **Not even composition holds** (adaptive clipping, whose clip norm follows the data; a
   divisor that does not match the schedule's batches; gradient accumulation over a
   schedule's batches): an error at the step where it is seen.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import attr

from hidden_state_accountants import validation as v
from hidden_state_accountants.errors import NO_GEOMETRY, CompositionFallbackWarning, HiddenStateWarning  # re-exported
from hidden_state_accountants.events import LOSSES, LossGeometry, TrainingRunDpEvent
from hidden_state_accountants.schedules import (
    DROPPED,
    EPOCH_ORDERS,
    FULL,
    KEPT_OWN_SIZE,
    POISSON,
    BatchSchedule,
    poisson_sizes,
)


ASSUMED_CONVEX_NOTE = (
    "the model structure was not verified: the user asserted (assume_convex_model=True) that "
    "the loss is convex in the trainable parameters with the declared geometry"
)


# ------------------------------------------------------------------------------ facts
Number = Union[float, Tuple[float, ...]]

REPLICA_REDUCTIONS = ("sum", "mean")
"""How a data-parallel framework combines its replicas' updates (:attr:`StepFacts.replica_reduction`)."""


def _number_or_groups(value):
    """A float, or a tuple of per-parameter-group floats (reduced to one value when equal)."""
    if isinstance(value, (list, tuple)):
        values = tuple(float(x) for x in value)
        return values[0] if len(set(values)) == 1 else values
    return None if value is None else float(value)


@attr.s(frozen=True, slots=True, kw_only=True)
class StepFacts:
    """What one optimiser step did, as the framework reports it (no judgement).

    Attributes:
      noise_multiplier: ``z``: noise std on the clipped sum over ``clip_norm``.
      clip_norm: ``C`` (``None`` if the framework did not say, e.g. Opacus' ``step()``).
      learning_rate: the step size, or one value per parameter group (``None``: unknown).
      divisor: the number the clipped sum and its noise are divided by (``None``: unknown).
      weight_decay: L2 strength applied after clipping and noise, or one per parameter group.
      projection_diameter: diameter of the convex set the parameters were projected onto
        after the step, ``None`` for no projection.
      optimizer: the update applied to the noisy gradient (``"sgd"`` for a plain step).
      momentum, nesterov: SGD momentum settings.
      clipping: ``"flat"``, ``"per_layer"`` or ``"adaptive"``.
      loss_reduction: ``"mean"`` or ``"sum"``.
      accumulation: batches (or optimiser calls) whose gradients one update applies.
      postprocessing: anything applied to the noisy gradient before the step (e.g. Keras'
        ``clipnorm``), described, or ``None``.
      sample_rate: the probability a record is in the step's batch, for Poisson steps whose
        rate the framework reports (Opacus), else ``None``.
      replicas: data-parallel replicas that each compute the update on their part of the
        batch (``tf.distribute``, ``torch.distributed``); 1 for one device. With several,
        ``divisor`` is the number each replica divides its clipped sum and noise by, and
        :func:`effective_step` is the one-device step the replicas add up to.
      replica_reduction: how the framework combines the replicas' updates: ``"sum"`` or
        ``"mean"``.
      replica_share: each replica adds ``1/replica_share`` of the noise variance
        ``(noise_multiplier * clip_norm)^2`` and of the L2 term ``weight_decay * theta``
        (1: each adds them in full, as an optimizer that knows nothing of replicas does).
      l2_after_reduction: the L2 term ``weight_decay * theta`` is applied once, to the combined
        update (the replicas reduce their noisy gradients and one optimizer step follows, e.g.
        Opacus' ``DistributedDPOptimizer``), not by each replica; ``replica_share`` then
        concerns the noise only.
    """

    noise_multiplier: float = attr.ib(converter=float)
    clip_norm: Optional[float] = attr.ib(default=None, converter=attr.converters.optional(float))
    learning_rate: Optional[Number] = attr.ib(default=None, converter=_number_or_groups)
    divisor: Optional[float] = attr.ib(default=None, converter=attr.converters.optional(float))
    weight_decay: Number = attr.ib(default=0.0, converter=_number_or_groups)
    projection_diameter: Optional[float] = attr.ib(default=None, converter=attr.converters.optional(float))
    optimizer: str = attr.ib(default="sgd")
    momentum: float = attr.ib(default=0.0, converter=float)
    nesterov: bool = attr.ib(default=False, converter=bool)
    clipping: str = attr.ib(default="flat")
    loss_reduction: str = attr.ib(default="mean")
    accumulation: int = attr.ib(default=1, converter=int)
    postprocessing: Optional[str] = attr.ib(default=None)
    sample_rate: Optional[float] = attr.ib(default=None, converter=attr.converters.optional(float))
    replicas: int = attr.ib(default=1)
    replica_reduction: str = attr.ib(default="sum")
    replica_share: int = attr.ib(default=1)
    l2_after_reduction: bool = attr.ib(default=False)

    @l2_after_reduction.validator
    def _check_flag(self, attribute, value):
        if not isinstance(value, bool):
            raise v.ParameterError(attribute.name, f"must be True or False, got {value!r}")

    @replicas.validator
    @replica_share.validator
    def _check_count(self, attribute, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise v.ParameterError(attribute.name, f"must be an integer >= 1, got {value!r}")

    @replica_reduction.validator
    def _check_reduction(self, _, value):
        if value not in REPLICA_REDUCTIONS:
            raise v.ParameterError("replica_reduction",
                                   f"must be one of {', '.join(REPLICA_REDUCTIONS)}, got {value!r}")

    def to_dict(self) -> Dict[str, Any]:
        return {k: (list(x) if isinstance(x, tuple) else x) for k, x in attr.asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "StepFacts":
        if not isinstance(d, dict):
            raise v.ParameterError("ledger", f"a step must be a dict, got {type(d).__name__}")
        unknown = set(d) - {f.name for f in attr.fields(cls)}
        if unknown:
            raise v.ParameterError("ledger", f"unknown step fields {sorted(unknown)}")
        try:
            return cls(**d)
        except (TypeError, ValueError) as err:  # ParameterError included
            raise v.ParameterError("ledger", f"malformed step {d!r}: {err}") from None


@attr.s(frozen=True, slots=True, kw_only=True)
class LayerFacts:
    """One layer of a model, in the order the forward pass applies it.

    ``kind`` is ``"affine"`` for a dense linear map with bias and no activation (Linear,
    Dense(activation=None)), ``"random"`` for layers that draw randomness in training
    (dropout), ``"other"`` for everything else. ``trainable`` says whether it owns parameters
    that the optimiser updates.
    """

    name: str = attr.ib()
    kind: str = attr.ib(validator=attr.validators.in_(("affine", "random", "other")))
    trainable: bool = attr.ib(converter=bool)


@attr.s(frozen=True, slots=True, kw_only=True)
class ModelFacts:
    """A model's structure: its layers in forward order, and whether that list is the whole
    forward pass (``complete=False`` when custom code could not be read)."""

    layers: Tuple[LayerFacts, ...] = attr.ib(converter=tuple)
    complete: bool = attr.ib(converter=bool)
    description: str = attr.ib(default="")
    feature_clip_norm: Optional[float] = attr.ib(default=None, converter=attr.converters.optional(float))
    """``max_norm`` of the package's feature clip when the adapter read from the model's structure
    that the clip's output is the whole input of the one trainable layer (so every input it sees has
    norm ``<= max_norm``), else ``None``."""


@attr.s(frozen=True, slots=True, kw_only=True)
class BatchSourceFacts:
    """Where a run's batches come from: a schedule of this package (verified), the law of a
    framework's own draws (:meth:`BatchSchedule.framework
    <hidden_state_accountants.schedules.BatchSchedule.framework>`: e.g. ``DataLoader(shuffle=True)``
    or Keras ``fit(shuffle=True)``, with whether the short batch is kept and how it is divided,
    and whether the framework's randomness is secret), or ``None`` with a description of what
    the framework feeds instead."""

    schedule: Optional[BatchSchedule] = attr.ib()
    description: str = attr.ib()
    steps_per_epoch: Optional[int] = attr.ib(default=None)
    next_step: Optional[int] = attr.ib(default=None)
    """The step of ``schedule`` whose batch the source hands out next (``None``: unknown,
    taken to be the run's position)."""
    independent_draws: int = attr.ib(default=1)
    """How many processes each draw the framework's permutation on their own and feed their
    part of it (several ranks each running ``DataLoader(shuffle=True)``, Keras
    ``fit(shuffle=True)`` on several workers); 1 for one process or a shared draw."""


def effective_step(step: StepFacts) -> StepFacts:
    """The one-device step that ``step.replicas`` data-parallel replicas add up to.

    Each of the ``R`` replicas applies ``lr * [(S_r + N_r) / d + (wd/s) * theta]`` to the
    clipped sum ``S_r`` of its part of the batch, with independent noise
    ``N_r ~ N(0, (z C)^2 / s)`` (``s = replica_share``); the framework combines the updates by
    their sum (``k = 1``) or mean (``k = 1/R``). Together:
    ``lr * [(S + N(0, (R/s) (z C)^2)) / (d/k) + k (R/s) wd * theta]``, the one-device step
    with divisor ``d/k``, noise multiplier ``sqrt(R/s) z`` and L2 term ``k (R/s) wd``. (Noise
    correlated across replicas would only add noise: independent draws are the least.)

    >>> tf_privacy = StepFacts(noise_multiplier=1, clip_norm=1, learning_rate=0.1, divisor=50, replicas=2)
    >>> s = effective_step(tf_privacy)  # each replica: all the noise, its 50 records' mean
    >>> round(s.noise_multiplier, 4), s.divisor  # sqrt(2) times the noise, half the batch's divisor
    (1.4142, 50.0)
    >>> split = StepFacts(noise_multiplier=1, clip_norm=1, learning_rate=0.1, divisor=100, weight_decay=0.01,
    ...                   replicas=2, replica_share=2)
    >>> s = effective_step(split)  # each replica: half the noise variance and the L2 term, / b
    >>> s.noise_multiplier, s.divisor, s.weight_decay, s.replicas
    (1.0, 100.0, 0.01, 1)

    With ``l2_after_reduction`` the L2 term is the one applied after the replicas combine
    (``k (R/s)`` scales the noisy gradients only):

    >>> opacus = StepFacts(noise_multiplier=1, clip_norm=1, learning_rate=0.1, divisor=50, weight_decay=0.01,
    ...                    replicas=2, replica_reduction="mean", replica_share=2, l2_after_reduction=True)
    >>> s = effective_step(opacus)  # noise on one rank, each rank / its 50 records, gradients averaged
    >>> s.noise_multiplier, s.divisor, s.weight_decay
    (1.0, 100.0, 0.01)
    """
    replicas = step.replicas
    if replicas == 1 and step.replica_share == 1:
        return attr.evolve(step, l2_after_reduction=False) if step.l2_after_reduction else step
    k = 1.0 if step.replica_reduction == "sum" else 1.0 / replicas
    ratio = replicas / step.replica_share  # exactly 1.0 when the replicas share the step evenly
    wd = step.weight_decay
    if not step.l2_after_reduction:
        wd = tuple(k * x * ratio for x in wd) if isinstance(wd, tuple) else k * wd * ratio
    return attr.evolve(step, replicas=1, replica_reduction="sum", replica_share=1, l2_after_reduction=False,
                       noise_multiplier=step.noise_multiplier * math.sqrt(ratio),
                       divisor=None if step.divisor is None else step.divisor / k, weight_decay=wd)


# ---------------------------------------------------------------------------- decisions
def unaccountable(step: StepFacts) -> Optional[Tuple[str, str]]:
    """``(parameter, reason)`` when not even composition covers the step, else ``None``."""
    if step.clipping == "adaptive":
        return "clipping", "adaptive clipping changes the clip norm with the data; use flat clipping"
    if not (math.isfinite(step.noise_multiplier) and step.noise_multiplier >= 0):
        return "noise_multiplier", f"must be a finite number >= 0, got {step.noise_multiplier!r}"
    return None


def update_departure(step: StepFacts) -> Optional[Tuple[str, str]]:
    """``(parameter, reason)`` why the step is not the analysed DP-SGD update
    ``theta - lr [(1/b) sum clip_C(grad l_i) + m_reg theta + (z C/b) xi]``, else ``None``.
    Composition still covers such a step (any use of the noisy gradient is post-processing)."""
    if step.optimizer != "sgd":
        return "optimizer", f"{step.optimizer} applies its own update to the noisy gradient; the analyses assume plain SGD steps"
    if step.momentum != 0.0 or step.nesterov:
        return "momentum", (f"momentum={step.momentum:g}, nesterov={step.nesterov}: a momentum step is not a "
                            "contraction of one gradient step; the analyses assume plain SGD")
    if step.clipping != "flat":
        return "clipping", f"{step.clipping} clipping: the analyses assume flat clipping of the whole per-example gradient"
    if step.loss_reduction != "mean":
        return "loss_reduction", f"loss_reduction={step.loss_reduction!r}: the analyses assume 'mean'"
    if step.postprocessing:
        return "optimizer", f"{step.postprocessing} post-processes the noisy gradient; the analyses assume it is applied as is"
    if isinstance(step.learning_rate, tuple):
        return "learning_rate", "parameter groups have different learning rates"
    if isinstance(step.weight_decay, tuple):
        return "weight_decay", "parameter groups have different weight_decay"
    if step.learning_rate is None or step.clip_norm is None:
        return "optimizer", "the step was recorded without the optimizer: learning rate and clip norm unknown"
    return None


def model_refusal(model: Optional[ModelFacts], assume_convex_model: bool = False) -> Optional[str]:
    """Why ``model`` does not back a declared geometry, or ``None``.

    The geometries here (e.g. :meth:`LossGeometry.logistic_regression`) hold for a loss that
    is convex in the parameters: one trainable affine map of fixed features, applied last
    (its outputs go straight into the loss). Parameter-free or frozen layers before it are a
    fixed feature map (the declared feature bound must hold for their output). A composition
    of trainable layers, or a non-linearity after the trainable map, is not convex in the
    parameters; layers that draw randomness make the update random.
    ``assume_convex_model=True`` accepts any model on the user's word (reported as such).
    """
    if assume_convex_model:
        return None
    if model is None:
        return ("the model structure is unknown: pass the model so it can be checked, or "
                "assume_convex_model=True if you have verified convexity yourself")
    what = model.description or "the model"
    hint = ("; no hidden-state analysis applies to it (use DP-SBCD for ReLU networks, geometry=None for "
            "composition, or assume_convex_model=True if you have verified that the loss is convex "
            "in the trainable parameters)")
    if not model.complete:
        return f"the forward pass of {what} could not be read (custom code), so its convexity is unknown" + hint
    random = [layer.name for layer in model.layers if layer.kind == "random"]
    if random:
        return f"{what} draws randomness in training ({', '.join(random)}): the update is not the analysed one" + hint
    trainable = [i for i, layer in enumerate(model.layers) if layer.trainable]
    if len(trainable) != 1:
        names = ", ".join(model.layers[i].name for i in trainable) or "none"
        return (f"{what} has {len(trainable)} trainable layers ({names}): a composition of trainable layers is "
                "not convex in its parameters" + hint if trainable else f"{what} has no trainable layer")
    i = trainable[0]
    layer = model.layers[i]
    if layer.kind != "affine":
        return f"its trainable layer {layer.name} is not an affine map without activation" + hint
    after = [x.name for x in model.layers[i + 1:]]
    if after:
        return (f"{', '.join(after)} follow the trainable layer {layer.name}: the loss must see its outputs "
                "directly (use logits and a from-logits loss)" + hint)
    return None


def check_batch_source(schedule: BatchSchedule, source: BatchSourceFacts, steps: int = 0) -> None:
    """Raises unless the batches of the steps after the first ``steps`` come from ``schedule``
    (the one the claim is about).

    A source that restarts a fixed-order schedule at another batch of the epoch than the run
    is at (training stopped mid-epoch) would visit some records twice in one epoch. A
    source of fresh per-step draws may be ahead of the run (draws nobody used are skipped,
    never reused), never behind it (it would hand out batches already used).
    """
    if source.schedule is None:
        raise v.ParameterError(
            "data", f"the batches do not come from a schedule of this package ({source.description}); "
            f"the {schedule.sampling!r} bounds need exactly that schedule")
    if source.schedule.external and source.independent_draws > 1:
        raise v.ParameterError(
            "data", f"{source.description}: {source.independent_draws} processes each draw their own permutation "
            "and feed their part of it, so the global batches are not cut from one permutation; use a schedule of "
            "this package, which every process follows with a shared secret seed")
    drawn_elsewhere = source.schedule.external or schedule.external
    if not (source.schedule.same_law(schedule) if drawn_elsewhere else source.schedule.same_schedule(schedule)):
        raise v.ParameterError(
            "data", f"the batches come from {source.schedule!r}, but the accountant was told {schedule!r}")
    if schedule.secret and not source.schedule.secret:
        raise v.ParameterError(
            "data", f"the batches' randomness is public ({source.description}), but the claim assumes it secret "
            "(describe the schedule with secret=False)")
    if source.steps_per_epoch is not None and source.steps_per_epoch != schedule.steps_per_epoch:
        raise v.ParameterError(
            "steps_per_epoch", f"training runs {source.steps_per_epoch} steps per epoch but {schedule.sampling} "
            f"with n={schedule.dataset_size}, b={schedule.batch_size} has {schedule.steps_per_epoch}")
    if source.next_step is None:
        return
    if schedule.sampling not in EPOCH_ORDERS + (FULL,):
        check_position(source.next_step, steps, source.description)
    elif (source.next_step - steps) % schedule.steps_per_epoch:
        spe = schedule.steps_per_epoch
        raise v.ParameterError(
            "data", f"the run is at batch {steps % spe} of its {spe}-batch epoch but {source.description} starts at "
            f"batch {source.next_step % spe} (training stopped mid-epoch): records would be visited twice in one "
            "epoch; train whole epochs")


def _poisson_needs(step: StepFacts) -> List[Tuple[str, str]]:
    """What a Poisson step without a package schedule lacks for a hidden-state claim: the analyses
    (docs/derivations.md sections 6-7) need the exact rate, a fixed whole-number divisor of the clipped sum
    (Opacus' expected batch size) and mean reduction."""
    out = []
    if step.sample_rate is None:
        out.append(("sample_rate", "the step does not report its sampling rate"))
    if step.loss_reduction != "mean" or step.divisor is None:
        out.append(("divisor", "the number the clipped sum is divided by is unknown"))
    elif abs(step.divisor - round(step.divisor)) > 1e-9 * step.divisor or round(step.divisor) < 1:
        out.append(("divisor", f"the clipped sum is divided by {step.divisor:g}, not a whole number of records"))
    return out


def check_geometry(geometry: LossGeometry, *, weight_decay: float, projection_diameter: Optional[float]) -> LossGeometry:
    """The declared geometry checked against what training enforces; returns the geometry to
    account (the projection's diameter filled in when none was declared).

    Strong convexity can only come from the L2 term applied outside clipping (a clipped
    gradient is bounded, so it is not strongly monotone); a geometry derived from a loss
    (``LossGeometry.logistic_regression``) must have a smoothness that includes the L2 term the
    update applies; a declared diameter needs a projection onto a set no larger.
    """
    m = geometry.strong_convexity
    if m > weight_decay * (1 + 1e-9):
        raise v.ParameterError(
            "geometry", f"strong_convexity {m:g} exceeds the L2 regularisation applied outside clipping "
            f"({weight_decay:g}): clipped per-example gradients give no strong convexity of their own, so "
            "m can be at most that L2 strength (the package's L2 hooks apply it outside clipping)")
    beta = geometry.loss_smoothness
    if beta is not None and geometry.smoothness < (beta + weight_decay) * (1 - 1e-9):
        # derived from a loss: the map clip_C(grad l_i) + wd * theta is (beta + wd)-smooth, not less
        raise v.ParameterError(
            "geometry", f"smoothness {geometry.smoothness:g} was derived with L2 strength "
            f"{geometry.smoothness - beta:g}, but the update applies {weight_decay:g} outside clipping, which makes "
            f"the per-example map {beta + weight_decay:g}-smooth; declare the geometry with that L2 strength")
    if geometry.diameter is None:
        if projection_diameter is not None:
            return attr.evolve(geometry, diameter=projection_diameter)
        return geometry
    if projection_diameter is None:
        raise v.ParameterError(
            "geometry", f"diameter {geometry.diameter:g} is declared but the parameters are not projected "
            "after every step (attach the package's projection)")
    if projection_diameter > geometry.diameter * (1 + 1e-12):
        raise v.ParameterError(
            "geometry", f"declared diameter {geometry.diameter:g} is smaller than the diameter "
            f"{projection_diameter:.6g} of the set the parameters are projected onto")
    return geometry


def check_position(batches_handed_out: int, steps: int, what: str) -> None:
    """Raises when fewer batches came from the schedule than steps were taken: the steps then
    used batches from elsewhere."""
    if batches_handed_out < steps:
        raise v.ParameterError(
            "data_loader", f"{what} has handed out {batches_handed_out} batches for {steps} steps: the "
            "batches did not come from it")


# ------------------------------------------------------------------------------ recorder
def _group_value(x: Number) -> float:
    return x[0] if isinstance(x, tuple) else x


class RunRecorder:
    """A ledger of optimiser steps and the claim they are accounted under.

    Args:
      schedule: the batch schedule (``None``: the framework's own Poisson sampler, whose rate
        each step reports as ``sample_rate``; composition only).
      geometry: the declared :class:`LossGeometry`, ``None`` for no hidden-state claim.
      model: the model's structure (needed with a geometry unless ``assume_convex_model``).
      assume_convex_model: accept the geometry for any model, on the user's word.
      gaussian_initialization: the user declares Chourasia et al.'s initialisation.
      dataset_size: ``n`` of a Poisson run without a schedule, if known.

    ``record(step)`` appends a step (the first one is checked against the claim: rule 1 of
    the module docstring); ``run()`` is the event for the steps so far.
    """

    def __init__(
        self,
        *,
        schedule: Optional[BatchSchedule],
        geometry: Optional[LossGeometry] = None,
        model: Optional[ModelFacts] = None,
        assume_convex_model: bool = False,
        gaussian_initialization: bool = False,
        dataset_size: Optional[int] = None,
        planned: bool = False,
    ) -> None:
        if schedule is not None and not isinstance(schedule, BatchSchedule):
            raise v.ParameterError("schedule", f"must be a BatchSchedule or None, got {type(schedule).__name__}")
        if geometry is not None and not isinstance(geometry, LossGeometry):
            raise v.ParameterError("geometry", f"must be a LossGeometry or None, got {geometry!r}")
        if geometry is not None and schedule is None and dataset_size is None:
            raise v.ParameterError(
                "dataset_size", "a hidden-state claim for steps without a package schedule (Poisson sampling at "
                "the rate the framework reports) needs the dataset size")
        for name, flag in (("assume_convex_model", assume_convex_model), ("gaussian_initialization", gaussian_initialization),
                           ("planned", planned)):
            if not isinstance(flag, bool):
                raise v.ParameterError(name, f"must be True or False, got {flag!r}")
        self.schedule = schedule
        self.geometry = geometry
        self.model = model
        self.assume_convex_model = assume_convex_model
        self.gaussian_initialization = gaussian_initialization
        self.dataset_size = None if dataset_size is None else v.positive_int("dataset_size", dataset_size)
        self.planned = planned
        self._ledger: List[List[Any]] = []  # [StepFacts, count]
        self._steps = 0
        self._warned: set = set()
        # what the data decides (feature norms) and the loss: see the module docstring, rule 1b
        self._feature_largest: Optional[float] = None  # the largest input norm checked in this process
        self._feature_cover = 0.0  # steps the last check covers (inf: every step until the next check)
        self._feature_claim: Optional[str] = None  # why the bound cannot be observed (assume_convex_model)
        self._feature_restored: Optional[float] = None  # the largest norm of a restored ledger's steps
        self._restored_steps = 0
        self._replaying = False
        self._loss: Optional[Tuple[Optional[str], str]] = None  # (kind or None, description) as observed
        if geometry is not None:
            reason = model_refusal(model, assume_convex_model)
            if reason:
                raise v.ParameterError("model", reason)
            clip, bound = (None if model is None else model.feature_clip_norm), geometry.feature_norm_bound
            if clip is not None and bound is not None and clip > bound:
                raise v.ParameterError(
                    "feature_norm_bound", f"the model's feature clip (max_norm={clip:g}) lets inputs of norm up to "
                    f"{clip:g} reach the trainable layer, above the declared bound {bound:g}; clip to {bound:g} or "
                    f"declare {clip:g}")

    # ------------------------------------------------------------------ ledger
    @property
    def steps(self) -> int:
        return self._steps

    @property
    def ledger(self) -> List[Tuple[StepFacts, int]]:
        return [(s, c) for s, c in self._ledger]

    def _check_accountable(self, step: StepFacts, first: Optional[int] = None, count: int = 1) -> None:
        """Rule 4: raises when not even composition covers ``step`` with this schedule."""
        raw, step = step, effective_step(step)
        problem = unaccountable(step)
        if problem:
            raise v.ParameterError(*problem)
        s = self.schedule
        if s is not None:
            if step.accumulation != 1:
                raise v.ParameterError(
                    "accumulation", f"{step.accumulation} batches per update (gradient accumulation) are not the "
                    f"{s.sampling} schedule; take one optimiser step per batch")
            self._check_divisor(raw, self._steps if first is None else first, count)

    def check(self, step: StepFacts, position: Optional[int] = None) -> None:
        """The checks of the first step, usable before any step runs (rule 1); ``position``:
        the step's index in the run (default: the next one), which fixes whether it is a
        kept short batch."""
        self._check_accountable(step, position)
        step = effective_step(step)
        if self.geometry is None:
            return
        departure = update_departure(step)
        if departure:
            param, reason = departure
            raise v.ParameterError(param, f"{reason} (a loss geometry is declared; use geometry=None to account "
                                          "this training by composition)")
        for param, problem in self._hidden_state_needs(step):
            raise v.ParameterError(param, f"{problem} (a loss geometry is declared; use geometry=None to "
                                          "account this training by composition)")
        wd = _group_value(step.weight_decay)
        geometry = check_geometry(self.geometry, weight_decay=wd, projection_diameter=step.projection_diameter)
        if geometry.strong_convexity < wd * (1 - 1e-9) and "loose" not in self._warned:
            self._warned.add("loose")
            warnings.warn(
                f"declared strong_convexity {geometry.strong_convexity:g} is below the L2 regularisation {wd:g}: "
                "valid but loose; the declared smoothness must include the L2 term", HiddenStateWarning, stacklevel=3)
        lr = _group_value(step.learning_rate)
        if lr >= 2.0 / geometry.smoothness:
            raise v.ParameterError(
                "learning_rate", f"must be < 2/smoothness = {2.0 / geometry.smoothness:.6g} for the declared geometry "
                f"(a gradient step is not contractive otherwise), got {lr:.6g}")

    def _hidden_state_needs(self, step: StepFacts) -> List[Tuple[str, str]]:
        """What a Poisson step lacks for the Poisson hidden-state analyses (none for other schedules):
        without a package schedule, the rate and a whole-number divisor; with a package Poisson
        schedule, the divisor must be its batch size ``b`` (the analyses divide by ``b``)."""
        s = self.schedule
        if s is None:
            return _poisson_needs(step)
        if s.sampling == POISSON and (step.loss_reduction != "mean" or step.divisor is None
                                      or abs(step.divisor - s.batch_size) > 1e-9 * s.batch_size):
            got = "an unknown number" if step.divisor is None or step.loss_reduction != "mean" else f"{step.divisor:g}"
            return [("batch_size", f"the Poisson schedule's divisor is its expected batch size {s.batch_size}, but "
                                   f"the update divides the clipped sum by {got}")]
        return []

    def _check_divisor(self, raw: StepFacts, first: int, count: int) -> None:
        """Not even composition holds when the clipped sum is divided by another number than
        the schedule's batches hold (rule 4). A kept short batch (``last_batch``) is the last
        step of every epoch; its divisor must be known and be what the schedule says."""
        s, step = self.schedule, effective_step(raw)
        if s is None or s.sampling == POISSON or step.loss_reduction != "mean":
            return
        b = s.batch_size
        if s.last_batch == DROPPED:
            expected = {b}
        else:
            if step.divisor is None:
                raise v.ParameterError(
                    "batch_size", f"the schedule keeps a short batch ({s.last_batch}) but the step's divisor is "
                    "unknown; it must be recorded to account the short batch")
            spe = s.steps_per_epoch
            # the short batch is step spe - 1 of every epoch: how many of [first, first + count) are short
            k0 = first + (spe - 1 - first) % spe
            shorts = 0 if k0 >= first + count else (first + count - 1 - k0) // spe + 1
            r = s.dataset_size % b
            expected = set()
            if shorts:
                expected.add(r if s.last_batch == KEPT_OWN_SIZE else b)
            if count > shorts:
                expected.add(b)
            if len(expected) > 1:
                raise v.ParameterError(
                    "batch_size", f"steps {first}..{first + count - 1} include the short batch of {r} records, "
                    "divided by its own size: record that step on its own")
        if step.divisor is not None and all(abs(step.divisor - d) > 1e-9 * d for d in expected):
            size = " or ".join(f"{d:g}" for d in sorted(expected))
            replicas = ""
            if raw.replicas > 1:
                how = "sums" if raw.replica_reduction == "sum" else "averages"
                replicas = (f" ({raw.replicas} replicas each divide their part of the batch by {raw.divisor:g} and "
                            f"the framework {how} their updates: the effective learning rate is "
                            f"{min(expected) / step.divisor:.4g} times the one set)")
            raise v.ParameterError(
                "batch_size", f"the update divides the clipped sum by {step.divisor:g} but the schedule's "
                f"batch at step {first} holds {size} records{replicas}")

    def check_plan(self, planned: Sequence[StepFacts], start: Optional[int] = None,
                   counts: Optional[Sequence[int]] = None) -> None:
        """Rule 1 for a run known in advance (e.g. a learning-rate schedule): with a declared
        geometry, a plan that already departs from the analysed update is an error now,
        before any step, instead of a fallback later.

        ``planned[i]`` is taken ``counts[i]`` times (default once each), and the plan is the
        steps from ``start`` on (default: the next step), so a kept short batch's divisor is
        checked where the schedule puts it."""
        planned = list(planned)
        if not planned:
            return
        counts = [1] * len(planned) if counts is None else [v.positive_int("counts", c) for c in counts]
        if len(counts) != len(planned):
            raise v.ParameterError("counts", f"needs one count per planned step ({len(planned)}), got {len(counts)}")
        if start is None:
            start = self._steps
        elif isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise v.ParameterError("start", f"must be an integer >= 0, got {start!r}")
        self.check(planned[0], start)
        position = start
        for step, count in zip(planned, counts):
            self._check_accountable(step, position, count)
            position += count
        if self.geometry is None:
            return
        probe = RunRecorder(schedule=self.schedule, geometry=self.geometry, model=self.model,
                            assume_convex_model=self.assume_convex_model)
        probe._ledger = [[effective_step(s), c] for s, c in zip(planned, counts)]
        probe._steps = sum(counts)
        reasons = probe.reasons()
        if reasons:
            raise v.ParameterError(
                "learning_rate" if any("learning rate" in r for r in reasons) else "optimizer",
                f"the planned run {'; '.join(reasons)} (a loss geometry is declared; use geometry=None to "
                "account this training by composition)")

    def record(self, step: StepFacts, count: int = 1) -> None:
        """Appends ``count`` identical steps."""
        if not isinstance(step, StepFacts):
            raise v.ParameterError("step", f"must be StepFacts, got {type(step).__name__}")
        count = v.positive_int("count", count)
        if self._steps == 0:
            self.check(step)
            if count > 1:
                self._check_divisor(step, 0, count)
        else:
            self._check_accountable(step, self._steps, count)
        step = effective_step(step)  # the ledger holds one-device steps
        self._use_feature_check(step, count)
        if self._ledger and self._ledger[-1][0] == step:
            self._ledger[-1][1] += count
        else:
            self._ledger.append([step, count])
        self._steps += count

    def reset(self) -> None:
        self._ledger, self._steps = [], 0
        self._feature_cover, self._restored_steps = 0.0, 0

    # ------------------------------------------------- what the data decides, and the loss
    @property
    def feature_norm_bound(self) -> Optional[float]:
        """``R`` of the declared geometry (``None``: nothing about the features is claimed)."""
        return None if self.geometry is None else self.geometry.feature_norm_bound

    @property
    def feature_clip_norm(self) -> Optional[float]:
        """The radius of the model's feature clip that enforces :attr:`feature_norm_bound`, or ``None``."""
        if self.feature_norm_bound is None or self.model is None:
            return None
        return self.model.feature_clip_norm  # never above the bound: refused at construction

    @property
    def needs_feature_checks(self) -> bool:
        """Whether the adapter must report the largest input norm of the trainable layer for the data
        of every step before the step is taken (:meth:`check_feature_norm`): a feature bound is
        declared, no feature clip in the model enforces it, and this is not a planned run."""
        return (self.feature_norm_bound is not None and self.feature_clip_norm is None and not self.planned
                and self._feature_claim is None)

    def check_feature_norm(self, largest: float, what: str, steps: Optional[int] = 1) -> None:
        """The adapter observed ``largest``, the largest L2 norm of an input of the trainable layer in
        ``what`` (e.g. "the batch of step 12"; per example, all dimensions but the first), before the
        steps it feeds are taken; it covers the
        next ``steps`` recorded steps (``None``: every step until the next check, for data checked
        in full before training).

        Raises :class:`~hidden_state_accountants.ParameterError` naming ``feature_norm_bound``, with
        the observed norm, when it exceeds the declared bound (or is not a finite number): the claim
        ends there, and the adapter raises it before the step is applied.
        """
        bound = self.feature_norm_bound
        if bound is None:
            return
        try:
            x = float(largest)
        except (TypeError, ValueError):
            raise v.ParameterError("largest", f"must be a number, got {largest!r}") from None
        if not (math.isfinite(x) and x <= bound):  # NaN and inf included
            raise v.ParameterError(
                "feature_norm_bound", f"in {what}, the trainable layer has an input of norm {x:.6g}, above the "
                f"declared bound {bound:g}: the declared smoothness does not hold for it, so the claim ends before "
                "a step is taken on it (clip the features, or declare the bound the data has)")
        self._feature_largest = x if self._feature_largest is None else max(self._feature_largest, x)
        self._feature_cover = math.inf if steps is None else float(v.positive_int("steps", steps))

    def feature_norm_unobservable(self, why: str) -> None:
        """The adapter can neither see a feature clip nor the trainable layer's inputs (``why``).
        With ``assume_convex_model`` the bound is then part of the user's claim (noted); otherwise it
        is an error naming ``feature_norm_bound``."""
        if self.feature_norm_bound is None or self.feature_clip_norm is not None:
            return
        if not self.assume_convex_model:
            raise v.ParameterError("feature_norm_bound", f"{self.feature_norm_bound:g} can be neither enforced nor "
                                                         f"checked: {why}")
        self._feature_claim = why

    def restore_feature_norm(self, largest: Optional[float], subject: str) -> None:
        """For a ledger loaded from a checkpoint (:meth:`load_ledger_state`, e.g. the Keras callback's
        state applied to the recorder of the model being trained): ``largest``, the input norm its
        steps are known to stay below, as the state stored it (``None``: unknown). Raises naming
        ``checkpoint`` when that does not back the declared bound."""
        bound = self.feature_norm_bound
        if largest is not None:
            largest = v.nonnegative_float("largest", largest)
        if bound is not None and self._restored_steps and (largest is None or largest > bound):
            known = "not known (taken without a checked feature bound)" if largest is None else f"{largest:.6g}"
            raise v.ParameterError(
                "checkpoint", f"{subject} has {self._restored_steps} steps whose largest input norm is {known}; "
                f"the declared feature_norm_bound {bound:g} does not cover them")
        self._feature_restored = largest

    @property
    def largest_feature_norm(self) -> Optional[float]:
        """A norm that every input of the trainable layer in the recorded steps stayed below (the
        feature clip's radius, or the largest checked), ``None`` when unknown or nothing was claimed."""
        if self.feature_norm_bound is None or not self._steps:
            return None
        values = [self._feature_restored] if self._restored_steps else []
        if self._steps > self._restored_steps:
            values.append(self.feature_clip_norm if self.feature_clip_norm is not None else self._feature_largest)
        return None if None in values else max(values)

    def _use_feature_check(self, step: StepFacts, count: int) -> None:
        """Rule 1b: a step that could back the claim must have had its data checked. (A step that is
        not the analysed update ends the hidden-state claim anyway; replayed steps were checked when
        they were first recorded.)"""
        if not self.needs_feature_checks or self._replaying or update_departure(step) is not None:
            return
        if self._feature_cover < count:
            first = self._steps + int(self._feature_cover)
            raise v.ParameterError(
                "feature_norm_bound", f"the inputs of the trainable layer in step {first} were not checked against "
                f"the declared bound {self.feature_norm_bound:g} before the step; the claim cannot cover it")
        self._feature_cover -= count

    def check_loss(self, kind: Optional[str], description: str) -> None:
        """The adapter's reading of the training loss: ``kind``, a key of
        :data:`~hidden_state_accountants.events.LOSSES` it matches (``"other"`` for none), or ``None``
        when the framework does not show the loss; ``description`` says what it is (or why it cannot
        be seen). A loss other than the one the geometry was derived from raises naming ``loss``."""
        assumed = None if self.geometry is None else self.geometry.loss
        if assumed is not None and kind is not None and kind != assumed:
            raise v.ParameterError(
                "loss", f"{description} is not the loss the geometry was derived from ({LOSSES[assumed]}): "
                "its smoothness is not the declared one (declare a LossGeometry for this loss, or geometry=None "
                "for composition)")
        self._loss = (kind, description)

    # ------------------------------------------------------------------- the run
    def reasons(self) -> List[str]:
        """Why the recorded steps do not back a hidden-state claim (empty when they do)."""
        if self.geometry is None:
            return [NO_GEOMETRY]
        steps = [s for s, _ in self._ledger]
        out: List[str] = []
        departures = sorted({d[1] for d in map(update_departure, steps) if d})
        out += departures
        for name, what in (("clip_norm", "the clip norm"), ("weight_decay", "the L2 regularisation"),
                           ("projection_diameter", "the projection")):
            if len({getattr(s, name) for s in steps}) > 1:
                out.append(f"{what} changed during training; the analyses assume it fixed")
        for name, what in (("learning_rate", "learning rate"), ("noise_multiplier", "noise multiplier")):
            if len({getattr(s, name) for s in steps}) > 1:
                out.append(f"the {what} changed during training; the hidden-state theorems assume it constant")
        out += sorted({problem for s in steps for _, problem in self._hidden_state_needs(s)})
        if self.schedule is None:
            for name, what in (("sample_rate", "sampling rate"), ("divisor", "divisor of the clipped sum")):
                if len({getattr(s, name) for s in steps}) > 1:
                    out.append(f"the {what} changed during training; the Poisson hidden-state analyses assume it "
                               "fixed")
        if not out and steps:
            try:
                check_geometry(self.geometry, weight_decay=_group_value(steps[0].weight_decay),
                               projection_diameter=steps[0].projection_diameter)
            except v.ParameterError as err:
                out.append(err.reason)
        return out

    def notes(self) -> List[str]:
        """Facts about the claim a report should state."""
        out = []
        if self.geometry is not None and self.assume_convex_model:
            out.append(ASSUMED_CONVEX_NOTE)
        out += self._geometry_notes()
        s = self.schedule
        if s is None:
            out.append("no batch schedule was declared: every step is accounted as Poisson sampling at the rate the "
                       "framework reports, which holds only if its data loader samples that way")
        elif s.is_random and not s.secret:
            out.append(f"the {s.sampling} batches are public (secret=False): only the bounds for the record's worst "
                       "positions apply")
        elif s.external:
            out.append(f"the {s.sampling} batches are drawn by the framework; the bound assumes its randomness is "
                       "unknown to the adversary (not seeded with a public value)")
        elif s.is_random and not s.seed_is_secret:
            out.append(f"the {s.sampling} schedule uses a seed chosen by the user; the bound assumes it is kept "
                       "as secret as the data")
        return out

    def _geometry_notes(self) -> List[str]:
        """What the declared geometry rests on: enforced, checked, or the user's claim."""
        g = self.geometry
        if g is None:
            return []
        out = []
        bound = g.feature_norm_bound
        if g.loss is None:
            given = (f"smoothness={g.smoothness:g}, strong_convexity={g.strong_convexity:g}"
                     + ("" if bound is None else f" for inputs of norm <= {bound:g}"))
            out.append(f"the declared geometry ({given}) is the user's claim: given by its constants, not derived "
                       "from a loss, it cannot be observed from the training run")
        if bound is not None:
            clip = self.feature_clip_norm
            if clip is not None:
                out.append(f"feature norm <= {bound:g}: enforced by the model's feature clip (max_norm={clip:g}) "
                           "in front of the trainable layer")
            elif self._feature_claim is not None:
                out.append(f"feature norm <= {bound:g} is the user's claim: {self._feature_claim}")
            elif not self.planned:
                seen = "none yet" if self._feature_largest is None else f"{self._feature_largest:.6g}"
                restored = (f"; the {self._restored_steps} steps restored from a checkpoint were checked when they "
                            "were taken" if self._restored_steps else "")
                out.append(f"feature norm <= {bound:g}: checked on the trainable layer's inputs before every step "
                           f"(largest seen {seen}){restored}")
        if g.loss is not None:
            kind, description = self._loss if self._loss is not None else (None, "the adapter did not observe it")
            if kind is None:
                out.append(f"the loss is the user's claim: the geometry assumes {LOSSES[g.loss]}; {description}")
            else:
                out.append(f"loss: {description}, as the geometry assumes")
        return out

    def run(self, *, steps: Optional[int] = None, warn: bool = True) -> TrainingRunDpEvent:
        """The event for the recorded steps (``steps`` more than recorded: the last step
        repeated, for planning), with the refusal reasons; warns once per reason."""
        if not self._ledger:
            raise v.ParameterError("steps", "no step has been recorded yet")
        ledger = [list(x) for x in self._ledger]
        if steps is not None:
            steps = v.positive_int("steps", steps)
            if steps < self._steps:
                raise v.ParameterError("steps", f"must be >= the {self._steps} steps recorded, got {steps}")
            ledger[-1][1] += steps - self._steps
        reasons = self.reasons()
        if warn:
            for r in reasons:
                if r not in self._warned:
                    self._warned.add(r)
                    warnings.warn(f"hidden-state analyses not applied ({r}); the composition bound is reported",
                                  CompositionFallbackWarning, stacklevel=3)
        return self._event(ledger, "; ".join(reasons) if reasons else None)

    def _event(self, ledger, refusal: Optional[str]) -> TrainingRunDpEvent:
        recs = [s for s, _ in ledger]
        counts = [c for _, c in ledger]

        def schedule_of(name, default):
            values = [_group_value(getattr(r, name)) if getattr(r, name) is not None else default for r in recs]
            if len(set(values)) == 1:
                return values[0]
            return tuple(x for x, c in zip(values, counts) for _ in range(c))

        clip = max((r.clip_norm for r in recs if r.clip_norm is not None), default=1.0)
        wds = {_group_value(r.weight_decay) if not isinstance(r.weight_decay, tuple) else None for r in recs}
        l2 = wds.pop() if len(wds) == 1 else None  # the L2 strength outside the batch sum, when fixed
        common = dict(steps=sum(counts), noise_multiplier=schedule_of("noise_multiplier", None),
                      clip_norm=clip, learning_rate=schedule_of("learning_rate", 1.0),
                      hidden_state_refusal=refusal, l2_regularization=l2)
        s = self.schedule
        if s is None:
            rates = [r.sample_rate for r in recs]
            if any(q is None for q in rates):
                raise v.ParameterError("sample_rate", "a Poisson step without a schedule must report its sample rate")
            q = max(rates)  # the Poisson composition grows with the rate: the largest covers every step
            n, b = poisson_sizes(q, self.dataset_size)
            geometry = None
            if self.geometry is not None and refusal is None:
                # the needs are met (reasons() is empty): n from the recorder, b the fixed divisor
                b = int(round(recs[0].divisor))
                geometry = check_geometry(self.geometry, weight_decay=_group_value(recs[0].weight_decay),
                                          projection_diameter=recs[0].projection_diameter)
            return TrainingRunDpEvent(dataset_size=n, batch_size=b, sampling=POISSON, sampling_probability=q,
                                      geometry=geometry, **common)
        geometry = None
        if self.geometry is not None and refusal is None:
            geometry = check_geometry(self.geometry, weight_decay=_group_value(recs[0].weight_decay),
                                      projection_diameter=recs[0].projection_diameter)
        extra = {}
        if s.sampling == POISSON and s.sampling_probability != s.batch_size / s.dataset_size:
            extra["sampling_probability"] = s.sampling_probability
        return TrainingRunDpEvent(dataset_size=s.dataset_size, batch_size=s.batch_size, sampling=s.sampling,
                                  geometry=geometry, gaussian_initialization=self.gaussian_initialization,
                                  last_batch=s.last_batch, secret_batches=s.secret, **extra, **common)

    # ------------------------------------------------------------- persistence
    def ledger_state(self) -> List[List[Any]]:
        """The ledger in plain Python types."""
        return [[s.to_dict(), c] for s, c in self._ledger]

    def load_ledger_state(self, state: Sequence[Sequence[Any]]) -> None:
        """Replaces the ledger (validated: every entry a known step with a positive count)."""
        if not isinstance(state, (list, tuple)):
            raise v.ParameterError("ledger", f"must be a list, got {type(state).__name__}")
        ledger = []
        for entry in state:
            if not isinstance(entry, (list, tuple)) or len(entry) != 2:
                raise v.ParameterError("ledger", f"every entry must be [step, count], got {entry!r}")
            step = effective_step(StepFacts.from_dict(entry[0]))
            count = entry[1]
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise v.ParameterError("ledger", f"a count must be a positive integer, got {count!r}")
            ledger.append([step, count])
        self._ledger = ledger
        self._steps = sum(c for _, c in ledger)
        self._restored_steps, self._feature_cover = self._steps, 0.0

    def record_restored(self, ledger: Sequence[Tuple[StepFacts, int]]) -> None:
        """Records the ``(step, count)`` entries of a stored ledger (a checkpoint's) through
        :meth:`record`, so each passes the checks it passed when it was first recorded, and marks
        them as restored: their data was checked against the feature bound when they were first
        taken (rule 1b), so they need no feature check now, and the notes and
        :meth:`restore_feature_norm` speak of them as restored."""
        self._replaying = True
        try:
            for step, count in ledger:
                self.record(step, count)
        finally:
            self._replaying = False
        self._restored_steps = self._steps


__all__ = [
    "NO_GEOMETRY",
    "HiddenStateWarning",
    "CompositionFallbackWarning",
    "StepFacts",
    "LayerFacts",
    "ModelFacts",
    "BatchSourceFacts",
    "RunRecorder",
    "unaccountable",
    "update_departure",
    "effective_step",
    "REPLICA_REDUCTIONS",
    "model_refusal",
    "check_batch_source",
    "check_geometry",
    "check_position",
]
