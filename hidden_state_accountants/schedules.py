"""Batch schedules: which records each step uses, and the rules every sampler follows.

The hidden-state bounds depend on the batch schedule, so the schedule is defined once,
here, and every sampler of the package (the PyTorch samplers, ``tf.data`` pipelines, both
DP-SBCD trainers) draws its batches from a :class:`BatchSchedule`:

==========================  ========================================================================
sampling                    schedule
==========================  ========================================================================
``full``                    every step uses all ``n`` records
``cyclic``                  batch ``j`` of every epoch is records ``j*b .. (j+1)*b - 1`` (data order)
``shuffle_partition``       one random permutation drawn *once*, cut into ``n // b`` batches,
                            visited in the same order every epoch
``without_replacement``     each step draws ``b`` distinct records afresh from all ``n``
``poisson``                 each record joins each step's batch independently with probability ``q``
==========================  ========================================================================

An epoch is ``n // b`` steps (one for ``full``); the partition schedules leave the last
``n % b`` records of their order out of every epoch (Ye & Shokri 2022, footnote 3).

**Secret seeds.** A random schedule is only as private as its randomness is secret: the
analyses of ``shuffle_partition`` (the record's position is uniform), ``without_replacement``
and ``poisson`` (amplification by sampling) assume the adversary does not know the draw. So
every random schedule draws a fresh secret seed from :mod:`secrets` unless the caller passes
one. A seed passed by the caller is their explicit choice and must be kept as private as the
data (it is stored in checkpoints, which must be too); a published seed makes the batches
public, and then only the fixed-order (``cyclic``) bounds hold for a partition.

The batch of global step ``t`` is a function of ``(seed, t)`` alone, so any process can
compute it and a run resumes anywhere in O(1).

>>> s = BatchSchedule(6, 2, CYCLIC)
>>> [s.batch(t).tolist() for t in range(4)]
[[0, 1], [2, 3], [4, 5], [0, 1]]
>>> BatchSchedule(6, 2, SHUFFLE_PARTITION).seed_is_secret
True
"""

from __future__ import annotations

import math
import secrets
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from hidden_state_accountants import validation as v

FULL = "full"
CYCLIC = "cyclic"
SHUFFLE_PARTITION = "shuffle_partition"
WITHOUT_REPLACEMENT = "without_replacement"
POISSON = "poisson"

SAMPLINGS: Tuple[str, ...] = (FULL, CYCLIC, SHUFFLE_PARTITION, WITHOUT_REPLACEMENT, POISSON)
"""Every batch schedule the accountant knows."""

PARTITIONS: Tuple[str, ...] = (CYCLIC, SHUFFLE_PARTITION)
"""Schedules that visit a fixed partition of the records in the same order every epoch."""

RANDOM: Tuple[str, ...] = (SHUFFLE_PARTITION, WITHOUT_REPLACEMENT, POISSON)
"""Schedules whose batches are random (and need a secret seed)."""

MAX_STEPS = 10**18
"""More optimiser steps than any training run takes; the hidden-state bounds' limit for
unbounded training is what ``max_epochs_within_budget`` / ``hsa epochs`` report."""

SAMPLING_DESCRIPTIONS: Dict[str, str] = {
    FULL: "every step uses all n records",
    CYCLIC: "one fixed partition into n//b batches, visited in the same order every epoch",
    SHUFFLE_PARTITION: "one partition drawn at random once, then visited in order every epoch",
    WITHOUT_REPLACEMENT: "each step draws b distinct records afresh",
    POISSON: "each record joins each step's batch independently with probability q",
}


def check_sampling(sampling: Any) -> str:
    if sampling not in SAMPLINGS:
        raise v.ParameterError("sampling", f"must be one of {', '.join(SAMPLINGS)}; got {sampling!r}")
    return sampling


def check_schedule(dataset_size: Any, batch_size: Any, sampling: Any) -> Tuple[int, int]:
    """Validates ``(n, b, sampling)`` and returns ``(n, b)``.

    ``b <= n``; ``b == n`` for ``full``; at least two batches for the partition schedules.
    Raises :class:`~hidden_state_accountants.ParameterError` naming the parameter.
    """
    n = v.positive_int("dataset_size", dataset_size)
    b = v.positive_int("batch_size", batch_size)
    check_sampling(sampling)
    if b > n:
        raise v.ParameterError("batch_size", f"must be <= dataset_size ({n}), got {b}")
    if sampling == FULL and b != n:
        raise v.ParameterError("batch_size", f"must equal dataset_size ({n}) for sampling='full', got {b}")
    if sampling in PARTITIONS and n // b < 2:
        raise v.ParameterError(
            "batch_size",
            f"{sampling} needs at least two batches (dataset_size // batch_size >= 2), "
            f"got {n} // {b} = {n // b}; use sampling='full' for one batch",
        )
    return n, b


