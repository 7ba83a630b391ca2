"""benchmarks/utility_at_budget.py (issue 20): its pieces and, on a tiny grid, the whole script.

The synthetic task's Bayes accuracy is checked against a closed form and by simulation; the run the
core calibrates for must be the run Opacus' loader makes and the adapter records; the end-to-end run
prints one row per method and budget, within budget, and writes its report and plot.
"""

import math
from dataclasses import replace

import numpy as np
import pytest
from scipy import stats

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
pytest.importorskip("sklearn")
pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def bench():
    from opacus_common import import_benchmark

    module = import_benchmark("utility_at_budget")
    module._quiet()
    return module


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


def test_a2_is_opacus_at_the_clip_a_multiclass_geometry_needs(bench):
    """(A2) exists on three or more classes only, clips at 2.01 there, and shares (A)'s z (the clip changes
    the noise's scale, not Opacus' calibration): (A) against (A2) is the clip's cost alone."""
    a, a2 = bench.METHODS["A"], bench.METHODS["A2"]
    assert a2.applies_to(10) and not a2.applies_to(2) and a.applies_to(2)
    assert bench.clip_norm_for(a2, 10) == bench.NONBINDING_CLIP_NORM == 2.01 and bench.clip_norm_for(a, 10) == 1.0
    assert bench.clip_norm_for(bench.METHODS["B"], 10) == 2.01 and bench.clip_norm_for(bench.METHODS["B"], 2) == 1.0
    # a configuration that can carry no hidden-state claim (no L2, no projection) keeps clip 1 and no geometry
    plain, regularised = bench.Config(72, 2, 1.0, 0.0, None), bench.Config(72, 2, 1.0, 0.05, None)
    for key in ("B", "C", "D"):
        method = bench.METHODS[key]
        assert not bench.declares_geometry(method, plain, 10) and bench.clip_norm_for(method, 10, plain) == 1.0
        assert bench.declares_geometry(method, regularised, 10) and bench.clip_norm_for(method, 10, regularised) == 2.01
        assert bench.declares_geometry(method, plain, 2) and bench.clip_norm_for(method, 2, plain) == 1.0
    assert bench.core_event(bench.METHODS["B"], plain, 1200, 10).geometry is None
    data = bench.dataset("digits")
    cfg = bench.Config(150, 2, 1.0, 0.0, None)
    clips, zs = [], []
    for method in (a, a2):
        _, optimizer, _, _ = bench.private_training(data, method, cfg, 0, target_epsilon=2.0)
        clips.append(optimizer.max_grad_norm)
        zs.append(optimizer.noise_multiplier)
    assert clips == [1.0, 2.01] and zs[0] == zs[1]


def test_the_composition_window_of_a_poisson_winner(bench):
    """The window's noise is composition over ceil(T_w) steps of the same Poisson run: Opacus' PRV calibration
    for that many steps agrees (an independent accountant), and the converged hidden-state z of the run is not
    below it (docs/derivations.md section 19: a valid bound cannot be; under sampling it sits a little above)."""
    from opacus.accountants.utils import get_noise_multiplier

    from hidden_state_accountants.lower_bounds import composition_window

    data, method = bench.dataset("digits"), bench.METHODS["B"]
    cfg = bench.Config(50, 100, 1.0, 0.05, None)  # T = 2400 steps, T_w = 39
    w = bench.window_noise(method, cfg, data.n, data.classes, 1.0)
    assert w["window"] == composition_window(1.0, 0.05) == 39.0 and w["window_steps"] == 39 and w["steps"] == 2400
    q, _, _ = bench.poisson_plan(data.n, cfg.batch_size)
    for steps, z in ((39, w["z_window"]), (2400, w["z_run"])):
        opacus = get_noise_multiplier(
            target_epsilon=1.0, target_delta=1e-5, sample_rate=q, steps=steps, accountant="prv"
        )
        assert z == pytest.approx(opacus, rel=0.02)
    z_hidden, analysis = bench.core_noise(method, cfg, data.n, data.classes, 1.0)
    assert analysis == "si_poisson" and w["z_window"] <= z_hidden < 0.5 * w["z_run"]
    # with a projection the argument does not apply: no window is claimed
    assert "window" not in bench.window_noise(method, replace(cfg, radius=10.0), data.n, data.classes, 1.0)


