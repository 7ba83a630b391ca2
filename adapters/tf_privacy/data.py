"""What ``model.fit`` actually feeds, read for the callback.

A :func:`~hidden_state_accountants.keras.data.batched_dataset` is recognised by its schedule
(:func:`~hidden_state_accountants.keras.data.dataset_source`). ``model.fit(x, y, batch_size=b,
shuffle=True)`` (Keras' default) draws a fresh uniform
permutation of the records every epoch (``tf.random.shuffle`` in its data adapter) and keeps a
short last batch of ``n % b`` records, which TF-Privacy divides by its own size: the
``reshuffle`` schedule with ``last_batch="kept_own_size"``, drawn by Keras
(:meth:`BatchSchedule.framework <hidden_state_accountants.BatchSchedule.framework>`). Whether
that draw is secret is read from the shuffle op itself: TensorFlow seeds a random op from the
operating system only when neither a global seed (``tf.random.set_seed``,
``tf.keras.utils.set_random_seed``) nor an op seed is set, i.e. when both of its seed attributes
are 0; otherwise the permutations are a function of a seed that is typically in the script,
and are reported as public (``secret=False``).

Keras 2 hands a callback neither the data nor its adapter, so :func:`fit_batch_source` and
:func:`fit_data` find them in the running ``model.fit`` call's frame; another Keras, or a custom
training loop, is refused with that reason.
"""

from __future__ import annotations

import sys
from typing import List, Optional, Tuple

import attr
import numpy as np
import tensorflow as tf

from hidden_state_accountants import BatchSchedule, ParameterError
from hidden_state_accountants.keras.data import DatasetSource, dataset_source
from hidden_state_accountants.recording import BatchSourceFacts
from hidden_state_accountants.schedules import CYCLIC, DROPPED, FULL, KEPT_OWN_SIZE, RESHUFFLE


def continue_batch_source(model, schedule: BatchSchedule, steps: int) -> None:
    """Makes the :func:`batched_dataset` that the running ``model.fit`` trains on continue
    a restored run: ``schedule`` (with the run's seed) from step ``steps`` on. Other data
    is left alone (the core refuses it)."""
    source = _fit_source(model)
    if source is not None:
        source.continue_run(schedule, steps)


def _fit_source(model) -> Optional[DatasetSource]:
    handler = _fit_data_handler(model)
    adapter = getattr(handler, "_adapter", None)
    dataset = getattr(getattr(adapter, "_internal_adapter", adapter), "_dataset", None)
    return dataset_source(dataset)


def share_batch_source_across_workers(model) -> None:
    """Under ``MultiWorkerMirroredStrategy``, makes every worker's batched_dataset follow the same
    schedule (:meth:`DatasetSource.share_across_workers
    <hidden_state_accountants.keras.data.DatasetSource.share_across_workers>`)."""
    source = _fit_source(model)
    if source is not None:
        source.share_across_workers(model.distribute_strategy)


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
        source = dataset_source(dataset)
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
