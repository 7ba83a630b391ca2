"""Issue 6: every public entry point against invalid, extreme and adversarial values.

Each row must end in a clear error naming the parameter (a ParameterError, or for the CLI a
one-line message with the flag and exit status 2) or in a finite, valid bound. Never NaN.
"""

import math

import numpy as np
import pytest

from hidden_state_accountants import (
    HiddenStateAccountant,
    LossGeometry,
    ParameterError,
    TrainingRunDpEvent,
    calibrate_noise_multiplier,
    max_epochs_within_budget,
)
from hidden_state_accountants.audit import audit
from hidden_state_accountants.cli import main

BAD_NUMBERS = [0, -1, -1e-300, math.nan, math.inf, -math.inf, "1", None, True]
RUN = dict(
    dataset_size=1000,
    batch_size=50,
    steps=200,
    noise_multiplier=1.0,
    clip_norm=1.0,
    learning_rate=0.1,
    sampling="cyclic",
)
GEOM = LossGeometry(strong_convexity=0.1, smoothness=1.0)


def run(**kw):
    return TrainingRunDpEvent(**{**RUN, "geometry": GEOM, **kw})


@pytest.mark.parametrize(
    "field", ["dataset_size", "batch_size", "steps", "noise_multiplier", "clip_norm", "learning_rate"]
)
@pytest.mark.parametrize("value", BAD_NUMBERS)
def test_run_event_rejects(field, value):
    with pytest.raises(ParameterError) as err:
        run(**{field: value})
    assert err.value.parameter == field


@pytest.mark.parametrize("field", ["smoothness", "strong_convexity", "diameter", "lsi_constant"])
@pytest.mark.parametrize("value", [v for v in BAD_NUMBERS if v is not None])
def test_geometry_rejects(field, value):
    if field == "strong_convexity" and value is not True and value == 0:
        return  # m = 0 declares convexity only: valid
    kw = {"smoothness": 1.0, field: value}
    with pytest.raises(ParameterError) as err:
        LossGeometry(**kw)
    assert err.value.parameter == field


@pytest.mark.parametrize(
    "kw,parameter",
    [
        (dict(orders=[0.5, 2.0]), "orders"),
        (dict(orders=[2.0, math.inf]), "orders"),
        (dict(orders=[2.0, math.nan]), "orders"),
        (dict(pld_discretization=0.0), "pld_discretization"),
        (dict(pld_discretization=math.nan), "pld_discretization"),
        (dict(pld_discretization=5.0), "pld_discretization"),
    ],
)
def test_accountant_constructor_rejects(kw, parameter):
    with pytest.raises(ParameterError) as err:
        HiddenStateAccountant(**kw)
    assert err.value.parameter == parameter


@pytest.mark.parametrize("delta", [-1e-5, math.nan, math.inf, 2.0])
def test_get_epsilon_rejects_delta(delta):
    with pytest.raises(ParameterError, match="target_delta"):
        HiddenStateAccountant().compose(run()).get_epsilon(delta)


def test_delta_zero_and_one_and_infinite_epsilon_follow_dp_accounting():
    """dp_accounting's accountants: epsilon(delta=0) is the pure-DP epsilon (inf for a Gaussian),
    epsilon(delta=1) = 0, delta(eps=inf) = 0."""
    acc = HiddenStateAccountant().compose(run())
    assert acc.get_epsilon(0.0) == math.inf and acc.get_epsilon(1.0) == 0.0
    assert acc.get_delta(math.inf) == 0.0


@pytest.mark.parametrize("eps", [-1.0, math.nan])
def test_get_delta_rejects_epsilon(eps):
    with pytest.raises(ParameterError, match="target_epsilon"):
        HiddenStateAccountant().compose(run()).get_delta(eps)


@pytest.mark.parametrize(
    "kw",
    [
        dict(steps=10**18),
        dict(noise_multiplier=1e-12),
        dict(noise_multiplier=1e12),
        dict(clip_norm=1e-300),
        dict(clip_norm=1e300),
        dict(learning_rate=1e-300),
        dict(dataset_size=10**12, batch_size=10**6),
    ],
)
@pytest.mark.parametrize("sampling", ["cyclic", "without_replacement", "full"])
def test_extreme_but_valid_runs_give_valid_bounds(kw, sampling):
    r = run(
        sampling=sampling,
        **({"batch_size": kw.get("dataset_size", RUN["dataset_size"])} if sampling == "full" else {}),
        **{k: v for k, v in kw.items() if not (sampling == "full" and k == "batch_size")},
    )
    acc = HiddenStateAccountant(orders=(1.5, 2.0, 32.0, 1e6))
    eps = acc.compose(r).get_epsilon(1e-9)
    assert not math.isnan(eps) and eps >= 0
    assert not np.any(np.isnan(acc.get_rdp()))


