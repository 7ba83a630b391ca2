"""Distributed Keras DP training jobs for the tf.distribute tests (each in its own process:
logical devices and TF_CONFIG must be set before TensorFlow starts).

    python tf_distribute_job.py mirrored            # two logical CPUs, MirroredStrategy
    python tf_distribute_job.py worker INDEX PORTS  # a MultiWorkerMirroredStrategy worker

Each prints one JSON line (the last line of its output).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

MODE = sys.argv[1]
if MODE == "worker":
    INDEX, PORTS = int(sys.argv[2]), sys.argv[3].split(",")
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": [f"localhost:{p}" for p in PORTS]}, "task": {"type": "worker", "index": INDEX}}
    )

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

if MODE == "mirrored":
    _cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import tensorflow_privacy  # noqa: E402

from hidden_state_accountants import LossGeometry, ParameterError  # noqa: E402
from hidden_state_accountants.tf_privacy import (  # noqa: E402
    DecoupledL2DPKerasSGDOptimizer,
    HiddenStatePrivacyCallback,
    batched_dataset,
)

# --- one step: signal and noise of the update
B, DIM, OUT = 100, 200, 50  # 10,050 parameters
Z, C, LR, L2 = 1.0, 1.0, 0.1, 0.5


class ScaledSum(tf.keras.losses.Loss):
    """``scale * sum(logits)`` per example: a constant gradient (``scale * (x, 1)`` per output)."""

    def __init__(self, scale):
        super().__init__(reduction=tf.keras.losses.Reduction.NONE)
        self.scale = scale

    def call(self, y_true, y_pred):
        return self.scale * tf.reduce_sum(y_pred, axis=1)


def optimizer(kind, noise, l2=L2):
    if kind == "package":
        return DecoupledL2DPKerasSGDOptimizer(
            l2_norm_clip=C, noise_multiplier=noise, l2_regularization=l2, learning_rate=LR
        )
    return tensorflow_privacy.DPKerasSGDOptimizer(l2_norm_clip=C, noise_multiplier=noise, learning_rate=LR)


def one_step(strategy, kind, scale, noise):
    """The update of one step from all-ones weights on a batch of identical records."""
    with strategy.scope():
        model = tf.keras.Sequential(
            [tf.keras.layers.Dense(OUT, input_shape=(DIM,), kernel_initializer="ones", bias_initializer="ones")]
        )
        model.compile(optimizer=optimizer(kind, noise), loss=ScaledSum(scale))
    x = np.full((B, DIM), 0.01, np.float32)  # per-example gradient norm sqrt(50 * 1.02) > C: clipped
    before = np.concatenate([w.ravel() for w in model.get_weights()])
    model.fit(tf.data.Dataset.from_tensor_slices((x, np.zeros(B, np.float32))).batch(B), epochs=1, verbose=0)
    return np.concatenate([w.ravel() for w in model.get_weights()]) - before


def step_figures(strategy, kind):
    signal = one_step(strategy, kind, 1.0, 0.0)  # constant gradient, no noise
    noise = one_step(strategy, kind, 0.0, Z)  # zero gradient: the L2 term and the noise
    return {
        "signal": signal.tolist()[:5] + [float(signal.mean())],
        "signal_max_abs": float(np.abs(signal).max()),
        "noise_mean": float(noise.mean()),
        "noise_std": float(noise.std()),
        "parameters": int(noise.size),
    }


# --- a run: the callback on a batched_dataset
N, RUN_B, FEATURES, CLASSES = 400, 100, 8, 400  # label = record index: the labels trained are the batch
RUN_Z, RUN_LR, RUN_L2 = 2.0, 0.5, 0.01
RUN_C = 2.0  # 400 classes: a clip that cannot bind, sqrt(2 (R^2 + 1)) at R = 1 (docs/derivations.md 18)
TRAINED = []


def _record(labels):
    TRAINED.append(sorted(int(i) for i in labels.numpy().ravel()))
    return np.float32(0.0)


def batch_labels(y_true, y_pred):
    """A metric that records the labels of the (local) batch each step trains on."""
    return tf.py_function(_record, [y_true], tf.float32)


def run(strategy, kind, sampling="cyclic", epochs=2, seed=None):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, FEATURES))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True) * 0.99).astype(np.float32)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(CLASSES, input_shape=(FEATURES,))])
        opt = (
            DecoupledL2DPKerasSGDOptimizer(
                l2_norm_clip=RUN_C, noise_multiplier=RUN_Z, l2_regularization=RUN_L2, learning_rate=RUN_LR
            )
            if kind == "package"
            else tensorflow_privacy.DPKerasSGDOptimizer(
                l2_norm_clip=RUN_C, noise_multiplier=RUN_Z, learning_rate=RUN_LR
            )
        )
        model.compile(
            optimizer=opt,
            metrics=[batch_labels],
            loss=tf.keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction=tf.keras.losses.Reduction.NONE
            ),
        )
    geometry = LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=RUN_L2, num_classes=CLASSES)
    callback = HiddenStatePrivacyCallback(
        geometry=geometry if kind == "package" else None,
        sampling=sampling,
        dataset_size=N,
        batch_size=RUN_B,
        delta=1e-5,
        verbose=0,
    )
    TRAINED.clear()
    try:
        model.fit(
            batched_dataset(x, np.arange(N), RUN_B, sampling, seed=seed), epochs=epochs, callbacks=[callback], verbose=0
        )
    except ParameterError as err:
        return {"refused": str(err), "iterations": int(model.optimizer.iterations.numpy())}
    return {
        "epsilon": callback.epsilon,
        "steps": callback.steps,
        "ledger": callback.recorder.ledger_state(),
        "schedule": callback.recorder.claim.schedule.describe(),
        "batches": list(TRAINED),
        "weights": [float(w.sum()) for w in model.get_weights()],
    }


def sbcd_refusal(strategy):
    from hidden_state_accountants.keras.sbcd import DPSBCD

    with strategy.scope():
        model = tf.keras.Sequential(
            [tf.keras.layers.Dense(8, activation="relu", input_shape=(4,)), tf.keras.layers.Dense(2)]
        )
    try:
        DPSBCD(model, np.zeros((40, 4), np.float32), np.zeros(40, np.int64), batch_size=10, step_size=0.1, noise=0.1)
    except ParameterError as err:
        return str(err)
    return None


def main():
    if MODE == "mirrored":
        mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        single = tf.distribute.get_strategy()
        out = {"replicas": mirrored.num_replicas_in_sync}
        for kind in ("package", "tf_privacy"):
            out[f"step_{kind}"] = {"single": step_figures(single, kind), "mirrored": step_figures(mirrored, kind)}
        out["run_package"] = run(mirrored, "package")
        out["run_package_single"] = run(single, "package")
        out["run_tf_privacy"] = run(mirrored, "tf_privacy")
        out["sbcd"] = sbcd_refusal(mirrored)
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        out = {
            "replicas": strategy.num_replicas_in_sync,
            "run": run(strategy, "package", sampling="shuffle_partition", epochs=1),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
