"""What Opacus and PyTorch say about a training run, read into the core's facts.

Nothing here judges: :mod:`hidden_state_accountants.recording` decides what the facts back.

* :func:`step_facts`: one DP optimizer step as :class:`~hidden_state_accountants.recording.StepFacts`.
* :func:`loader_facts`: where a ``DataLoader``'s batches come from, as
  :class:`~hidden_state_accountants.recording.BatchSourceFacts` (a sampler of this package,
  ``DataLoader(shuffle=True)``: the ``reshuffle`` law drawn by torch, a ``DataLoader`` in data order:
  ``cyclic``, Opacus' ``DPDataLoader``: Poisson sampling); :func:`count_poisson_batches` makes a
  ``DPDataLoader`` count the batches it hands out.
* :func:`model_facts`: a model's structure as :class:`~hidden_state_accountants.recording.ModelFacts`,
  read from ``nn.Sequential`` containers or, for custom ``forward`` code, from a ``torch.fx`` trace.

>>> from torch import nn
>>> facts = model_facts(nn.Sequential(nn.Flatten(), nn.Linear(4, 2)))
>>> [(str(layer.kind), layer.trainable) for layer in facts.layers], facts.complete
([('other', False), ('affine', True)], True)
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from opacus.grad_sample.gsm_base import AbstractGradSampleModule
from opacus.optimizers import AdaClipDPOptimizer, DPOptimizer
from opacus.utils.uniform_sampler import DistributedUniformWithReplacementSampler, UniformWithReplacementSampler
from torch import nn

from hidden_state_accountants import validation as v
from hidden_state_accountants.recording import (
    BatchSourceFacts,
    Clipping,
    LayerFacts,
    LayerKind,
    LossReduction,
    ModelFacts,
    OptimizerKind,
    ReplicaReduction,
    StepFacts,
)
from hidden_state_accountants.schedules import CYCLIC, DROPPED, FULL, KEPT_BATCH_SIZE, BatchSchedule

from hidden_state_accountants.pytorch.features import FeatureClip
from hidden_state_accountants.pytorch.samplers import HiddenStateBatchSampler, has_secret_generator

__all__ = [
    "step_facts",
    "optimizer_facts",
    "model_facts",
    "unwrap_model",
    "loader_facts",
    "count_poisson_batches",
    "batches_handed_out",
    "trainable_linear",
    "feature_facts",
    "PROJECTION_ATTR",
    "LOSS_UNSEEN",
    "OPACUS_CLIP_MARGIN",
]

OPACUS_CLIP_MARGIN = 1e-6
"""Opacus scales a per-sample gradient by ``min(1, max_grad_norm / (norm + 1e-6))``
(``DPOptimizer.clip_and_accumulate``): it rescales every gradient whose norm exceeds
``max_grad_norm - 1e-6``, the core's ``StepFacts.clip_margin``."""

PROJECTION_ATTR = "_hsa_projection"
"""The attribute of the DP optimizer that holds its :class:`~hidden_state_accountants.pytorch.projection.ProjectionHook`
(read here at every step)."""


# ---------------------------------------------------------------------------- steps
def optimizer_facts(base: torch.optim.Optimizer) -> Dict[str, Any]:
    """The update a (base) optimizer applies: its kind, per-group learning rates and L2, momentum."""
    groups = base.param_groups
    sgd = isinstance(base, torch.optim.SGD)
    ascent = sgd and any(g.get("maximize", False) for g in groups)
    return dict(
        optimizer=OptimizerKind.SGD if sgd else OptimizerKind.named(type(base).__name__),
        postprocessing="maximize=True (a gradient ascent step)" if ascent else None,
        learning_rate=[float(g["lr"]) for g in groups],
        weight_decay=[float(g.get("weight_decay", 0.0)) for g in groups],
        momentum=max(float(g.get("momentum", 0.0)) for g in groups),
        nesterov=any(g.get("nesterov", False) for g in groups),
    )


def _clipping(optimizer: DPOptimizer) -> Clipping:
    if isinstance(optimizer, AdaClipDPOptimizer):
        return Clipping.ADAPTIVE
    return Clipping.PER_LAYER if getattr(optimizer, "max_grad_norms", None) is not None else Clipping.FLAT


