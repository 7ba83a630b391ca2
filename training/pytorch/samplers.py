"""PyTorch batch samplers that follow the core's batch schedules exactly.

Each sampler wraps a :class:`~hidden_state_accountants.schedules.BatchSchedule` (the one
definition of every schedule, and of the secret-seed rule) and hands its batches to
``DataLoader(batch_sampler=...)``:

=========================================  ========================
sampler                                    ``sampling``
=========================================  ========================
:class:`CyclicBatchSampler`                ``"cyclic"``
:class:`ShufflePartitionBatchSampler`      ``"shuffle_partition"``
:class:`ReshuffleBatchSampler`             ``"reshuffle"``
:class:`WithoutReplacementBatchSampler`    ``"without_replacement"``
:class:`FullBatchSampler`                  ``"full"``
:class:`BallsInBinsBatchSampler`           ``"balls_in_bins"``
=========================================  ========================

An epoch is ``n // b`` steps (one for ``full``); the partition samplers and
:class:`ReshuffleBatchSampler` leave the last ``n % b`` records of their order out of every
epoch and warn about it once (:class:`ReshuffleBatchSampler` may keep them as a short batch).

A plain ``DataLoader(dataset, batch_size=b, shuffle=True)`` draws the same law as
:class:`ReshuffleBatchSampler` with torch's randomness: the accountant recognises it
(``configure(data_loader=loader)``); :func:`secret_shuffle` gives its ``RandomSampler`` a
secretly seeded generator, without which its batches count as public.

**Seeds are secrets.** The random samplers default to ``seed=None``: a fresh seed drawn by the
core's rule, shared by every rank through ``torch.distributed``. A seed you pass is your explicit
choice (the accountant's report says so) and must be kept as private as the data, like the
checkpoints that store it.

Samplers are resumable (the batch of global step ``t`` depends on ``(seed, t)`` only; the
sampler remembers its :attr:`~HiddenStateBatchSampler.position`) and, under
``torch.distributed``, every rank computes the same global batch and keeps
``batch[rank::world_size]``.

>>> s = CyclicBatchSampler(9, 3)
>>> list(s), s.sampling, len(s)
([[0, 1, 2], [3, 4, 5], [6, 7, 8]], 'cyclic', 3)
>>> s = ShufflePartitionBatchSampler(6, 2)
>>> list(s) == list(s), s.schedule.seed_is_secret  # one secret partition, every epoch
(True, True)
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import torch
from torch.utils.data import Sampler

from hidden_state_accountants import validation as v
from hidden_state_accountants.errors import HiddenStateWarning
from hidden_state_accountants.schedules import (
    BALLS_IN_BINS,
    CYCLIC,
    DROPPED,
    FULL,
    KEPT_BATCH_SIZE,
    KEPT_OWN_SIZE,
    RANDOM,
    RESHUFFLE,
    SHUFFLE_PARTITION,
    WITHOUT_REPLACEMENT,
    BatchSchedule,
    draw_secret_seed,
)

__all__ = [
    "HiddenStateBatchSampler",
    "CyclicBatchSampler",
    "ShufflePartitionBatchSampler",
    "ReshuffleBatchSampler",
    "WithoutReplacementBatchSampler",
    "FullBatchSampler",
    "BallsInBinsBatchSampler",
    "EmptyBatchCollate",
    "balls_in_bins_loader",
    "sampler_from_state_dict",
    "secret_shuffle",
    "has_secret_generator",
]


def _distributed_defaults(num_replicas: Optional[int], rank: Optional[int]):
    """World size and rank: given, or from ``torch.distributed`` when it is initialised."""
    dist = torch.distributed
    initialised = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    num_replicas = v.positive_int("num_replicas", num_replicas)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
        raise v.ParameterError("rank", f"must be an integer in [0, num_replicas={num_replicas}), got {rank!r}")
    return num_replicas, rank


def _broadcast_from_rank0(seed: int) -> int:
    """Rank 0's secret draw, on every rank."""
    box = [seed]
    torch.distributed.broadcast_object_list(box, src=0)
    return int(box[0])


