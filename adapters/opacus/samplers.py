"""Batch samplers that produce exactly the schedules the hidden-state analyses assume.

Each sampler is a PyTorch ``Sampler`` of index lists, for ``DataLoader(batch_sampler=...)``:

=================================  ===========================  ==========================================
sampler                            ``sampling``                 schedule (DESIGN.md section 3)
=================================  ===========================  ==========================================
:class:`CyclicBatchSampler`        ``"cyclic"``                 batch ``j`` = records ``j*b .. (j+1)*b - 1``,
                                                                same order every epoch
:class:`ShufflePartitionBatchSampler`  ``"shuffle_partition"``  one random partition (from ``seed``),
                                                                reused in the same order every epoch
:class:`WithoutReplacementBatchSampler`  ``"without_replacement"``  ``b`` distinct records drawn afresh
                                                                from all ``n`` at every step
:class:`FullBatchSampler`          ``"full"``                   all ``n`` records at every step
=================================  ===========================  ==========================================

An epoch is ``n // b`` steps (one for ``full``). The partition samplers leave the
``n % b`` records at the end of their order out of every epoch, as Ye & Shokri (2022)
footnote 3 does, and warn about it once at construction; the sampling-without-replacement
sampler draws from all ``n`` records, so it leaves none out (its epoch is just a length).

The random schedules are only as private as their seed: the analyses of
``shuffle_partition`` (averaging over the record's position) and ``without_replacement``
(amplification by sampling) assume the adversary does not know the draw. Leave ``seed=None``
for a fresh secret seed (from :mod:`secrets`); it is kept in the sampler's ``state_dict``
(and so in checkpoints, which must stay as private as the data). A fixed, published seed
makes the partition public; then only the fixed-order (``cyclic``) bounds hold.

Samplers are seeded and resumable: the batch of global step ``t`` is a function of
``(seed, t)`` alone, the sampler remembers how many batches it has handed out
(:attr:`HiddenStateBatchSampler.position`), and ``state_dict``/``load_state_dict`` (or the
accountant's checkpoint, which sets the position to the number of steps taken) continue
the same schedule. Under ``torch.distributed`` every rank computes the same global batch
and keeps its share ``batch[rank::world_size]``.

>>> s = CyclicBatchSampler(9, 3)
>>> list(s), s.sampling, len(s)
([[0, 1, 2], [3, 4, 5], [6, 7, 8]], 'cyclic', 3)
>>> s = ShufflePartitionBatchSampler(6, 2, seed=0)
>>> list(s) == list(s)  # the same partition, in the same order, every epoch
True
"""

from __future__ import annotations

import secrets
import warnings
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import torch
from torch.utils.data import Sampler

from hidden_state_accountants import validation as v
from hidden_state_accountants.schedules import check_schedule, steps_per_epoch