def steps_per_epoch(dataset_size: int, batch_size: int, sampling: str) -> int:
    """One step for ``full``; ``n // b`` otherwise (a remainder of ``n % b`` records is
    dropped each epoch by the partition schedules, Ye & Shokri footnote 3)."""
    if sampling == FULL:
        return 1
    return max(1, dataset_size // batch_size)


def visits_per_record(steps: int, batches_per_epoch: int) -> int:
    """Most visits any record gets in ``steps`` steps of a fixed-order schedule."""
    return -(-steps // batches_per_epoch)


def draw_secret_seed() -> int:
    """A fresh seed from the operating system's cryptographic source (63 bits)."""
    return secrets.randbits(63)


def check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 2**63:
        raise v.ParameterError("seed", f"must be an integer in [0, 2**63) or None for a secret one, got {seed!r}")
    return int(seed)


def _rng(seed: int, *stream: int) -> np.random.Generator:
    """An independent generator for ``(seed, *stream)``: reproducible and O(1) to reach."""
    return np.random.default_rng(np.random.SeedSequence([seed, *stream]))


class BatchSchedule:
    """A batch schedule: ``batch(step)`` is the (global) batch of every step.

    Args:
      dataset_size: ``n``; records are indices ``0 .. n-1``.
      batch_size: ``b`` (the expected batch size for ``poisson``).
      sampling: one of :data:`SAMPLINGS`.
      seed: for the random schedules, ``None`` (the default) draws a secret seed; an integer
        is the caller's explicit choice and must be kept secret. Deterministic schedules
        take no seed.
      sampling_probability: ``q`` for ``poisson`` (default ``b / n``).
      share_seed: for several processes that must follow one schedule: called with the
        secret seed drawn here, returns the seed every process uses (e.g. a broadcast from
        the first process); the result is still a secret draw. Only used when ``seed=None``.

    The object is immutable; samplers that remember a position wrap it.

    >>> BatchSchedule(6, 2, SHUFFLE_PARTITION, share_seed=lambda drawn: 12345).seed_is_secret
    True
    """

    __slots__ = ("dataset_size", "batch_size", "sampling", "seed", "seed_is_secret",
                 "sampling_probability", "_order")

    def __init__(self, dataset_size: int, batch_size: int, sampling: str, seed: Optional[int] = None, *,
                 sampling_probability: Optional[float] = None,
                 share_seed: Optional[Callable[[int], int]] = None) -> None:
        n, b = check_schedule(dataset_size, batch_size, sampling)
        if sampling in RANDOM:
            secret = seed is None
            if secret:
                seed = draw_secret_seed()
                seed = seed if share_seed is None else check_seed(share_seed(seed))
            else:
                seed = check_seed(seed)
        else:
            if seed is not None:
                raise v.ParameterError("seed", f"sampling={sampling!r} is deterministic and takes no seed, got {seed!r}")
            secret = False
        q = None
        if sampling == POISSON:
            q = b / n if sampling_probability is None else v.real("sampling_probability", sampling_probability)
            if not 0 < q <= 1:
                raise v.ParameterError("sampling_probability", f"must lie in (0, 1], got {sampling_probability!r}")
        elif sampling_probability is not None:
            raise v.ParameterError("sampling_probability", f"applies to sampling='poisson' only, not {sampling!r}")
        object.__setattr__(self, "dataset_size", n)
        object.__setattr__(self, "batch_size", b)
        object.__setattr__(self, "sampling", sampling)
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "seed_is_secret", secret)
        object.__setattr__(self, "sampling_probability", q)
        object.__setattr__(self, "_order", None)

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable")

    # ------------------------------------------------------------------ structure
    @property
    def is_random(self) -> bool:
        return self.sampling in RANDOM

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.dataset_size, self.batch_size, self.sampling)

    @property
    def dropped_per_epoch(self) -> int:
        """Records that take no part in an epoch (``n % b`` for the partition schedules)."""
        return self.dataset_size % self.batch_size if self.sampling in PARTITIONS else 0

    @property
    def fixed_batch_size(self) -> bool:
        """Every batch holds exactly ``batch_size`` records (all but ``poisson``)."""
        return self.sampling != POISSON

    def order(self) -> np.ndarray:
        """The record order a partition schedule cuts into batches (computed once)."""
        if self.sampling not in PARTITIONS:
            raise v.ParameterError("sampling", f"{self.sampling!r} has no fixed order")
        if self._order is None:
            n = self.dataset_size
            order = np.arange(n) if self.sampling == CYCLIC else _rng(self.seed).permutation(n)
            object.__setattr__(self, "_order", order)
        return self._order

    def partition(self) -> np.ndarray:
        """The batches of one epoch of a partition schedule, shape ``(n // b, b)``."""
        spe, b = self.steps_per_epoch, self.batch_size
        return self.order()[: spe * b].reshape(spe, b)

    def batch(self, step: int) -> np.ndarray:
        """Indices of the whole batch used at global step ``step`` (0-based)."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise v.ParameterError("step", f"must be a non-negative integer, got {step!r}")
        n, b, s = self.dataset_size, self.batch_size, self.sampling
        if s == FULL:
            return np.arange(n)
        if s in PARTITIONS:
            j = int(step) % self.steps_per_epoch
            return self.order()[j * b:(j + 1) * b]
        rng = _rng(self.seed, int(step))  # one stream per step: O(1) to resume anywhere
        if s == WITHOUT_REPLACEMENT:
            return rng.choice(n, b, replace=False)
        return np.flatnonzero(rng.random(n) < self.sampling_probability)

    # --------------------------------------------------------------- persistence
    def describe(self) -> Dict[str, Any]:
        """Everything that defines the schedule, in plain Python types (the seed included:
        keep the result as private as the data)."""
        out = {"sampling": self.sampling, "dataset_size": self.dataset_size, "batch_size": self.batch_size,
               "seed": self.seed}
        if self.sampling == POISSON:
            out["sampling_probability"] = self.sampling_probability
        return out

    @classmethod
    def from_description(cls, state: Dict[str, Any], *, seed_is_secret: bool = False) -> "BatchSchedule":
        """Rebuilds a schedule from :meth:`describe`.

        A stored seed counts as the caller's choice unless ``seed_is_secret=True``: pass that
        only for the description of a schedule whose seed was drawn secretly and has been kept
        as private as the data since (e.g. restored from a private checkpoint of the same run).

        >>> s = BatchSchedule(6, 2, SHUFFLE_PARTITION)
        >>> t = BatchSchedule.from_description(s.describe(), seed_is_secret=True)
        >>> t == s and t.seed_is_secret
        True
        """
        if not isinstance(seed_is_secret, bool):
            raise v.ParameterError("seed_is_secret", f"must be True or False, got {seed_is_secret!r}")
        if not isinstance(state, dict):
            raise v.ParameterError("schedule", f"must be a dict from BatchSchedule.describe(), got {type(state).__name__}")
        missing = [k for k in ("sampling", "dataset_size", "batch_size", "seed") if k not in state]
        if missing:
            raise v.ParameterError("schedule", f"missing {', '.join(missing)}")
        sampling = check_sampling(state["sampling"])
        schedule = cls(state["dataset_size"], state["batch_size"], sampling,
                       state["seed"] if sampling in RANDOM else None,
                       sampling_probability=state.get("sampling_probability"))
        if seed_is_secret and schedule.is_random:
            object.__setattr__(schedule, "seed_is_secret", True)
        return schedule

    def same_schedule(self, other: "BatchSchedule") -> bool:
        return isinstance(other, BatchSchedule) and self.describe() == other.describe()

    def __eq__(self, other) -> bool:
        return self.same_schedule(other)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.describe().items())))

    def __repr__(self) -> str:
        seed = "" if self.seed is None else (", seed=<secret>" if self.seed_is_secret else f", seed={self.seed}")
        q = "" if self.sampling != POISSON else f", q={self.sampling_probability:.6g}"
        return (f"BatchSchedule(dataset_size={self.dataset_size}, batch_size={self.batch_size}, "
                f"sampling={self.sampling!r}{seed}{q})")


def poisson_sizes(sampling_probability: float, dataset_size: Optional[int] = None) -> Tuple[int, int]:
    """``(n, b)`` describing a Poisson schedule known only by its rate ``q`` (e.g. Opacus'
    history): ``n`` as given, else recovered from ``q`` when ``q`` is a simple fraction, else
    ``ceil(1/q)``; ``b = max(1, round(q n))``. The rate itself is always carried exactly
    (``sampling_probability``); these sizes only describe the run."""
    q = v.real("sampling_probability", sampling_probability)
    if not 0 < q <= 1:
        raise v.ParameterError("sampling_probability", f"must lie in (0, 1], got {sampling_probability!r}")
    if dataset_size is not None:
        n = v.positive_int("dataset_size", dataset_size)
    else:
        from fractions import Fraction

        frac = Fraction(q).limit_denominator(10**7)
        n = frac.denominator if abs(frac.numerator / frac.denominator - q) <= 1e-12 * q else math.ceil(1 / q)
    return n, min(n, max(1, round(q * n)))
