"""``tf.data`` batch schedules whose accounting the core knows (DESIGN.md section 3).

``model.fit`` on arrays reshuffles into a new partition every epoch and keeps a short last
batch: that schedule is none of the analysed ones. :func:`batched_dataset` produces exactly
the schedule the callback is told, with exactly ``batch_size`` records per step and
``n // b`` steps per epoch (one step for ``full``); the ``n % b`` records left over are
dropped each epoch (Ye & Shokri 2022, footnote 3), as
:attr:`hidden_state_accountants.TrainingRunDpEvent.steps_per_epoch` assumes.
"""

from __future__ import annotations

import secrets
from typing import Optional, Union

import numpy as np
import tensorflow as tf

ArrayLike = Union[np.ndarray, tf.Tensor, list]

from hidden_state_accountants import ParameterError
from hidden_state_accountants.schedules import steps_per_epoch as _steps_per_epoch

DATASET_SAMPLINGS = ("full", "cyclic", "shuffle_partition", "without_replacement")
"""Schedules :func:`batched_dataset` produces. ``poisson`` batches have a random size, which
Keras batching does not produce, and TF-Privacy divides by the realised batch size."""


def partition_indices(dataset_size: int, batch_size: int, sampling: str, seed: Optional[int] = 0) -> np.ndarray:
    """The fixed partition of a fixed-order schedule, shape ``(steps_per_epoch, batch_size)``.

    ``full``: one row holding every index. ``cyclic``: ``[0..b), [b..2b), ...`` in data order.
    ``shuffle_partition``: one permutation drawn from ``seed`` once, cut into rows.
    The last ``n % b`` indices of the (permuted) order are dropped.
    """
    n, b = _check_sizes(dataset_size, batch_size, sampling)
    if sampling == "without_replacement":
        raise ParameterError("sampling", "'without_replacement' has no fixed partition")
    if sampling == "full":
        return np.arange(n, dtype=np.int64)[None, :]
    order = np.arange(n, dtype=np.int64)
    if sampling == "shuffle_partition":
        order = np.random.default_rng(_check_seed(seed)).permutation(n)
    spe = n // b
    return order[: spe * b].reshape(spe, b)


def batched_dataset(
    features: ArrayLike,
    labels: ArrayLike,
    batch_size: int,
    sampling: str,
    seed: Optional[int] = 0,
) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of ``(features, labels)`` batches following ``sampling``.

    Args:
      features: array-like with the records along axis 0 (numpy array or tensor).
      labels: array-like with the same first dimension.
      batch_size: ``b``; every batch has exactly ``b`` records (``full`` needs ``b == n``).
      sampling: ``"full"``, ``"cyclic"``, ``"shuffle_partition"`` or ``"without_replacement"``.
      seed: fixes the partition of ``shuffle_partition`` and the draws of
        ``without_replacement``; the same seed gives the same batches in every process.
        ``None`` draws a secret seed from the operating system (not reproducible).
        The guarantees of these two schedules rest on the batches being random *and
        unknown* to an adversary: a seed that is published (e.g. the default 0 in released
        code) makes the partition known, so account such a ``shuffle_partition`` run as
        ``cyclic`` (the fixed-order bounds hold for any known order), and it voids the
        subsampling amplification of ``without_replacement``.

    Returns:
      A finite dataset of ``steps_per_epoch`` batches that Keras re-iterates each epoch:
      ``full`` yields all records once; ``cyclic`` and ``shuffle_partition`` yield the same
      ``n // b`` batches in the same order every epoch (``n % b`` records never used);
      ``without_replacement`` yields ``n // b`` batches, each ``b`` distinct records drawn
      uniformly and independently of every other step, fresh draws in every epoch.

    Pass it to ``model.fit`` without ``batch_size``, ``shuffle`` or ``steps_per_epoch``.
    """
    x = tf.convert_to_tensor(features)
    y = tf.convert_to_tensor(labels)
    if x.shape.rank is None or x.shape.rank < 1 or x.shape[0] is None:
        raise ParameterError("features", "must have a known first dimension (the records)")
    if y.shape.rank is None or y.shape.rank < 1 or y.shape[0] != x.shape[0]:
        raise ParameterError(
            "labels", f"must have the same number of records as features ({x.shape[0]}), got shape {y.shape}"
        )
    n, b = _check_sizes(int(x.shape[0]), batch_size, sampling)
    seed = _check_seed(seed)

    def gather(idx):
        return tf.gather(x, idx), tf.gather(y, idx)

    if sampling == "without_replacement":
        spe = _steps_per_epoch(n, b, sampling)

        def draw(step_seed):
            # b distinct indices, uniform over all b-subsets: the top b of n iid uniforms.
            u = tf.random.stateless_uniform([n], seed=tf.stack([step_seed, tf.constant(seed, tf.int64)]))
            return tf.math.top_k(u, k=b, sorted=False).indices

        # One random seed per step; rerandomised (reproducibly) every time Keras re-iterates.
        seeds = tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True).take(spe)
        ds = seeds.map(draw).map(gather)
        return ds.apply(tf.data.experimental.assert_cardinality(spe)).prefetch(2)

    idx = partition_indices(n, b, sampling, seed)
    ds = tf.data.Dataset.from_tensor_slices(tf.constant(idx)).map(gather)
    return ds.prefetch(2)


def clip_feature_norms(features: ArrayLike, max_norm: float) -> np.ndarray:
    """Rescales each row of ``features`` to L2 norm at most ``max_norm`` (``||x|| <= R``).

    The logistic-regression geometry (:meth:`LossGeometry.logistic_regression`) needs
    ``||x|| <= R`` for every record; this makes it true.
    """
    r = float(max_norm)
    if not r > 0:
        raise ParameterError("max_norm", f"must be > 0, got {max_norm!r}")
    x = np.asarray(features, dtype=np.float64)
    flat = x.reshape(len(x), -1)
    norms = np.linalg.norm(flat, axis=1)
    # a hair inside the ball, so float32 rounding cannot push a row past r
    scale = np.minimum(1.0, r * (1.0 - 1e-6) / np.maximum(norms, 1e-300))
    out = (flat * scale[:, None]).reshape(x.shape)
    return out.astype(np.float32)


def _check_sizes(dataset_size: int, batch_size: int, sampling: str) -> "tuple[int, int]":
    if sampling not in DATASET_SAMPLINGS:
        raise ParameterError(
            "sampling",
            f"must be one of {', '.join(DATASET_SAMPLINGS)}, got {sampling!r}"
            + (" (Poisson batches have a random size; TF-Privacy divides by the realised one)"
               if sampling == "poisson" else ""),
        )
    n = int(dataset_size)
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ParameterError("batch_size", f"must be a positive integer, got {batch_size!r}")
    b = int(batch_size)
    if b > n:
        raise ParameterError("batch_size", f"must be <= the number of records ({n}), got {b}")
    if sampling == "full" and b != n:
        raise ParameterError("batch_size", f"must equal the number of records ({n}) for sampling='full', got {b}")
    if sampling in ("cyclic", "shuffle_partition") and n // b < 2:
        raise ParameterError(
            "batch_size", f"{sampling} needs at least two batches (n // b >= 2), got {n} // {b} = {n // b}"
        )
    return n, b


def _check_seed(seed: Optional[int]) -> int:
    if seed is None:
        return secrets.randbits(62)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ParameterError("seed", f"must be a non-negative integer or None for a secret one, got {seed!r}")
    return int(seed)
