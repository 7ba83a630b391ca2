"""The TF-Privacy example runs, prints epsilon in Keras' progress output, and learns."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import warnings

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("tensorflow_privacy")
pytest.importorskip("sklearn")
pytestmark = pytest.mark.tf

from hidden_state_accountants import HiddenStateAccountant, LossGeometry, TrainingRunDpEvent  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "tf_logistic_regression.py"


def _load():
    spec = importlib.util.spec_from_file_location("tf_logistic_regression", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_prints_epsilon_per_epoch_and_accuracy(capsys):
    result = _load().main(["--epochs", "4"])
    out = capsys.readouterr().out
    progress = [line for line in out.splitlines() if line.startswith("22/22")]
    assert len(progress) == 4
    assert all(" - epsilon: " in line and " - epsilon_composition: " in line for line in progress)
    assert "final test accuracy:" in out and "Example-level DP" in out
    assert result["accuracy"] > 0.7  # four epochs of DP logistic regression on digits
    run = TrainingRunDpEvent.from_epochs(
        dataset_size=1437,
        batch_size=64,
        epochs=4,
        noise_multiplier=2.0,
        clip_norm=2.0,
        learning_rate=0.5,
        sampling="shuffle_partition",
        geometry=LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=0.01, num_classes=10),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = HiddenStateAccountant().compose(run).get_epsilon(1e-5)
    assert result["epsilon"] == pytest.approx(expected, rel=1e-12)
    assert f"epsilon: {expected:.4f}" in progress[-1]


def test_example_budget_stop():
    result = _load().main(["--epochs", "10", "--target-epsilon", "3.3"])
    # issue 19 (si_position_amplified): epsilon 3.254 after 7 epochs; an 8th: 3.403
    assert result["epochs"] == 7 and result["epsilon"] <= 3.3


def test_example_distributed_mode_reports_the_one_device_run():
    # a fresh process: the two logical CPU devices must be set before TensorFlow starts
    code = (
        "import json, runpy, sys; sys.argv = ['x', '--epochs', '2', '--distributed']; "
        f"print(json.dumps(runpy.run_path({str(EXAMPLE)!r}, run_name='example')['main'](sys.argv[1:]), "
        "default=float))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES=""),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DecoupledL2DPKerasSGDOptimizer on 2 replicas" in out.stdout
    result = json.loads(out.stdout.strip().splitlines()[-1])
    run = TrainingRunDpEvent.from_epochs(
        dataset_size=1437,
        batch_size=64,
        epochs=2,
        noise_multiplier=2.0,
        clip_norm=2.0,
        learning_rate=0.5,
        sampling="shuffle_partition",
        geometry=LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=0.01, num_classes=10),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = HiddenStateAccountant().compose(run).get_epsilon(1e-5)
    assert result["replicas"] == 2 and result["epsilon"] == pytest.approx(expected, rel=1e-12)


def _reshuffle_epsilon(epochs, secret):
    run = TrainingRunDpEvent(
        dataset_size=1437,
        batch_size=64,
        steps=epochs * 23,
        noise_multiplier=2.0,
        clip_norm=2.0,
        learning_rate=0.5,
        sampling="reshuffle",
        last_batch="kept_own_size",
        secret_batches=secret,
        geometry=LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=0.01, num_classes=10),
    )
    return HiddenStateAccountant().compose(run).explain(1e-5)


def test_example_keras_shuffle_is_accounted_as_reshuffle(capsys):
    """Plain fit(x, y, batch_size=64, shuffle=True): 1437 = 22 * 64 + 29, the short batch kept."""
    import tensorflow as tf

    tf.random.set_seed(None)  # no global seed left over from another test: Keras' shuffle is secret
    result = _load().main(["--epochs", "2", "--keras-shuffle"])
    out = " ".join(capsys.readouterr().out.split())
    expected = _reshuffle_epsilon(2, secret=True)
    assert result["steps"] == 46 and result["last_batch"] == "kept_own_size" and result["secret_batches"]
    assert result["epsilon"] == pytest.approx(expected.epsilon, rel=1e-12)
    assert result["analysis"] == expected.analysis == "si_reshuffle_amplified"  # issue 19
    assert "Keras draws a new random permutation of the records every epoch (secret" in out
    # --seed sets TensorFlow's global seed: the permutations are public, the worst pattern is reported
    result = _load().main(["--epochs", "2", "--keras-shuffle", "--seed", "0"])
    out = " ".join(capsys.readouterr().out.split())
    public = _reshuffle_epsilon(2, secret=False)
    assert result["epsilon"] == pytest.approx(public.epsilon, rel=1e-12) and public.epsilon > expected.epsilon
    assert result["analysis"] == "si_reshuffle_worst" and "public (secret=False)" in out
    assert result["secret_batches"] is False
    tf.random.set_seed(None)
