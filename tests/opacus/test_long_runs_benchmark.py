"""benchmarks/long_runs.py (issue 30, "where it pays"): the run it accounts is the run the engine records, and
its quick mode end to end.

The continued-training table accounts the MNIST-scale run without training it; the first test checks that
the event it builds is what ``accountant="hidden_state"`` records for that run in Opacus (a few real steps on
data of the same size and classes), and the quick run checks the tables against Opacus' own accountants.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
pytest.importorskip("sklearn")
pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def long_runs():
    from opacus_common import import_benchmark

    module = import_benchmark("long_runs")
    module.ub._quiet()  # the utility benchmark's warning filters
    return module


def test_the_mnist_scale_event_is_what_the_engine_records(long_runs):
    """Three steps of the MNIST-scale run (n = 60000, batch 256, ten classes; two features, which the
    accounting does not see) through Opacus with ``accountant="hidden_state"``: the recorded run is the
    table's event, so the table's epsilons are the engine's."""
    ub = long_runs.ub
    rng = np.random.default_rng(0)
    x = rng.standard_normal((long_runs.MNIST_N, 2)).astype(np.float32)
    y = rng.integers(0, long_runs.MNIST_CLASSES, long_runs.MNIST_N)
    data = ub.Data("mnist-sized", "", x, y, x[:10], y[:10], x[:10], y[:10], long_runs.MNIST_CLASSES)
    cfg = ub.Config(long_runs.MNIST_BATCH, 1, long_runs.LR, long_runs.L2, None)
    model, optimizer, loader, engine = ub.private_training(data, ub.METHODS["B"], cfg, 0, noise_multiplier=1.0)
    assert optimizer.max_grad_norm == 2.01 and len(loader) == 235
    for step, (xb, yb) in enumerate(loader):
        if step == 3:
            break
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
    expected = long_runs.mnist_event(1).replace(steps=3, noise_multiplier=1.0)
    assert engine.accountant.training_run() == expected
    assert expected.clip_norm == 2.01 and expected.geometry.num_classes == 10


def test_quick_mode_end_to_end(long_runs, tmp_path, capsys):
    out = tmp_path / "long.md"
    res = long_runs.main(["--quick", "--no-progress", "--out", str(out), "--cache", str(tmp_path / "c.jsonl")])
    printed = capsys.readouterr().out
    fixed = res["fixed"]
    assert [(r["dataset"], r["batch_size"], r["epochs"], r["epsilon"]) for r in fixed] == [
        ("digits", 150, 5, 1.0),
        ("digits", 150, 20, 1.0),
    ]
    for r in fixed:
        assert r["clip"] == 2.01 and r["steps"] == 8 * r["epochs"] and r["window"] == 399.0
        # where no hidden-state bound wins the adapter calibrates by composition: Opacus' z, up to the two
        # accountants' discretisation; it never needs more
        assert r["z_ours"] <= r["z_prv"] * 1.01 and r["z_composition"] == pytest.approx(r["z_prv"], rel=0.02)
        assert r["ours_epsilon"] <= 1.0 * (1 + 1e-6) and len(r["test_prv"]) == len(r["test_ours"]) == 1
        assert 0.5 < r["test_prv"][0] <= 1 and 0.5 < r["test_ours"][0] <= 1
    cont = res["continued"]
    assert [c["epochs"] for c in cont] == [20, 50] and [c["steps"] for c in cont] == [4700, 11750]
    for c in cont:
        # ours composes with dp_accounting's PLD: Opacus' PRV up to discretisation (the swap table: 1.576 at 20)
        assert c["composition"] == pytest.approx(c["prv"], rel=0.01) and c["analysis"] == "si_poisson"
        assert c["lower_bound"] <= c["ours"] < c["prv"] < c["rdp"]
        assert c["z_ours"][1.0] < c["z_prv"][1.0]
    assert cont[0]["prv"] == pytest.approx(1.576, abs=0.002)
    assert cont[1]["prv"] > cont[0]["prv"] and cont[1]["ours"] == pytest.approx(cont[0]["ours"], rel=1e-9)
    assert cont[1]["z_ours"][1.0] == pytest.approx(cont[0]["z_ours"][1.0], rel=1e-3)  # converged: no more noise
    text = out.read_text()
    assert "python benchmarks/long_runs.py --quick" in text and "opacus 1.6" in text
    assert "## (i) Training to convergence" in text and "## (ii) Continued training" in text
    assert "| 20 | 4700 | 1.757 | 1.576 |" in text and "| 20 | 4700 | 1.757 | 1.576 |" in printed