def test_the_report_tables_for_the_clip_no_l2_and_windows(bench):
    """The three tables the findings rest on, from rows made by hand: the clip's cost, (D) against (A) without
    L2 (its spread rule) and the window of each hidden-state winner (only those)."""

    def row(method, eps, test, cfg, analysis="opacus prv", window=None, z=2.0):
        r = bench.Row(
            "digits",
            method,
            bench.METHODS[method].label,
            "ADD_OR_REMOVE_ONE",
            eps,
            cfg,
            z,
            None,
            None,
            "",
            0.9,
            list(test),
            analysis=analysis,
        )
        r.window = window
        return r

    plain = bench.Config(150, 10, 1.0, 0.0, None)
    rows = [
        row("A", 1.0, [0.86, 0.87, 0.88], plain),
        row("A2", 1.0, [0.80, 0.81, 0.82], plain),
        row("D", 1.0, [0.855, 0.86, 0.865], replace(plain, sampler="balls_in_bins"), "composition_allocation_pld"),
    ]
    clip = bench.clip_table(rows, (1.0,))
    assert (
        len(clip) == 3 and "| digits | 1 | 0.870 ± 0.010 | 0.810 ± 0.010 | -0.060 (worse) | 0.013, 0.027 |" in clip[2]
    )
    no_l2 = bench.no_l2_table(rows, (1.0,))
    assert "| 0.870 ± 0.010 | 0.860 ± 0.005 | -0.010 (no clear difference) | yes |" in no_l2[2]
    rows[2].test = [0.80, 0.80, 0.80]
    assert "| no |" in bench.no_l2_table(rows, (1.0,))[2]
    assert bench.window_table(rows) == []  # no hidden-state winner
    window = dict(
        steps=80,
        z_run=6.8,
        analysis_run="composition_poisson_pld",
        window=39.0,
        window_steps=39,
        z_window=4.8,
        analysis_window="composition_poisson_pld",
    )
    rows.append(row("B", 1.0, [0.8] * 3, replace(plain, l2=0.05), "si_poisson", window, z=5.0))
    table = bench.window_table(rows)
    assert (
        len(table) == 3
        and "| 80 | 39.0 | 5.000 | 4.800 (composition_poisson_pld) | 6.800 (composition_poisson_pld) |" in table[2]
    )
    assert bench.clip_table(rows[2:], (1.0,)) == []  # two classes or no (A2): no clip table
    # the summary at the top of the report says the same, from the same rows (and the grid's noise ratios)
    search = [
        dict(dataset="digits", method=m, epsilon=1.0, config=bench.asdict(replace(plain, sampler=s)), z=z)
        for m, s, z in (("A", None, 2.2), ("D", "balls_in_bins", 2.0), ("A", None, 9.0))
    ]
    search[2]["config"]["l2"] = 0.05  # not a configuration without L2: left out
    text = "\n".join(bench.headline(rows, rows[:3], search, (1.0,)))
    assert "(2.01 against 1), digits: (A2) - (A) = -0.060 in test accuracy over eps 1 (1 worse)" in text
    assert "digits 1.100 (median 1.100, 1 configurations)" in text
    assert "The 1 hidden-state winners of (B) and (D) need 1.04 times" in text and "and 0.74 times" in text


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
        "--datasets breast_cancer,digits --budgets 1,4 --batch-sizes 72 --epochs 2 --lrs 1 --l2s 0,0.05 --radii none "
        "--samplers shuffle_partition --seeds 2 --no-progress"
    ).split()
    files = ["--out", str(out), "--plot", str(fig), "--cache", str(tmp_path / "cache.jsonl")]
    res = bench.main(tiny + files + ["--json", str(js)])
    printed = capsys.readouterr().out
    rows = res["rows"]
    methods = {"breast_cancer": ("A", "B", "A'", "C", "D"), "digits": ("A", "A2", "B", "A'", "C", "D")}
    assert [(r["dataset"], r["method"], r["epsilon_budget"]) for r in rows] == [
        x
        for name in ("breast_cancer", "digits")
        for x in [(name, m, e) for m in methods[name] for e in (1.0, 4.0)] + [(name, "non-private", None)]
    ]  # (A2) on ten classes only
    for r in rows:
        assert len(r["test"]) == 2 and 0.2 < r["mean"] <= 1.0
        if r["epsilon_budget"] is not None:
            assert r["z"] > 0 and r["reported_epsilon"] <= r["epsilon_budget"] * (1 + 1e-6)
            assert f"| {r['label']} | {r['epsilon_budget']:g} | {r['mean']:.3f} ± " in printed
        hidden = r["analysis"] and bench._is_hidden_state(r["analysis"])
        assert (r["window"] is not None) == bool(hidden)  # a window for each hidden-state winner, and only those
        if hidden:
            assert f"| {r['window']['steps']} | {r['window']['window']:.1f} | {r['z']:.3f} |" in printed
    # (A), (A2) and (D) also selected without an L2 term, each at most as good on validation as overall
    assert [(r["dataset"], r["method"]) for r in res["without_l2"]] == [
        (name, m)
        for name in ("breast_cancer", "digits")
        for m in methods[name]
        if m in ("A", "A2", "D")
        for _ in (1, 4)
    ]
    assert all(r["config"]["l2"] == 0 for r in res["without_l2"])
    assert len(res["search"]) == 2 * 2 * (5 + 6)  # every method, budget and configuration searched
    text = out.read_text()
    assert "python benchmarks/utility_at_budget.py --datasets breast_cancer,digits" in text and "opacus 1.6" in text
    summary = text.split("## Hidden-state accounting")[0]
    assert summary.count("| breast_cancer | (") == 5 and summary.count("| digits | (") == 6
    assert "## What the clip that cannot bind costs" in text and "| digits | 1 | " in printed
    assert "## Balls-in-bins against Poisson without an L2 term" in text
    assert fig.stat().st_size > 10_000 and js.stat().st_size > 0
    # the cache resumes: a second run does no work and prints the same rows
    again = bench.main(tiny + files)
    assert [r["test"] for r in again["rows"]] == [r["test"] for r in rows]