def step_facts(
    optimizer: DPOptimizer, sample_rate: Optional[float] = None, *, accumulation: Optional[int] = None
) -> StepFacts:
    """The step the DP optimizer takes now.

    ``sample_rate`` is Opacus' (``1 / len(data_loader)``); ``accumulation`` defaults to the
    batches accumulated since the last step (pass ``1`` before training, to read the plan).
    Under ``DifferentiallyPrivateDistributedDataParallel`` each of ``world_size`` ranks divides
    its clipped sum by ``expected_batch_size``, rank 0 adds the noise and the ranks average
    their gradients: the facts say so (``replicas``, ``replica_reduction``, ``replica_share``,
    ``l2_after_reduction``) and the core's ``effective_step`` is the one-process step they add
    up to, so a divisor that does not match the global batch is refused with that explanation.
    """
    if not isinstance(optimizer, DPOptimizer):
        raise v.ParameterError(
            "optimizer", f"must be the DPOptimizer returned by make_private, got {type(optimizer).__name__}"
        )
    k = optimizer.accumulated_iterations if accumulation is None else accumulation
    projection = getattr(optimizer, PROJECTION_ATTR, None)
    world = int(getattr(optimizer, "world_size", 1))
    mean = optimizer.loss_reduction == "mean"
    # Opacus' Distributed*Optimizer: every rank divides its clipped sum by expected_batch_size,
    # only rank 0 adds noise (the total variance of one draw: a 1/world share each), the ranks
    # all-reduce the gradients (averaged for "mean") and one base-optimizer step, weight_decay
    # included, follows on the combined gradient.
    replicas = (
        dict(
            replicas=world,
            replica_reduction=ReplicaReduction.MEAN if mean else ReplicaReduction.SUM,
            replica_share=world,
            l2_after_reduction=True,
        )
        if world > 1
        else {}
    )
    return StepFacts(
        noise_multiplier=optimizer.noise_multiplier,
        clip_norm=optimizer.max_grad_norm,
        clip_margin=OPACUS_CLIP_MARGIN,
        divisor=optimizer.expected_batch_size,
        **replicas,
        projection_diameter=None if projection is None else projection.diameter,
        clipping=_clipping(optimizer),
        loss_reduction=LossReduction.MEAN if mean else LossReduction.SUM,
        accumulation=k,
        sampling_probability=None if sample_rate is None else sample_rate * k,
        **optimizer_facts(optimizer.original_optimizer),
    )


# ---------------------------------------------------------------------------- batches
def loader_facts(data_loader) -> BatchSourceFacts:
    """Where ``data_loader``'s batches come from.

    * ``batch_sampler`` a sampler of this package: its schedule, at its position.
    * ``DataLoader(dataset, batch_size=b, shuffle=True, drop_last=...)`` (torch's
      ``RandomSampler``, without replacement, under a ``BatchSampler``): a fresh permutation
      every epoch, :meth:`BatchSchedule.framework` ``reshuffle``; with ``drop_last=False`` the
      short last batch is kept and Opacus divides it, like every batch, by its fixed
      ``expected_batch_size`` (``last_batch="kept_batch_size"``). Its randomness is secret only
      if the sampler draws from a generator :func:`~.samplers.secret_shuffle` seeded; otherwise it
      comes from torch's global generator (or one the user seeded), which scripts seed publicly.
    * ``DataLoader(dataset, batch_size=b)`` (``shuffle=False``: torch's ``SequentialSampler``) in
      one process: the records in data order, cut into batches of ``b``: ``cyclic`` when the short
      last batch is dropped (``drop_last=True``) or there is none, ``full`` for ``b = n``.
    * Opacus' ``DPDataLoader`` (its ``UniformWithReplacementSampler``): Poisson sampling at the rate
      the steps report (``poisson=True``).
    * anything else (a ``DistributedSampler``, a data-order loader keeping a short batch, sampling
      with replacement): ``schedule=None`` with a description.

    >>> from torch.utils.data import DataLoader
    >>> facts = loader_facts(DataLoader(list(range(10)), batch_size=3, shuffle=True))
    >>> facts.schedule
    BatchSchedule(dataset_size=10, batch_size=3, sampling='reshuffle', drawn by the framework, last_batch='kept_batch_size', public)
    >>> loader_facts(DataLoader(list(range(10)), batch_size=5)).schedule
    BatchSchedule(dataset_size=10, batch_size=5, sampling='cyclic')
    """
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

    if not isinstance(data_loader, DataLoader):
        raise v.ParameterError("data_loader", f"must be a torch DataLoader, got {type(data_loader).__name__}")
    bs = data_loader.batch_sampler
    if isinstance(bs, _POISSON_SAMPLERS):
        return BatchSourceFacts(
            schedule=None,
            poisson=True,
            description=f"Opacus' DPDataLoader (Poisson sampling at sample_rate={bs.sample_rate:.6g}; make_private "
            "returns it in place of the data loader unless poisson_sampling=False)",
        )
    if isinstance(bs, HiddenStateBatchSampler):
        return BatchSourceFacts(
            schedule=bs.schedule,
            description=f"the DataLoader's {type(bs).__name__}",
            steps_per_epoch=len(data_loader),
            next_step=bs.position,
        )
    rs = getattr(bs, "sampler", None)
    if type(bs) is BatchSampler and type(rs) is RandomSampler:
        n = len(rs.data_source)
        if rs.replacement or rs.num_samples != n:
            return BatchSourceFacts(
                schedule=None,
                description=(
                    f"a RandomSampler with replacement={rs.replacement}, num_samples={rs.num_samples} of {n} records"
                ),
            )
        secret = has_secret_generator(data_loader)
        schedule = BatchSchedule.framework(
            n, bs.batch_size, last_batch=DROPPED if bs.drop_last else KEPT_BATCH_SIZE, secret=secret
        )
        where = (
            "a generator seeded secretly by secret_shuffle"
            if secret
            else "torch's global generator or one seeded by the script"
        )
        dist = torch.distributed
        ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return BatchSourceFacts(
            schedule=schedule,
            steps_per_epoch=len(data_loader),
            independent_draws=ranks,
            description=f"DataLoader(batch_size={bs.batch_size}, shuffle=True, "
            f"drop_last={bs.drop_last}) drawing from {where}",
        )
    if type(bs) is BatchSampler and type(rs) is SequentialSampler:
        return _data_order_facts(len(rs.data_source), bs.batch_size, bs.drop_last, len(data_loader))
    what = type(bs).__name__ if rs is None else f"{type(bs).__name__} over a {type(rs).__name__}"
    return BatchSourceFacts(schedule=None, description=f"a DataLoader with a {what}")


