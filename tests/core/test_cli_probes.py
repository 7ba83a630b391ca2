"""Issue 18, the command-line probes: every bad input exits 2 with one line naming the flag the
user typed, before any work; noise and epochs list their analyses. Each test failed before the fix."""

import json
import math
import subprocess
import sys

import pytest

from hidden_state_accountants import accountant as accountant_module
from hidden_state_accountants import calibration
from hidden_state_accountants.bounds import Bound
from hidden_state_accountants.cli import FLAG_FOR_PARAMETER, main

CYCLIC = {
    "--dataset-size": "60000",
    "--batch-size": "1500",
    "--noise-multiplier": "3",
    "--clip-norm": "1",
    "--learning-rate": "0.05",
    "--sampling": "cyclic",
    "--strong-convexity": "0.002",
    "--smoothness": "1.002",
    "--delta": "1e-5",
}
POISSON = {
    "--dataset-size": "6000",
    "--batch-size": "60",
    "--noise-multiplier": "1.7",
    "--clip-norm": "1",
    "--learning-rate": "0.5",
    "--sampling": "poisson",
    "--smoothness": "1.01",
    "--l2-regularization": "0.01",
    "--delta": "1e-5",
}


def argv(command, base, *extra, drop=()):
    flags = {k: v for k, v in base.items() if k not in drop}
    return [command, *[x for kv in flags.items() for x in kv], *extra]


def cli(capsys, args):
    try:
        code = main(list(args))
    except SystemExit as done:  # argparse's own errors
        code = done.code
    out = capsys.readouterr()
    return code, out.out, out.err


def refused(capsys, args, flag):
    code, out, err = cli(capsys, args)
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith(f"hsa: error: {flag}:"), err
    assert "Traceback" not in err
    return out, err


# ------------------------------------------------------------------------- bad input, one line
@pytest.mark.parametrize("command,extra", [("epochs", ["--target-epsilon", "5"]), ("plot", ["--output", "x.png"])])
def test_a_zero_batch_size_is_named(capsys, tmp_path, command, extra):
    # was: ZeroDivisionError in steps_per_epoch before any validation
    if command == "plot":
        extra = ["--output", str(tmp_path / "x.png")]
    refused(capsys, argv(command, {**CYCLIC, "--batch-size": "0"}, *extra), "--batch-size")


@pytest.mark.parametrize("command", ["plot", "demo"])
def test_an_output_where_no_file_can_be_created_is_refused_before_the_work(capsys, command):
    # was: FileNotFoundError from matplotlib after the whole computation
    args = (
        ["demo", "--output", "/proc/x.png"]
        if command == "demo"
        else argv("plot", CYCLIC, "--output", "/proc/x.png", "--max-epochs", "2")
    )
    out, err = refused(capsys, args, "--output")
    assert out == "" and "/proc" in err


@pytest.mark.parametrize(
    "change,flag",
    [
        ({"--epochs": "1e30"}, "--epochs"),
        ({"--epochs": "10", "--dataset-size": "1" + "0" * 30}, "--dataset-size"),
    ],
)
def test_too_many_steps_name_the_flag_typed(capsys, change, flag):
    # was: "--steps: must be at most 1e+18", a flag the user never typed
    out, err = refused(capsys, argv("epsilon", {**CYCLIC, **change}), flag)
    assert "--steps" not in err


def test_a_max_epochs_beyond_any_run_is_named(capsys, tmp_path):
    # was: --steps named (plot), or a silent answer (epochs)
    refused(capsys, argv("plot", CYCLIC, "--output", str(tmp_path / "x.png"), "--max-epochs", "1e30"), "--max-epochs")
    refused(capsys, argv("epochs", CYCLIC, "--target-epsilon", "5", "--max-epochs", "1" + "0" * 30), "--max-epochs")


def test_a_plot_of_less_than_one_epoch_is_refused(capsys, tmp_path):
    # was: one epoch plotted for --max-epochs 0.5
    out, _ = refused(
        capsys, argv("plot", CYCLIC, "--output", str(tmp_path / "x.png"), "--max-epochs", "0.5"), "--max-epochs"
    )
    assert out == "" and not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    "parameter,flag", [("l2_regularization", "--l2-regularization"), ("neighboring_relation", "--neighboring-relation")]
)
def test_every_parameter_of_a_flag_maps_to_it(capsys, parameter, flag):
    assert FLAG_FOR_PARAMETER[parameter] == flag


def test_a_bad_l2_strength_names_its_flag(capsys):
    # was: "hsa: error: l2_regularization: must be >= 0" (the parameter, not the flag)
    refused(capsys, argv("epsilon", {**POISSON, "--l2-regularization": "-1"}, "--steps", "10"), "--l2-regularization")