class HiddenStateBatchSampler(Sampler[List[int]]):
    """Base class: a core :class:`BatchSchedule` with a position, sharded across ranks.

    Iterating yields the batches from :attr:`position` to the end of the current epoch, so a
    ``for batch in loader`` loop after a resume finishes the interrupted epoch first.

    Args:
      dataset_size: ``n`` (records are indices ``0 .. n-1``).
      batch_size: ``b``, the *global* batch size (all ranks together).
      seed: the random schedules' seed; ``None`` (default) draws a secret one.
      num_replicas, rank: world size and rank; default to ``torch.distributed``'s.
    """

    sampling: str = ""

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        seed: Optional[int] = None,
        *,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        last_batch: str = DROPPED,
        steps_per_epoch: Optional[int] = None,
    ) -> None:
        num_replicas, rank = _distributed_defaults(num_replicas, rank)
        share = None
        if num_replicas > 1 and self.sampling in RANDOM and seed is None:
            if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
                raise v.ParameterError(
                    "seed",
                    "with num_replicas > 1 pass the same seed on every rank, or initialise "
                    "torch.distributed so a secret one can be shared",
                )
            share = _broadcast_from_rank0
        self._setup(
            BatchSchedule(
                dataset_size,
                batch_size,
                self.sampling,
                seed,
                share_seed=share,
                last_batch=last_batch,
                steps_per_epoch=steps_per_epoch,
            ),
            num_replicas,
            rank,
        )
        if self.dropped_per_epoch:
            which = (
                "of each epoch's permutation are left out of that epoch"
                if self.sampling == RESHUFFLE
                else "at the end of the order are left out of every epoch"
            )
            warnings.warn(
                f"{type(self).__name__}: dataset_size % batch_size = {self.dataset_size} % {self.batch_size} = "
                f"{self.dropped_per_epoch} records {which} (as in Ye & Shokri 2022, footnote 3)",
                HiddenStateWarning,
                stacklevel=3,
            )

    def _setup(self, schedule: BatchSchedule, num_replicas: int, rank: int) -> None:
        if num_replicas > schedule.batch_size:
            raise v.ParameterError(
                "num_replicas", f"{num_replicas} ranks cannot share a batch of {schedule.batch_size} records"
            )
        self.schedule, self.num_replicas, self.rank = schedule, num_replicas, rank
        self.position = 0  # global steps handed out so far

    # ----------------------------------------------------------------- schedule
    dataset_size = property(lambda self: self.schedule.dataset_size)
    batch_size = property(lambda self: self.schedule.batch_size)
    seed = property(lambda self: self.schedule.seed)
    steps_per_epoch = property(lambda self: self.schedule.steps_per_epoch, doc="``n // b`` (1 for ``full``).")
    dropped_per_epoch = property(lambda self: self.schedule.dropped_per_epoch)

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self.position // self.steps_per_epoch

    @property
    def dropped_indices(self) -> List[int]:
        """The records a partition sampler never uses (the last ``n % b`` of its order)."""
        return self.schedule.order()[self.steps_per_epoch * self.batch_size :].tolist()

    def global_batch(self, step: int) -> List[int]:
        """Indices of the whole batch (all ranks) used at global step ``step``."""
        return self.schedule.batch(step).tolist()

    def local_batch(self, step: int) -> List[int]:
        """This rank's share of :meth:`global_batch`."""
        batch = self.global_batch(step)
        return batch if self.num_replicas == 1 else batch[self.rank :: self.num_replicas]

    def __len__(self) -> int:
        return self.steps_per_epoch  # Opacus reads its sample rate as 1 / len(data_loader)

    def __iter__(self) -> Iterator[List[int]]:
        end = (self.epoch + 1) * self.steps_per_epoch
        while self.position < end:
            step = self.position
            self.position += 1  # before yielding: a batch handed out counts as used
            yield self.local_batch(step)

    # --------------------------------------------------------------- checkpoints
    def set_position(self, step: int) -> None:
        """Continue the schedule at global step ``step`` (e.g. the steps already trained)."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise v.ParameterError("position", f"must be a non-negative integer, got {step!r}")
        self.position = int(step)

    def describe(self) -> Dict[str, Any]:
        """What defines the schedule (the seed included: keep it private), without position or rank."""
        return {"class": type(self).__name__, **self.schedule.describe()}

    def state_dict(self) -> Dict[str, Any]:
        return {**self.describe(), "position": self.position}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores the position after checking the schedule is the same one."""
        if not isinstance(state, dict):
            raise v.ParameterError("sampler", f"the state must be a dict from state_dict(), got {type(state).__name__}")
        mine, theirs = self.describe(), {k: state.get(k) for k in self.describe()}
        if mine != theirs:
            hint = ""
            if self.schedule.seed_is_secret and {k for k in mine if mine[k] != theirs[k]} == {"seed"}:
                # the usual mistake: the resumed script built its sampler with seed=None again
                hint = (
                    "; this sampler drew a fresh secret seed (seed=None), so it cannot continue the "
                    "checkpoint's schedule: to resume, build the sampler from the checkpoint with "
                    "hidden_state_accountants.opacus.sampler_from_checkpoint(torch.load(path)) (it keeps "
                    "the stored seed secret and the position) and hand that sampler to the DataLoader "
                    "and to configure()"
                )
            raise v.ParameterError(
                "sampler", f"checkpoint holds the schedule {_redacted(theirs)}, this sampler is {_redacted(mine)}{hint}"
            )
        if "position" not in state:
            raise v.ParameterError("sampler", "the state has no position")
        self.set_position(state["position"])

    def __repr__(self) -> str:
        extra = f", rank={self.rank}/{self.num_replicas}" if self.num_replicas > 1 else ""
        return f"{type(self).__name__}({self.schedule!r}, position={self.position}{extra})"