def _data_order_facts(n: int, b: int, drop_last: bool, steps_per_epoch: int) -> BatchSourceFacts:
    """``DataLoader(dataset, batch_size=b, shuffle=False, drop_last=...)``: batch ``j`` of every epoch
    is records ``j*b .. (j+1)*b - 1``, the package's ``cyclic`` schedule (``full`` for ``b = n``) when
    no short last batch is kept."""
    what = f"DataLoader(batch_size={b}, shuffle=False, drop_last={drop_last}) in data order"
    dist = torch.distributed
    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if ranks > 1:
        return BatchSourceFacts(
            schedule=None, description=f"{what} in each of {ranks} processes (every process feeds the same batches)"
        )
    if n % b and not drop_last:
        return BatchSourceFacts(
            schedule=None,
            description=f"{what}, which keeps a short last batch of {n % b} records (the cyclic schedule drops them: "
            "pass drop_last=True)",
        )
    try:
        schedule = BatchSchedule(n, b, FULL if b == n else CYCLIC)
    except v.ParameterError as err:  # e.g. one batch of b < n records per epoch
        return BatchSourceFacts(schedule=None, description=f"{what} ({err.reason})")
    return BatchSourceFacts(schedule=schedule, description=what, steps_per_epoch=steps_per_epoch)


_POISSON_SAMPLERS = (UniformWithReplacementSampler, DistributedUniformWithReplacementSampler)


def _counted(sampler, batches: Iterator[List[int]]) -> Iterator[List[int]]:
    """``batches``, counted on ``sampler`` as they are handed out (Opacus' ``BatchMemoryManager`` splits
    each into physical batches after)."""
    for batch in batches:
        sampler.hsa_batches_handed_out += 1
        yield batch


class _CountedUniformSampler(UniformWithReplacementSampler):
    """What :func:`count_poisson_batches` makes of Opacus' Poisson batch sampler."""

    hsa_batches_handed_out = 0

    def __iter__(self) -> Iterator[List[int]]:
        return _counted(self, super().__iter__())


class _CountedDistributedUniformSampler(DistributedUniformWithReplacementSampler):
    """What :func:`count_poisson_batches` makes of Opacus' distributed Poisson batch sampler."""

    hsa_batches_handed_out = 0

    def __iter__(self) -> Iterator[List[int]]:
        return _counted(self, super().__iter__())


_COUNTED = {
    UniformWithReplacementSampler: _CountedUniformSampler,
    DistributedUniformWithReplacementSampler: _CountedDistributedUniformSampler,
}


