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
``reshuffle``               a fresh random permutation every epoch, cut into ``n // b`` batches
                            (``DataLoader(shuffle=True)``, Keras ``fit(shuffle=True)``)
``without_replacement``     each step draws ``b`` distinct records afresh from all ``n``
``poisson``                 each record joins each step's batch independently with probability ``q``
``balls_in_bins``           every epoch, each record independently draws its step uniformly among the
                            epoch's ``n // b`` steps (batches of random size, divided by ``b``)
==========================  ========================================================================

An epoch is ``n // b`` steps (one for ``full``); the partition schedules and ``reshuffle``
leave the last ``n % b`` records of their order out of every epoch (Ye & Shokri 2022,
footnote 3). ``reshuffle`` may instead keep that short batch (``last_batch``, see
:data:`LAST_BATCHES`): an epoch is then ``ceil(n / b)`` steps. ``balls_in_bins`` uses every
record exactly once per epoch; where a record goes does not depend on the other records, so
adding or removing one changes nothing else (the property its ADD_OR_REMOVE_ONE analyses rest
on, docs/derivations.md, "Balls-in-bins sampling"), and its batch sizes vary around ``n / (n // b)``.
Its number of steps per epoch ``t`` must be a public constant, the same for neighbouring datasets:
give it (``steps_per_epoch``), or it is ``n // b`` of the dataset size given, which is then treated
as public (under ADD_OR_REMOVE_ONE a neighbour with ``n + 1`` records would otherwise run
``(n + 1) // b`` steps when ``b`` divides ``n + 1``).

**Secret seeds.** A random schedule is only as private as its randomness is secret: the
analyses of ``shuffle_partition``, ``reshuffle`` and ``balls_in_bins`` that average over the
record's position, ``without_replacement`` and ``poisson`` (amplification by sampling) assume the
adversary does not know the draw. So
every random schedule draws a fresh secret seed from :mod:`secrets` unless the caller passes
one. A seed passed by the caller is their explicit choice and must be kept as private as the
data (it is stored in checkpoints, which must be too); a published seed makes the batches
public: say so with ``secret=False``, and then only the bounds for the worst batch positions
hold (the fixed-order bounds for a partition, the worst visit pattern for ``reshuffle``).

A framework that draws its own batches (``DataLoader(shuffle=True)``, Keras
``fit(shuffle=True)``) is described by :meth:`BatchSchedule.framework`: the same law, drawn
with the framework's randomness, secret or not as the adapter reports.

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
RESHUFFLE = "reshuffle"
POISSON = "poisson"
BALLS_IN_BINS = "balls_in_bins"

SAMPLINGS: Tuple[str, ...] = (FULL, CYCLIC, SHUFFLE_PARTITION, RESHUFFLE, WITHOUT_REPLACEMENT, POISSON, BALLS_IN_BINS)
"""Every batch schedule the accountant knows."""

PARTITIONS: Tuple[str, ...] = (CYCLIC, SHUFFLE_PARTITION)
"""Schedules that visit a fixed partition of the records in the same order every epoch."""

RANDOM: Tuple[str, ...] = (SHUFFLE_PARTITION, RESHUFFLE, WITHOUT_REPLACEMENT, POISSON, BALLS_IN_BINS)
"""Schedules whose batches are random (and need a secret seed)."""

EPOCH_ORDERS: Tuple[str, ...] = (CYCLIC, SHUFFLE_PARTITION, RESHUFFLE)
"""Schedules that cut an order of the records into batches and use every batch once per epoch."""

DROPPED = "dropped"
KEPT_OWN_SIZE = "kept_own_size"
KEPT_BATCH_SIZE = "kept_batch_size"
LAST_BATCHES: Tuple[str, ...] = (DROPPED, KEPT_OWN_SIZE, KEPT_BATCH_SIZE)
"""What ``reshuffle`` does with the last ``n % b`` records of each epoch's order: drop them
(``DataLoader(drop_last=True)``, the default), or keep them as a short last batch whose
clipped sum and noise are divided by its own size (TF-Privacy / Keras ``fit``) or by the
fixed ``b`` (Opacus with ``optimizer.expected_batch_size = b``). When ``b`` divides ``n``
there is no short batch and every value means ``dropped``."""

MAX_DATASET_SIZE = 10**100
"""More records than any dataset holds; the bound keeps every product of sizes a finite float."""
MAX_STEPS = 10**18
"""More optimiser steps than any training run takes; the hidden-state bounds' limit for
unbounded training is what ``max_epochs_within_budget`` / ``hsa epochs`` report."""
UNBOUNDED_STEPS = 10**15
"""Steps standing in for "forever" when a bound valid for every length is certified (calibration's
``limit_epsilon``; analyses that must answer there)."""

SAMPLING_DESCRIPTIONS: Dict[str, str] = {
    FULL: "every step uses all n records",
    CYCLIC: "one fixed partition into n//b batches, visited in the same order every epoch",
    SHUFFLE_PARTITION: "one partition drawn at random once, then visited in order every epoch",
    WITHOUT_REPLACEMENT: "each step draws b distinct records afresh",
    RESHUFFLE: "a fresh random permutation every epoch, cut into n//b batches",
    POISSON: "each record joins each step's batch independently with probability q",
    BALLS_IN_BINS: (
        "every epoch, each record independently draws its step uniformly among the epoch's n//b "
        "steps (batches of random size, each divided by b)"
    ),
}


def check_sampling(sampling: Any) -> str:
    if sampling not in SAMPLINGS:
        raise v.ParameterError("sampling", f"must be one of {', '.join(SAMPLINGS)}; got {sampling!r}")
    return sampling


def check_last_batch(last_batch: Any, sampling: str, dataset_size: int, batch_size: int) -> str:
    """Validates ``last_batch`` for a checked schedule; ``dropped`` when ``b`` divides ``n``."""
    if last_batch not in LAST_BATCHES:
        raise v.ParameterError("last_batch", f"must be one of {', '.join(LAST_BATCHES)}; got {last_batch!r}")
    if last_batch != DROPPED and sampling != RESHUFFLE:
        raise v.ParameterError(
            "last_batch", f"a kept short batch applies to sampling={RESHUFFLE!r} only, not {sampling!r}"
        )
    return last_batch if dataset_size % batch_size else DROPPED


def check_schedule(dataset_size: Any, batch_size: Any, sampling: Any) -> Tuple[int, int]:
    """Validates ``(n, b, sampling)`` and returns ``(n, b)``.

    ``b <= n``; ``b == n`` for ``full``; at least two batches for the partition schedules.
    Raises :class:`~hidden_state_accountants.ParameterError` naming the parameter.
    """
    n = v.positive_int(
        "dataset_size", dataset_size, maximum=MAX_DATASET_SIZE, why=" (more records than any dataset holds)"
    )
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


def check_epoch_steps(epoch_steps: Any, sampling: str) -> Optional[int]:
    """Validates an explicit number of steps per epoch (``balls_in_bins`` only; ``None`` derives it)."""
    if epoch_steps is None:
        return None
    if sampling != BALLS_IN_BINS:
        raise v.ParameterError(
            "steps_per_epoch",
            f"is given for sampling={BALLS_IN_BINS!r} only (the others cut n // b batches), not {sampling!r}",
        )
    return v.positive_int("steps_per_epoch", epoch_steps, maximum=MAX_STEPS, why=" (more than any training run takes)")


def balls_in_bins_note(steps: int, given: bool) -> str:
    """What a balls-in-bins report says about its steps per epoch (a public constant, docs/derivations.md B.1)."""
    if given:  # an adapter may compute it from the dataset size (Keras' padded balls_in_bins_steps(n, b))
        return (
            f"balls_in_bins: t = {steps} steps per epoch is a public constant (given explicitly); the guarantee is "
            "for neighbouring datasets run with the same t (a t computed from the dataset size, as the Keras "
            "pipeline's default is, treats that size as public)"
        )
    return (
        f"balls_in_bins: t = {steps} steps per epoch is a public constant (n // b of the dataset size, which is "
        "treated as public); the guarantee is for neighbouring datasets run with the same t (pass steps_per_epoch "
        "to fix it independently of the data)"
    )


def steps_per_epoch(
    dataset_size: int, batch_size: int, sampling: str, last_batch: str = DROPPED, epoch_steps: Optional[int] = None
) -> int:
    """One step for ``full``; ``n // b`` otherwise (a remainder of ``n % b`` records is
    dropped each epoch by the partition schedules, Ye & Shokri footnote 3; ``balls_in_bins``
    spreads all ``n`` records over these steps), ``ceil(n / b)`` when ``reshuffle`` keeps the
    short batch; ``epoch_steps`` when given (``balls_in_bins``' public constant, validated by
    :func:`check_epoch_steps`)."""
    if epoch_steps is not None:
        return epoch_steps
    if sampling == FULL:
        return 1
    if last_batch != DROPPED:
        return -(-dataset_size // batch_size)
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
      batch_size: ``b``, the number every batch's clipped sum is divided by (the expected
        batch size for ``poisson``; for ``balls_in_bins`` a batch holds ``n / (n // b)``
        records on average).
      sampling: one of :data:`SAMPLINGS`.
      seed: for the random schedules, ``None`` (the default) draws a secret seed; an integer
        is the caller's explicit choice and must be kept secret. Deterministic schedules
        take no seed.
      sampling_probability: ``q`` for ``poisson`` (default ``b / n``).
      last_batch: for ``reshuffle``, what happens to the last ``n % b`` records of each
        epoch's order (:data:`LAST_BATCHES`; default ``dropped``).
      secret: whether the draw is secret from the adversary (default). ``False`` says the
        batches are public (e.g. a published seed): the bounds that average over the
        record's position no longer apply. ``without_replacement`` and ``poisson`` need a
        secret draw (no analysis here covers them with public batches).
      share_seed: for several processes that must follow one schedule: called with the
        secret seed drawn here, returns the seed every process uses (e.g. a broadcast from
        the first process); the result is still a secret draw. Only used when ``seed=None``.
      steps_per_epoch: for ``balls_in_bins``, the number of steps ``t`` each epoch spreads the
        records over, a public constant; ``None`` (default) takes ``n // b``, treating the
        dataset size as public (docs/derivations.md B.1).

    The object is immutable; samplers that remember a position wrap it.

    >>> s = BatchSchedule(7, 3, RESHUFFLE, seed=1, last_batch=KEPT_OWN_SIZE)
    >>> s.steps_per_epoch, [len(s.batch(t)) for t in range(3)]
    (3, [3, 3, 1])
    >>> sorted(np.concatenate([s.batch(t) for t in range(3, 6)]).tolist()) == list(range(7))
    True
    >>> BatchSchedule(6, 2, SHUFFLE_PARTITION, share_seed=lambda drawn: 12345).seed_is_secret
    True
    """

    __slots__ = (
        "dataset_size",
        "batch_size",
        "sampling",
        "seed",
        "seed_is_secret",
        "sampling_probability",
        "last_batch",
        "secret",
        "external",
        "epoch_steps",
        "_order",
        "_epoch",
    )

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        sampling: str,
        seed: Optional[int] = None,
        *,
        sampling_probability: Optional[float] = None,
        last_batch: str = DROPPED,
        secret: bool = True,
        share_seed: Optional[Callable[[int], int]] = None,
        steps_per_epoch: Optional[int] = None,
    ) -> None:
        self._build(
            dataset_size,
            batch_size,
            sampling,
            seed,
            sampling_probability,
            last_batch,
            secret,
            False,
            share_seed,
            steps_per_epoch,
        )

    @classmethod
    def framework(
        cls, dataset_size: int, batch_size: int, sampling: str = RESHUFFLE, *, last_batch: str = DROPPED, secret: bool
    ) -> "BatchSchedule":
        """The law of batches a framework draws with its own randomness (``reshuffle`` only:
        ``DataLoader(shuffle=True)``, Keras ``fit(shuffle=True)``). ``secret``: whether that
        randomness is unknown to the adversary; ``False`` when the framework's generator was
        seeded with a value that is or may be public (``torch.manual_seed(0)`` in a script).
        :meth:`batch` is not available: the framework draws the batches.

        >>> s = BatchSchedule.framework(61, 6, last_batch=KEPT_OWN_SIZE, secret=False)
        >>> s.steps_per_epoch, s.external, s.secret
        (11, True, False)
        """
        if sampling != RESHUFFLE:
            raise v.ParameterError(
                "sampling", f"a framework's own draws are supported for {RESHUFFLE!r} only, got {sampling!r}"
            )
        out = cls.__new__(cls)
        out._build(dataset_size, batch_size, sampling, None, None, last_batch, secret, True, None, None)
        return out

    def _build(
        self,
        dataset_size,
        batch_size,
        sampling,
        seed,
        sampling_probability,
        last_batch,
        secret,
        external,
        share_seed,
        epoch_steps,
    ) -> None:
        n, b = check_schedule(dataset_size, batch_size, sampling)
        epoch_steps = check_epoch_steps(epoch_steps, sampling)
        last_batch = check_last_batch(last_batch, sampling, n, b)
        if not isinstance(secret, bool):
            raise v.ParameterError("secret", f"must be True or False, got {secret!r}")
        if not secret and sampling in (WITHOUT_REPLACEMENT, POISSON):
            raise v.ParameterError(
                "secret", f"{sampling} with public batches is not covered (its analyses rest on the draw being secret)"
            )
        if external:
            seed_secret = False
        elif sampling in RANDOM:
            seed_secret = seed is None
            if seed_secret:
                seed = draw_secret_seed()
                seed = seed if share_seed is None else check_seed(share_seed(seed))
            else:
                seed = check_seed(seed)
        else:
            if seed is not None:
                raise v.ParameterError(
                    "seed", f"sampling={sampling!r} is deterministic and takes no seed, got {seed!r}"
                )
            seed_secret = False
        q = None
        if sampling == POISSON:
            q = b / n if sampling_probability is None else v.real("sampling_probability", sampling_probability)
            if not 0 < q <= 1:
                raise v.ParameterError("sampling_probability", f"must lie in (0, 1], got {sampling_probability!r}")
        elif sampling_probability is not None:
            raise v.ParameterError("sampling_probability", f"applies to sampling='poisson' only, not {sampling!r}")
        for name, value in (
            ("dataset_size", n),
            ("batch_size", b),
            ("sampling", sampling),
            ("seed", seed),
            ("seed_is_secret", seed_secret),
            ("sampling_probability", q),
            ("last_batch", last_batch),
            ("secret", secret),
            ("external", external),
            ("epoch_steps", epoch_steps),
            ("_order", None),
            ("_epoch", None),
        ):
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable")

    # ------------------------------------------------------------------ structure
    @property
    def is_random(self) -> bool:
        return self.sampling in RANDOM

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.dataset_size, self.batch_size, self.sampling, self.last_batch, self.epoch_steps)

    @property
    def dropped_per_epoch(self) -> int:
        """Records that take no part in an epoch (``n % b`` for the partition schedules and
        ``reshuffle`` unless it keeps the short batch)."""
        if self.sampling in EPOCH_ORDERS and self.last_batch == DROPPED:
            return self.dataset_size % self.batch_size
        return 0

    @property
    def fixed_batch_size(self) -> bool:
        """Every batch holds exactly ``batch_size`` records (all but ``poisson``,
        ``balls_in_bins`` and a kept short batch)."""
        return self.sampling not in (POISSON, BALLS_IN_BINS) and self.last_batch == DROPPED

    def order(self) -> np.ndarray:
        """The record order a partition schedule cuts into batches (computed once)."""
        if self.sampling not in PARTITIONS:
            raise v.ParameterError("sampling", f"{self.sampling!r} has no fixed order")
        if self._order is None:
            n = self.dataset_size
            order = np.arange(n) if self.sampling == CYCLIC else _rng(self.seed).permutation(n)
            object.__setattr__(self, "_order", order)
        return self._order

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The permutation ``reshuffle`` cuts into batches in ``epoch`` (0-based): one stream
        per ``(seed, epoch)``, so any epoch is reached in O(n)."""
        if self.sampling != RESHUFFLE:
            return self.order()
        if self.external:
            raise v.ParameterError("schedule", "the framework draws these batches; this schedule only describes them")
        cached = self._epoch
        if cached is None or cached[0] != epoch:
            cached = (epoch, _rng(self.seed, int(epoch)).permutation(self.dataset_size))
            object.__setattr__(self, "_epoch", cached)
        return cached[1]

    def epoch_assignment(self, epoch: int) -> np.ndarray:
        """``balls_in_bins``: the step (``0 .. n//b - 1``) of every record in ``epoch`` (0-based).
        Record ``i``'s step is the ``i``-th of ``n`` independent uniform draws from one stream per
        ``(seed, epoch)``: the draws are i.i.d., so no record's step depends on the others'
        (appending a record leaves the first ``n`` draws as they were), and any epoch is reached
        in O(n).

        >>> s = BatchSchedule(5, 2, BALLS_IN_BINS, seed=7)
        >>> a = s.epoch_assignment(0)
        >>> sorted(np.concatenate([s.batch(0), s.batch(1)]).tolist()), bool(np.all(s.batch(1) == np.flatnonzero(a == 1)))
        ([0, 1, 2, 3, 4], True)
        """
        return self._epoch_bins(epoch)[0]

    def _epoch_bins(self, epoch: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(assignment, records sorted by step, where each step's records start)``, cached."""
        if self.sampling != BALLS_IN_BINS:
            raise v.ParameterError("sampling", f"{self.sampling!r} draws no step per record")
        cached = self._epoch
        if cached is None or cached[0] != epoch:
            steps = self.steps_per_epoch
            assignment = _rng(self.seed, int(epoch)).integers(0, steps, self.dataset_size)
            order = np.argsort(assignment, kind="stable")  # ascending record ids within a step
            starts = np.searchsorted(assignment[order], np.arange(steps + 1))
            cached = (epoch, assignment, order, starts)
            object.__setattr__(self, "_epoch", cached)
        return cached[1], cached[2], cached[3]

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
        if s in EPOCH_ORDERS:
            epoch, j = divmod(int(step), self.steps_per_epoch)
            return self.epoch_order(epoch)[j * b : (j + 1) * b]  # a kept short batch is the tail
        if self.external:
            raise v.ParameterError("schedule", "the framework draws these batches; this schedule only describes them")
        if s == BALLS_IN_BINS:
            epoch, j = divmod(int(step), self.steps_per_epoch)
            _, order, starts = self._epoch_bins(epoch)
            return order[starts[j] : starts[j + 1]]
        rng = _rng(self.seed, int(step))  # one stream per step: O(1) to resume anywhere
        if s == WITHOUT_REPLACEMENT:
            return rng.choice(n, b, replace=False)
        return np.flatnonzero(rng.random(n) < self.sampling_probability)

    # --------------------------------------------------------------- persistence
    def describe(self) -> Dict[str, Any]:
        """Everything that defines the schedule, in plain Python types (the seed included:
        keep the result as private as the data)."""
        out = {
            "sampling": self.sampling,
            "dataset_size": self.dataset_size,
            "batch_size": self.batch_size,
            "seed": self.seed,
        }
        if self.sampling == POISSON:
            out["sampling_probability"] = self.sampling_probability
        if self.last_batch != DROPPED:
            out["last_batch"] = self.last_batch
        if not self.secret:
            out["secret"] = False
        if self.external:
            out["external"] = True
        if self.epoch_steps is not None:
            out["steps_per_epoch"] = self.epoch_steps
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
            raise v.ParameterError(
                "schedule", f"must be a dict from BatchSchedule.describe(), got {type(state).__name__}"
            )
        missing = [k for k in ("sampling", "dataset_size", "batch_size", "seed") if k not in state]
        if missing:
            raise v.ParameterError("schedule", f"missing {', '.join(missing)}")
        sampling = check_sampling(state["sampling"])
        extra = dict(last_batch=state.get("last_batch", DROPPED), secret=state.get("secret", True))
        if state.get("external", False):
            return cls.framework(state["dataset_size"], state["batch_size"], sampling, **extra)
        schedule = cls(
            state["dataset_size"],
            state["batch_size"],
            sampling,
            state["seed"] if sampling in RANDOM else None,
            sampling_probability=state.get("sampling_probability"),
            steps_per_epoch=state.get("steps_per_epoch"),
            **extra,
        )
        if seed_is_secret and schedule.is_random:
            object.__setattr__(schedule, "seed_is_secret", True)
        return schedule

    def same_law(self, other: "BatchSchedule") -> bool:
        """The same schedule up to the draw itself (seed, secrecy, who draws)."""
        keys = ("sampling", "dataset_size", "batch_size", "sampling_probability", "last_batch", "epoch_steps")
        return isinstance(other, BatchSchedule) and all(getattr(self, k) == getattr(other, k) for k in keys)

    def same_schedule(self, other: "BatchSchedule") -> bool:
        return isinstance(other, BatchSchedule) and self.describe() == other.describe()

    def __eq__(self, other) -> bool:
        return self.same_schedule(other)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.describe().items())))

    def __repr__(self) -> str:
        if self.external:
            seed = ", drawn by the framework"
        else:
            seed = "" if self.seed is None else (", seed=<secret>" if self.seed_is_secret else f", seed={self.seed}")
        q = "" if self.sampling != POISSON else f", q={self.sampling_probability:.6g}"
        last = "" if self.last_batch == DROPPED else f", last_batch={self.last_batch!r}"
        public = "" if self.secret else ", public"
        spe = "" if self.epoch_steps is None else f", steps_per_epoch={self.epoch_steps}"
        return (
            f"BatchSchedule(dataset_size={self.dataset_size}, batch_size={self.batch_size}, "
            f"sampling={self.sampling!r}{seed}{q}{last}{public}{spe})"
        )


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
