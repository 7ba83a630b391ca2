"""The recording layer: what a training framework did, turned into a privacy report.

Adapters (Opacus, Keras) only *read* their framework and hand the facts over; every decision about
whether those facts back a hidden-state claim is made here, the same way for every framework. This
docstring is the adapter policy; the adapters' guides (docs/opacus.md, docs/tf_privacy.md) and
docs/design.md link here.

* :class:`StepFacts`: what one optimiser step did (noise, clip norm, learning rate, the number the
  clipped sum is divided by, L2 outside clipping, projection, update rule, clipping mode, ...), in
  the hand-over vocabularies (:class:`OptimizerKind`, :class:`Clipping`, :class:`LossReduction`,
  :class:`ReplicaReduction`), validated when the facts are made.
* :class:`ModelFacts`: the model's structure, layer by layer (:class:`LayerKind`).
* :class:`BatchSourceFacts`: where the batches come from (a schedule of this package, or a
  description of something else).
* :class:`Claim`: what the run is accounted under, frozen and checked when made: the batch
  schedule, the declared geometry, the model's structure, the user's flags, the dataset size, the
  neighbouring relation (the one rule: :func:`~hidden_state_accountants.relations.resolve_relation`,
  each adapter stating its host's default) and what the adapter observed about the data (a feature
  bound it cannot observe, the loss). Checkpoints store it (:mod:`hidden_state_accountants.checkpoint`).
* :class:`RunRecorder` ``(claim)`` keeps a run-length-encoded ledger of steps;
  :meth:`RunRecorder.report` is the report for them (every analysis, the reasons a hidden-state
  analysis does not apply, the notes) in one call.

The policy, one for every framework:

1. **Contradictions known before training are errors.** With a declared geometry, a model
   that is not one linear map of its features, an update that is not plain DP-SGD (momentum,
   Adam, per-layer clipping, ...), ``strong_convexity`` above the L2 term applied outside
   clipping, a declared diameter without projection, ``learning_rate >= 2/smoothness``, or
   batches that do not come from the declared schedule raise
   :class:`~hidden_state_accountants.ParameterError` naming the parameter, at configuration or
   before the first step is accounted. So does a loss other than the one the geometry was derived
   from, and a model whose feature clip is wider than the declared feature bound. **The accounted
   schedule is the one trained on** (:func:`claim_for_source`): without a declared schedule, batches
   that are not the framework's Poisson sampling are accounted as the schedule they follow (a
   shuffled loader is ``reshuffle``, data order ``cyclic``), never as Poisson sampling, and refused
   when they follow none; an adapter that can see which loader hands out the batches checks it
   before each step (:func:`check_position`).
1b. **What the data decides is enforced or checked before each step.** A geometry with a
   ``feature_norm_bound`` holds only if every input of the trainable layer has that norm at most:
   *enforced* when the model's structure shows the package's feature clip (radius ``<=`` the bound)
   feeding the trainable layer (:attr:`ModelFacts.feature_clip_norm`), else *checked*: the adapter
   reports the largest input norm of the data of each step before the step is taken
   (:meth:`RunRecorder.check_feature_norm`), and a step recorded without such a check, or data above
   the bound, is an error naming ``feature_norm_bound`` (with the observed norm). What no adapter can
   observe (a geometry given by its constants, a loss the framework does not show, inputs it cannot
   see under ``assume_convex_model``) is the user's claim, and every report's notes say so.
1c. **A run starts from weights its ledger accounts for** (:func:`check_initial_weights`): weights
   the adapter saw loaded from storage without the run's privacy state are refused unless declared
   public (independent of the private data); a resumed run restores its ledger with its weights.
2. **Departures during training end the hidden-state claim.** If the learning rate, noise,
   clip norm, L2 strength or projection changes mid-run, or the update stops being plain
   DP-SGD, the run is accounted by composition (valid for any post-processing of the noisy
   gradients). :class:`CompositionFallbackWarning` is emitted once per reason, and the reason
   is in the report's notes.
3. **No geometry, no hidden-state claim**: composition, with the same warning.
4. **Not even composition holds** (adaptive clipping, whose clip norm follows the data; a
   divisor that does not match the schedule's batches; gradient accumulation over a
   schedule's batches): an error at the step where it is seen.

**What no adapter observes.** The adapters read the framework's objects, not the tensors a step
trains on: a loop that draws from the declared sampler but trains every step on other data (one
fixed batch, a second loader, data augmented with other records) departs from the accounted schedule
unseen (the records of a batch trained on at every step are in every step, which no sampling
analysis covers). So do weights set outside what the adapter reads (Opacus: ``load_state_dict`` of
a trained model; Keras: ``set_weights``, variables assigned directly), and iterates released
besides the last one (``epsilon_composition`` covers those). The claim rests on the training loop
doing what it declares; docs/opacus.md and docs/tf_privacy.md list what each adapter checks.

Projections and feature clips round in the safe direction by one rule
(:mod:`hidden_state_accountants.projection`); a kept short batch is the last step of every epoch
(:func:`batch_records`).
"""

from __future__ import annotations

import enum
import math
import warnings
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import attr

from hidden_state_accountants import validation as v
from hidden_state_accountants.accountant import HiddenStateAccountant, PrivacyReport
from hidden_state_accountants.errors import NO_GEOMETRY, CompositionFallbackWarning, HiddenStateWarning  # re-exported
from hidden_state_accountants.events import LOSSES, LossGeometry, TrainingRunDpEvent, check_learning_rate
from hidden_state_accountants.relations import REPLACE_ONE, NeighborRel, parse_relation, resolve_relation
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


# ------------------------------------------------------------------------- vocabularies
class Vocabulary(str, enum.Enum):
    """A closed vocabulary of the hand-over: each member is (and compares equal to) its value, the
    string the ledger stores; anything else is refused when the facts are made."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, name: str, value: Any) -> "Vocabulary":
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise v.ParameterError(name, f"must be one of {', '.join(m.value for m in cls)}, got {value!r}") from None


class OptimizerKind(Vocabulary):
    """The update rule applied to the noisy gradient (only ``sgd`` is the analysed one)."""

    SGD = "sgd"
    ADAM = "adam"
    ADAMW = "adamw"
    ADAGRAD = "adagrad"
    RMSPROP = "rmsprop"
    OTHER = "other"

    @classmethod
    def named(cls, class_name: str) -> "OptimizerKind":
        """The kind of a framework's optimizer class, by its name (``"Adam"`` -> ``adam``);
        ``other`` for names outside the vocabulary. Adapters decide ``sgd`` by class, not by name."""
        lowered = class_name.lower()
        return next((m for m in cls if m.value == lowered and m is not cls.SGD), cls.OTHER)


class Clipping(Vocabulary):
    FLAT = "flat"
    PER_LAYER = "per_layer"
    ADAPTIVE = "adaptive"


class LossReduction(Vocabulary):
    MEAN = "mean"
    SUM = "sum"


class ReplicaReduction(Vocabulary):
    """How a data-parallel framework combines its replicas' updates."""

    SUM = "sum"
    MEAN = "mean"


class LayerKind(Vocabulary):
    """``affine``: a dense linear map with bias and no activation; ``random``: draws randomness in
    training (dropout); ``other``: everything else."""

    AFFINE = "affine"
    RANDOM = "random"
    OTHER = "other"


def _in(vocabulary, name: str):
    return lambda value: vocabulary.parse(name, value)


# ------------------------------------------------------------------------------ facts
Number = Union[float, Tuple[float, ...]]


def _number_or_groups(value):
    """A float, or a tuple of per-parameter-group floats (reduced to one value when equal)."""
    if isinstance(value, (list, tuple)):
        values = tuple(float(x) for x in value)
        return values[0] if len(set(values)) == 1 else values
    return None if value is None else float(value)