def count_poisson_batches(data_loader) -> Optional[Any]:
    """Opacus' Poisson batch sampler of ``data_loader`` (a ``DPDataLoader``), made to count the batches
    it hands out (:func:`batches_handed_out`; its class becomes a subclass that counts, nothing else
    changes), or ``None`` when ``data_loader`` does not sample that way. The count says whether the
    training loop draws its batches from this loader."""
    bs = getattr(data_loader, "batch_sampler", None)
    if type(bs) in _COUNTED.values():
        return bs
    counted = _COUNTED.get(type(bs))
    if counted is None:
        return None
    bs.__class__ = counted
    return bs


def batches_handed_out(batch_sampler) -> int:
    """The batches a sampler of :func:`count_poisson_batches` has handed out."""
    return batch_sampler.hsa_batches_handed_out


# ---------------------------------------------------------------------------- models
_RANDOM_MODULES = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
    nn.RReLU,
)
# functions and tensor methods that draw randomness
_RANDOM_FUNCTIONS = frozenset(
    """
    dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout rrelu gumbel_softmax
    rand randn randint rand_like randn_like randint_like randperm bernoulli
    normal multinomial poisson bernoulli_ normal_ uniform_ exponential_ random_
    cauchy_ geometric_ log_normal_
    """.split()
)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside Opacus' ``GradSampleModule`` and (DP)DDP wrappers."""
    while True:
        if isinstance(model, AbstractGradSampleModule):
            model = model._module
        elif isinstance(model, (DPDDP, nn.parallel.DistributedDataParallel)):
            model = model.module
        else:
            return model