def test_calibration_and_budget_reject_bad_targets():
    for target in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ParameterError, match="target_epsilon"):
            calibrate_noise_multiplier(run(), target, 1e-5)
        with pytest.raises(ParameterError, match="target_epsilon"):
            max_epochs_within_budget(run(), target, 1e-5)
    with pytest.raises(ParameterError, match="max_epochs"):
        max_epochs_within_budget(run(), 1.0, 1e-5, max_epochs=0)


@pytest.mark.parametrize(
    "kw,parameter",
    [
        (dict(repetitions=-5), "repetitions"),
        (dict(repetitions=math.nan), "repetitions"),
        (dict(delta=math.nan), "delta"),
        (dict(confidence=0.0), "confidence"),
    ],
)
def test_audit_rejects(kw, parameter):
    with pytest.raises(ParameterError) as err:
        audit(run(), **kw)
    assert err.value.parameter == parameter


CLI = [
    "--dataset-size",
    "1000",
    "--batch-size",
    "50",
    "--steps",
    "200",
    "--noise-multiplier",
    "1",
    "--clip-norm",
    "1",
    "--learning-rate",
    "0.1",
    "--sampling",
    "cyclic",
    "--strong-convexity",
    "0.1",
    "--smoothness",
    "1",
    "--delta",
    "1e-5",
]


@pytest.mark.parametrize(
    "flag",
    [
        "--dataset-size",
        "--batch-size",
        "--steps",
        "--noise-multiplier",
        "--clip-norm",
        "--learning-rate",
        "--strong-convexity",
        "--smoothness",
        "--delta",
    ],
)
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "x", "1e400"])
def test_cli_rejects_with_one_line_naming_the_flag(capsys, flag, value):
    argv = list(CLI)
    argv[argv.index(flag) + 1] = value
    try:
        code = main(["epsilon", *argv])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    if flag == "--strong-convexity" and value == "0":
        assert code == 0  # convex only: a valid declaration
        return
    assert code == 2 and len(err.strip().splitlines()) == 1 and flag in err, err


def test_cli_extreme_but_valid(capsys):
    argv = list(CLI)
    argv[argv.index("--steps") + 1] = str(10**15)
    argv[argv.index("--noise-multiplier") + 1] = "1e-9"
    assert main(["epsilon", *argv, "--json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    assert data["epsilon"] is None or data["epsilon"] >= 0  # inf is reported as null in JSON


def test_tf_adapter_entry_points():
    pytest.importorskip("tensorflow")
    from hidden_state_accountants import tf_privacy as tfp

    x, y = np.zeros((100, 3), np.float32), np.zeros(100, np.int64)
    for kw, parameter in [
        (dict(batch_size=0), "batch_size"),
        (dict(batch_size=200), "batch_size"),
        (dict(sampling="poisson"), "sampling"),
        (dict(seed=-1), "seed"),
    ]:
        args = dict(batch_size=10, sampling="cyclic", seed=0) | kw
        with pytest.raises(ParameterError) as err:
            tfp.batched_dataset(x, y, **args)
        assert err.value.parameter == parameter
    for value in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ParameterError, match="radius"):
            tfp.L2BallProjection(value)
        with pytest.raises(ParameterError, match="l2_regularization"):
            tfp.DecoupledL2DPKerasSGDOptimizer(
                l2_norm_clip=1.0, noise_multiplier=1.0, l2_regularization=-1.0 if value == 0 else value
            )
        with pytest.raises(ParameterError, match="delta"):
            tfp.HiddenStatePrivacyCallback(
                geometry=None, sampling="cyclic", dataset_size=100, batch_size=10, delta=value
            )
    with pytest.raises(ParameterError, match="num_epochs"):
        tfp.compute_hidden_state_privacy_statement(
            100, 10, math.nan, 1.0, 1e-5, l2_norm_clip=1.0, learning_rate=0.1, sampling="cyclic", geometry=None
        )
    text = tfp.compute_hidden_state_privacy_statement(
        100,
        10,
        10**9,
        1e-6,
        1e-5,
        l2_norm_clip=1.0,
        learning_rate=0.1,
        sampling="cyclic",
        geometry=LossGeometry(strong_convexity=0.1, smoothness=1.0),
    )
    assert "nan" not in text.lower()