def test_vanishing_noise_prints_no_floating_point_warnings():
    # was: numpy RuntimeWarnings with source lines on stderr (a real process: what the user sees)
    for sampling in ("cyclic", "poisson"):
        base = {
            **POISSON,
            "--sampling": sampling,
            "--noise-multiplier": "1e-308",
            "--strong-convexity": "0.01",
            "--diameter": "10",
        }
        proc = subprocess.run(
            [sys.executable, "-m", "hidden_state_accountants", *argv("epsilon", base, "--steps", "200")],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0 and proc.stderr == "", (sampling, proc.stderr)
        assert "inf" in proc.stdout


# ------------------------------------------------------------------- relations, plots, budgets
def test_epochs_under_add_remove_for_a_fixed_size_schedule_is_the_noise_refusal(capsys):
    # was: "0 epochs fit in epsilon 5 ... (epsilon 0.0000, from none)", exit 0
    _, epochs = refused(
        capsys,
        argv("epochs", CYCLIC, "--target-epsilon", "5", "--neighboring-relation", "add_or_remove_one"),
        "--neighboring-relation",
    )
    _, noise = refused(
        capsys,
        argv(
            "noise",
            CYCLIC,
            "--epochs",
            "5",
            "--target-epsilon",
            "5",
            "--neighboring-relation",
            "add_or_remove_one",
            drop=("--noise-multiplier",),
        ),
        "--neighboring-relation",
    )
    assert epochs == noise


def test_a_plot_with_nothing_to_plot_says_why(capsys, tmp_path):
    # was: a matplotlib traceback (every value infinite on a log scale)
    out, err = refused(
        capsys,
        argv(
            "plot",
            CYCLIC,
            "--output",
            str(tmp_path / "x.png"),
            "--max-epochs",
            "3",
            "--neighboring-relation",
            "add_or_remove_one",
        ),
        "--neighboring-relation",
    )
    assert "nothing to plot" in err and "ADD_OR_REMOVE_ONE" in err and out == ""
    code, out, err = cli(
        capsys,
        argv(
            "plot", {**CYCLIC, "--noise-multiplier": "1e-308"}, "--output", str(tmp_path / "y.png"), "--max-epochs", "3"
        ),
    )
    assert code == 2 and err.startswith("hsa: error: nothing to plot") and err.count("\n") == 1
    assert not (tmp_path / "y.png").exists()


def test_the_plot_axis_names_the_relation(tmp_path):
    from hidden_state_accountants import TrainingRunDpEvent
    from hidden_state_accountants.plotting import epsilon_curves

    run = TrainingRunDpEvent(
        dataset_size=600,
        batch_size=600,
        steps=1,
        noise_multiplier=3.0,
        clip_norm=1.0,
        learning_rate=0.1,
        sampling="full",
    )
    curves = epsilon_curves(run, [1, 2], 1e-5, neighboring_relation="ADD_OR_REMOVE_ONE")
    assert curves.neighboring_relation == "ADD_OR_REMOVE_ONE"


# ------------------------------------------------------------------- --l2-regularization as m
def test_l2_regularization_is_the_strong_convexity_when_none_is_declared(capsys):
    # was: every hidden-state analysis refused ("l2_regularization exceeds the declared strong_convexity 0")
    code, out, _ = cli(capsys, argv("epsilon", POISSON, "--steps", "3000", "--json"))
    implied = json.loads(out)
    code2, out2, _ = cli(capsys, argv("epsilon", POISSON, "--steps", "3000", "--json", "--strong-convexity", "0.01"))
    explicit = json.loads(out2)
    assert code == code2 == 0
    assert implied["epsilon"] == explicit["epsilon"] < explicit["composition_epsilon"]
    si = {a["name"]: a for a in implied["analyses"]}["si_poisson"]
    assert si["epsilon"] is not None and si["reason"] is None
    assert any("--l2-regularization" in n and "strong convexity" in n for n in implied["notes"])
    assert not any("--l2-regularization" in n for n in explicit["notes"])
    code, out, _ = cli(capsys, argv("epsilon", POISSON, "--steps", "200"))
    assert "strong convexity taken from --l2-regularization: m = 0.01" in out


def test_an_l2_strength_above_the_smoothness_is_named(capsys):
    refused(capsys, argv("epsilon", {**POISSON, "--l2-regularization": "2"}, "--steps", "10"), "--l2-regularization")


# --------------------------------------------------------------------- noise/epochs --json
def analyses_contract(data):
    assert isinstance(data["analyses"], list) and data["analyses"]
    for a in data["analyses"]:
        assert {"name", "epsilon", "reason", "hidden_state"} <= set(a)
    return [a["name"] for a in data["analyses"]]


def test_noise_and_epochs_json_list_the_analyses_as_epsilon_does(capsys):
    # was: noise and epochs printed no analyses, so nobody could see why one was dropped
    code, out, _ = cli(capsys, argv("epsilon", CYCLIC, "--epochs", "5", "--json"))
    names = analyses_contract(json.loads(out))
    code, out, _ = cli(
        capsys, argv("noise", CYCLIC, "--epochs", "5", "--target-epsilon", "3", "--json", drop=("--noise-multiplier",))
    )
    noise = json.loads(out)
    assert code == 0 and analyses_contract(noise) == names
    winner = {a["name"]: a for a in noise["analyses"]}[noise["analysis"]]
    assert winner["epsilon"] == pytest.approx(noise["epsilon"], rel=1e-12)
    code, out, _ = cli(capsys, argv("epochs", CYCLIC, "--target-epsilon", "5", "--json"))
    epochs = json.loads(out)
    assert code == 0 and analyses_contract(epochs) == names and epochs["epochs"] == 74
    assert {a["name"]: a for a in epochs["analyses"]}["bok_thm4.5"]["epsilon"] == pytest.approx(epochs["epsilon"])


class _Fixed(Bound):
    def __init__(self, name, eps, monotone, kind):
        super().__init__(name=name, hidden_state=kind != "gdp", monotone_in_steps=monotone)
        self._eps, self.kind = eps, kind

    def epsilon(self, delta):
        return self._eps


def test_epochs_says_unlimited_for_a_converging_f_dp_bound(capsys, monkeypatch):
    # was: f-DP bounds left out of the limit: "the bound tends to 9.2e10" and a cap at 100000 epochs
    def analyze(run, ctx=None):
        e = run.steps / run.steps_per_epoch
        return [_Fixed("composition", 0.1 * e, True, "gdp"), _Fixed("converging", 2.33 - 1.0 / e, True, "fdp")]

    monkeypatch.setattr(accountant_module, "analyze_training_run", analyze)
    monkeypatch.setattr(calibration, "analyze_training_run", analyze, raising=False)
    code, out, _ = cli(capsys, argv("epochs", CYCLIC, "--target-epsilon", "3"))
    assert code == 0 and out.startswith("unlimited: converging stays at or below epsilon 2.3300")
    code, out, _ = cli(capsys, argv("epochs", CYCLIC, "--target-epsilon", "2"))
    assert code == 0 and "converging converges to epsilon 2.3300, above the target" in out
    assert "epochs fit in epsilon 2" in out and "would cost" in out


def test_epochs_when_nothing_fits_says_what_one_epoch_costs(capsys):
    code, out, _ = cli(capsys, argv("epochs", CYCLIC, "--target-epsilon", "0.001"))
    assert code == 0 and out.startswith("no whole epoch fits in epsilon 0.001") and "one epoch costs 2.7534" in out
    assert math.isfinite(float(out.split("one epoch costs ")[1].split()[0]))


# ------------------------------------------------------------------ issue 29 (and 27, 5a): edges answer
ISSUE29_Q1 = [
    "epsilon",
    *(
        "--dataset-size 1000 --batch-size 1000 --steps 50 --noise-multiplier 2 --clip-norm 1 --learning-rate 0.5"
    ).split(),
    *("--sampling poisson --smoothness 1.01 --l2-regularization 0.01 --delta 1e-5 --json").split(),
]


def test_poisson_at_rate_one_answers_as_full_batch_training(capsys):
    # was: ValueError: math domain error in ye_shokri.recursion_log_s (q = b/n = 1)
    code, out, err = cli(capsys, ISSUE29_Q1)
    assert code == 0 and "Traceback" not in err
    poisson = json.loads(out)
    code, out, _ = cli(capsys, [x if x != "poisson" else "full" for x in ISSUE29_Q1])
    full = json.loads(out)
    assert poisson["epsilon"] == full["epsilon"] and poisson["analysis"] == "bok_thm4.2"
    assert accountant_module.FULL_BATCH_NOTE in poisson["notes"]


@pytest.mark.parametrize("length", [["--epochs", "1"], ["--steps", "3"]])
def test_a_400_digit_dataset_size_is_refused_by_name(capsys, length):
    # was: OverflowError inside the refusal message (formatting the size as a float), or in the analyses
    args = argv("epsilon", {**POISSON, "--dataset-size": "1" + "0" * 400}, *length)
    _, err = refused(capsys, args, "--dataset-size")
    assert "about 1e400" in err


def test_an_infinite_loss_of_probability_one_is_a_vacuous_candidate_not_a_crash(capsys):
    # issue 27 (5a), was: ValueError: math domain error in compose_pmfs (1.0 - 1e-300 == 1.0)
    args = (
        "epsilon --dataset-size 125 --batch-size 59 --steps 5 --noise-multiplier 0.3594 --clip-norm 1.0 "
        "--learning-rate 0.0480067 --sampling poisson --strong-convexity 0.0133981 --smoothness 0.674299 "
        "--l2-regularization 0.0133981 --neighboring-relation replace_one --delta 0.000889 --json"
    ).split()
    code, out, err = cli(capsys, args)
    assert code == 0 and "Traceback" not in err
    report = json.loads(out)
    assert math.isfinite(report["epsilon"]) and report["epsilon"] <= report["composition_epsilon"]
