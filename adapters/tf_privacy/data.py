"""``tf.data`` pipelines of the core's batch schedules, and what ``model.fit`` actually feeds.

:func:`batched_dataset` yields exactly the batches of a core
:class:`~hidden_state_accountants.BatchSchedule` (``schedule.batch(step)``), and remembers
which schedule each dataset it returned follows, so that :class:`HiddenStatePrivacyCallback`
can verify that ``fit`` trains on such a dataset (:func:`fit_batch_source`).

``model.fit(x, y, batch_size=b, shuffle=True)`` (Keras' default) draws a fresh uniform
permutation of the records every epoch (``tf.random.shuffle`` in its data adapter) and keeps a
short last batch of ``n % b`` records, which TF-Privacy divides by its own size: the
``reshuffle`` schedule with ``last_batch="kept_own_size"``, drawn by Keras
(:meth:`BatchSchedule.framework <hidden_state_accountants.BatchSchedule.framework>`). Whether
that draw is secret is read from the shuffle op itself: TensorFlow seeds a random op from the
operating system only when neither a global seed (``tf.random.set_seed``,
``tf.keras.utils.set_random_seed``) nor an op seed is set, i.e. when both of its seed attributes
are 0; otherwise the permutations are a function of a seed that is typically in the script,
and are reported as public (``secret=False``).
"""

from __future__ import annotations

import sys
import weakref
from typing import List, Optional, Tuple, Union

import attr
import numpy as np
import tensorflow as tf

from hidden_state_accountants import BatchSchedule, ParameterError
from hidden_state_accountants import validation as v
from hidden_state_accountants.projection import inside_factor
from hidden_state_accountants.recording import BatchSourceFacts
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

ArrayLike = Union[np.ndarray, tf.Tensor, list]

DATASET_SAMPLINGS = (FULL, CYCLIC, SHUFFLE_PARTITION, RESHUFFLE, WITHOUT_REPLACEMENT)
"""Schedules a Keras ``fit`` with TF-Privacy can be accounted for. ``poisson`` batches have a random
size, which Keras batching does not produce, and TF-Privacy divides by the realised batch size."""

PIPELINE_SAMPLINGS = DATASET_SAMPLINGS + (BALLS_IN_BINS,)
"""Schedules :func:`batched_dataset` produces: also ``balls_in_bins``, whose batches of random size
must be divided by the fixed ``b``. TF-Privacy's Keras optimizers divide by the realised size, so
:class:`HiddenStatePrivacyCallback` refuses it; a custom training loop that divides the noisy sum by
``b`` can be accounted with the core ``HiddenStateAccountant``."""

_REALISED_SIZE = (
    "TF-Privacy's Keras optimizers divide each batch by its own size, so random batch sizes "
    "change the noise and, under ADD_OR_REMOVE_ONE, every other record's weight in the batch"
)


def check_dataset_sampling(sampling, allowed=DATASET_SAMPLINGS) -> str:
    if sampling not in allowed:
        extra = ""
        if sampling == POISSON:
            extra = f" (Poisson batches have a random size that Keras batching does not produce, and {_REALISED_SIZE})"
        elif sampling == BALLS_IN_BINS:
            extra = (
                f" ({_REALISED_SIZE}, while the balls_in_bins analyses need the fixed divisor b; "
                "batched_dataset(..., 'balls_in_bins') feeds custom loops that divide by b)"
            )
        raise ParameterError("sampling", f"must be one of {', '.join(allowed)}, got {sampling!r}{extra}")
    return sampling


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


class _Source:
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


