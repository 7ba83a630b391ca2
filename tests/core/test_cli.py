"""The ``hsa`` command line: the contract of docs/usage.md, "Command line"."""

import json
import subprocess
import sys

import pytest

from hidden_state_accountants import HiddenStateAccountant, LossGeometry, TrainingRunDpEvent
from hidden_state_accountants.cli import main

RUN = [
    "--dataset-size",
    "60000",
    "--batch-size",
    "1500",
    "--epochs",
    "50",
    "--noise-multiplier",
    "3",
    "--clip-norm",
    "1",
    "--learning-rate",
    "0.05",
    "--sampling",
    "cyclic",
    "--strong-convexity",
    "0.002",
    "--smoothness",
    "1.002",
    "--delta",
    "1e-5",
]


def run_cli(capsys, args):
    try:
        code = main(args)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def test_epsilon_json_contract(capsys):
    code, out, _ = run_cli(capsys, ["epsilon", *RUN, "--json"])
    assert code == 0
    data = json.loads(out)
    assert {"epsilon", "delta", "analysis", "neighboring_relation", "analyses"} <= set(data)
    assert data["analysis"] == "bok_thm4.5" and data["neighboring_relation"] == "REPLACE_ONE"
    assert data["epsilon"] == pytest.approx(4.34, abs=0.005) and data["delta"] == 1e-5
    for a in data["analyses"]:
        assert {"name", "epsilon", "reason"} <= set(a)
        assert (a["epsilon"] is None) != (a["reason"] is None)
    # the same number as the core
    run = TrainingRunDpEvent.from_epochs(
        dataset_size=60000,
        batch_size=1500,
        epochs=50,
        noise_multiplier=3.0,
        clip_norm=1.0,
        learning_rate=0.05,
        sampling="cyclic",
        geometry=LossGeometry(strong_convexity=0.002, smoothness=1.002),
    )
    assert data["epsilon"] == HiddenStateAccountant().compose(run).get_epsilon(1e-5)


def test_epsilon_table(capsys):
    code, out, _ = run_cli(capsys, ["epsilon", *RUN])
    assert code == 0
    assert "bok_thm4.5" in out and "REPLACE_ONE" in out and "[composition]" in out


@pytest.mark.parametrize(
    "args,flag",
    [
        (["--dataset-size", "0"], "--dataset-size"),
        (["--batch-size", "-3"], "--batch-size"),
        (["--noise-multiplier", "0"], "--noise-multiplier"),
        (["--noise-multiplier", "nan"], "--noise-multiplier"),
        (["--clip-norm", "-1"], "--clip-norm"),
        (["--learning-rate", "0"], "--learning-rate"),
        (["--learning-rate", "3"], "--learning-rate"),  # >= 2/M
        (["--strong-convexity", "2"], "--strong-convexity"),  # m > M
        (["--delta", "0"], "--delta"),
        (["--delta", "1.5"], "--delta"),
        (["--batch-size", "40000"], "--batch-size"),  # n/b < 2 for cyclic
        (["--sampling", "shuffle"], "--sampling"),
        (["--batch-size", "abc"], "--batch-size"),
    ],
)
def test_bad_input_one_line_naming_the_flag(capsys, args, flag):
    argv = list(RUN)
    argv[argv.index(args[0]) + 1] = args[1]
    code, _, err = run_cli(capsys, ["epsilon", *argv])
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert flag in err


def test_strong_convexity_without_smoothness(capsys):
    argv = list(RUN)
    i = argv.index("--smoothness")
    del argv[i : i + 2]
    code, _, err = run_cli(capsys, ["epsilon", *argv])
    assert code == 2 and "--smoothness" in err


def test_noise_and_epochs_commands(capsys):
    base = list(RUN)
    noise_args = base[: base.index("--noise-multiplier")] + base[base.index("--noise-multiplier") + 2 :]
    code, out, _ = run_cli(capsys, ["noise", *noise_args, "--target-epsilon", "4.34", "--json"])
    data = json.loads(out)
    assert code == 0 and data["noise_multiplier"] == pytest.approx(3.0, rel=2e-3) and data["epsilon"] <= 4.34
    epoch_args = base[: base.index("--epochs")] + base[base.index("--epochs") + 2 :]
    code, out, _ = run_cli(capsys, ["epochs", *epoch_args, "--target-epsilon", "30", "--json"])
    data = json.loads(out)
    assert code == 0 and data["unlimited"] is True and data["epochs"] is None
    code, out, _ = run_cli(capsys, ["epochs", *epoch_args, "--target-epsilon", "5"])
    assert code == 0 and "epochs fit in epsilon 5" in out


def test_plot_and_demo_write_images(capsys, tmp_path):
    epoch_args = RUN[: RUN.index("--epochs")] + RUN[RUN.index("--epochs") + 2 :]
    out_file = tmp_path / "curve.png"
    assert main(["plot", *epoch_args, "--max-epochs", "20", "--output", str(out_file)]) == 0
    assert out_file.stat().st_size > 10_000
    demo = tmp_path / "demo.png"
    assert main(["demo", "--output", str(demo)]) == 0
    out = capsys.readouterr().out
    assert "bok_thm4.4" in out and demo.stat().st_size > 10_000


def test_module_entry_point_runs_the_same_cli():
    proc = subprocess.run(
        [sys.executable, "-m", "hidden_state_accountants", "epsilon", *RUN, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["analysis"] == "bok_thm4.5"
    bad = subprocess.run(
        [sys.executable, "-m", "hidden_state_accountants", "epsilon", *RUN[:-2], "--delta", "-1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--delta" in bad.stderr


def test_a_reader_that_closes_early_is_not_an_error():
    """`hsa epsilon ... | head -1`: the pipe closes before the report is printed; the command ends quietly
    (exit 0, no traceback) instead of raising BrokenPipeError."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hidden_state_accountants", "epsilon", *RUN],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # closed before the interpreter has even imported the package
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0 and "Traceback" not in err, err


def test_demo_leads_with_what_an_opacus_user_sees(capsys, tmp_path):
    """The demo's first table is the run an Opacus user makes (Poisson, add/remove): its composition
    column is dp_accounting's Poisson PLD (what Opacus' PRV prints, within discretisation), and the
    hidden-state column is never above it, equal for short runs, and flat once it converges."""
    import dp_accounting

    assert main(["demo", "--json", "--output", str(tmp_path / "demo.png")]) == 0
    rows = json.loads(capsys.readouterr().out)["opacus_poisson"]
    assert [r["epochs"] for r in rows] == [1, 2, 3, 5, 10, 20, 50]
    by_epochs = {r["epochs"]: r for r in rows}
    pld = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    pld.compose(
        dp_accounting.PoissonSampledDpEvent(256 / 60000, dp_accounting.GaussianDpEvent(1.0)), by_epochs[20]["steps"]
    )
    assert by_epochs[20]["composition_add_or_remove"] == pytest.approx(pld.get_epsilon(1e-5), abs=0.02)
    for r in rows:
        assert r["epsilon_add_or_remove"] <= r["composition_add_or_remove"] + 1e-12
    assert by_epochs[1]["epsilon_add_or_remove"] == pytest.approx(by_epochs[1]["composition_add_or_remove"])
    assert by_epochs[20]["analysis_add_or_remove"] == "si_poisson"
    assert by_epochs[20]["epsilon_add_or_remove"] < 0.4 * by_epochs[20]["composition_add_or_remove"]
    assert by_epochs[50]["epsilon_add_or_remove"] == pytest.approx(by_epochs[20]["epsilon_add_or_remove"], rel=0.02)
