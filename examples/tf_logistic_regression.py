"""DP logistic regression with TF-Privacy and the hidden-state callback.

Trains multi-class logistic regression on scikit-learn's digits with ``DPKerasSGDOptimizer``
semantics (per-example clipping, Gaussian noise; here the subclass that also applies the L2
term outside clipping), a ``shuffle_partition`` batch schedule from ``batched_dataset``, and
``HiddenStatePrivacyCallback``, which prints the hidden-state epsilon next to Keras' metrics
each epoch. Ends with the test accuracy and the model-card privacy statement.

    python examples/tf_logistic_regression.py [--epochs 30] [--noise-multiplier 2.0]
    python examples/tf_logistic_regression.py --distributed   # MirroredStrategy, two logical CPUs
    python examples/tf_logistic_regression.py --backup-dir DIR  # kill it, run it again: it resumes
    python examples/tf_logistic_regression.py --keras-shuffle  # plain model.fit(x, y, shuffle=True)

With ``--keras-shuffle`` the model trains on the arrays with Keras' own per-epoch shuffle
(``model.fit(x, y, batch_size=b, shuffle=True)``, no ``batched_dataset``): the callback
accounts it as ``reshuffle``, drawn by Keras, with the short last batch (``n % b`` records)
kept and divided by its own size as TF-Privacy does. Its randomness is secret only if
TensorFlow's random seed is not set: with ``--seed`` the permutations are public and the
report gives the worst-pattern bound, and says so.

With ``--distributed`` the model trains under ``tf.distribute.MirroredStrategy`` on two logical
CPU devices (each replica computes half of every batch); the package's optimizer takes the same
step as on one device, so the epsilon and the accuracy are those of the one-device run.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

from hidden_state_accountants import LossGeometry  # noqa: E402
from hidden_state_accountants.schedules import RANDOM  # noqa: E402
from hidden_state_accountants.tf_privacy import (  # noqa: E402
    DATASET_SAMPLINGS,
    DecoupledL2DPKerasSGDOptimizer,
    HiddenStatePrivacyCallback,
    batched_dataset,
    clip_feature_norms,
)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--noise-multiplier", type=float, default=2.0)
    # ten classes: a clip that cannot bind, >= sqrt(2 (R^2 + 1)) = 2 at R = 1 (a binding clip makes the clipped
    # multi-class gradient non-monotone: docs/derivations.md section 18); the epsilon does not depend on it
    p.add_argument("--clip-norm", type=float, default=2.0)
    p.add_argument("--learning-rate", type=float, default=0.5)
    p.add_argument("--l2", type=float, default=0.01, help="L2 regularisation outside clipping")
    p.add_argument("--sampling", default="shuffle_partition", choices=DATASET_SAMPLINGS)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--target-epsilon", type=float, default=None)
    p.add_argument("--distributed", action="store_true", help="train under MirroredStrategy on two logical CPU devices")
    p.add_argument(
        "--backup-dir",
        default=None,
        help="back up after every epoch (BackupAndRestore); the same command resumes an interrupted "
        "run, with the callback's ledger and batch schedule (keep DIR as private as the data)",
    )
    p.add_argument(
        "--keras-shuffle",
        action="store_true",
        help="train with model.fit(x, y, batch_size=b, shuffle=True), accounted as 'reshuffle'",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="fix every seed for a reproducible demo; a known seed voids the guarantee "
        "(the noise and the partition become predictable), so the default draws secret ones",
    )
    args = p.parse_args(argv)
    if args.keras_shuffle:
        args.sampling = "reshuffle"
    strategy = two_cpu_strategy() if args.distributed else tf.distribute.get_strategy()
    if args.seed is not None:
        tf.keras.utils.set_random_seed(args.seed)

    # Data: features centred and clipped to ||x|| <= R = 1, the geometry's assumption.
    x, y = load_digits(return_X_y=True)
    x = x / 16.0
    x = x - x.mean(axis=0)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0)
    radius = 1.0
    x_train = clip_feature_norms(x_train, radius)
    x_test = clip_feature_norms(x_test, radius)
    n = len(x_train)
    batch_size = n if args.sampling == "full" else args.batch_size

    with strategy.scope():  # the default strategy (one device) unless --distributed
        model = tf.keras.Sequential([tf.keras.layers.Dense(10, input_shape=(x.shape[1],))])
        optimizer = DecoupledL2DPKerasSGDOptimizer(
            l2_norm_clip=args.clip_norm,
            noise_multiplier=args.noise_multiplier,
            l2_regularization=args.l2,
            learning_rate=args.learning_rate,
        )
        model.compile(
            optimizer=optimizer,
            loss=tf.keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction=tf.keras.losses.Reduction.NONE
            ),
            metrics=["accuracy"],
        )
    geometry = LossGeometry.logistic_regression(feature_norm_bound=radius, l2_regularization=args.l2, num_classes=10)
    privacy = HiddenStatePrivacyCallback(
        geometry=geometry,
        sampling=args.sampling,
        dataset_size=n,
        batch_size=batch_size,
        delta=args.delta,
        target_epsilon=args.target_epsilon,
    )
    # a random schedule draws a secret seed unless --seed fixes it (then the statement says so)
    seed = args.seed if args.sampling in RANDOM else None
    callbacks = [privacy]
    if args.backup_dir:  # listed after the privacy callback, so its history is backed up too
        callbacks.append(tf.keras.callbacks.BackupAndRestore(args.backup_dir))
    if args.keras_shuffle:  # Keras' own shuffle; public if --seed set TensorFlow's random seed
        history = model.fit(
            x_train.astype(np.float32),
            y_train,
            batch_size=batch_size,
            shuffle=True,
            epochs=args.epochs,
            callbacks=callbacks,
            verbose=2,
        )
    else:
        train = batched_dataset(x_train, y_train, batch_size, args.sampling, seed=seed)
        history = model.fit(train, epochs=args.epochs, callbacks=callbacks, verbose=2)

    _, accuracy = model.evaluate(x_test.astype(np.float32), y_test, verbose=0)
    eps = history.history["epsilon"][-1]
    comp = history.history["epsilon_composition"][-1]
    print(f"\nfinal test accuracy: {accuracy:.4f}")
    print(
        f"epsilon (final model only): {eps:.3f} via {privacy.report.analysis}; "
        f"composition (every checkpoint): {comp:.3f}; delta = {args.delta:g}"
    )
    print()
    print(privacy.privacy_statement())  # states the reasons and notes the claim rests on
    return {
        "accuracy": accuracy,
        "epsilon": eps,
        "epsilon_composition": comp,
        "epochs": len(history.history["epsilon"]),
        "replicas": strategy.num_replicas_in_sync,
        "analysis": privacy.report.analysis,
        "steps": privacy.steps,
        "last_batch": privacy.run_event().last_batch,
        "secret_batches": privacy.run_event().secret_batches,
    }


def two_cpu_strategy() -> tf.distribute.Strategy:
    """MirroredStrategy over two logical CPU devices (set before TensorFlow starts its runtime)."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    except RuntimeError:  # already initialised: fine if it has the two devices
        pass
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    if len(devices) < 2:
        raise SystemExit("--distributed needs two logical CPU devices; run it in a fresh process")
    return tf.distribute.MirroredStrategy(devices[:2])


if __name__ == "__main__":
    main()