class CyclicBatchSampler(HiddenStateBatchSampler):
    """Batch ``j`` of every epoch is records ``j*b .. (j+1)*b - 1`` (``sampling="cyclic"``).

    The order is the dataset's own: shuffle the dataset once beforehand if it is sorted.

    >>> [b for b in CyclicBatchSampler(6, 2)]
    [[0, 1], [2, 3], [4, 5]]
    >>> CyclicBatchSampler(6, 2, num_replicas=2, rank=1).local_batch(0)
    [1]
    """

    sampling = CYCLIC

    def __init__(
        self, dataset_size: int, batch_size: int, *, num_replicas: Optional[int] = None, rank: Optional[int] = None
    ) -> None:
        super().__init__(dataset_size, batch_size, None, num_replicas=num_replicas, rank=rank)


class ShufflePartitionBatchSampler(HiddenStateBatchSampler):
    """One random partition drawn once, visited in the same order every epoch
    (``sampling="shuffle_partition"``); *not* ``DataLoader(shuffle=True)``, which reshuffles.

    >>> s = ShufflePartitionBatchSampler(6, 2, seed=3)  # an explicit seed: keep it secret
    >>> epoch1, epoch2 = list(s), list(s)
    >>> epoch1 == epoch2, sorted(i for b in epoch1 for i in b)
    (True, [0, 1, 2, 3, 4, 5])
    """

    sampling = SHUFFLE_PARTITION


class ReshuffleBatchSampler(HiddenStateBatchSampler):
    """A fresh random permutation every epoch, cut into batches (``sampling="reshuffle"``): the
    law of ``DataLoader(shuffle=True)``, with a secret seed, resumable anywhere and shared across
    ranks like the other samplers.

    Args:
      last_batch: the last ``n % b`` records of each epoch's permutation: ``"dropped"`` (default,
        ``drop_last=True``) or ``"kept_batch_size"``, a short last batch that Opacus divides by
        its fixed ``expected_batch_size = b`` (as it does every batch; an epoch is then
        ``ceil(n / b)`` steps). ``"kept_own_size"`` is refused: Opacus never divides by a
        batch's own size.

    >>> s = ReshuffleBatchSampler(6, 2, seed=3)  # an explicit seed: keep it secret
    >>> epoch1, epoch2 = list(s), list(s)
    >>> sorted(i for b in epoch1 for i in b) == sorted(i for b in epoch2 for i in b) == list(range(6))
    True
    >>> [len(b) for b in ReshuffleBatchSampler(7, 3, seed=3, last_batch="kept_batch_size")]
    [3, 3, 1]
    """

    sampling = RESHUFFLE

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        seed: Optional[int] = None,
        *,
        last_batch: str = DROPPED,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
    ) -> None:
        if last_batch == KEPT_OWN_SIZE:
            raise v.ParameterError(
                "last_batch",
                f"Opacus divides every batch, a short one too, by its fixed expected_batch_size: use "
                f"{KEPT_BATCH_SIZE!r} (the short batch divided by b) or {DROPPED!r}",
            )
        super().__init__(dataset_size, batch_size, seed, num_replicas=num_replicas, rank=rank, last_batch=last_batch)