__all__ = [
    "HiddenStateBatchSampler",
    "CyclicBatchSampler",
    "ShufflePartitionBatchSampler",
    "WithoutReplacementBatchSampler",
    "FullBatchSampler",
    "sampler_from_state_dict",
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


def _shared_secret_seed(num_replicas: int) -> int:
    """A fresh secret seed, the same on every rank (rank 0 draws it and broadcasts it)."""
    if num_replicas == 1:
        return secrets.randbits(63)
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise v.ParameterError(
            "seed", "with num_replicas > 1 pass the same seed on every rank, or initialise "
            "torch.distributed so a secret one can be shared")
    box = [secrets.randbits(63) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def _rng(seed: int, *stream: int) -> np.random.Generator:
    """An independent generator for ``(seed, *stream)``: reproducible and O(1) to reach."""
    return np.random.default_rng(np.random.SeedSequence([seed, *stream]))


class HiddenStateBatchSampler(Sampler[List[int]]):
    """Base class: a seeded, resumable schedule of global batches, sharded across ranks.

    Subclasses define :attr:`sampling` and :meth:`global_batch`. Iterating yields the
    batches from the current :attr:`position` to the end of the current epoch, so a
    ``for batch in loader`` loop after a resume finishes the interrupted epoch first.

    Args:
      dataset_size: ``n``, the number of records (indices ``0 .. n-1``).
      batch_size: ``b``, the *global* batch size (all ranks together).
      seed: seed of the random schedule (ignored by the deterministic samplers); ``None``
        draws a secret one.
      num_replicas, rank: distributed world size and this process's rank; default to
        ``torch.distributed``'s when it is initialised, else ``1`` and ``0``.
    """

    sampling: str = ""

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        seed: Optional[int] = 0,
        *,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
    ) -> None:
        # the core's checks: b <= n, b = n for full, n // b >= 2 for partitions
        n, b = check_schedule(dataset_size, batch_size, self.sampling)
        self.num_replicas, self.rank = _distributed_defaults(num_replicas, rank)
        if self.num_replicas > b:
            raise v.ParameterError(
                "num_replicas", f"{self.num_replicas} ranks cannot share a batch of {b} records")
        if seed is None:
            seed = _shared_secret_seed(self.num_replicas)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise v.ParameterError("seed", f"must be a non-negative integer, got {seed!r}")
        self.dataset_size = n
        self.batch_size = b
        self.seed = int(seed)
        self.position = 0  # global steps handed out so far
        if self.dropped_per_epoch:
            warnings.warn(
                f"{type(self).__name__}: dataset_size % batch_size = {n} % {b} = "
                f"{self.dropped_per_epoch} records at the end of the order are left out of every "
                f"epoch (Ye & Shokri 2022, footnote 3; the accountant uses n/b -> {n // b})",
                UserWarning, stacklevel=3)  # the caller of the subclass

    # ----------------------------------------------------------------- schedule
    @property
    def steps_per_epoch(self) -> int:
        """``n // b`` (``1`` for ``full``), the core's definition."""
        return steps_per_epoch(self.dataset_size, self.batch_size, self.sampling)

    @property
    def dropped_per_epoch(self) -> int:
        """Records that take no part in an epoch (``n % b`` for the partition samplers)."""
        return 0

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self.position // self.steps_per_epoch

    def global_batch(self, step: int) -> List[int]:
        """Indices of the whole batch (all ranks) used at global step ``step``."""
        raise NotImplementedError

    def local_batch(self, step: int) -> List[int]:
        """This rank's share of :meth:`global_batch`."""
        batch = self.global_batch(step)
        if self.num_replicas == 1:
            return batch
        return batch[self.rank::self.num_replicas]

    def __len__(self) -> int:
        # Opacus reads the sample rate as 1 / len(data_loader): one epoch of steps
        return self.steps_per_epoch

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
        """What defines the schedule (everything but the position and the rank)."""
        return {"class": type(self).__name__, "sampling": self.sampling,
                "dataset_size": self.dataset_size, "batch_size": self.batch_size, "seed": self.seed}

    def state_dict(self) -> Dict[str, Any]:
        return {**self.describe(), "position": self.position}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores the position after checking the schedule is the same one."""
        mine, theirs = self.describe(), {k: state.get(k) for k in self.describe()}
        if mine != theirs:
            raise v.ParameterError("sampler", f"checkpoint holds the schedule {theirs}, this sampler is {mine}")
        self.set_position(state["position"])

    def __repr__(self) -> str:
        extra = f", rank={self.rank}/{self.num_replicas}" if self.num_replicas > 1 else ""
        return (f"{type(self).__name__}(dataset_size={self.dataset_size}, batch_size={self.batch_size}, "
                f"seed={self.seed}, position={self.position}{extra})")


class _PartitionSampler(HiddenStateBatchSampler):
    """A fixed order of the records, cut into ``n // b`` batches, visited cyclically."""

    def _order(self) -> np.ndarray:
        raise NotImplementedError

    @property
    def dropped_per_epoch(self) -> int:
        return self.dataset_size % self.batch_size

    def global_batch(self, step: int) -> List[int]:
        j, b = step % self.steps_per_epoch, self.batch_size
        return self._order()[j * b:(j + 1) * b].tolist()

    @property
    def dropped_indices(self) -> List[int]:
        """The records that are never used (the last ``n % b`` of the order)."""
        n_used = self.steps_per_epoch * self.batch_size
        return self._order()[n_used:].tolist()


class CyclicBatchSampler(_PartitionSampler):
    """Fixed order: batch ``j`` of every epoch is records ``j*b .. (j+1)*b - 1``.

    Matches ``sampling="cyclic"`` (Bok et al. Thms 4.4-4.6, Ye & Shokri Thm 3.3). The order is
    the dataset's own, so shuffle the dataset once beforehand if it is sorted; the records
    ``(n // b) * b .. n - 1`` are never used.

    >>> [b for b in CyclicBatchSampler(6, 2)]
    [[0, 1], [2, 3], [4, 5]]
    >>> CyclicBatchSampler(6, 2, num_replicas=2, rank=1).local_batch(0)
    [1]
    """

    sampling = "cyclic"

    def __init__(self, dataset_size: int, batch_size: int, *, num_replicas: Optional[int] = None,
                 rank: Optional[int] = None) -> None:
        super().__init__(dataset_size, batch_size, 0, num_replicas=num_replicas, rank=rank)
        self._fixed = np.arange(self.dataset_size)

    def _order(self) -> np.ndarray:
        return self._fixed


class ShufflePartitionBatchSampler(_PartitionSampler):
    """One random partition drawn once from ``seed``, visited in the same order every epoch.

    Matches ``sampling="shuffle_partition"`` (Ye & Shokri Thm 4.2; every fixed-order bound
    also holds). This is *not* ``DataLoader(shuffle=True)``, which draws a new partition
    every epoch. The last ``n % b`` records of the random order are never used.

    >>> s = ShufflePartitionBatchSampler(6, 2, seed=3)
    >>> epoch1, epoch2 = list(s), list(s)
    >>> epoch1 == epoch2, sorted(i for b in epoch1 for i in b)
    (True, [0, 1, 2, 3, 4, 5])
    """

    sampling = "shuffle_partition"

    def __init__(self, dataset_size: int, batch_size: int, seed: Optional[int] = None, *,
                 num_replicas: Optional[int] = None, rank: Optional[int] = None) -> None:
        super().__init__(dataset_size, batch_size, seed, num_replicas=num_replicas, rank=rank)
        self._perm = _rng(self.seed).permutation(self.dataset_size)

    def _order(self) -> np.ndarray:
        return self._perm


class WithoutReplacementBatchSampler(HiddenStateBatchSampler):
    """At every step, ``b`` distinct records drawn uniformly from all ``n``, independently of
    every other step (``sampling="without_replacement"``: Ye & Shokri Thm 4.3, Bok et al.
    Thms 4.8-4.10, Altschuler & Talwar). An epoch is ``n // b`` steps; no record is left out.

    >>> s = WithoutReplacementBatchSampler(10, 4, seed=1)
    >>> [len(set(b)) for b in s]
    [4, 4]
    """

    sampling = "without_replacement"

    def __init__(self, dataset_size: int, batch_size: int, seed: Optional[int] = None, *,
                 num_replicas: Optional[int] = None, rank: Optional[int] = None) -> None:
        super().__init__(dataset_size, batch_size, seed, num_replicas=num_replicas, rank=rank)

    def global_batch(self, step: int) -> List[int]:
        # one stream per step: the same batch whatever was drawn before (resumable in O(1))
        return _rng(self.seed, step).choice(self.dataset_size, self.batch_size, replace=False).tolist()


class FullBatchSampler(HiddenStateBatchSampler):
    """Every step uses all ``n`` records (``sampling="full"``: Bok et al. Thms 4.1-4.3,
    Chourasia et al.); one step per epoch.

    >>> list(FullBatchSampler(3))
    [[0, 1, 2]]
    """

    sampling = "full"

    def __init__(self, dataset_size: int, *, num_replicas: Optional[int] = None,
                 rank: Optional[int] = None) -> None:
        super().__init__(dataset_size, dataset_size, 0, num_replicas=num_replicas, rank=rank)

    def global_batch(self, step: int) -> List[int]:
        return list(range(self.dataset_size))


_CLASSES = {c.__name__: c for c in (CyclicBatchSampler, ShufflePartitionBatchSampler,
                                    WithoutReplacementBatchSampler, FullBatchSampler)}


def sampler_from_state_dict(state: Dict[str, Any], *, num_replicas: Optional[int] = None,
                            rank: Optional[int] = None) -> HiddenStateBatchSampler:
    """Rebuilds a sampler (schedule and position) from :meth:`HiddenStateBatchSampler.state_dict`."""
    cls = _CLASSES.get(state.get("class"))
    if cls is None:
        raise v.ParameterError("sampler", f"unknown sampler class {state.get('class')!r}")
    n, b, seed = state["dataset_size"], state["batch_size"], state["seed"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the remainder warning was given when it was first built
        if cls is FullBatchSampler:
            s = cls(n, num_replicas=num_replicas, rank=rank)
        elif cls is CyclicBatchSampler:
            s = cls(n, b, num_replicas=num_replicas, rank=rank)
        else:
            s = cls(n, b, seed, num_replicas=num_replicas, rank=rank)
    s.load_state_dict(state)
    return s
