"""The example trains, reports both epsilons and saves its plot; on CUDA when there is one."""

import importlib.util
import pathlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
pytest.importorskip("sklearn")
pytestmark = pytest.mark.torch

from hidden_state_accountants import HiddenStateAccountant  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "opacus_logistic_regression.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("opacus_logistic_regression", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def check(res, epochs):
    h = res["history"]
    assert [r["epoch"] for r in h] == list(range(1, epochs + 1))
    hidden = [r["hidden_state_epsilon"] for r in h]
    comp = [r["composition_epsilon"] for r in h]
    assert all(a <= b for a, b in zip(hidden, comp))
    assert hidden[-1] < 0.7 * comp[-1], "the hidden-state bound grows slower than composition"
    assert res["final_accuracy"] > 0.3, "well above chance (0.1) on 10 classes"


def test_example_trains_on_cpu(example):
    res = example.train(epochs=4, progress=False, device="cpu")
    check(res, 4)
    # the printed epsilon is the core's for the run the example describes
    from hidden_state_accountants import LossGeometry, TrainingRunDpEvent

    expected = TrainingRunDpEvent.from_epochs(
        dataset_size=1500,
        batch_size=100,
        epochs=4,
        noise_multiplier=4.0,
        clip_norm=2.01,
        learning_rate=0.5,
        sampling="shuffle_partition",
        geometry=LossGeometry.logistic_regression(1.0, 0.01, diameter=10.0, num_classes=10),
    )
    assert res["epsilon"] == HiddenStateAccountant().compose(expected).get_epsilon(1e-5)


def test_example_main_prints_and_saves_the_plot(example, tmp_path, capsys):
    out = tmp_path / "plot.png"
    example.main(["--epochs", "2", "--device", "cpu", "--output", str(out)])
    text = capsys.readouterr().out
    assert out.exists() and out.stat().st_size > 1000
    assert "epoch   2  hidden-state eps" in text and "final: hidden-state epsilon" in text


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_example_trains_on_cuda(example):
    res = example.train(epochs=4, progress=False, device="cuda")
    check(res, 4)
    assert all(p.is_cuda for p in res["model"].parameters())
    cpu = example.train(epochs=4, progress=False, device="cpu")
    assert res["epsilon"] == cpu["epsilon"], "accounting does not depend on the device"


def test_example_distributed_mode_reports_the_one_process_run(example, tmp_path):
    """``--distributed 2``: two gloo processes under DPDDP train the same run and report the
    epsilon of one process's run (issue 13: the README's command)."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--distributed",
            "2",
            "--epochs",
            "2",
            "--device",
            "cpu",
            "--json",
            "--output",
            str(tmp_path / "p.png"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    res = json.loads(out.strip().splitlines()[-1])
    assert "(2 processes)" in out and res["relation"] == "REPLACE_ONE"
    one = example.train(epochs=2, progress=False)
    assert res["epsilon"] == pytest.approx(one["epsilon"], rel=1e-12)
    assert res["composition_epsilon"] == pytest.approx(one["composition_epsilon"], rel=1e-12)
    assert res["final_accuracy"] > 0.2
