"""``tf.data`` pipelines of the core's batch schedules.

:func:`batched_dataset` yields exactly the batches of a core
:class:`~hidden_state_accountants.BatchSchedule` (``schedule.batch(step)``), and remembers
which schedule each dataset it returned follows (:func:`dataset_source`), so that the TF-Privacy
callback can verify that ``fit`` trains on such a dataset. It needs TensorFlow only; the rules for
what TF-Privacy's Keras optimizers can train on (:func:`check_dataset_sampling`,
:func:`check_dataset_last_batch`: they divide every batch by its own size) are checked here too, so
a dataset that the callback would refuse is refused when it is built.
"""

from __future__ import annotations

import weakref
from typing import List, Optional

import numpy as np
import tensorflow as tf
from scipy import stats

from hidden_state_accountants import BatchSchedule, ParameterError
from hidden_state_accountants.schedules import check_schedule
from hidden_state_accountants import validation as v
from hidden_state_accountants.schedules import (
    BALLS_IN_BINS,
    CYCLIC,
    DROPPED,
    FULL,
    KEPT_BATCH_SIZE,
    KEPT_OWN_SIZE,
    LAST_BATCHES,
    POISSON,
    RESHUFFLE,
    SAMPLINGS,
    SHUFFLE_PARTITION,
    WITHOUT_REPLACEMENT,
)

from .features import ArrayLike, largest_row_norm

DATASET_SAMPLINGS = (FULL, CYCLIC, SHUFFLE_PARTITION, RESHUFFLE, WITHOUT_REPLACEMENT, BALLS_IN_BINS)
"""Schedules a Keras ``fit`` with TF-Privacy can be accounted for. ``poisson`` batches have a random
size, which Keras batching does not produce, and TF-Privacy divides by the realised batch size.
``balls_in_bins`` batches are padded to ``b`` rows of weight 0 (:func:`batched_dataset`), so that
TF-Privacy's division by the batch's rows is the fixed divisor ``b`` the analyses need."""

PIPELINE_SAMPLINGS = DATASET_SAMPLINGS
"""Schedules :func:`batched_dataset` produces."""

PAD_OVERFLOW = 1e-15
"""The largest probability that a ``balls_in_bins`` step of a Keras pipeline draws more than ``b`` records
(:func:`balls_in_bins_steps`; the pipeline then stops with an error). Outside that event the run is the
fixed-divisor one the analyses account, so its delta is the accounted one plus at most this per step: the
callback accounts each run at ``delta - steps * PAD_OVERFLOW`` (:func:`overflow_delta`)."""

_REALISED_SIZE = (
    "TF-Privacy's Keras optimizers divide each batch by its own size, so random batch sizes "
    "change the noise and, under ADD_OR_REMOVE_ONE, every other record's weight in the batch"
)


def check_dataset_sampling(sampling, allowed=DATASET_SAMPLINGS) -> str:
    if sampling not in allowed:
        extra = ""
        if sampling == POISSON:
            extra = f" (Poisson batches have a random size that Keras batching does not produce, and {_REALISED_SIZE})"
        raise ParameterError("sampling", f"must be one of {', '.join(allowed)}, got {sampling!r}{extra}")
    return sampling


def _overflow(dataset_size: int, batch_size: int, steps: int) -> float:
    """``P(a step draws more than b records)``: ``n + 1`` records (a neighbour with one more) each in one of
    ``steps`` steps."""
    return float(stats.binom.sf(batch_size, dataset_size + 1, 1.0 / steps))


