"""No input crashes: valid input gets a finite answer (or an explicit infinity), bad input one
line naming the parameter (exit 2 on the command line). Each case failed before issue 10."""

import math
import os
import unittest
import warnings

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting import privacy_accountant_test

from hidden_state_accountants import HiddenStateAccountant, LossGeometry, ParameterError, TrainingRunDpEvent
from hidden_state_accountants.cli import main
from hidden_state_accountants.exact import MixturePair

TABLE1 = dict(
    dataset_size=60000,
    batch_size=1500,
    clip_norm=1.0,
    learning_rate=0.05,
    sampling="cyclic",
    geometry=LossGeometry(strong_convexity=0.002, smoothness=1.002),
)


def epsilon(**kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # composition-only runs warn by design
        return HiddenStateAccountant().compose(TrainingRunDpEvent(**kw)).get_epsilon(1e-5)


def cli(capsys, *argv):
    """Exit code, stdout, stderr of ``hsa argv`` (argparse errors exit through SystemExit)."""
    try:
        code = main(list(argv))
    except SystemExit as done:
        code = done.code
    out = capsys.readouterr()
    return code, out.out, out.err


# --------------------------------------------------------------- valid, extreme input
@pytest.mark.parametrize(
    "z,finite", [(1e-154, False), (1e-200, False), (5e-324, False), (1e300, True), (1.7e308, True)]
)
def test_extreme_noise_on_the_table1_run(z, finite):
    eps = epsilon(steps=50 * 40, noise_multiplier=z, **TABLE1)
    assert eps >= 0 and (math.isfinite(eps) == finite)


@pytest.mark.parametrize("sampling", ["full", "cyclic", "shuffle_partition", "reshuffle", "without_replacement"])
@pytest.mark.parametrize("z", [5e-324, 1e-300])
def test_vanishing_noise_gives_infinity_on_every_schedule(sampling, z):
    b = 600 if sampling == "full" else 60
    for geometry in (
        None,
        LossGeometry(strong_convexity=0.1, smoothness=1.0),
        LossGeometry(smoothness=1.0, diameter=2.0),
    ):
        eps = epsilon(
            dataset_size=600,
            batch_size=b,
            steps=50,
            noise_multiplier=z,
            clip_norm=1e-300,
            learning_rate=0.1,
            sampling=sampling,
            geometry=geometry,
        )
        assert eps == math.inf


@pytest.mark.parametrize("last_batch", ["dropped", "kept_own_size", "kept_batch_size"])
@pytest.mark.parametrize(
    "steps,z,lr_m",
    [
        (10**18, 2.0, 0.5),
        (10**7, 1.0, 1e-7),
        (10**6 + 3, 0.3, 1 - 1e-12),
        (7, 1e300, 0.5),
        (10**12, 1e-3, 0.1),
        (3, 2.0, 1e-300),
    ],
)
def test_reshuffle_at_extreme_inputs_is_finite_and_quick(steps, z, lr_m, last_batch):
    """Issue 11: any length (partial last epochs, 10^18 steps), tiny and huge noise, c near 0
    and 1, n/b huge: a finite epsilon (or infinity), quickly, never a crash."""
    import time

    for n, b in ((61, 6), (10**9 + 7, 10)):
        start = time.monotonic()
        kw = dict(
            dataset_size=n,
            batch_size=b,
            steps=steps,
            noise_multiplier=z,
            clip_norm=1.0,
            learning_rate=0.5,
            sampling="reshuffle",
            last_batch=last_batch,
            geometry=LossGeometry(strong_convexity=2 * lr_m, smoothness=max(2 * lr_m, 1.0)),
        )
        report = HiddenStateAccountant().compose(TrainingRunDpEvent(**kw)).explain(1e-5)
        assert report.epsilon >= 0 and not math.isnan(report.epsilon)
        assert math.isfinite(report.epsilon) or z < 1e-2
        assert time.monotonic() - start < 20
        for public in (True, False):
            sp = dict(kw, sampling="shuffle_partition", last_batch="dropped", secret_batches=public)
            assert HiddenStateAccountant().compose(TrainingRunDpEvent(**sp)).get_epsilon(1e-5) >= 0


def test_vanishing_renyi_divergence_is_not_negative():
    """Huge noise: a bound that rounds to -4e-15 used to make dp_accounting raise."""
    eps = epsilon(
        dataset_size=10**6,
        batch_size=10**5,
        steps=1000,
        noise_multiplier=1e9,
        clip_norm=1.0,
        learning_rate=1.0,
        sampling="shuffle_partition",
        geometry=LossGeometry(strong_convexity=0.5, smoothness=1.0),
    )
    assert eps == 0.0


def test_rescaling_to_clip_norm_one_never_fails_on_valid_input():
    # D / C overflows: the constrained bounds are vacuous, the others still apply
    eps = epsilon(
        dataset_size=600,
        batch_size=60,
        steps=10,
        noise_multiplier=2.0,
        clip_norm=1e-300,
        learning_rate=0.1,
        sampling="cyclic",
        geometry=LossGeometry(smoothness=1.0, diameter=1e9),
    )
    assert math.isfinite(eps)
    # c C^2 underflows: Chourasia Thm 2 takes its c -> 0 limit (larger), it does not fail
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = (
            HiddenStateAccountant()
            .compose(
                TrainingRunDpEvent(
                    dataset_size=600,
                    batch_size=600,
                    steps=10,
                    noise_multiplier=2.0,
                    clip_norm=1e-200,
                    learning_rate=0.1,
                    sampling="full",
                    geometry=LossGeometry(smoothness=1.0, lsi_constant=1e-3),
                )
            )
            .explain(1e-5)
        )
    thm2 = next(a for a in report.analyses if a.name == "chourasia_thm2")
    unit = report.epsilon
    assert math.isfinite(thm2.epsilon) and thm2.epsilon >= unit


def test_cli_extreme_values_are_answered(capsys):
    common = [
        "--dataset-size",
        "600",
        "--batch-size",
        "60",
        "--steps",
        "10",
        "--noise-multiplier",
        "2",
        "--learning-rate",
        "0.1",
        "--sampling",
        "cyclic",
        "--delta",
        "1e-5",
        "--json",
    ]
    code, out, err = cli(capsys, "epsilon", *common, "--clip-norm", "1e-300", "--smoothness", "1", "--diameter", "1e9")
    assert code == 0 and '"epsilon"' in out, err


# ---------------------------------------------------------------- bad input, one line
@pytest.mark.parametrize(
    "argv,flag,shown",
    [
        (["--noise-multiplier", "1.8e308"], "--noise-multiplier", "1.8e308"),
        (["--steps", "1" + "0" * 400], "--steps", "1e400"),
    ],
)
def test_cli_out_of_range_numbers_name_the_flag_and_the_typed_value(capsys, argv, flag, shown):
    base = {
        "--dataset-size": "600",
        "--batch-size": "60",
        "--steps": "10",
        "--noise-multiplier": "2",
        "--clip-norm": "1",
        "--learning-rate": "0.1",
        "--sampling": "cyclic",
        "--delta": "1e-5",
    }
    base.update(dict(zip(argv[::2], argv[1::2])))
    code, out, err = cli(capsys, "epsilon", *[x for kv in base.items() for x in kv])
    assert code == 2 and err.count("\n") == 1 and flag in err, err
    assert "got inf" not in err and shown in err  # quotes what was typed, not float('inf')


@pytest.mark.parametrize("output,text", [("/nonexistent/p.png", "does not exist"), ("p.txt", "must end in")])
def test_plot_output_is_checked_before_the_work(capsys, output, text):
    code, out, err = cli(
        capsys,
        "plot",
        "--dataset-size",
        "600",
        "--batch-size",
        "60",
        "--noise-multiplier",
        "2",
        "--clip-norm",
        "1",
        "--learning-rate",
        "0.1",
        "--sampling",
        "cyclic",
        "--delta",
        "1e-5",
        "--smoothness",
        "1",
        "--strong-convexity",
        "0.1",
        "--output",
        output,
    )
    assert code == 2 and err.startswith("hsa: error: --output:") and text in err and err.count("\n") == 1
    assert out == ""  # nothing computed


def test_plot_into_a_directory_prints_the_file_written(capsys, tmp_path):
    code, out, err = cli(
        capsys,
        "plot",
        "--dataset-size",
        "600",
        "--batch-size",
        "60",
        "--noise-multiplier",
        "2",
        "--clip-norm",
        "1",
        "--learning-rate",
        "0.1",
        "--sampling",
        "cyclic",
        "--delta",
        "1e-5",
        "--smoothness",
        "1",
        "--strong-convexity",
        "0.1",
        "--max-epochs",
        "2",
        "--output",
        str(tmp_path),
    )
    written = tmp_path / "hsa_epsilon_vs_epochs.png"
    assert code == 0 and written.exists() and f"plot saved to {written}" in out


def test_too_many_steps_names_steps():
    with pytest.raises(ParameterError, match="steps: must be at most") as err:
        TrainingRunDpEvent(steps=10**400, noise_multiplier=1.0, **TABLE1)
    assert err.value.parameter == "steps"


@pytest.mark.parametrize("value", ["no", math.nan, None, {}, 1])
def test_gaussian_initialization_must_be_a_bool(value):
    with pytest.raises(ParameterError, match="gaussian_initialization"):
        TrainingRunDpEvent(steps=10, noise_multiplier=1.0, gaussian_initialization=value, **TABLE1)


@pytest.mark.parametrize(
    "event,parameter",
    [
        (dpa.PoissonSampledDpEvent(1.5, dpa.GaussianDpEvent(1.0)), "sampling_probability"),
        (dpa.PoissonSampledDpEvent(-0.1, dpa.GaussianDpEvent(1.0)), "sampling_probability"),
        (dpa.GaussianDpEvent(math.nan), "noise_multiplier"),
        (dpa.GaussianDpEvent(-1.0), "noise_multiplier"),
        (dpa.SampledWithoutReplacementDpEvent(10, 20, dpa.GaussianDpEvent(1.0)), "sample_size"),
        (dpa.LaplaceDpEvent(math.nan), "noise_multiplier"),
    ],
)
def test_standard_events_out_of_range_name_the_parameter(event, parameter):
    with pytest.raises(ParameterError) as err:
        HiddenStateAccountant().compose(event).get_epsilon(1e-5)
    assert err.value.parameter == parameter


@pytest.mark.parametrize(
    "event",
    [
        dpa.PoissonSampledDpEvent(0.0, dpa.GaussianDpEvent(1.0)),
        dpa.SampledWithoutReplacementDpEvent(1000, 0, dpa.GaussianDpEvent(1.0)),
    ],
)
def test_events_that_touch_no_record_cost_nothing(event):
    acc = HiddenStateAccountant().compose(event)
    assert acc.get_epsilon(1e-5) == 0.0 and acc.get_delta(0.0) == 0.0


# ------------------------------------------------------------- dp_accounting semantics
class TestGenericPrivacyAccountant(privacy_accountant_test.PrivacyAccountantTest):
    """dp_accounting's own generic accountant tests (no events, no-op, non-private, unsupported)."""

    def _make_test_accountants(self):
        return [HiddenStateAccountant()]


def test_dp_accounting_generic_tests_pass():
    result = unittest.TextTestRunner(stream=open(os.devnull, "w")).run(
        unittest.TestLoader().loadTestsFromTestCase(TestGenericPrivacyAccountant)
    )
    assert result.wasSuccessful() and result.testsRun >= 5, result.failures + result.errors


# --------------------------------------------------------------------- ground truth
def test_exact_pair_epsilon_beyond_709():
    pair = MixturePair([80.0], [0.0], [0.0], [0.0])  # mu = 80
    eps = pair.epsilon(1e-5)
    assert 3000 < eps < 4000 and math.isfinite(eps)
    assert pair.delta(eps) <= 1e-5
    mixture = MixturePair([60.0, 80.0], np.log([0.5, 0.5]), [0.0], [0.0])  # the worst pair's shape
    eps = mixture.epsilon(1e-5)
    assert 1500 < eps < 4000 and mixture.delta(eps) <= 1e-5 * (1 + 1e-6)


@pytest.mark.parametrize("z,finite", [(1e-154, False), (1e300, True), (1.7e308, True)])
def test_projected_sgd_bound_at_extreme_noise_is_quick_and_valid(z, finite):
    """Altschuler & Talwar's bound used to hang at z = 1e-154 (dp_accounting's fractional-order
    series never terminates once 1/(2 sigma^2) overflows) and to overflow at z = 1e300."""
    import time

    start = time.monotonic()
    eps = epsilon(
        dataset_size=600,
        batch_size=60,
        steps=50,
        noise_multiplier=z,
        clip_norm=1.0,
        learning_rate=0.1,
        sampling="without_replacement",
        geometry=LossGeometry(smoothness=1.0, diameter=1e9),
    )
    assert math.isfinite(eps) == finite and time.monotonic() - start < 30


# ----------------------------------------------------------------- issue 29: the largest datasets
@pytest.mark.parametrize(
    "sampling", ["full", "cyclic", "shuffle_partition", "reshuffle", "without_replacement", "poisson", "balls_in_bins"]
)
def test_the_largest_dataset_size_answers_on_every_schedule(sampling):
    # was: a numpy TypeError from 1e20 records (poisson, balls_in_bins with a geometry), an OverflowError
    # from 1e320 (the others); the size is now capped at 1e100, more records than any dataset holds
    n = 10**100
    eps = epsilon(
        dataset_size=n,
        batch_size=n if sampling == "full" else n // 3,
        steps=10,
        noise_multiplier=2.0,
        clip_norm=1.0,
        learning_rate=0.5,
        sampling=sampling,
        geometry=LossGeometry(strong_convexity=0.01, smoothness=1.01),
        l2_regularization=0.01,
    )
    assert math.isfinite(eps) and eps > 0
    with pytest.raises(ParameterError, match="^dataset_size: must be at most 1e\\+100"):
        TrainingRunDpEvent(
            dataset_size=n + 1,
            batch_size=3,
            steps=1,
            noise_multiplier=1.0,
            clip_norm=1.0,
            learning_rate=0.1,
            sampling=sampling if sampling != "full" else "cyclic",
        )