class WithoutReplacementBatchSampler(HiddenStateBatchSampler):
    """Every step draws ``b`` distinct records afresh from all ``n``
    (``sampling="without_replacement"``); no record is left out of an epoch.

    >>> [len(set(b)) for b in WithoutReplacementBatchSampler(10, 4)]
    [4, 4]
    """

    sampling = WITHOUT_REPLACEMENT


class FullBatchSampler(HiddenStateBatchSampler):
    """Every step uses all ``n`` records (``sampling="full"``); one step per epoch.

    >>> list(FullBatchSampler(3))
    [[0, 1, 2]]
    """

    sampling = FULL

    def __init__(self, dataset_size: int, *, num_replicas: Optional[int] = None, rank: Optional[int] = None) -> None:
        super().__init__(dataset_size, dataset_size, None, num_replicas=num_replicas, rank=rank)


EMPTY_BATCHES = ("refuse", "yield")
"""What :class:`BallsInBinsBatchSampler` does with a step no record drew: refuse it with a clear error (the
default: torch's default collate cannot batch nothing), or hand the DataLoader an empty list, which
:class:`EmptyBatchCollate` turns into tensors with no rows (:func:`balls_in_bins_loader` sets both up)."""


class BallsInBinsBatchSampler(HiddenStateBatchSampler):
    """Every epoch, each record independently draws its step uniformly among the epoch's
    ``t = n // b`` steps (``sampling="balls_in_bins"``): batches of random size (``n / t`` on
    average), every record exactly once per epoch, and no record's step depends on the others', so
    adding or removing a record changes nothing else. That is what gives it an ADD_OR_REMOVE_ONE
    number (Opacus' relation; docs/derivations.md, "Balls-in-bins sampling"), which
    ``DataLoader(shuffle=True)`` does not have, and, with no geometry declared, the amplified
    composition of random allocation (``composition_allocation_pld``, about Poisson's number).

    ``steps_per_epoch``: ``t``, a public constant: neighbouring datasets must run the same ``t``, so pass it
    when the dataset's size is not public (``None``: ``n // b`` of the ``dataset_size`` given, which is then
    treated as public; docs/derivations.md B.1).

    Opacus must divide every batch by the fixed ``b``: ``accountant.configure(sampler=sampler,
    optimizer=optimizer, ...)`` sets the optimizer's ``expected_batch_size`` to ``b`` (per rank).

    **Empty steps.** A step no record drew is still a step of the schedule: the optimiser must take it with
    noise only (Opacus' ``DPOptimizer`` does, as for an empty Poisson batch), and the accountant counts it.
    A DataLoader's default collate cannot batch nothing, so by default (``empty_batches="refuse"``) such a
    step raises a clear error before the DataLoader sees it; build the loader with
    :func:`balls_in_bins_loader` (or set ``empty_batches="yield"`` and pass
    ``collate_fn=EmptyBatchCollate(dataset)``) to hand the model tensors with no rows instead. The
    sampler warns at construction when an empty step is not negligible (``t (1 - 1/t)^n > 1e-9`` per epoch,
    i.e. only for tiny batches).

    >>> s = BallsInBinsBatchSampler(10, 3, seed=5)  # an explicit seed: keep it secret
    >>> epoch = list(s)
    >>> len(epoch), sorted(i for b in epoch for i in b) == list(range(10))
    (3, True)
    """

    sampling = BALLS_IN_BINS
    _empty_batches = "refuse"  # also for a sampler rebuilt from its state

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        seed: Optional[int] = None,
        *,
        steps_per_epoch: Optional[int] = None,
        empty_batches: str = "refuse",
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
    ) -> None:
        super().__init__(
            dataset_size, batch_size, seed, num_replicas=num_replicas, rank=rank, steps_per_epoch=steps_per_epoch
        )
        self.empty_batches = empty_batches
        n, t = self.dataset_size, self.steps_per_epoch
        if t > 1 and math.log(t) + n * math.log1p(-1.0 / t) > math.log(1e-9) and empty_batches == "refuse":
            warnings.warn(
                f"BallsInBinsBatchSampler: with {n} records over {t} steps an epoch has an empty step with "
                f"probability up to {min(1.0, t * (1 - 1 / t) ** n):.2g}; a DataLoader's default collate cannot "
                "batch nothing, so such a step is refused: build the loader with balls_in_bins_loader(dataset, "
                "sampler), which hands the model tensors with no rows (the optimiser then adds noise only)",
                HiddenStateWarning,
                stacklevel=2,
            )

    @property
    def empty_batches(self) -> str:
        return self._empty_batches

    @empty_batches.setter
    def empty_batches(self, value: str) -> None:
        if value not in EMPTY_BATCHES:
            raise v.ParameterError("empty_batches", f"must be one of {', '.join(EMPTY_BATCHES)}, got {value!r}")
        self._empty_batches = value

    def __iter__(self) -> Iterator[List[int]]:
        end = (self.epoch + 1) * self.steps_per_epoch
        while self.position < end:
            step = self.position
            batch = self.local_batch(step)
            if not batch and self.empty_batches == "refuse":
                raise v.ParameterError(
                    "empty_batches",
                    f"step {step} of the balls_in_bins schedule drew no record{' on this rank' if self.num_replicas > 1 else ''}: "
                    "an empty step is still a step (the optimiser adds noise only, and the accountant counts it), but "
                    "a DataLoader's default collate cannot batch nothing; build the loader with "
                    "balls_in_bins_loader(dataset, sampler) (or empty_batches='yield' and "
                    "collate_fn=EmptyBatchCollate(dataset)), or use larger batches",
                )
            self.position += 1  # before yielding: a batch handed out counts as used
            yield batch