_SOURCES: "weakref.WeakKeyDictionary[tf.data.Dataset, _Source]" = weakref.WeakKeyDictionary()


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
) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of ``(features, labels)`` batches of a core batch schedule.

    Args:
      features: array-like with the records along axis 0 (numpy array or tensor).
      labels: array-like with the same first dimension.
      batch_size: ``b``; every batch has exactly ``b`` records (``full`` needs ``b == n``),
        except a kept short batch of ``reshuffle`` and the random sizes of ``balls_in_bins``.
      sampling: ``"full"``, ``"cyclic"``, ``"shuffle_partition"``, ``"reshuffle"``,
        ``"without_replacement"`` or ``"balls_in_bins"`` (each record in a uniform step of every
        epoch, batches of random size; for custom loops that divide by ``b``: TF-Privacy's Keras
        optimizers divide by the realised size and the callback refuses it).
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
    source = _Source(BatchSchedule(int(x.shape[0]), batch_size, sampling, seed, last_batch=last_batch), x, y)
    schedule = source.schedule
    spe, b = schedule.steps_per_epoch, schedule.batch_size
    size = b if schedule.fixed_batch_size else None  # a kept short batch is shorter

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


def continue_batch_source(model, schedule: BatchSchedule, steps: int) -> None:
    """Makes the :func:`batched_dataset` that the running ``model.fit`` trains on continue
    a restored run: ``schedule`` (with the run's seed) from step ``steps`` on. Other data
    is left alone (the core refuses it)."""
    source = _fit_source(model)
    if source is not None:
        source.continue_run(schedule, steps)


def _fit_source(model) -> Optional[_Source]:
    handler = _fit_data_handler(model)
    adapter = getattr(handler, "_adapter", None)
    dataset = getattr(getattr(adapter, "_internal_adapter", adapter), "_dataset", None)
    return _SOURCES.get(dataset) if isinstance(dataset, tf.data.Dataset) else None


def share_batch_source_across_workers(model) -> None:
    """Under ``MultiWorkerMirroredStrategy``, makes every worker's :func:`batched_dataset`
    follow the same schedule: each worker feeds its part of every global batch, so all must
    cut the same batches. A fresh secret seed (no step used it) is replaced by worker 0's;
    seeds you chose must agree. Raises :class:`ParameterError` when the workers' datasets
    differ otherwise. (The seed travels between the workers over the strategy's collective
    communication, like the gradients.)"""
    strategy = model.distribute_strategy
    source = _fit_source(model)
    if source is None or not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return
    s = source.schedule
    fresh = s.seed_is_secret and source.epochs_started == 0
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
            },
            seed_is_secret=bool(chief[4]),
        )
        source.continue_run(shared, source.first_step)


def dataset_schedule(dataset) -> Optional[BatchSchedule]:
    """The :class:`~hidden_state_accountants.BatchSchedule` of a dataset that
    :func:`batched_dataset` returned, else ``None`` (keep it as private as the seed)."""
    source = _SOURCES.get(dataset) if isinstance(dataset, tf.data.Dataset) else None
    return None if source is None else source.schedule


def largest_row_norm(features: ArrayLike) -> float:
    """The largest L2 norm of a record of ``features`` (all dimensions but the first), in float64
    (``nan`` if a record holds NaN; 0 for no record)."""
    x = np.asarray(features)
    rows = x.reshape(len(x), -1).astype(np.float64) if x.ndim else x.reshape(1, 1).astype(np.float64)
    return float(np.sqrt(np.max(np.einsum("ij,ij->i", rows, rows)))) if len(rows) else 0.0


def clip_feature_norms(features: ArrayLike, max_norm: float) -> np.ndarray:
    """Rescales each row of ``features`` to L2 norm at most ``max_norm`` (``||x|| <= R``).

    The logistic-regression geometry (:meth:`LossGeometry.logistic_regression`) needs
    ``||x|| <= R`` for every record; this makes it true.
    """
    r = v.positive_float("max_norm", max_norm)
    x = np.asarray(features, dtype=np.float64)
    flat = x.reshape(len(x), -1)
    norms = np.linalg.norm(flat, axis=1)
    # a hair inside the ball, so float32 rounding cannot push a row past r
    scale = np.minimum(1.0, r * inside_factor(float(np.finfo(np.float32).eps)) / np.maximum(norms, 1e-300))
    return (flat * scale[:, None]).reshape(x.shape).astype(np.float32)