def _plain(value):
    """A fact's value in plain JSON types."""
    if isinstance(value, tuple):
        return list(value)
    return value.value if isinstance(value, Vocabulary) else value


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
      optimizer: the update applied to the noisy gradient (:class:`OptimizerKind`; ``sgd`` for
        a plain step).
      momentum, nesterov: SGD momentum settings.
      clipping: :class:`Clipping`: ``flat``, ``per_layer`` or ``adaptive``.
      loss_reduction: :class:`LossReduction`: ``mean`` or ``sum``.
      accumulation: batches (or optimiser calls) whose gradients one update applies.
      postprocessing: anything applied to the noisy gradient before the step (e.g. Keras'
        ``clipnorm``), described, or ``None``.
      sampling_probability: the probability a record is in the step's batch, for Poisson steps whose
        rate the framework reports (Opacus' ``sample_rate``), else ``None``.
      replicas: data-parallel replicas that each compute the update on their part of the
        batch (``tf.distribute``, ``torch.distributed``); 1 for one device. With several,
        ``divisor`` is the number each replica divides its clipped sum and noise by, and
        :func:`effective_step` is the one-device step the replicas add up to.
      replica_reduction: :class:`ReplicaReduction`: how the framework combines the replicas'
        updates, ``sum`` or ``mean``.
      replica_share: each replica adds ``1/replica_share`` of the noise variance
        ``(noise_multiplier * clip_norm)^2`` and of the L2 term ``weight_decay * theta``
        (1: each adds them in full, as an optimizer that knows nothing of replicas does).
      l2_after_reduction: the L2 term ``weight_decay * theta`` is applied once, to the combined
        update (the replicas reduce their noisy gradients and one optimizer step follows, e.g.
        Opacus' ``DistributedDPOptimizer``), not by each replica; ``replica_share`` then
        concerns the noise only.
      clip_margin: how far below ``clip_norm`` the framework's clip starts rescaling a per-example
        gradient (0 for ``min(1, C/|g|)``; Opacus divides by ``|g| + 1e-6``: 1e-6). A clip that never
        binds is one whose ``clip_norm - clip_margin`` no gradient reaches.
    """

    noise_multiplier: float = attr.ib(converter=float)
    clip_norm: Optional[float] = attr.ib(default=None, converter=attr.converters.optional(float))
    learning_rate: Optional[Number] = attr.ib(default=None, converter=_number_or_groups)
    divisor: Optional[float] = attr.ib(default=None, converter=attr.converters.optional(float))
    weight_decay: Number = attr.ib(default=0.0, converter=_number_or_groups)
    projection_diameter: Optional[float] = attr.ib(default=None, converter=attr.converters.optional(float))
    optimizer: OptimizerKind = attr.ib(default=OptimizerKind.SGD, converter=_in(OptimizerKind, "optimizer"))
    momentum: float = attr.ib(default=0.0, converter=float)
    nesterov: bool = attr.ib(default=False, converter=bool)
    clipping: Clipping = attr.ib(default=Clipping.FLAT, converter=_in(Clipping, "clipping"))
    loss_reduction: LossReduction = attr.ib(default=LossReduction.MEAN, converter=_in(LossReduction, "loss_reduction"))
    accumulation: int = attr.ib(default=1, converter=int)
    postprocessing: Optional[str] = attr.ib(default=None)
    sampling_probability: Optional[float] = attr.ib(default=None, converter=attr.converters.optional(float))
    replicas: int = attr.ib(default=1)
    replica_reduction: ReplicaReduction = attr.ib(
        default=ReplicaReduction.SUM, converter=_in(ReplicaReduction, "replica_reduction")
    )
    replica_share: int = attr.ib(default=1)
    l2_after_reduction: bool = attr.ib(default=False)
    clip_margin: float = attr.ib(default=0.0, converter=float)

    @clip_margin.validator
    def _check_margin(self, attribute, value):
        if not (math.isfinite(value) and value >= 0):
            raise v.ParameterError(attribute.name, f"must be a finite number >= 0, got {value!r}")

    @l2_after_reduction.validator
    def _check_flag(self, attribute, value):
        if not isinstance(value, bool):
            raise v.ParameterError(attribute.name, f"must be True or False, got {value!r}")

    @replicas.validator
    @replica_share.validator
    def _check_count(self, attribute, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise v.ParameterError(attribute.name, f"must be an integer >= 1, got {value!r}")

    def to_dict(self) -> Dict[str, Any]:
        return {k: _plain(x) for k, x in attr.asdict(self, recurse=False).items()}

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
    """One layer of a model, in the order the forward pass applies it: its :class:`LayerKind`, and
    whether it owns parameters that the optimiser updates (``trainable``)."""

    name: str = attr.ib()
    kind: LayerKind = attr.ib(converter=_in(LayerKind, "kind"))
    trainable: bool = attr.ib(converter=bool)

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "kind": self.kind.value, "trainable": self.trainable}


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
    outputs: Optional[int] = attr.ib(default=None)
    """The number of outputs (logits) of the one trainable affine layer (``out_features``, ``units``), or
    ``None`` when the adapter could not read it."""

    @outputs.validator
    def _check_outputs(self, attribute, value):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise v.ParameterError(attribute.name, f"must be None or an integer >= 1, got {value!r}")

    @property
    def classes(self) -> Optional[int]:
        """The classes the trainable layer's logits score: its outputs, with one output read as a binary
        model (one sigmoid logit); ``None`` when unknown."""
        return None if self.outputs is None else max(2, self.outputs)

    def structure(self) -> Tuple[Any, ...]:
        """What the checks read from the model, without the names (a framework may name the layers of
        the same model differently each time it builds it)."""
        return tuple((layer.kind, layer.trainable) for layer in self.layers), self.complete, self.feature_clip_norm


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
    poisson: bool = attr.ib(default=False)
    """The framework's own Poisson sampling (``schedule=None``): each record joins each batch
    independently at the rate the steps report (Opacus' ``DPDataLoader``). See :func:`claim_for_source`."""


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
    k = 1.0 if step.replica_reduction is ReplicaReduction.SUM else 1.0 / replicas
    ratio = replicas / step.replica_share  # exactly 1.0 when the replicas share the step evenly
    wd = step.weight_decay
    if not step.l2_after_reduction:
        wd = tuple(k * x * ratio for x in wd) if isinstance(wd, tuple) else k * wd * ratio
    return attr.evolve(
        step,
        replicas=1,
        replica_reduction=ReplicaReduction.SUM,
        replica_share=1,
        l2_after_reduction=False,
        noise_multiplier=step.noise_multiplier * math.sqrt(ratio),
        divisor=None if step.divisor is None else step.divisor / k,
        weight_decay=wd,
    )


# ---------------------------------------------------------------------------- decisions
def unaccountable(step: StepFacts) -> Optional[Tuple[str, str]]:
    """``(parameter, reason)`` when not even composition covers the step, else ``None``."""
    if step.clipping is Clipping.ADAPTIVE:
        return "clipping", "adaptive clipping changes the clip norm with the data; use flat clipping"
    if not (math.isfinite(step.noise_multiplier) and step.noise_multiplier >= 0):
        return "noise_multiplier", f"must be a finite number >= 0, got {step.noise_multiplier!r}"
    return None


def update_departure(step: StepFacts) -> Optional[Tuple[str, str]]:
    """``(parameter, reason)`` why the step is not the analysed DP-SGD update
    ``theta - lr [(1/b) sum clip_C(grad l_i) + m_reg theta + (z C/b) xi]``, else ``None``.
    Composition still covers such a step (any use of the noisy gradient is post-processing)."""
    if step.optimizer is not OptimizerKind.SGD:
        what = "an optimizer other than SGD" if step.optimizer is OptimizerKind.OTHER else step.optimizer.value
        return "optimizer", f"{what} applies its own update to the noisy gradient; the analyses assume plain SGD steps"
    if step.momentum != 0.0 or step.nesterov:
        return "momentum", (
            f"momentum={step.momentum:g}, nesterov={step.nesterov}: a momentum step is not a "
            "contraction of one gradient step; the analyses assume plain SGD"
        )
    if step.clipping is not Clipping.FLAT:
        return (
            "clipping",
            f"{step.clipping} clipping: the analyses assume flat clipping of the whole per-example gradient",
        )
    if step.loss_reduction is not LossReduction.MEAN:
        return "loss_reduction", f"loss_reduction='{step.loss_reduction}': the analyses assume 'mean'"
    if step.postprocessing:
        return (
            "optimizer",
            f"{step.postprocessing} post-processes the noisy gradient; the analyses assume it is applied as is",
        )
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
        return (
            "the model structure is unknown: pass the model so it can be checked, or "
            "assume_convex_model=True if you have verified convexity yourself"
        )
    what = model.description or "the model"
    hint = (
        "; no hidden-state analysis applies to it (geometry=None for composition; DP-SBCD trains ReLU "
        "networks with a composition bound too, not a hidden-state one; or assume_convex_model=True if you "
        "have verified that the loss is convex in the trainable parameters)"
    )
    if not model.complete:
        return f"the forward pass of {what} could not be read (custom code), so its convexity is unknown" + hint
    random = [layer.name for layer in model.layers if layer.kind is LayerKind.RANDOM]
    if random:
        return f"{what} draws randomness in training ({', '.join(random)}): the update is not the analysed one" + hint
    trainable = [i for i, layer in enumerate(model.layers) if layer.trainable]
    if len(trainable) != 1:
        names = ", ".join(model.layers[i].name for i in trainable) or "none"
        return (
            f"{what} has {len(trainable)} trainable layers ({names}): a composition of trainable layers is "
            "not convex in its parameters" + hint
            if trainable
            else f"{what} has no trainable layer"
        )
    i = trainable[0]
    layer = model.layers[i]
    if layer.kind is not LayerKind.AFFINE:
        return f"its trainable layer {layer.name} is not an affine map without activation" + hint
    after = [x.name for x in model.layers[i + 1 :]]
    if after:
        return (
            f"{', '.join(after)} follow the trainable layer {layer.name}: the loss must see its outputs "
            "directly (use logits and a from-logits loss)" + hint
        )
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
            "data",
            f"the batches do not come from a schedule of this package ({source.description}); "
            f"the {schedule.sampling!r} bounds need exactly that schedule",
        )
    if source.schedule.external and source.independent_draws > 1:
        raise v.ParameterError(
            "data",
            f"{source.description}: {source.independent_draws} processes each draw their own permutation "
            "and feed their part of it, so the global batches are not cut from one permutation; use a schedule of "
            "this package, which every process follows with a shared secret seed",
        )
    drawn_elsewhere = source.schedule.external or schedule.external
    if not (source.schedule.same_law(schedule) if drawn_elsewhere else source.schedule.same_schedule(schedule)):
        raise v.ParameterError(
            "data", f"the batches come from {source.schedule!r}, but the accountant was told {schedule!r}"
        )
    if schedule.secret and not source.schedule.secret:
        raise v.ParameterError(
            "data",
            f"the batches' randomness is public ({source.description}), but the claim assumes it secret "
            "(describe the schedule with secret=False)",
        )
    if source.steps_per_epoch is not None and source.steps_per_epoch != schedule.steps_per_epoch:
        raise v.ParameterError(
            "steps_per_epoch",
            f"training runs {source.steps_per_epoch} steps per epoch but {schedule.sampling} "
            f"with n={schedule.dataset_size}, b={schedule.batch_size} has {schedule.steps_per_epoch}",
        )
    if source.next_step is None:
        return
    if schedule.sampling not in EPOCH_ORDERS + (FULL,):
        check_position(source.next_step, steps, source.description)
    elif (source.next_step - steps) % schedule.steps_per_epoch:
        spe = schedule.steps_per_epoch
        raise v.ParameterError(
            "data",
            f"the run is at batch {steps % spe} of its {spe}-batch epoch but {source.description} starts at "
            f"batch {source.next_step % spe} (training stopped mid-epoch): records would be visited twice in one "
            "epoch; train whole epochs",
        )


def _poisson_needs(step: StepFacts) -> List[Tuple[str, str]]:
    """What a Poisson step without a package schedule lacks for a hidden-state claim: the analyses
    (docs/derivations.md sections 6-7) need the exact rate, a fixed whole-number divisor of the clipped sum
    (Opacus' expected batch size) and mean reduction."""
    out = []
    if step.sampling_probability is None:
        out.append(("sampling_probability", "the step does not report its sampling rate"))
    if step.loss_reduction is not LossReduction.MEAN or step.divisor is None:
        out.append(("divisor", "the number the clipped sum is divided by is unknown"))
    elif abs(step.divisor - round(step.divisor)) > 1e-9 * step.divisor or round(step.divisor) < 1:
        out.append(("divisor", f"the clipped sum is divided by {step.divisor:g}, not a whole number of records"))
    return out


def check_geometry(
    geometry: LossGeometry,
    *,
    weight_decay: float,
    projection_diameter: Optional[float],
    num_classes: Optional[int] = None,
) -> LossGeometry:
    """The declared geometry checked against what training enforces; returns the geometry to
    account (the projection's diameter filled in when none was declared, and the model's number of
    classes when the geometry derived from a loss does not declare it).

    Strong convexity can only come from the L2 term applied outside clipping (a clipped
    gradient is bounded, so it is not strongly monotone); a geometry derived from a loss
    (``LossGeometry.logistic_regression``) must have a smoothness that includes the L2 term the
    update applies; a declared diameter needs a projection onto a set no larger.
    """
    m = geometry.strong_convexity
    if m > weight_decay * (1 + 1e-9):
        raise v.ParameterError(
            "geometry",
            f"strong_convexity {m:g} exceeds the L2 regularisation applied outside clipping "
            f"({weight_decay:g}): clipped per-example gradients give no strong convexity of their own, so "
            "m can be at most that L2 strength (the package's L2 hooks apply it outside clipping)",
        )
    beta = geometry.loss_smoothness
    if beta is not None and geometry.smoothness < (beta + weight_decay) * (1 - 1e-9):
        # derived from a loss: the map clip_C(grad l_i) + wd * theta is (beta + wd)-smooth, not less
        raise v.ParameterError(
            "geometry",
            f"smoothness {geometry.smoothness:g} was derived with L2 strength "
            f"{geometry.smoothness - beta:g}, but the update applies {weight_decay:g} outside clipping, which makes "
            f"the per-example map {beta + weight_decay:g}-smooth; declare the geometry with that L2 strength",
        )
    if geometry.loss is not None and geometry.num_classes is None and num_classes is not None:
        geometry = attr.evolve(geometry, num_classes=num_classes)
    if geometry.diameter is None:
        if projection_diameter is not None:
            return attr.evolve(geometry, diameter=projection_diameter)
        return geometry
    if projection_diameter is None:
        raise v.ParameterError(
            "geometry",
            f"diameter {geometry.diameter:g} is declared but the parameters are not projected "
            "after every step (attach the package's projection)",
        )
    if projection_diameter > geometry.diameter * (1 + 1e-12):
        raise v.ParameterError(
            "geometry",
            f"declared diameter {geometry.diameter:g} is smaller than the diameter "
            f"{projection_diameter:.6g} of the set the parameters are projected onto",
        )
    return geometry


def check_position(batches_handed_out: int, steps: int, what: str) -> None:
    """Raises when fewer batches came from the schedule than steps were taken: the steps then
    used batches from elsewhere."""
    if batches_handed_out < steps:
        raise v.ParameterError(
            "data_loader",
            f"{what} has handed out {batches_handed_out} batches for {steps} steps: the batches did not come from it",
        )


def batch_records(schedule: BatchSchedule, step: int) -> int:
    """The records in the batch of 0-based ``step``: ``b``, except the short batch of ``n % b``
    records that a kept last batch (``last_batch`` not ``dropped``) adds as the last step of every
    epoch. (It is divided by its own size under ``kept_own_size``, by ``b`` under
    ``kept_batch_size``.) The one statement of where the short batch falls.

    >>> s = BatchSchedule(23, 5, "reshuffle", last_batch="kept_own_size")  # 4 full batches and 3 records
    >>> [batch_records(s, t) for t in range(6)]
    [5, 5, 5, 5, 3, 5]
    """
    b, spe = schedule.batch_size, schedule.steps_per_epoch
    if schedule.last_batch != DROPPED and step % spe == spe - 1:
        return schedule.dataset_size % b  # not 0: a kept last batch means b does not divide n
    return b


def _short_batches(schedule: BatchSchedule, first: int, count: int) -> int:
    """How many of the steps ``first .. first + count - 1`` take the kept short batch
    (:func:`batch_records`), without visiting them."""
    if schedule.last_batch == DROPPED or not schedule.dataset_size % schedule.batch_size:
        return 0
    spe = schedule.steps_per_epoch
    k0 = first + (spe - 1 - first) % spe  # the first short step at or after `first`
    return 0 if k0 >= first + count else (first + count - 1 - k0) // spe + 1


# ------------------------------------------------------------------------------ the claim
LossObservation = Tuple[Optional[str], str]


def _optional_relation(value):
    return None if value is None else parse_relation(value)


@attr.s(frozen=True, slots=True, kw_only=True)
class Claim:
    """What a run is accounted under, besides its steps: checked when it is made, the same for every
    adapter (rule 1 of the module docstring), and stored with the run's checkpoints.

    Attributes:
      schedule: the batch schedule (``None``: the framework's own Poisson sampler, whose rate each
        step reports as ``sampling_probability``).
      geometry: the declared :class:`~hidden_state_accountants.LossGeometry`, ``None`` for no
        hidden-state claim.
      model: the model's structure (needed with a geometry unless ``assume_convex_model``).
      assume_convex_model: accept the geometry for any model, on the user's word.
      gaussian_initialization: the user declares Chourasia et al.'s initialisation.
      dataset_size: ``n`` of a Poisson run without a schedule (needed there with a geometry); with
        a schedule it must be the schedule's (and is not stored twice).
      neighboring_relation: the relation the user asked for, or ``None`` for the rule of
        :func:`~hidden_state_accountants.relations.resolve_relation` with ``default_relation``.
      default_relation: the host library's convention (Opacus: ADD_OR_REMOVE_ONE; the TF-Privacy
        adapter: REPLACE_ONE).
      feature_unobservable: why the adapter can neither see a feature clip nor the trainable
        layer's inputs; the feature bound is then the user's claim (only with
        ``assume_convex_model``, else an error naming ``feature_norm_bound``).
      loss: ``(kind, description)`` of the training loss as the adapter observed it: ``kind`` a key
        of :data:`~hidden_state_accountants.events.LOSSES` (``"other"`` for none) or ``None`` when
        the framework does not show it; ``None``: not observed at all.
      planned: a run planned in advance (calibration, planning): no data to check.

    >>> from hidden_state_accountants import LossGeometry
    >>> Claim(schedule=BatchSchedule(100, 10, "cyclic"), geometry=LossGeometry(smoothness=1.0, strong_convexity=0.1))
    Traceback (most recent call last):
    ...
    hidden_state_accountants.errors.ParameterError: model: the model structure is unknown: pass the model so it can be checked, or assume_convex_model=True if you have verified convexity yourself
    """

    schedule: Optional[BatchSchedule] = attr.ib(default=None)
    geometry: Optional[LossGeometry] = attr.ib(default=None)
    model: Optional[ModelFacts] = attr.ib(default=None)
    assume_convex_model: bool = attr.ib(default=False)
    gaussian_initialization: bool = attr.ib(default=False)
    dataset_size: Optional[int] = attr.ib(default=None)
    neighboring_relation: Optional[NeighborRel] = attr.ib(default=None, converter=_optional_relation)
    default_relation: NeighborRel = attr.ib(default=REPLACE_ONE, converter=parse_relation)
    feature_unobservable: Optional[str] = attr.ib(default=None)
    loss: Optional[LossObservation] = attr.ib(default=None)
    planned: bool = attr.ib(default=False)

    def __attrs_post_init__(self) -> None:
        schedule, geometry, model = self.schedule, self.geometry, self.model
        if schedule is not None and not isinstance(schedule, BatchSchedule):
            raise v.ParameterError("schedule", f"must be a BatchSchedule or None, got {type(schedule).__name__}")
        if geometry is not None and not isinstance(geometry, LossGeometry):
            raise v.ParameterError("geometry", f"must be a LossGeometry or None, got {geometry!r}")
        if model is not None and not isinstance(model, ModelFacts):
            raise v.ParameterError("model", f"must be ModelFacts or None, got {type(model).__name__}")
        for name in ("assume_convex_model", "gaussian_initialization", "planned"):
            if not isinstance(getattr(self, name), bool):
                raise v.ParameterError(name, f"must be True or False, got {getattr(self, name)!r}")
        if self.dataset_size is not None:
            n = v.positive_int("dataset_size", self.dataset_size)
            if schedule is not None and n != schedule.dataset_size:
                raise v.ParameterError("dataset_size", f"{n} is not the schedule's {schedule.dataset_size}")
            object.__setattr__(self, "dataset_size", None if schedule is not None else n)
        if geometry is not None and schedule is None and self.dataset_size is None:
            raise v.ParameterError(
                "dataset_size",
                "a hidden-state claim for steps without a package schedule (Poisson sampling at "
                "the rate the framework reports) needs the dataset size",
            )
        if geometry is None:  # nothing about the data is claimed
            object.__setattr__(self, "feature_unobservable", None)
            return
        reason = model_refusal(model, self.assume_convex_model)
        if reason:
            raise v.ParameterError("model", reason)
        observed, declared = (None if model is None else model.classes), geometry.num_classes
        if geometry.loss is not None and None not in (observed, declared) and observed != declared:
            raise v.ParameterError(
                "num_classes",
                f"the geometry is declared for {declared} classes, but the model's trainable layer has "
                f"{model.outputs} output{'s' if model.outputs > 1 else ''} ({observed} classes)",
            )
        clip, bound = (None if model is None else model.feature_clip_norm), geometry.feature_norm_bound
        if clip is not None and bound is not None and clip > bound:
            raise v.ParameterError(
                "feature_norm_bound",
                f"the model's feature clip (max_norm={clip:g}) lets inputs of norm up to "
                f"{clip:g} reach the trainable layer, above the declared bound {bound:g}; clip to {bound:g} or "
                f"declare {clip:g}",
            )
        why = self.feature_unobservable
        if why is not None:
            if not isinstance(why, str) or not why:
                raise v.ParameterError("feature_unobservable", f"must be a reason or None, got {why!r}")
            if bound is None or clip is not None:  # nothing to observe: the bound is not claimed, or enforced
                object.__setattr__(self, "feature_unobservable", None)
            elif not self.assume_convex_model:
                raise v.ParameterError("feature_norm_bound", f"{bound:g} can be neither enforced nor checked: {why}")
        if self.loss is not None:
            kind, description = self.loss
            assumed = geometry.loss
            if assumed is not None and kind is not None and kind != assumed:
                raise v.ParameterError(
                    "loss",
                    f"{description} is not the loss the geometry was derived from ({LOSSES[assumed]}): "
                    "its smoothness is not the declared one (declare a LossGeometry for this loss, or geometry=None "
                    "for composition)",
                )

    # ------------------------------------------------------------------ derived
    @property
    def sampling(self) -> str:
        """The schedule's sampling, ``poisson`` for the framework's own sampler."""
        return POISSON if self.schedule is None else self.schedule.sampling

    def relation(self) -> Tuple[NeighborRel, Optional[str]]:
        """The relation every number is reported under, and the note saying why it is not the host's
        default when it is not (:func:`~hidden_state_accountants.relations.resolve_relation`)."""
        return resolve_relation(self.neighboring_relation, self.default_relation, self.sampling)

    @property
    def num_classes(self) -> Optional[int]:
        """The classes of a geometry derived from a loss: declared, else read from the model's trainable
        layer (``None``: unknown, or no such geometry)."""
        if self.geometry is None or self.geometry.loss is None:
            return None
        if self.geometry.num_classes is not None:
            return self.geometry.num_classes
        return None if self.model is None else self.model.classes

    @property
    def needs_feature_checks(self) -> bool:
        """Whether the adapter must report the largest input norm of the trainable layer for the data
        of every step before the step is taken: a feature bound is declared, no feature clip in the
        model enforces it, the adapter can see the inputs, and this is not a planned run."""
        return (
            self.geometry is not None
            and self.geometry.feature_norm_bound is not None
            and self.feature_clip_norm is None
            and not self.planned
            and self.feature_unobservable is None
        )

    @property
    def feature_clip_norm(self) -> Optional[float]:
        """The radius of the model's feature clip that enforces the declared feature bound, or ``None``."""
        if self.geometry is None or self.geometry.feature_norm_bound is None or self.model is None:
            return None
        return self.model.feature_clip_norm  # never above the bound: refused at construction

    def observed(self, **observations) -> "Claim":
        """This claim with what the adapter observed about the data (``loss``,
        ``feature_unobservable``), checked again."""
        unknown = set(observations) - {"loss", "feature_unobservable"}
        if unknown:
            raise v.ParameterError("observations", f"unknown {sorted(unknown)}")
        return attr.evolve(self, **observations)

    def accounted(self) -> Tuple[Any, ...]:
        """What the numbers depend on besides the steps (what a noise multiplier is calibrated for),
        for comparing two claims: the schedule, the geometry, the resolved relation, and the flags and
        the Poisson dataset size where a geometry reads them; not the model's structure or the
        observations, which only decide whether the claim holds."""
        with_geometry = self.geometry is not None
        return (
            self.schedule,
            self.geometry,
            self.relation()[0],
            self.assume_convex_model and with_geometry,
            self.gaussian_initialization and with_geometry,
            self.dataset_size if with_geometry else None,
        )

    def describe(self) -> str:
        """The claim in words, for messages."""
        if self.schedule is None:
            batches = "the framework's Poisson sampling"
            if self.dataset_size is not None:
                batches += f" of n={self.dataset_size} records"
        else:
            batches = f"the {self.schedule!r}"
        what = "composition only" if self.geometry is None else f"the declared {self.geometry}"
        flags = [f for f in ("assume_convex_model", "gaussian_initialization") if getattr(self, f)]
        return f"{batches}, {what}{''.join(f', {f}' for f in flags)}, under {self.relation()[0].name}"

    def recorder(self, steps: Iterable[Tuple["StepFacts", int]] = ()) -> "RunRecorder":
        """A recorder of a run under this claim, with ``(step, count)`` entries recorded through
        every check (e.g. a planned run). Every recorder of the package is made here."""
        recorder = RunRecorder(self)
        for step, count in steps:
            recorder.record(step, count)
        return recorder


# ------------------------------------------------------------------------------ recorder
def _group_value(x: Number) -> float:
    return x[0] if isinstance(x, tuple) else x


_REMEDY = " (a loss geometry is declared; use geometry=None to account this training by composition)"


def parse_ledger(state: Sequence[Sequence[Any]]) -> List[Tuple[StepFacts, int]]:
    """:meth:`RunRecorder.ledger_state` back as ``(step, count)`` entries (types and counts checked;
    the checks of the claim are the recorder's)."""
    if not isinstance(state, (list, tuple)):
        raise v.ParameterError("ledger", f"must be a list, got {type(state).__name__}")
    ledger = []
    for entry in state:
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            raise v.ParameterError("ledger", f"every entry must be [step, count], got {entry!r}")
        count = entry[1]
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise v.ParameterError("ledger", f"a count must be a positive integer, got {count!r}")
        ledger.append((effective_step(StepFacts.from_dict(entry[0])), count))
    return ledger


class RunRecorder:
    """A ledger of optimiser steps and the :class:`Claim` they are accounted under.

    ``record(step)`` appends a step (the first one, and each new kind of step, checked against the
    claim: rule 1 of the module docstring); :meth:`report` is the report for the steps so far;
    :meth:`run` the event it accounts.
    """

    def __init__(self, claim: Claim) -> None:
        if not isinstance(claim, Claim):
            raise v.ParameterError("claim", f"must be a Claim, got {type(claim).__name__}")
        self.claim = claim
        self._ledger: List[List[Any]] = []  # [StepFacts (one device), count]
        self._steps = 0
        self._warned: set = set()
        self._checked: Optional[StepFacts] = None  # the last step that passed the first-step checks
        self.accounted_geometry: Optional[LossGeometry] = None
        """The declared geometry as the checks of that step account it (the projection's diameter
        filled in where none was declared), ``None`` before or without one."""
        self._cache: Tuple[Any, Optional[PrivacyReport]] = (None, None)
        # what the data decides (feature norms): see the module docstring, rule 1b
        self._feature_largest: Optional[float] = None  # the largest input norm checked in this process
        self._feature_cover = 0.0  # steps the last check covers (inf: every step until the next check)
        self._feature_restored: Optional[float] = None  # the largest norm of a restored ledger's steps
        self._restored_steps = 0
        self._replaying = False

    # ------------------------------------------------------------------ ledger
    @property
    def steps(self) -> int:
        return self._steps

    @property
    def ledger(self) -> List[Tuple[StepFacts, int]]:
        return [(s, c) for s, c in self._ledger]

    def _check_accountable(self, raw: StepFacts, step: StepFacts, first: int, count: int) -> None:
        """Rule 4: raises when not even composition covers ``step`` (``raw``'s one-device step)
        at steps ``first .. first + count - 1`` of this schedule."""
        problem = unaccountable(step)
        if problem:
            raise v.ParameterError(*problem)
        s = self.claim.schedule
        if s is not None:
            if step.accumulation != 1:
                raise v.ParameterError(
                    "accumulation",
                    f"{step.accumulation} batches per update (gradient accumulation) are not the "
                    f"{s.sampling} schedule; take one optimiser step per batch",
                )
            self._check_divisor(raw, step, first, count)

    def _check_claim(self, step: StepFacts) -> None:
        """Rule 1 for a one-device step that is to back the claim (once per kind of step)."""
        geometry = self.claim.geometry
        if geometry is None or step == self._checked:
            return
        departure = update_departure(step)
        if departure:
            raise v.ParameterError(departure[0], departure[1] + _REMEDY)
        for param, problem in self._hidden_state_needs(step):
            raise v.ParameterError(param, problem + _REMEDY)
        wd = _group_value(step.weight_decay)
        accounted = check_geometry(
            geometry,
            weight_decay=wd,
            projection_diameter=step.projection_diameter,
            num_classes=self.claim.num_classes,
        )
        if accounted.strong_convexity < wd * (1 - 1e-9) and "loose" not in self._warned:
            self._warned.add("loose")
            warnings.warn(
                f"declared strong_convexity {accounted.strong_convexity:g} is below the L2 regularisation {wd:g}: "
                "valid but loose; the declared smoothness must include the L2 term",
                HiddenStateWarning,
                stacklevel=4,
            )
        check_learning_rate(_group_value(step.learning_rate), accounted)
        self._checked, self.accounted_geometry = step, accounted

    def check(self, step: StepFacts, position: Optional[int] = None) -> None:
        """The checks of the first step, usable before any step runs (rule 1); ``position``:
        the step's index in the run (default: the next one), which fixes whether it is a
        kept short batch."""
        one = effective_step(step)
        self._check_accountable(step, one, self._steps if position is None else position, 1)
        self._check_claim(one)

    def _hidden_state_needs(self, step: StepFacts) -> List[Tuple[str, str]]:
        """What a Poisson step lacks for the Poisson hidden-state analyses (none for other schedules):
        without a package schedule, the rate and a whole-number divisor; with a package Poisson
        schedule, the divisor must be its batch size ``b`` (the analyses divide by ``b``)."""
        s = self.claim.schedule
        if s is None:
            return _poisson_needs(step)
        mean = step.loss_reduction is LossReduction.MEAN
        if s.sampling == POISSON and (
            not mean or step.divisor is None or abs(step.divisor - s.batch_size) > 1e-9 * s.batch_size
        ):
            got = "an unknown number" if step.divisor is None or not mean else f"{step.divisor:g}"
            return [
                (
                    "batch_size",
                    f"the Poisson schedule's divisor is its expected batch size {s.batch_size}, but "
                    f"the update divides the clipped sum by {got}",
                )
            ]
        return []

    def _check_divisor(self, raw: StepFacts, step: StepFacts, first: int, count: int) -> None:
        """Not even composition holds when the clipped sum is divided by another number than
        the schedule's batches hold (rule 4). A kept short batch (:func:`batch_records`) is the
        last step of every epoch; its divisor must be known and be what the schedule says."""
        s = self.claim.schedule
        if s is None or s.sampling == POISSON or step.loss_reduction is not LossReduction.MEAN:
            return
        b = s.batch_size
        shorts = _short_batches(s, first, count)
        if s.last_batch != DROPPED and step.divisor is None:
            raise v.ParameterError(
                "batch_size",
                f"the schedule keeps a short batch ({s.last_batch}) but the step's divisor is "
                "unknown; it must be recorded to account the short batch",
            )
        r = s.dataset_size % b
        expected = set()
        if shorts:
            expected.add(r if s.last_batch == KEPT_OWN_SIZE else b)
        if count > shorts:
            expected.add(b)
        if len(expected) > 1:
            raise v.ParameterError(
                "batch_size",
                f"steps {first}..{first + count - 1} include the short batch of {r} records, "
                "divided by its own size: record that step on its own",
            )
        if step.divisor is not None and all(abs(step.divisor - d) > 1e-9 * d for d in expected):
            size = " or ".join(f"{d:g}" for d in sorted(expected))
            replicas = ""
            if raw.replicas > 1:
                how = "sums" if raw.replica_reduction is ReplicaReduction.SUM else "averages"
                replicas = (
                    f" ({raw.replicas} replicas each divide their part of the batch by {raw.divisor:g} and "
                    f"the framework {how} their updates: the effective learning rate is "
                    f"{min(expected) / step.divisor:.4g} times the one set)"
                )
            raise v.ParameterError(
                "batch_size",
                f"the update divides the clipped sum by {step.divisor:g} but the schedule's "
                f"batch at step {first} holds {size} records{replicas}",
            )

    def check_plan(
        self, planned: Sequence[StepFacts], start: Optional[int] = None, counts: Optional[Sequence[int]] = None
    ) -> None:
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
        ones = [effective_step(s) for s in planned]
        position = start
        for raw, one, count in zip(planned, ones, counts):
            self._check_accountable(raw, one, position, count)
            position += count
        self._check_claim(ones[0])
        # a clip that can bind on several classes is a fallback to composition, not an error (issue 27)
        reasons = self._hidden_state(ones, with_clip=False)[1]
        if self.claim.geometry is not None and reasons:
            raise v.ParameterError(
                "learning_rate" if any("learning rate" in r for r in reasons) else "optimizer",
                f"the planned run {'; '.join(reasons)}{_REMEDY}",
            )

    def record(self, step: StepFacts, count: int = 1) -> None:
        """Appends ``count`` identical steps."""
        if not isinstance(step, StepFacts):
            raise v.ParameterError("step", f"must be StepFacts, got {type(step).__name__}")
        count = v.positive_int("count", count)
        one = effective_step(step)  # the ledger holds one-device steps
        self._check_accountable(step, one, self._steps, count)
        if self._steps == 0:
            self._check_claim(one)
        self._use_feature_check(one, count)
        if self._ledger and self._ledger[-1][0] == one:
            self._ledger[-1][1] += count
        else:
            self._ledger.append([one, count])
        self._steps += count

    def record_restored(self, ledger: Iterable[Tuple[StepFacts, int]]) -> None:
        """Records the ``(step, count)`` entries of a stored ledger (a checkpoint's) through
        :meth:`record`, so each passes the checks it passed when it was first recorded, and marks
        them as restored: their data was checked against the feature bound when they were first
        taken (rule 1b), so they need no feature check now (:meth:`restore_feature_norm` says what
        they stayed below), and the notes speak of them as restored."""
        self._replaying = True
        try:
            for step, count in ledger:
                self.record(step, count)
        finally:
            self._replaying = False
        self._restored_steps, self._feature_cover = self._steps, 0.0

    def restore_feature_norm(self, largest: Optional[float], subject: str) -> None:
        """For restored steps (:meth:`record_restored`): ``largest``, the input norm the state says
        they stayed below (``None``: unknown). Raises naming ``checkpoint`` (beginning with
        ``subject``) when that does not back the declared bound; unknown is accepted only where the
        claim says the bound cannot be observed (the user's claim, :attr:`Claim.feature_unobservable`)."""
        bound = self.feature_norm_bound
        if largest is not None:
            largest = v.nonnegative_float("largest", largest)
        claimed = self.claim.feature_unobservable is not None
        if (
            bound is not None
            and self._restored_steps
            and (largest is None and not claimed or largest is not None and largest > bound)
        ):
            known = "not known (taken without a checked feature bound)" if largest is None else f"{largest:.6g}"
            raise v.ParameterError(
                "checkpoint",
                f"{subject} has {self._restored_steps} steps whose largest input norm is {known}; "
                f"the declared feature_norm_bound {bound:g} does not cover them",
            )
        self._feature_restored = largest

    # ------------------------------------------------- what the data decides, and the loss
    @property
    def feature_norm_bound(self) -> Optional[float]:
        """``R`` of the declared geometry (``None``: nothing about the features is claimed)."""
        return None if self.claim.geometry is None else self.claim.geometry.feature_norm_bound

    @property
    def needs_feature_checks(self) -> bool:
        """:attr:`Claim.needs_feature_checks`: the adapter reports the inputs' largest norm before every step."""
        return self.claim.needs_feature_checks

    def check_feature_norm(self, largest: float, what: str, steps: Optional[int] = 1) -> None:
        """The adapter observed ``largest``, the largest L2 norm of an input of the trainable layer in
        ``what`` (e.g. "the batch of step 12"; per example, all dimensions but the first), before the
        steps it feeds are taken; it covers the next ``steps`` recorded steps (``None``: every step
        until the next check, for data checked in full before training).

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
                "feature_norm_bound",
                f"in {what}, the trainable layer has an input of norm {x!r}, above the declared bound {bound:g}"
                f"{'' if not math.isfinite(x) else f' by {x - bound:.3g}'}: the declared smoothness does not hold "
                "for it, so the claim ends before a step is taken on it (clip the features with the package's "
                "FeatureClip or clip_features, which round inside the ball: dividing by the norm in float32 can "
                "leave a norm a few roundings above it; or declare the bound the data has)",
            )
        self._feature_largest = x if self._feature_largest is None else max(self._feature_largest, x)
        self._feature_cover = math.inf if steps is None else float(v.positive_int("steps", steps))

    def observe(self, **observations) -> None:
        """What the adapter observed about the data (:meth:`Claim.observed`: ``loss=(kind,
        description)``, ``feature_unobservable=why``), checked against the claim now."""
        self.claim = self.claim.observed(**observations)
        self._cache = (None, None)

    @property
    def largest_feature_norm(self) -> Optional[float]:
        """A norm that every input of the trainable layer in the recorded steps stayed below (the
        feature clip's radius, or the largest checked), ``None`` when unknown or nothing was claimed."""
        if self.feature_norm_bound is None or not self._steps:
            return None
        values = [self._feature_restored] if self._restored_steps else []
        if self._steps > self._restored_steps:
            clip = self.claim.feature_clip_norm
            values.append(clip if clip is not None else self._feature_largest)
        return None if None in values else max(values)

    def _use_feature_check(self, step: StepFacts, count: int) -> None:
        """Rule 1b: a step that could back the claim must have had its data checked. (A step that is
        not the analysed update ends the hidden-state claim anyway; replayed steps were checked when
        they were first recorded.)"""
        if not self.claim.needs_feature_checks or self._replaying or update_departure(step) is not None:
            return
        if self._feature_cover < count:
            first = self._steps + int(self._feature_cover)
            raise v.ParameterError(
                "feature_norm_bound",
                f"the inputs of the trainable layer in step {first} were not checked against "
                f"the declared bound {self.feature_norm_bound:g} before the step; the claim cannot cover it",
            )
        self._feature_cover -= count

    # ------------------------------------------------------------------- the run
    def _hidden_state(
        self, steps: Sequence[StepFacts], with_clip: bool = True
    ) -> Tuple[Optional[LossGeometry], List[str]]:
        """The geometry the analyses account for ``steps`` (one-device), or ``None`` with the reasons
        they do not back a hidden-state claim (``with_clip=False``: not counting a clip that can bind on
        several classes)."""
        geometry = self.claim.geometry
        if geometry is None:
            return None, [NO_GEOMETRY]
        out: List[str] = sorted({d[1] for d in map(update_departure, steps) if d})
        for name, what in (
            ("clip_norm", "the clip norm"),
            ("weight_decay", "the L2 regularisation"),
            ("projection_diameter", "the projection"),
        ):
            if len({getattr(s, name) for s in steps}) > 1:
                out.append(f"{what} changed during training; the analyses assume it fixed")
        for name, what in (("learning_rate", "learning rate"), ("noise_multiplier", "noise multiplier")):
            if len({getattr(s, name) for s in steps}) > 1:
                out.append(f"the {what} changed during training; the hidden-state theorems assume it constant")
        out += sorted({problem for s in steps for _, problem in self._hidden_state_needs(s)})
        if self.claim.schedule is None:
            for name, what in (("sampling_probability", "sampling rate"), ("divisor", "divisor of the clipped sum")):
                if len({getattr(s, name) for s in steps}) > 1:
                    out.append(f"the {what} changed during training; the Poisson hidden-state analyses assume it fixed")
        if out or not steps:
            return None, out
        try:
            accounted = check_geometry(
                geometry,
                weight_decay=_group_value(steps[0].weight_decay),
                projection_diameter=steps[0].projection_diameter,
                num_classes=self.claim.num_classes,
            )
        except v.ParameterError as err:
            return None, [err.reason]
        # the constants must hold for the map the framework's clip really computes
        binding = with_clip and accounted.clipped_map_refusal(steps[0].clip_norm, max(s.clip_margin for s in steps))
        return (None, [binding]) if binding else (accounted, [])

    def reasons(self) -> List[str]:
        """Why the recorded steps do not back a hidden-state claim (empty when they do)."""
        return self._hidden_state([s for s, _ in self._ledger])[1]

    def notes(self) -> List[str]:
        """Facts about the claim a report should state (the last: why the relation is not the host's default,
        when it is not)."""
        c = self.claim
        out = []
        if c.geometry is not None and c.assume_convex_model:
            out.append(ASSUMED_CONVEX_NOTE)
        out += self._geometry_notes()
        s = c.schedule
        if s is None:
            out.append(
                "no batch schedule was declared: every step is accounted as Poisson sampling at the rate the "
                "framework reports, which holds only if its data loader samples that way, with draws unknown to the "
                "adversary (Opacus' DPDataLoader draws from torch's generator: seeded with a public value, e.g. "
                "torch.manual_seed(0) in a published script, the batches are public and no sampling amplification "
                "holds; Opacus' secure_mode draws them from a cryptographically secure generator)"
            )
        elif s.is_random and not s.secret:
            out.append(
                f"the {s.sampling} batches are public (secret=False): only the bounds for the record's worst "
                "positions apply"
            )
        elif s.external:
            out.append(
                f"the {s.sampling} batches are drawn by the framework; the bound assumes its randomness is "
                "unknown to the adversary (not seeded with a public value)"
            )
        elif s.is_random and not s.seed_is_secret:
            out.append(
                f"the {s.sampling} schedule uses a seed chosen by the user; the bound assumes it is kept "
                "as secret as the data"
            )
        relation_note = c.relation()[1]  # why the relation is not the host's default, when it is not
        return out + ([relation_note] if relation_note else [])

    def _geometry_notes(self) -> List[str]:
        """What the declared geometry rests on: enforced, checked, or the user's claim."""
        c = self.claim
        g = c.geometry
        if g is None:
            return []
        out = []
        bound = g.feature_norm_bound
        if g.loss is None:
            given = f"smoothness={g.smoothness:g}, strong_convexity={g.strong_convexity:g}" + (
                "" if bound is None else f" for inputs of norm <= {bound:g}"
            )
            out.append(
                f"the declared geometry ({given}) is the user's claim: given by its constants, not derived "
                "from a loss, it cannot be observed from the training run"
            )
        if bound is not None:
            clip = c.feature_clip_norm
            if clip is not None:
                out.append(
                    f"feature norm <= {bound:g}: enforced by the model's feature clip (max_norm={clip:g}) "
                    "in front of the trainable layer"
                )
            elif c.feature_unobservable is not None:
                out.append(f"feature norm <= {bound:g} is the user's claim: {c.feature_unobservable}")
            elif not c.planned:
                seen = "none yet" if self._feature_largest is None else f"{self._feature_largest:.6g}"
                restored = (
                    f"; the {self._restored_steps} steps restored from a checkpoint were checked when they were taken"
                    if self._restored_steps
                    else ""
                )
                out.append(
                    f"feature norm <= {bound:g}: checked on the trainable layer's inputs before every step "
                    f"(largest seen {seen}){restored}"
                )
        if g.loss is not None:
            kind, description = c.loss if c.loss is not None else (None, "the adapter did not observe it")
            if kind is None:
                out.append(f"the loss is the user's claim: the geometry assumes {LOSSES[g.loss]}; {description}")
            else:
                out.append(f"loss: {description}, as the geometry assumes")
        return out

    def _planned_ledger(self, plan: Iterable[Tuple[StepFacts, int]], steps: Optional[int]) -> List[List[Any]]:
        ledger = [list(x) for x in self._ledger]
        for step, count in plan:
            one = effective_step(step)
            if ledger and ledger[-1][0] == one:
                ledger[-1][1] += count
            else:
                ledger.append([one, v.positive_int("count", count)])
        if not ledger:
            raise v.ParameterError("steps", "no step has been recorded yet")
        recorded = sum(c for _, c in ledger)
        if steps is not None:
            steps = v.positive_int("steps", steps)
            if steps < recorded:
                raise v.ParameterError("steps", f"must be >= the {recorded} steps recorded, got {steps}")
            ledger[-1][1] += steps - recorded
        return ledger

    def run(
        self, *, plan: Iterable[Tuple[StepFacts, int]] = (), steps: Optional[int] = None, warn: bool = True
    ) -> TrainingRunDpEvent:
        """The event for the recorded steps, followed by the ``(step, count)`` entries of ``plan``
        (steps planned, not taken: checked with :meth:`check_plan`) and, when ``steps`` is more than
        those, the last step repeated; with the refusal reasons. Warns once per reason."""
        ledger = self._planned_ledger(plan, steps)
        geometry, reasons = self._hidden_state([s for s, _ in ledger])
        if warn:
            for r in reasons:
                if r not in self._warned:
                    self._warned.add(r)
                    warnings.warn(
                        f"hidden-state analyses not applied ({r}); the composition bound is reported",
                        CompositionFallbackWarning,
                        stacklevel=3,
                    )
        return self._event(ledger, geometry, "; ".join(reasons) if reasons else None)

    def _event(self, ledger, geometry: Optional[LossGeometry], refusal: Optional[str]) -> TrainingRunDpEvent:
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
        common = dict(
            steps=sum(counts),
            noise_multiplier=schedule_of("noise_multiplier", None),
            clip_norm=clip,
            learning_rate=schedule_of("learning_rate", 1.0),
            hidden_state_refusal=refusal,
            l2_regularization=l2,
            geometry=geometry,
        )
        s = self.claim.schedule
        if s is None:
            rates = [r.sampling_probability for r in recs]
            if any(q is None for q in rates):
                raise v.ParameterError(
                    "sampling_probability", "a Poisson step without a schedule must report its sampling probability"
                )
            q = max(rates)  # the Poisson composition grows with the rate: the largest covers every step
            n, b = poisson_sizes(q, self.claim.dataset_size)
            if geometry is not None:  # the needs are met: n from the claim, b the fixed divisor
                b = int(round(recs[0].divisor))
            return TrainingRunDpEvent(dataset_size=n, batch_size=b, sampling=POISSON, sampling_probability=q, **common)
        extra = {}
        if s.sampling == POISSON and s.sampling_probability != s.batch_size / s.dataset_size:
            extra["sampling_probability"] = s.sampling_probability
        if s.epoch_steps is not None:
            extra["epoch_steps"] = s.epoch_steps
        return TrainingRunDpEvent(
            dataset_size=s.dataset_size,
            batch_size=s.batch_size,
            sampling=s.sampling,
            gaussian_initialization=self.claim.gaussian_initialization,
            last_batch=s.last_batch,
            secret_batches=s.secret,
            **extra,
            **common,
        )

    def report(
        self,
        delta: float,
        *,
        plan: Iterable[Tuple[StepFacts, int]] = (),
        steps: Optional[int] = None,
        warn: bool = True,
    ) -> PrivacyReport:
        """The report for the recorded steps (and a ``plan``, as :meth:`run`): every analysis with its
        epsilon or why it does not apply, under the claim's relation (:meth:`Claim.relation`), with the
        reasons for a composition fallback and the notes. Epsilon 0 before any step."""
        plan = list(plan)
        relation = self.claim.relation()[0]
        if not self._steps and not plan:
            return HiddenStateAccountant(neighboring_relation=relation).explain(delta)
        run = self.run(plan=plan, steps=steps, warn=warn)
        key = (run, float(delta), relation, self.claim)
        if self._cache[0] != key:
            report = HiddenStateAccountant(neighboring_relation=relation).compose(run).explain(delta)
            report.notes.extend(self.notes())
            self._cache = (key, report)
        return self._cache[1]

    # ------------------------------------------------------------- persistence
    def ledger_state(self) -> List[List[Any]]:
        """The ledger in plain Python types."""
        return [[s.to_dict(), c] for s, c in self._ledger]


# --------------------------------------------- what a run trains on and starts from (issue 29)
def claim_for_source(claim: Claim, source: BatchSourceFacts, steps: int = 0) -> Claim:
    """The claim a run is accounted under once ``source`` says where its batches come from (the
    loader the framework trains on): the accounted schedule is the one trained on.

    * ``claim`` has a schedule: the batches must come from it (:func:`check_batch_source`); ``claim``.
    * ``claim`` has none (each step Poisson-sampled at the rate it reports): ``claim`` when ``source``
      is the framework's Poisson sampling (``source.poisson``). When ``source`` follows a schedule (a
      sampler of this package, ``DataLoader(shuffle=True)``'s framework-drawn ``reshuffle``, data
      order's ``cyclic``), the claim *is* that schedule, with the relation the rule of
      :func:`~hidden_state_accountants.relations.resolve_relation` gives it. Accounting fixed-size
      batches as Poisson sampling at ``1/steps_per_epoch`` would under-report: amplification by
      sampling needs each record to join each batch independently (n = 1500, b = 100, z = 1, 5 epochs
      of a shuffled loader: 28.37 by composition under REPLACE_ONE, where Poisson accounting says
      4.124 under ADD_OR_REMOVE_ONE, a relation no analysis of these batches covers). Any other
      source is refused (``data``): no analysis here covers it.

    ``steps``: the steps already recorded under ``claim``; its schedule cannot change after them.

    >>> from hidden_state_accountants.schedules import BatchSchedule
    >>> loader = BatchSourceFacts(schedule=BatchSchedule.framework(1500, 100, secret=False),
    ...                           description="DataLoader(batch_size=100, shuffle=True)")
    >>> c = claim_for_source(Claim(default_relation="ADD_OR_REMOVE_ONE"), loader)
    >>> c.schedule.sampling, c.relation()[0].name
    ('reshuffle', 'REPLACE_ONE')
    """
    if claim.schedule is not None:
        check_batch_source(claim.schedule, source, steps)
        return claim
    if source.poisson:
        return claim
    if source.schedule is None:
        raise v.ParameterError(
            "data",
            f"the batches come from {source.description}: neither the framework's Poisson sampling nor a "
            "schedule of this package, so no analysis here covers them (accounting them as Poisson sampling "
            "at the rate the framework reports would under-report); use a sampler of this package",
        )
    if steps:
        raise v.ParameterError(
            "data",
            f"{steps} steps were accounted as the framework's Poisson sampling, but the batches come from "
            f"{source.description} ({source.schedule!r})",
        )
    check_batch_source(source.schedule, source)
    return attr.evolve(claim, schedule=source.schedule)


def check_initial_weights(loaded: Optional[str], *, restored: bool, public: bool) -> Optional[str]:
    """Rule 1c: a run is accounted from its first step, so the weights it starts from must not carry
    steps its ledger lacks.

    ``loaded``: how the adapter saw the model's weights loaded from storage before the run (e.g.
    ``"model.load_weights('w.h5')"``), ``None`` when it saw none; ``restored``: the run's privacy
    state (its ledger) came back with them; ``public``: the user declares that the loaded weights do not
    depend on the private data (e.g. public pre-training). Returns the note a report states when the
    claim rests on that declaration (else ``None``).

    Raises :class:`~hidden_state_accountants.ParameterError` naming ``model`` for loaded weights with
    neither: if they were trained on the data (a run resumed from a weights-only file), the steps that
    trained them are missing from the ledger and the report would count the new steps only (40 steps
    and 10 more from an HDF5 file reported the 10 steps' epsilon).

    >>> check_initial_weights(None, restored=False, public=False) is None
    True
    >>> check_initial_weights("model.load_weights('w.h5')", restored=False, public=False)
    Traceback (most recent call last):
    ...
    hidden_state_accountants.errors.ParameterError: model: its weights were loaded by model.load_weights('w.h5') without the run's privacy state: if they were trained on the private data, the steps that trained them are not in the ledger and the epsilon would count the new steps only; restore the privacy state with the weights, or declare the weights public (independent of the private data)
    """
    if loaded is None or restored:
        return None
    if not public:
        raise v.ParameterError(
            "model",
            f"its weights were loaded by {loaded} without the run's privacy state: if they were trained on the "
            "private data, the steps that trained them are not in the ledger and the epsilon would count the new "
            "steps only; restore the privacy state with the weights, or declare the weights public (independent "
            "of the private data)",
        )
    return (
        f"the run starts from weights loaded by {loaded}, declared public (independent of the private data); "
        "the bound covers the steps from there"
    )


__all__ = [
    "NO_GEOMETRY",
    "HiddenStateWarning",
    "CompositionFallbackWarning",
    "OptimizerKind",
    "Clipping",
    "LossReduction",
    "ReplicaReduction",
    "LayerKind",
    "StepFacts",
    "LayerFacts",
    "ModelFacts",
    "BatchSourceFacts",
    "Claim",
    "RunRecorder",
    "parse_ledger",
    "unaccountable",
    "update_departure",
    "effective_step",
    "batch_records",
    "model_refusal",
    "check_batch_source",
    "claim_for_source",
    "check_initial_weights",
    "check_geometry",
    "check_position",
]