def _no_rows(x):
    """``x`` (a collated batch) with no rows: tensors and arrays cut to length 0, containers recursively."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return x[:0]
    if isinstance(x, dict):
        return {k: _no_rows(e) for k, e in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a named tuple
        return type(x)(*(_no_rows(e) for e in x))
    if isinstance(x, (list, tuple)):
        if all(isinstance(e, (torch.Tensor, np.ndarray, dict, list, tuple)) for e in x):
            return type(x)(_no_rows(e) for e in x)
        return type(x)()  # one value per record (e.g. strings): none
    return x


class EmptyBatchCollate:
    """A ``collate_fn`` that also batches nothing: an empty step of :class:`BallsInBinsBatchSampler` becomes the
    batch's structure with no rows (the collate of one record, ``dataset[0]``, cut to length 0: its shapes and
    types, none of its values), on which the model's forward and Opacus' ``DPOptimizer`` take a noise-only
    step. Other batches go to ``collate_fn`` (torch's default when ``None``).

    >>> from torch.utils.data import TensorDataset
    >>> collate = EmptyBatchCollate(TensorDataset(torch.ones(4, 3), torch.zeros(4)))
    >>> [tuple(t.shape) for t in collate([])]
    [(0, 3), (0,)]
    """

    def __init__(self, dataset, collate_fn=None) -> None:
        from torch.utils.data import default_collate

        self.dataset, self.collate_fn = dataset, collate_fn or default_collate

    def __call__(self, batch):
        if len(batch):
            return self.collate_fn(batch)
        return _no_rows(self.collate_fn([self.dataset[0]]))


def balls_in_bins_loader(dataset, sampler: BallsInBinsBatchSampler, **kwargs):
    """``DataLoader(dataset, batch_sampler=sampler, collate_fn=EmptyBatchCollate(dataset, collate_fn))``
    with the sampler set to yield empty steps (``empty_batches="yield"``): every step of the schedule reaches
    the training loop, an empty one as tensors with no rows. ``kwargs`` go to the ``DataLoader``.

    >>> from torch.utils.data import TensorDataset
    >>> data = TensorDataset(torch.arange(4.0)[:, None])
    >>> loader = balls_in_bins_loader(data, BallsInBinsBatchSampler(4, 1, seed=0, empty_batches="yield"))
    >>> len([batch for batch in loader]) == 4
    True
    """
    from torch.utils.data import DataLoader

    if not isinstance(sampler, BallsInBinsBatchSampler):
        raise v.ParameterError("sampler", f"must be a BallsInBinsBatchSampler, got {type(sampler).__name__}")
    sampler.empty_batches = "yield"
    collate = EmptyBatchCollate(dataset, kwargs.pop("collate_fn", None))
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, **kwargs)


_CLASSES = {
    c.__name__: c
    for c in (
        CyclicBatchSampler,
        ShufflePartitionBatchSampler,
        ReshuffleBatchSampler,
        WithoutReplacementBatchSampler,
        FullBatchSampler,
        BallsInBinsBatchSampler,
    )
}

# Generators seeded by secret_shuffle: the only ones whose draws this package knows to be secret.
_SECRET_GENERATORS: "weakref.WeakSet" = weakref.WeakSet()


def secret_shuffle(data_loader):
    """Gives a ``DataLoader(shuffle=True)``'s ``RandomSampler`` a generator seeded secretly (the
    core's rule: a fresh seed from :mod:`secrets`), so its permutations are unknown to an
    adversary who knows the script (a ``RandomSampler`` without a generator of its own draws
    its permutation seeds from torch's global generator, which scripts seed publicly with
    ``torch.manual_seed``). Returns the loader. Call it before the first epoch. The seed is
    drawn here and never stored: a resumed run continues with a fresh secret one, which draws
    the same law.

    >>> import torch
    >>> from torch.utils.data import DataLoader
    >>> loader = secret_shuffle(DataLoader(list(range(10)), batch_size=5, shuffle=True, drop_last=True))
    >>> has_secret_generator(loader)
    True
    """
    from torch.utils.data import BatchSampler, RandomSampler

    bs = getattr(data_loader, "batch_sampler", None)
    rs = getattr(bs, "sampler", None)
    if type(bs) is not BatchSampler or type(rs) is not RandomSampler:
        raise v.ParameterError(
            "data_loader",
            "must be a DataLoader(dataset, batch_size=b, shuffle=True) (a "
            f"RandomSampler under a BatchSampler), got {type(data_loader).__name__}",
        )
    g = torch.Generator()
    g.manual_seed(draw_secret_seed())
    rs.generator = g
    _SECRET_GENERATORS.add(g)
    return data_loader


def has_secret_generator(data_loader) -> bool:
    """Whether the loader's ``RandomSampler`` draws from a generator :func:`secret_shuffle` seeded."""
    rs = getattr(getattr(data_loader, "batch_sampler", None), "sampler", None)
    g = getattr(rs, "generator", None)
    return g is not None and g in _SECRET_GENERATORS


def _redacted(description: Dict[str, Any]) -> Dict[str, Any]:
    """A schedule description fit for an error message: a seed is a secret, never printed."""
    return {k: ("<seed>" if k == "seed" and x is not None else x) for k, x in description.items()}


def sampler_from_state_dict(
    state: Dict[str, Any],
    *,
    num_replicas: Optional[int] = None,
    rank: Optional[int] = None,
    seed_is_secret: bool = False,
) -> HiddenStateBatchSampler:
    """Rebuilds a sampler (schedule and position) from :meth:`HiddenStateBatchSampler.state_dict`.

    The stored seed becomes an explicit one (it was written down, so the report says so) unless
    ``seed_is_secret=True``, for a state of a secretly seeded sampler that has been kept as
    private as the data (the accountant's sealed checkpoints record which it was)."""
    cls = _CLASSES.get(state.get("class")) if isinstance(state, dict) else None
    if cls is None:
        what = state.get("class") if isinstance(state, dict) else type(state).__name__
        raise v.ParameterError("sampler", f"unknown sampler state (class {what!r})")
    schedule = BatchSchedule.from_description(state, seed_is_secret=seed_is_secret)
    if schedule.sampling != cls.sampling:
        raise v.ParameterError(
            "sampler", f"{cls.__name__} has sampling {cls.sampling!r}, the state says {schedule.sampling!r}"
        )
    s = cls.__new__(cls)  # not __init__: the remainder warning was given when the sampler was first made
    s._setup(schedule, *_distributed_defaults(num_replicas, rank))
    s.load_state_dict(state)
    return s