def _is_leaf(m: nn.Module) -> bool:
    """Modules read as one layer: PyTorch's own (as ``torch.fx`` treats them) and :class:`FeatureClip`."""
    if isinstance(m, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        return False
    return isinstance(m, FeatureClip) or type(m).__module__.startswith(("torch.nn", "torch.ao.nn"))


def _layer(name: str, m: nn.Module) -> LayerFacts:
    if isinstance(m, _RANDOM_MODULES):
        kind = LayerKind.RANDOM
    elif isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward:
        kind = LayerKind.AFFINE
    else:
        kind = LayerKind.OTHER
    trainable = any(p.requires_grad for p in m.parameters())
    return LayerFacts(name=f"{name}:{type(m).__name__}" if name else type(m).__name__, kind=kind, trainable=trainable)


class _Tracer(torch.fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return _is_leaf(m)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _traced(m: nn.Module, path: str) -> Optional[List[LayerFacts]]:
    """The operations of ``m``'s forward pass in execution order, each one a layer (so anything
    after the trainable layer is seen), or ``None`` if ``torch.fx`` cannot trace it."""
    try:
        graph = _Tracer().trace(m)
    except Exception:  # data-dependent control flow and the like: the forward pass is unknown
        return None
    layers: List[LayerFacts] = []
    last = None
    for node in graph.nodes:
        if node.op == "call_module":
            layers.append(_layer(_join(path, node.target), m.get_submodule(node.target)))
        elif node.op == "get_attr":  # a parameter or buffer used directly in forward
            obj = m
            for part in node.target.split("."):
                obj = getattr(obj, part)
            trainable = isinstance(obj, torch.Tensor) and obj.requires_grad
            layers.append(LayerFacts(name=_join(path, node.target), kind=LayerKind.OTHER, trainable=trainable))
        elif node.op in ("call_function", "call_method"):
            fn = getattr(node.target, "__name__", str(node.target))
            kind = LayerKind.RANDOM if fn in _RANDOM_FUNCTIONS else LayerKind.OTHER
            layers.append(LayerFacts(name=_join(path, fn), kind=kind, trainable=False))
        elif node.op == "output" and node.args[0] is not last:  # the loss sees more than the last layer
            layers.append(LayerFacts(name=_join(path, "output"), kind=LayerKind.OTHER, trainable=False))
        last = node
    return layers


def _read(m: nn.Module, path: str) -> Optional[List[LayerFacts]]:
    if isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward:
        out: List[LayerFacts] = []
        for name, child in m.named_children():
            sub = _read(child, _join(path, name))
            if sub is None:
                return None
            out += sub
        return out
    if _is_leaf(m):
        return [_layer(path, m)]
    return _traced(m, path)


def model_facts(model: nn.Module) -> ModelFacts:
    """The model's layers in forward order (wrappers of Opacus and DDP unwrapped).

    ``nn.Linear`` is ``"affine"``, dropout-like layers and random functions ``"random"``,
    everything else ``"other"``; a layer is trainable when it owns parameters with
    ``requires_grad`` (a frozen layer is a fixed feature map). ``complete=False`` when the
    forward pass could not be read (custom code ``torch.fx`` cannot trace).
    ``feature_clip_norm`` is the radius of a :class:`FeatureClip` whose output is the whole
    input of the one trainable ``nn.Linear`` (:func:`_feeding_clip`), ``outputs`` its ``out_features``.

    >>> facts = model_facts(nn.Sequential(FeatureClip(1.0), nn.Linear(4, 2)))
    >>> facts.feature_clip_norm, facts.outputs
    (1.0, 2)
    """
    if not isinstance(model, nn.Module):
        raise v.ParameterError("model", f"must be a torch.nn.Module, got {type(model).__name__}")
    model = unwrap_model(model)
    layers = _read(model, "")
    what = f"the {type(model).__name__} model"
    if layers is None:
        return ModelFacts(layers=[], complete=False, description=what)
    target = trainable_linear(model)
    clip = None if target is None else _feeding_clip(model, target)
    return ModelFacts(
        layers=layers,
        complete=True,
        description=what,
        feature_clip_norm=None if clip is None else clip.max_norm,
        outputs=None if target is None else target.out_features,
    )


# ---------------------------------------------------------------------------- features
def trainable_linear(model: nn.Module) -> Optional[nn.Linear]:
    """The model's trainable layer when it is the only module owning trainable parameters and a
    plain ``nn.Linear``, else ``None`` (wrappers unwrapped)."""
    owners = [m for m in unwrap_model(model).modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
    if len(owners) == 1 and type(owners[0]) is nn.Linear:
        return owners[0]
    return None


def _clip_at_output(m: nn.Module) -> Optional[FeatureClip]:
    """The :class:`FeatureClip` whose output is ``m``'s output: ``m`` itself, or the last layer of a
    plain ``nn.Sequential`` (recursively)."""
    if type(m) is FeatureClip:  # a subclass may change forward
        return m
    if isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward and len(m):
        return _clip_at_output(m[-1])
    return None


def _feeding_clip(model: nn.Module, target: nn.Module) -> Optional[FeatureClip]:
    """The :class:`FeatureClip` whose output is the whole input of ``target``, read from the data
    flow of the model's structure: the previous layer of a plain ``nn.Sequential`` (the
    container's input when ``target`` is its first layer), or, in custom ``forward`` code, the
    ``torch.fx`` node ``target`` is called on. ``None`` when no clip feeds it for sure (``target``
    called twice, on several arguments, on something computed from the clip's output, ...)."""

    def find(m: nn.Module, fed_by: Optional[FeatureClip]):  # (found, clip) for target inside m
        if m is target:
            return True, fed_by
        if isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward:
            for child in m:
                found, clip = find(child, fed_by)
                if found:
                    return True, clip
                fed_by = _clip_at_output(child)
            return False, None
        if not any(sub is target for sub in m.modules()):
            return False, None
        try:
            graph = _Tracer().trace(m)
        except Exception:  # custom code torch.fx cannot read: nothing is known
            return True, None
        name = next(n for n, sub in m.named_modules() if sub is target)
        calls = [node for node in graph.nodes if node.op == "call_module" and node.target == name]
        inputs = [node for node in graph.nodes if node.op == "placeholder"]
        if len(calls) != 1 or len(calls[0].args) != 1 or calls[0].kwargs:
            return True, None
        source = calls[0].args[0]
        if getattr(source, "op", None) == "call_module":
            return True, _clip_at_output(m.get_submodule(source.target))
        if inputs == [source]:  # target is applied to m's only input
            return True, fed_by
        return True, None

    return find(unwrap_model(model), None)[1]


LOSS_UNSEEN = "Opacus does not see it (the training loop computes the loss)"
"""The core's loss observation for every Opacus run: the loss is the user's claim."""


def feature_facts(model: Optional[nn.Module]) -> Tuple[Optional[nn.Linear], Optional[str]]:
    """The trainable ``nn.Linear`` whose inputs can be checked on every batch (a
    :class:`~hidden_state_accountants.pytorch.features.FeatureNormMonitor` on it), or ``None`` and why none can (the core's
    :attr:`Claim.feature_unobservable <hidden_state_accountants.recording.Claim.feature_unobservable>`)."""
    if model is None:
        return None, "the model was not given to configure(), so its inputs cannot be checked"
    layer = trainable_linear(model)
    if layer is None:
        return None, "no single trainable nn.Linear of the model was found whose inputs could be checked on every batch"
    return layer, None
