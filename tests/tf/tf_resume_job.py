"""A Keras DP training job for the resume tests (run as a script in its own process).

    python tf_resume_job.py WORKDIR SAMPLING ORDER [KILL_AT_STEP]

Trains logistic regression whose label is the record's index (so the labels a step trains
on are its batch) for EPOCHS epochs with ``BackupAndRestore(WORKDIR/backup)``, listed before
or after the privacy callback (ORDER = ``callback_first`` or ``backup_first``). With
KILL_AT_STEP, writes the batches trained so far and the callback's state to
WORKDIR/batches.json and WORKDIR/state.json after that optimizer step, then kills itself with
SIGKILL. Prints a JSON line: epsilon, steps, ledger, the batch of every step trained.
"""

import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from hidden_state_accountants import LossGeometry  # noqa: E402
from hidden_state_accountants.tf_privacy import (  # noqa: E402
    DecoupledL2DPKerasSGDOptimizer,
    HiddenStatePrivacyCallback,
    batched_dataset,
)

N, B, DIM, EPOCHS = 120, 20, 5, 3
CLASSES = N  # label = record index
Z, C, LR, L2, DELTA = 1.5, 2.0, 0.5, 0.05, 1e-5  # C: 120 classes need a clip that cannot bind (derivations 18)


TRAINED = []  # the batch of every step trained, as its labels


def _record(labels):
    TRAINED.append(sorted(int(i) for i in labels.numpy().ravel()))
    return np.float32(0.0)


def batch_labels(y_true, y_pred):
    """A metric that records the labels of the batch each step trains on."""
    return tf.py_function(_record, [y_true], tf.float32)


def build(sampling):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, DIM))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True) * 0.99).astype(np.float32)
    y = np.arange(N)
    model = tf.keras.Sequential([tf.keras.layers.Dense(CLASSES, input_shape=(DIM,))])
    model.compile(
        optimizer=DecoupledL2DPKerasSGDOptimizer(
            l2_norm_clip=C, noise_multiplier=Z, l2_regularization=L2, learning_rate=LR
        ),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=tf.keras.losses.Reduction.NONE),
        metrics=[batch_labels],
    )
    callback = HiddenStatePrivacyCallback(
        geometry=LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=L2, num_classes=CLASSES),
        sampling=sampling,
        dataset_size=N,
        batch_size=B,
        delta=DELTA,
        verbose=0,
    )
    return model, callback, batched_dataset(x, y, B, sampling)


class KillAt(tf.keras.callbacks.Callback):
    """After optimizer step ``step``: writes the batches trained so far and the privacy
    callback's state to ``workdir``, then kills the process."""

    def __init__(self, step, callback, workdir):
        super().__init__()
        self.step, self.callback, self.workdir = step, callback, workdir

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == self.step:
            with open(os.path.join(self.workdir, "batches.json"), "w") as f:
                json.dump(TRAINED, f)
            if hasattr(self.callback, "privacy_state"):  # (absent before issue 10)
                with open(os.path.join(self.workdir, "state.json"), "w") as f:
                    json.dump(self.callback.privacy_state(), f)
            os.kill(os.getpid(), signal.SIGKILL)


def main(workdir, sampling, order, kill_at=None):
    model, callback, ds = build(sampling)
    backup = tf.keras.callbacks.BackupAndRestore(os.path.join(workdir, "backup"))
    callbacks = [callback, backup] if order == "callback_first" else [backup, callback]
    if kill_at is not None:
        callbacks.append(KillAt(kill_at, callback, workdir))
    model.fit(ds, epochs=EPOCHS, callbacks=callbacks, verbose=0)
    print(
        json.dumps(
            {
                "epsilon": callback.epsilon,
                "steps": callback.steps,
                "ledger": callback.recorder.ledger_state(),
                "batches": TRAINED,
            }
        )
    )


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], args[1], args[2], int(args[3]) if len(args) > 3 else None)