# ----------------------------------------------------------------- what fit consumes
def _fit_locals(model) -> dict:
    """The local variables of the running ``model.fit`` call (Keras 2), or ``{}``."""
    frame = sys._getframe(1)
    try:
        while frame is not None:
            local = frame.f_locals
            if frame.f_code.co_name == "fit" and local.get("self") is model and "data_handler" in local:
                return local
            frame = frame.f_back
        return {}
    finally:
        del frame


def _fit_data_handler(model):
    """The ``data_handler`` local of the running ``model.fit`` call (Keras 2), or ``None``."""
    return _fit_locals(model).get("data_handler")


@attr.s(frozen=True, slots=True, kw_only=True)
class FitData:
    """The records the running ``model.fit`` trains on, as far as they can be read.

    ``features`` / ``labels``: the arrays every batch is cut from (``None`` when they cannot be
    read: data that is not a :func:`batched_dataset` or arrays); ``weights``: a description of the
    sample or class weights ``fit`` applies to the per-example losses, or ``None``."""

    features: object = attr.ib()
    labels: object = attr.ib()
    weights: Optional[str] = attr.ib()


def fit_data(model) -> FitData:
    """What the running ``model.fit`` trains on: the ``features`` and ``labels`` of its
    :func:`batched_dataset` or of the arrays passed to it (after ``validation_split``), and the
    weights it applies (``sample_weight``, ``class_weight``)."""
    local = _fit_locals(model)
    source = _fit_source(model)
    if source is not None:
        features, labels = source.features, source.labels
    elif isinstance(local.get("x"), (np.ndarray, tf.Tensor)):
        features, labels = local["x"], local.get("y")
    else:
        features, labels = None, None  # a dict of inputs, a dataset or generator this package did not build
    weights = [f"{name} passed to fit" for name in ("sample_weight", "class_weight") if local.get(name) is not None]
    return FitData(features=features, labels=labels, weights=", ".join(weights) or None)


def _shuffle_seeds(dataset) -> List[Tuple[int, int]]:
    """``(seed, seed2)`` of every ``RandomShuffle`` op in the functions of ``dataset`` and
    the datasets it is built from (Keras' per-epoch permutation is one of them)."""
    found, pending, seen = [], [dataset], set()
    while pending:
        ds = pending.pop()
        if id(ds) in seen:
            continue
        seen.add(id(ds))
        wrapper = getattr(ds, "_map_func", None)
        graph = getattr(getattr(wrapper, "function", None), "graph", None)
        for op in graph.get_operations() if graph is not None else ():
            if op.type in ("RandomShuffle", "RandomShuffleV2"):
                found.append((int(op.get_attr("seed")), int(op.get_attr("seed2"))))
        pending += [
            d
            for d in [getattr(ds, "_input_dataset", None)] + list(getattr(ds, "_datasets", None) or [])
            if isinstance(d, tf.data.Dataset)
        ]
    return found


