"""tf.distribute (issue 13): under MirroredStrategy and MultiWorkerMirroredStrategy the
package's DP optimizer takes exactly the accounted step on the global batch, the callback
accounts the single-device run, and what cannot be supported is refused before any step."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
pytest.importorskip("tensorflow_privacy")
pytestmark = pytest.mark.tf

from hidden_state_accountants import (  # noqa: E402
    BatchSchedule,
    HiddenStateAccountant,
    LossGeometry,
    ParameterError,
    TrainingRunDpEvent,
)
from hidden_state_accountants.tf_privacy import HiddenStatePrivacyCallback, batched_dataset  # noqa: E402
from hidden_state_accountants.tf_privacy import DecoupledL2DPKerasSGDOptimizer  # noqa: E402

JOB = pathlib.Path(__file__).resolve().parent / "tf_distribute_job.py"
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
# the job's constants
B, Z, C, LR, L2 = 100, 1.0, 1.0, 0.1, 0.5
N, RUN_B, RUN_Z, RUN_LR, RUN_L2 = 400, 100, 2.0, 0.5, 0.01


def last_json(completed):
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def mirrored():
    """One process with two logical CPUs: single-device and MirroredStrategy figures."""
    return last_json(
        subprocess.run([sys.executable, str(JOB), "mirrored"], capture_output=True, text=True, timeout=300, env=ENV)
    )


def test_a_mirrored_step_has_the_single_device_signal(mirrored):
    # constant per-example gradient (clipped), no noise, L2 outside clipping: the same update
    # on one device and on two replicas (TF-Privacy's own step: twice the signal on two)
    single, two = mirrored["step_package"]["single"], mirrored["step_package"]["mirrored"]
    assert mirrored["replicas"] == 2
    np.testing.assert_allclose(two["signal"], single["signal"], rtol=1e-6)
    assert two["signal_max_abs"] == pytest.approx(single["signal_max_abs"], rel=1e-6)
    # the signal is the clipped mean plus the L2 term once: lr*(C*g/||g|| + L2*theta) per entry
    g = np.array([0.01] * 200 + [1.0])
    clipped = C * g / np.linalg.norm(g) / np.sqrt(50)  # the gradient spans 50 outputs
    assert single["signal"][0] == pytest.approx(-LR * (clipped[0] + L2), rel=1e-5)
    tfp_single, tfp_two = mirrored["step_tf_privacy"]["single"], mirrored["step_tf_privacy"]["mirrored"]
    assert tfp_two["signal"][0] == pytest.approx(2 * tfp_single["signal"][0], rel=1e-3)  # what is refused below


def test_a_mirrored_step_has_the_accounted_noise(mirrored):
    accounted = LR * Z * C / B  # lr z C / b = 0.001
    for where in ("single", "mirrored"):
        figures = mirrored["step_package"][where]
        # zero gradient: theta - lr*(L2*theta + noise); the std of 10,050 draws is within
        # 5 standard errors (1/sqrt(2*10050) = 0.7%) of the accounted one
        assert figures["noise_std"] == pytest.approx(accounted, rel=5 / np.sqrt(2 * figures["parameters"]))
        assert figures["noise_mean"] == pytest.approx(-LR * L2, abs=5 * accounted / np.sqrt(figures["parameters"]))
    # TF-Privacy's own optimizer: every replica adds the full noise, the sum is 2*sqrt(2) times it
    assert mirrored["step_tf_privacy"]["mirrored"]["noise_std"] == pytest.approx(2 * np.sqrt(2) * accounted, rel=0.04)


def test_a_mirrored_fit_is_accounted_as_the_single_device_run(mirrored):
    two, one = mirrored["run_package"], mirrored["run_package_single"]
    assert two["steps"] == one["steps"] == 8
    assert two["ledger"] == one["ledger"] and two["epsilon"] == one["epsilon"]
    step = two["ledger"][0][0]
    assert (step["noise_multiplier"], step["divisor"], step["weight_decay"], step["replicas"]) == (
        RUN_Z,
        RUN_B,
        RUN_L2,
        1,
    )
    # each step's two local batches make up the schedule's global batch
    schedule = BatchSchedule(N, RUN_B, "cyclic")
    local = two["batches"]
    assert len(local) == 2 * two["steps"]
    for t in range(two["steps"]):
        assert sorted(local[2 * t] + local[2 * t + 1]) == sorted(schedule.batch(t).tolist())


def test_tf_privacys_own_optimizer_under_mirrored_is_refused_with_the_reason(mirrored):
    refused = mirrored["run_tf_privacy"]
    assert refused["iterations"] == 0  # before any step
    assert refused["refused"] == (
        "batch_size: the update divides the clipped sum by 50 but the schedule's batch at step 0 holds 100 records (2 "
        "replicas each divide their part of the batch by 50 and the framework sums their updates: the effective "
        "learning rate is 2 times the one set)"
    )


def test_dp_sbcd_keras_trainer_refuses_a_mirrored_model(mirrored):
    assert mirrored["sbcd"].startswith(
        "model: the model was built under MirroredStrategy: DP-SBCD's Keras trainer runs on one device"
    )


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def test_two_workers_on_localhost_train_the_accounted_run_and_agree_on_the_ledger():
    ports = ",".join(map(str, free_ports(2)))
    workers = [
        subprocess.Popen(
            [sys.executable, str(JOB), "worker", str(i), ports],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        for i in range(2)
    ]
    try:
        outs = [w.communicate(timeout=240) for w in workers]
    finally:
        for w in workers:
            w.kill()
    results = [last_json(subprocess.CompletedProcess(w.args, w.returncode, *out)) for w, out in zip(workers, outs)]
    runs = [r["run"] for r in results]
    assert all(r["replicas"] == 2 for r in results)
    assert "refused" not in runs[0], runs[0]
    # one run: the same ledger, epsilon, schedule (worker 0's secret seed) and weights on both
    assert runs[0]["ledger"] == runs[1]["ledger"] and runs[0]["epsilon"] == runs[1]["epsilon"]
    assert runs[0]["schedule"] == runs[1]["schedule"] and runs[0]["weights"] == runs[1]["weights"]
    # the single-device run's ledger and epsilon
    ((step, count),) = runs[0]["ledger"]
    assert count == 4 and (step["noise_multiplier"], step["divisor"], step["weight_decay"]) == (RUN_Z, RUN_B, RUN_L2)
    run = TrainingRunDpEvent(
        dataset_size=N,
        batch_size=RUN_B,
        steps=4,
        noise_multiplier=RUN_Z,
        clip_norm=2.0,
        learning_rate=RUN_LR,
        sampling="shuffle_partition",
        geometry=LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=RUN_L2, num_classes=N),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert runs[0]["epsilon"] == HiddenStateAccountant().compose(run).get_epsilon(1e-5)
    # each step, the workers' local batches make up the schedule's global batch
    schedule = BatchSchedule.from_description(runs[0]["schedule"])
    for t in range(4):
        assert sorted(runs[0]["batches"][t] + runs[1]["batches"][t]) == sorted(schedule.batch(t).tolist())


# ----------------------------------------------------------------- in this process
def test_an_unverified_strategy_is_refused_before_any_step():
    strategy = tf.distribute.experimental.CentralStorageStrategy()
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(3, input_shape=(4,))])
        model.compile(
            optimizer=DecoupledL2DPKerasSGDOptimizer(
                l2_norm_clip=1.0, noise_multiplier=1.0, l2_regularization=0.0, learning_rate=0.1
            ),
            loss=tf.keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction=tf.keras.losses.Reduction.NONE
            ),
        )
    cb = HiddenStatePrivacyCallback(
        geometry=None, sampling="cyclic", dataset_size=40, batch_size=10, delta=1e-5, verbose=0
    )
    ds = batched_dataset(np.zeros((40, 4), np.float32), np.zeros(40, np.int64), 10, "cyclic")
    with pytest.raises(ParameterError, match="^distribute_strategy: CentralStorageStrategy is not supported"):
        model.fit(ds, epochs=1, callbacks=[cb], verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0