def balls_in_bins_steps(dataset_size: int, batch_size: int) -> int:
    """The steps per epoch of a Keras ``balls_in_bins`` pipeline with ``b``-row batches: the fewest ``t``
    (at least ``n // b``) for which a step draws more than ``b`` records with probability at most
    :data:`PAD_OVERFLOW`. Batches then hold ``n / t`` records on average, padded to ``b`` rows of weight 0.
    A function of ``n`` and ``b`` only, so it is public when they are (pass ``steps_per_epoch`` to fix it).

    >>> balls_in_bins_steps(60000, 256)
    401
    """
    n, b = check_schedule(dataset_size, batch_size, BALLS_IN_BINS)
    lo = max(1, n // b)
    hi = 64 * lo
    if _overflow(n, b, hi) > PAD_OVERFLOW:
        raise ParameterError(
            "batch_size",
            f"{b} is too small for padded balls_in_bins batches of {n} records: even {hi} steps per epoch leave a "
            f"batch of more than {b} records likely above {PAD_OVERFLOW:g} per step; use larger batches",
        )
    if _overflow(n, b, lo) <= PAD_OVERFLOW:  # not in practice: the mean batch (n + 1) / (n // b) exceeds b
        return lo
    while hi - lo > 1:  # lo fails, hi meets the bound
        mid = (lo + hi) // 2
        if _overflow(n, b, mid) <= PAD_OVERFLOW:
            hi = mid
        else:
            lo = mid
    return hi


def overflow_delta(schedule, steps: int) -> float:
    """What a Keras run of ``steps`` steps of ``schedule`` leaves out of its delta: at most ``steps`` times the
    chance that a padded ``balls_in_bins`` step overflows (0 for the other schedules)."""
    if schedule.sampling != BALLS_IN_BINS:
        return 0.0
    return min(1.0, steps * _overflow(schedule.dataset_size, schedule.batch_size, schedule.steps_per_epoch))


def accounted_delta(delta: float, schedule, steps: int) -> float:
    """The delta a Keras run of ``steps`` steps of ``schedule`` (a schedule or the run's event) is accounted at:
    ``delta`` less :func:`overflow_delta`, so that the run meets ``(epsilon, delta)``; refused when nothing is
    left."""
    overflow = overflow_delta(schedule, steps)
    if not delta - overflow > 0:
        raise ParameterError(
            "delta",
            f"{delta:g} is below the chance {overflow:.3g} that a padded balls_in_bins batch of this run overflows; "
            "use a larger delta or more steps per epoch",
        )
    return delta - overflow


def keras_schedule(
    dataset_size: int,
    batch_size: int,
    sampling: str,
    seed: Optional[int] = None,
    *,
    last_batch: str = DROPPED,
    secret: bool = True,
    steps_per_epoch: Optional[int] = None,
) -> BatchSchedule:
    """The :class:`~hidden_state_accountants.BatchSchedule` a Keras run of ``sampling`` follows: for
    ``balls_in_bins`` with ``steps_per_epoch`` steps (default :func:`balls_in_bins_steps`), refused when a
    step would draw more than ``b`` records with probability above :data:`PAD_OVERFLOW`."""
    check_dataset_sampling(sampling)
    if sampling != BALLS_IN_BINS:
        return BatchSchedule(
            dataset_size,
            batch_size,
            sampling,
            seed,
            last_batch=last_batch,
            secret=secret,
            steps_per_epoch=steps_per_epoch,
        )
    if steps_per_epoch is None:
        steps_per_epoch = balls_in_bins_steps(dataset_size, batch_size)
    schedule = BatchSchedule(dataset_size, batch_size, sampling, seed, secret=secret, steps_per_epoch=steps_per_epoch)
    p = _overflow(schedule.dataset_size, schedule.batch_size, schedule.steps_per_epoch)
    if p > PAD_OVERFLOW:
        raise ParameterError(
            "steps_per_epoch",
            f"{schedule.steps_per_epoch} steps leave a batch of more than {schedule.batch_size} records with "
            f"probability {p:.3g} per step (at most {PAD_OVERFLOW:g}: Keras batches are padded to b rows); use at "
            f"least {balls_in_bins_steps(schedule.dataset_size, schedule.batch_size)}",
        )
    return schedule


def check_dataset_last_batch(last_batch) -> str:
    """A ``last_batch`` that TF-Privacy can train on: it divides every batch by its own size,
    so a kept short batch is ``kept_own_size`` (never ``kept_batch_size``)."""
    if last_batch not in LAST_BATCHES:
        raise ParameterError("last_batch", f"must be one of {', '.join(LAST_BATCHES)}, got {last_batch!r}")
    if last_batch == KEPT_BATCH_SIZE:
        raise ParameterError(
            "last_batch",
            f"{KEPT_BATCH_SIZE!r} is not what TF-Privacy does: its optimizers divide every batch by "
            f"its own size; use {KEPT_OWN_SIZE!r} to keep the short batch, or {DROPPED!r}",
        )
    return last_batch


class DatasetSource:
    """A dataset's schedule and where in it the dataset is.

    ``first_step`` is the step whose batch the first epoch starts at (0, or a resumed
    run's position); a fixed partition restarts at its first batch every epoch.
    """

    def __init__(self, schedule: BatchSchedule, features=None, labels=None):
        self.schedule = schedule
        self.epochs_started = 0
        self.first_step = 0
        self.features, self.labels = features, labels  # every batch is gathered from these

    @property
    def next_step(self) -> int:
        """The step whose batch the dataset hands out next (fixed partitions restart at
        their first batch; fresh draws, per step or per epoch, go on)."""
        if self.schedule.sampling not in (WITHOUT_REPLACEMENT, RESHUFFLE, BALLS_IN_BINS):
            return 0
        return self.first_step + self.epochs_started * self.schedule.steps_per_epoch

    def next_epoch(self) -> List[np.ndarray]:
        """The indices of the next epoch's batches: ``schedule.batch(step)`` one by one (a
        kept short batch is the last, shorter one)."""
        spe, start = self.schedule.steps_per_epoch, self.next_step
        self.epochs_started += 1
        return [self.schedule.batch(t).astype(np.int64) for t in range(start, start + spe)]

    def continue_run(self, schedule: BatchSchedule, steps: int) -> None:
        """Makes a dataset that has not been iterated yet continue ``schedule`` (a restored
        run's, with the run's seed) after its first ``steps`` steps.

        The dataset's own seed is replaced only if it was a secret draw that no step has
        used; a seed the user chose is kept (and then compared by the core).
        """
        mine = self.schedule
        if self.epochs_started:
            return  # the core compares the batches it hands out next with the run's
        same_kind = (mine.dataset_size, mine.batch_size, mine.sampling, mine.last_batch) == (
            schedule.dataset_size,
            schedule.batch_size,
            schedule.sampling,
            schedule.last_batch,
        ) and not schedule.external
        if not same_kind:
            return
        if mine.seed != schedule.seed and not mine.seed_is_secret:
            raise ParameterError(
                "seed",
                f"the batched_dataset has a seed you chose, but the run's {schedule.sampling} schedule has "
                "another one; pass seed=None (the run's seed is then restored from its state) or the run's seed",
            )
        self.schedule = schedule
        self.first_step = steps

    def share_across_workers(self, strategy) -> None:
        """Under ``MultiWorkerMirroredStrategy``, makes every worker's dataset follow the same
        schedule: each worker feeds its part of every global batch, so all must cut the same
        batches. A fresh secret seed (no step used it) is replaced by worker 0's; seeds you chose
        must agree. Raises :class:`ParameterError` when the workers' datasets differ otherwise.
        (The seed travels between the workers over the strategy's collective communication, like
        the gradients.)"""
        if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
            return
        s = self.schedule
        fresh = s.seed_is_secret and self.epochs_started == 0
        mine = [
            s.dataset_size,
            s.batch_size,
            SAMPLINGS.index(s.sampling),
            -1 if s.seed is None else s.seed,
            int(s.seed_is_secret),
            int(fresh),
        ]
        rows = strategy.gather(strategy.run(lambda: tf.constant([mine], tf.int64)), axis=0).numpy().tolist()
        chief = rows[0]
        if all(row[:4] == chief[:4] for row in rows):
            return
        if any(row[:3] != chief[:3] for row in rows):
            described = sorted({f"n={r[0]}, b={r[1]}, {SAMPLINGS[r[2]]}" for r in rows})
            raise ParameterError(
                "data",
                f"the workers' batched_datasets differ ({'; '.join(described)}); every worker "
                "must pass a batched_dataset of the same data and schedule",
            )
        if any(row[:4] != chief[:4] and not row[5] for row in rows):
            raise ParameterError(
                "seed",
                "the workers' batched_datasets have different seeds; pass the same seed on every worker, or "
                "seed=None on every worker (worker 0's secret seed is then used by all)",
            )
        if mine != chief:
            shared = BatchSchedule.from_description(
                {
                    "sampling": s.sampling,
                    "dataset_size": s.dataset_size,
                    "batch_size": s.batch_size,
                    "seed": chief[3],
                    "last_batch": s.last_batch,
                    "steps_per_epoch": s.epoch_steps,
                },
                seed_is_secret=bool(chief[4]),
            )
            self.continue_run(shared, self.first_step)


_SOURCES: "weakref.WeakKeyDictionary[tf.data.Dataset, DatasetSource]" = weakref.WeakKeyDictionary()


def partition_indices(dataset_size: int, batch_size: int, sampling: str, seed: Optional[int] = None) -> np.ndarray:
    """The fixed partition of a fixed-order schedule, shape ``(steps_per_epoch, batch_size)``:
    ``BatchSchedule(dataset_size, batch_size, sampling, seed).partition()`` (one row of every
    index for ``full``). ``seed=None`` draws a secret partition.

    >>> partition_indices(7, 3, "cyclic").tolist()
    [[0, 1, 2], [3, 4, 5]]
    """
    check_dataset_sampling(sampling, PIPELINE_SAMPLINGS)
    if sampling in (WITHOUT_REPLACEMENT, RESHUFFLE, BALLS_IN_BINS):
        raise ParameterError("sampling", f"{sampling!r} has no fixed partition")
    schedule = BatchSchedule(dataset_size, batch_size, sampling, seed)
    return schedule.batch(0)[None, :] if sampling == FULL else schedule.partition()


def batched_dataset(
    features: ArrayLike,
    labels: ArrayLike,
    batch_size: int,
    sampling: str,
    seed: Optional[int] = None,
    *,
    last_batch: str = DROPPED,
    feature_norm_bound: Optional[float] = None,
    steps_per_epoch: Optional[int] = None,
) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of ``(features, labels)`` batches of a core batch schedule
    (``(features, labels, weights)`` for ``balls_in_bins``).

    Args:
      features: array-like with the records along axis 0 (numpy array or tensor).
      labels: array-like with the same first dimension.
      batch_size: ``b``; every batch has exactly ``b`` records (``full`` needs ``b == n``),
        except a kept short batch of ``reshuffle`` and the random sizes of ``balls_in_bins``.
      sampling: ``"full"``, ``"cyclic"``, ``"shuffle_partition"``, ``"reshuffle"``,
        ``"without_replacement"`` or ``"balls_in_bins"`` (each record in a uniform step of every
        epoch, batches of random size, each padded to ``b`` rows: the records' rows with weight 1,
        then copies of the first record with weight 0, which contribute nothing, so that TF-Privacy's
        division by the batch's rows is the fixed ``b``; a step that drew no record is all padding
        and takes the optimiser's noise-only step).
      seed: for ``shuffle_partition``, ``reshuffle``, ``without_replacement`` and ``balls_in_bins``, ``None``
        (the default) draws a secret seed; an integer is your explicit choice, reproducible,
        and must be kept as secret as the data (a published seed makes the batches known; the
        privacy statement then says the seed was chosen by the user). Deterministic schedules
        take no seed.
      last_batch: for ``reshuffle``, ``"dropped"`` (the default: the last ``n % b`` records of
        each epoch's permutation are left out) or ``"kept_own_size"`` (they form a short last
        batch, which TF-Privacy divides by its own size).
      feature_norm_bound: if given, every record's features (all dimensions but the first) must
        have L2 norm at most this, or :class:`ParameterError` (naming ``feature_norm_bound``, with
        the largest norm) is raised now. The callback checks the inputs of the trainable layer
        against the declared geometry's bound in any case, before the first step.
      steps_per_epoch: for ``balls_in_bins``, the steps ``t`` of an epoch, a public constant;
        ``None``: :func:`balls_in_bins_steps` (enough steps that a batch holds more than ``b``
        records with probability at most :data:`PAD_OVERFLOW`; such a batch would stop training with
        an error).

    Returns:
      A finite dataset of ``steps_per_epoch`` batches that Keras iterates once per epoch: the
      ``k``-th iteration yields ``schedule.batch(k * steps_per_epoch + j)`` for every ``j``,
      where ``schedule`` is :func:`dataset_schedule` of the result. ``full``, ``cyclic`` and
      ``shuffle_partition`` yield the same ``n // b`` batches in the same order every epoch
      (the ``n % b`` records left over are never used); ``reshuffle`` cuts a fresh secret
      permutation into batches every epoch (permutation ``k`` for the ``k``-th epoch of the
      run, so a resumed run goes on with new ones), ``balls_in_bins`` fresh steps for every
      record every epoch; ``without_replacement`` yields fresh draws of ``b`` distinct records
      every step.

    Pass it to ``model.fit`` as it is (no ``batch_size``, ``shuffle``, ``steps_per_epoch``,
    ``repeat()`` or ``map()``): the callback verifies that ``fit`` trains on this object. When
    the callback continues a run (a restored state, or a second ``fit``), a dataset that has
    not been iterated yet continues the run's schedule: its fresh secret seed (which no step
    used) is replaced by the run's, and ``reshuffle`` and ``without_replacement`` start at
    the run's step.

    >>> import numpy as np
    >>> ds = batched_dataset(np.zeros((7, 2)), np.arange(7), 3, "cyclic")
    >>> [y.numpy().tolist() for _, y in ds]
    [[0, 1, 2], [3, 4, 5]]
    """
    check_dataset_sampling(sampling, PIPELINE_SAMPLINGS)
    check_dataset_last_batch(last_batch)
    x = tf.convert_to_tensor(features)
    y = tf.convert_to_tensor(labels)
    if x.shape.rank is None or x.shape.rank < 1 or x.shape[0] is None:
        raise ParameterError("features", "must have a known first dimension (the records)")
    if y.shape.rank is None or y.shape.rank < 1 or y.shape[0] != x.shape[0]:
        raise ParameterError(
            "labels", f"must have the same number of records as features ({x.shape[0]}), got shape {y.shape}"
        )
    if feature_norm_bound is not None:
        bound = v.nonnegative_float("feature_norm_bound", feature_norm_bound)
        largest = largest_row_norm(x)
        if not largest <= bound:  # NaN included
            raise ParameterError(
                "feature_norm_bound",
                f"the features have a record of norm {largest:.6g}, above "
                f"{bound:g} (clip them, e.g. with clip_feature_norms)",
            )
    source = DatasetSource(
        keras_schedule(
            int(x.shape[0]), batch_size, sampling, seed, last_batch=last_batch, steps_per_epoch=steps_per_epoch
        ),
        x,
        y,
    )
    schedule = source.schedule
    spe, b = schedule.steps_per_epoch, schedule.batch_size
    size = b if schedule.fixed_batch_size else None  # a kept short batch is shorter

    if sampling == BALLS_IN_BINS:
        # each batch padded to b rows of weight 0 (copies of record 0: shapes only, no gradient)
        def padded():
            for idx in source.next_epoch():
                if idx.size > b:
                    raise ParameterError(
                        "batch_size",
                        f"a balls_in_bins step drew {idx.size} records, more than the {b} rows a batch is padded to "
                        f"(probability at most {PAD_OVERFLOW:g} per step); the run cannot continue with this schedule",
                    )
                weights = np.zeros(b, np.float32)
                weights[: idx.size] = 1.0
                yield np.concatenate([idx, np.zeros(b - idx.size, np.int64)]), weights

        spec = (tf.TensorSpec((b,), tf.int64), tf.TensorSpec((b,), tf.float32))
        idx = tf.data.Dataset.from_generator(padded, output_signature=spec)
        idx = idx.apply(tf.data.experimental.assert_cardinality(spe))
        ds = idx.map(lambda i, w: (tf.gather(x, i), tf.gather(y, i), w)).prefetch(2)
        _SOURCES[ds] = source
        return ds
    if schedule.is_random:
        # one epoch of index rows computed when Keras starts iterating (not when it creates
        # the iterator), so the k-th epoch trained is the k-th epoch of the schedule, and a
        # resumed run can hand the dataset its schedule and position before the first epoch
        def rows():
            yield from source.next_epoch()

        idx = tf.data.Dataset.from_generator(rows, output_signature=tf.TensorSpec((size,), tf.int64))
        idx = idx.apply(tf.data.experimental.assert_cardinality(spe))
    else:  # deterministic: the same batches every epoch
        idx = tf.data.Dataset.from_tensor_slices(
            schedule.batch(0)[None, :] if sampling == FULL else schedule.partition()
        )
    ds = idx.map(lambda i: (tf.gather(x, i), tf.gather(y, i))).prefetch(2)
    _SOURCES[ds] = source
    return ds


def dataset_schedule(dataset) -> Optional[BatchSchedule]:
    """The :class:`~hidden_state_accountants.BatchSchedule` of a dataset that
    :func:`batched_dataset` returned, else ``None`` (keep it as private as the seed)."""
    source = dataset_source(dataset)
    return None if source is None else source.schedule


def dataset_source(dataset) -> Optional[DatasetSource]:
    """The schedule and position of a dataset that :func:`batched_dataset` returned, else ``None``."""
    return _SOURCES.get(dataset) if isinstance(dataset, tf.data.Dataset) else None
