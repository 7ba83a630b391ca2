"""benchmarks/utility_at_budget.py (issue 20): its pieces and, on a tiny grid, the whole script.

The synthetic task's Bayes accuracy is checked against a closed form and by simulation; the run the
core calibrates for must be the run Opacus' loader makes and the adapter records; the end-to-end run
prints one row per method and budget, within budget, and writes its report and plot.
"""

import importlib
import math
import pathlib
import sys

import numpy as np
import pytest
from scipy import stats

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
pytest.importorskip("sklearn")
pytestmark = pytest.mark.torch

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))  # as when the script runs: benchmarks/ on the path
    mod = importlib.import_module("utility_at_budget")
    mod._quiet()
    return mod


@pytest.mark.parametrize("s", [0.0, 0.7, 1.3, 3.0])
def test_bayes_accuracy_of_two_classes_is_the_closed_form(bench, s):
    # two simplex means s(e_k - 1/2): correct iff s + eta_k > eta_j, i.e. N(0, 2) < s
    assert bench.bayes_accuracy_simplex(s, 2) == pytest.approx(stats.norm.cdf(s / math.sqrt(2)), abs=1e-10)


def test_bayes_accuracy_of_ten_classes_matches_simulation(bench):
    s, k, n = 2.0, 10, 400_000
    rng = np.random.default_rng(1)
    y = rng.integers(0, k, n)
    means = s * (np.eye(k) - 1.0 / k)
    w = means[y] + rng.standard_normal((n, k))
    hit = float(np.mean(np.argmax(w @ means.T, axis=1) == y))
    exact = bench.bayes_accuracy_simplex(s, k)
    assert abs(hit - exact) < 4 * math.sqrt(exact * (1 - exact) / n)
    assert bench.bayes_accuracy_simplex(0.0, k) == pytest.approx(1 / k, abs=1e-9)  # no signal: chance


@pytest.mark.parametrize("eigenvalues", [(1.0, 1.0), (0.2, 5.0)])
def test_synthetic_task_has_the_announced_bayes_accuracy(bench, eigenvalues):
    data = bench.synthetic_linear_probe(
        n_train=2000, n_val=500, n_test=20000, dim=64, classes=10, bayes=0.85, eigenvalues=eigenvalues
    )
    assert data.bayes_accuracy == pytest.approx(0.85, abs=1e-9)
    scored = float(data.description.rsplit("scores ", 1)[1].split(" ")[0])  # the Bayes rule on the test split
    assert abs(scored - 0.85) < 4 * math.sqrt(0.85 * 0.15 / 20000)
    x = np.concatenate([data.x_train, data.x_val, data.x_test])
    assert np.abs(x.mean(0)).max() < 0.05 and np.abs(x.std(0) - 1).max() < 0.05  # population standardisation


@pytest.mark.parametrize("n,b", [(1200, 50), (1200, 64), (360, 72), (10000, 1000), (97, 13)])
def test_poisson_plan_is_what_opacus_does(bench, n, b):
    from opacus.data_loader import DPDataLoader
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.zeros(n, 1)), batch_size=b)
    q, divisor, steps = bench.poisson_plan(n, b)
    assert q == 1 / len(loader) and divisor == int(n * (1 / len(loader)))
    assert steps == len(DPDataLoader.from_data_loader(loader))


@pytest.mark.parametrize(
    "key,sampler",
    [("B", None), ("C", "reshuffle"), ("C", "shuffle_partition"), ("C", "balls_in_bins"), ("D", "balls_in_bins")],
)
def test_the_core_calibrates_for_the_run_the_adapter_records(bench, key, sampler):
    """The z of (B) and (C) is the core's for the event the engine's accountant records after training."""
    data = bench.dataset("breast_cancer")
    method = bench.METHODS[key]
    cfg = bench.Config(72, 2, 1.0, 0.05, None, sampler)
    z, _ = bench.core_noise(method, cfg, data.n, data.classes, 2.0)
    out = bench.train_run(data, method, cfg, z, 0, account=True)
    assert out["same_event"] and out["relation"] == method.relation
    assert out["epsilon"] <= 2.0 * (1 + 1e-9)
    assert out["epsilon"] == pytest.approx(2.0, rel=2e-3)  # calibrated to rel_tol 1e-3 from above


def test_bad_grids_are_refused_naming_the_flag(bench, capsys):
    for argv, flag in (
        (["--lrs", "1.95"], "--lrs"),
        (["--datasets", "mnist"], "--datasets"),
        (["--methods", "E"], "--methods"),
        (["--budgets", "0"], "--budgets"),
        (["--samplers", "poisson"], "--samplers"),
        (["--batch-sizes", "1000"], "--batch-sizes"),
    ):
        with pytest.raises(SystemExit) as err:
            bench.main(["--quick"] + (argv if flag == "--datasets" else ["--datasets", "breast_cancer"] + argv))
        assert err.value.code == 2 and flag in capsys.readouterr().err


@pytest.mark.slow
def test_a_tiny_run_end_to_end(bench, tmp_path, capsys):
    out, fig, js = tmp_path / "u.md", tmp_path / "u.png", tmp_path / "u.json"
    tiny = (
        "--datasets breast_cancer --budgets 1,4 --batch-sizes 72 --epochs 2 --lrs 1 --l2s 0,0.05 --radii none "
        "--samplers shuffle_partition --seeds 2 --no-progress"
    ).split()
    files = ["--out", str(out), "--plot", str(fig), "--cache", str(tmp_path / "cache.jsonl")]
    res = bench.main(tiny + files + ["--json", str(js)])
    printed = capsys.readouterr().out
    rows = res["rows"]
    assert [(r["method"], r["epsilon_budget"]) for r in rows] == [
        (m, e) for m in ("A", "B", "A'", "C", "D") for e in (1.0, 4.0)
    ] + [("non-private", None)]
    for r in rows:
        assert len(r["test"]) == 2 and 0.5 < r["mean"] <= 1.0
        if r["epsilon_budget"] is not None:
            assert r["z"] > 0 and r["reported_epsilon"] <= r["epsilon_budget"] * (1 + 1e-6)
            assert f"| {r['label']} | {r['epsilon_budget']:g} | {r['mean']:.3f} ± " in printed
    assert len(res["search"]) == 5 * 2 * 2  # every method, budget and configuration searched
    text = out.read_text()
    assert "python benchmarks/utility_at_budget.py --datasets breast_cancer" in text and "opacus 1.6" in text
    assert text.count("| breast_cancer | (") == 5 and fig.stat().st_size > 10_000 and js.stat().st_size > 0
    # the cache resumes: a second run does no work and prints the same rows
    again = bench.main(tiny + files)
    assert [r["test"] for r in again["rows"]] == [r["test"] for r in rows]