def _array_source(adapter, strategy=None) -> BatchSourceFacts:
    """The schedule of ``fit`` on arrays (Keras' TensorLikeDataAdapter)."""
    b, partial, shuffle = adapter._batch_size, adapter._partial_batch_size, adapter._shuffle
    n = (adapter._size - (1 if partial else 0)) * b + partial
    what = f"model.fit on {n} array records with batch_size={b}, shuffle={shuffle!r}"
    if b == n:  # every step uses every record, in whatever order
        return BatchSourceFacts(schedule=BatchSchedule(n, n, FULL), description=what)
    if shuffle is False and not partial and n // b >= 2:  # data order, whole batches: cyclic
        return BatchSourceFacts(schedule=BatchSchedule(n, b, CYCLIC), description=what, next_step=0)
    short = f", with a short last batch of {partial} records" if partial else ""
    if shuffle is True and b < n:
        # a fresh uniform permutation every epoch (tf.random.shuffle), the short batch its tail,
        # divided by its own size by TF-Privacy: reshuffle, drawn by Keras
        seeds = _shuffle_seeds(adapter._dataset)
        if len(seeds) != 1:
            return BatchSourceFacts(
                schedule=None,
                description=(
                    f"{what}: a new random permutation every epoch, but Keras' shuffle op could not be read "
                    f"({len(seeds)} found), so whether its randomness is secret is unknown"
                ),
            )
        workers = (
            strategy.extended._num_workers if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) else 1
        )
        seed, seed2 = seeds[0]
        secret = seed == 0 and seed2 == 0  # TensorFlow then seeds the op from the operating system
        randomness = (
            "secret: not seeded, TensorFlow seeds the op from the operating system"
            if secret
            else f"public: seeded (seed={seed}, seed2={seed2}) by tf.random.set_seed / "
            "keras.utils.set_random_seed or an op seed, so the permutations follow from that seed"
        )
        last = KEPT_OWN_SIZE if partial else DROPPED
        kept = ", kept and divided by its own size" if partial else ""
        return BatchSourceFacts(
            schedule=BatchSchedule.framework(n, b, RESHUFFLE, last_batch=last, secret=secret),
            description=f"{what}: Keras draws a new random permutation of the records every epoch ({randomness})"
            f"{short}{kept}",
            next_step=0,
            independent_draws=workers,
        )  # every fit starts a new epoch
    # none of the core's schedules: say what Keras does
    if shuffle == "batch":
        what += ": a shuffle in chunks of the batch size every epoch"
    else:
        what += ": data order"
    return BatchSourceFacts(schedule=None, description=what + short)


def fit_batch_source(model) -> BatchSourceFacts:
    """What the running ``model.fit`` trains on, read from its data handler.

    Raises :class:`ParameterError` when it cannot be read (a custom training loop, or a
    Keras version whose ``fit`` differs from Keras 2.15's).
    """
    handler = _fit_data_handler(model)
    adapter = getattr(handler, "_adapter", None)
    if adapter is None:
        raise ParameterError(
            "data",
            "cannot find what model.fit trains on (the callback reads Keras 2's fit; custom training "
            "loops and other Keras versions are not supported), so the batch schedule cannot be verified",
        )
    adapter = getattr(adapter, "_internal_adapter", adapter)  # lists of scalars wrap array data
    user_steps = getattr(handler, "_steps_per_epoch", None)
    name = type(adapter).__name__
    if name == "TensorLikeDataAdapter":
        facts = _array_source(adapter, model.distribute_strategy)
    elif name == "DatasetAdapter":
        dataset = adapter._dataset
        source = _SOURCES.get(dataset) if isinstance(dataset, tf.data.Dataset) else None
        if source is None:
            size = int(dataset.cardinality()) if isinstance(dataset, tf.data.Dataset) else -2
            kind = {-1: "an infinite ", -2: "a "}.get(size, f"a {size}-batch ")
            facts = BatchSourceFacts(
                schedule=None,
                description=f"{kind}tf.data.Dataset not returned by batched_dataset, whose batches "
                "cannot be verified (e.g. shuffle() is a uniform permutation only with a buffer of every record, "
                "and its seeds and any map() in the pipeline are not checked); use batched_dataset(x, y, b, "
                "'reshuffle') for a fresh permutation every epoch, or model.fit(x, y, batch_size=b, shuffle=True)",
            )
        else:
            facts = BatchSourceFacts(
                schedule=source.schedule, description="the batched_dataset", next_step=source.next_step
            )
    else:
        facts = BatchSourceFacts(schedule=None, description=f"data of Keras' {name}")
    steps = user_steps if user_steps is not None else getattr(handler, "_inferred_steps", None)
    return attr.evolve(facts, steps_per_epoch=None if steps in (None, -1) else int(steps))
