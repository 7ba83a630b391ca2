"""ADD_OR_REMOVE_ONE as a first-class parameter (docs/derivations.md section 11).

Composition baselines under add/remove equal dp_accounting's own PLD / RDP accountants with that
relation; the schedules whose samplers place records by position are refused with the reason;
reports, JSON and the CLI name the relation.
"""

import json
import math
import warnings

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.privacy_accountant import NeighboringRelation as NR
from dp_accounting.rdp import rdp_privacy_accountant
from hypothesis import example, given, settings, strategies as st

from hidden_state_accountants import HiddenStateAccountant, LossGeometry, ParameterError, TrainingRunDpEvent
from hidden_state_accountants.cli import main
from hidden_state_accountants.relations import ADD_REMOVE_UNSUPPORTED

AR = "ADD_OR_REMOVE_ONE"


def poisson_run(q=0.01, z=1.0, steps=200, n=60000, **kw):
    b = int(round(q * n))
    return TrainingRunDpEvent(
        dataset_size=n,
        batch_size=b,
        steps=steps,
        noise_multiplier=z,
        clip_norm=1.0,
        learning_rate=0.1,
        sampling="poisson",
        sampling_probability=q,
        **kw,
    )


def quiet(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


def report_of(run, relation=AR, delta=1e-5):
    return quiet(lambda: HiddenStateAccountant(neighboring_relation=relation).compose(run).explain(delta))


def rows(report):
    return {a.name: a for a in report.analyses}


@settings(max_examples=8, deadline=None)
@given(
    q=st.sampled_from([0.004, 0.01, 0.05]),
    z=st.sampled_from([0.8, 1.0, 2.0]),
    steps=st.sampled_from([1, 10, 300]),
    delta=st.sampled_from([1e-3, 1e-5, 1e-7]),
)
@example(q=0.004, z=0.8, steps=1, delta=1e-7)  # one step: dp_accounting's self_compose(1) truncates tails too
def test_poisson_composition_equals_dp_accounting(q, z, steps, delta):
    report = report_of(poisson_run(q, z, steps), delta=delta)
    event = dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)), steps)
    pld = pld_privacy_accountant.PLDAccountant(NR.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-3)
    rdp = rdp_privacy_accountant.RdpAccountant(HiddenStateAccountant()._ctx.orders, NR.ADD_OR_REMOVE_ONE)
    r = rows(report)
    # the same PLD computation; FFT round-off differs between numpy builds by ~1e-9 relative
    assert r["composition_poisson_pld"].epsilon == pytest.approx(pld.compose(event).get_epsilon(delta), rel=1e-7)
    assert r["composition_poisson_rdp"].epsilon == pytest.approx(rdp.compose(event).get_epsilon(delta), rel=1e-9)
    assert report.neighboring_relation == AR


def test_standard_events_under_add_remove():
    orders = HiddenStateAccountant()._ctx.orders
    # Gaussian: G(1/z), exact; dp_accounting's PLD is above it by its discretisation only
    acc = HiddenStateAccountant(neighboring_relation=NR.ADD_OR_REMOVE_ONE).compose(dp_event.GaussianDpEvent(2.0), 5)
    ref = pld_privacy_accountant.PLDAccountant(NR.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4)
    ref.compose(dp_event.GaussianDpEvent(2.0), 5)
    assert acc.get_epsilon(1e-5) == pytest.approx(ref.get_epsilon(1e-5), abs=1e-3)
    assert acc.get_epsilon(1e-5) < 0.6 * HiddenStateAccountant().compose(dp_event.GaussianDpEvent(2.0), 5).get_epsilon(
        1e-5
    )
    # a Poisson event composed several times: dp_accounting's RDP curve exactly
    ev = dp_event.PoissonSampledDpEvent(0.02, dp_event.GaussianDpEvent(1.1))
    acc = HiddenStateAccountant(neighboring_relation=AR).compose(ev, 50)
    rdp = rdp_privacy_accountant.RdpAccountant(orders, NR.ADD_OR_REMOVE_ONE).compose(ev, 50)
    np.testing.assert_allclose(acc.get_rdp(), rdp._rdp, rtol=1e-12)
    # sampling without replacement: no add/remove statement (as in dp_accounting)
    acc = HiddenStateAccountant(neighboring_relation=AR)
    wor = dp_event.SampledWithoutReplacementDpEvent(100, 10, dp_event.GaussianDpEvent(1.0))
    assert not acc.supports(wor)
    assert HiddenStateAccountant().supports(wor)


def test_full_batch_composition_is_the_gaussian_with_sensitivity_c():
    run = TrainingRunDpEvent(
        dataset_size=1000,
        batch_size=1000,
        steps=40,
        noise_multiplier=3.0,
        clip_norm=2.0,
        learning_rate=0.1,
        sampling="full",
    )
    r = rows(report_of(run))
    orders = HiddenStateAccountant()._ctx.orders
    ref = rdp_privacy_accountant.RdpAccountant(orders, NR.ADD_OR_REMOVE_ONE)
    ref.compose(dp_event.GaussianDpEvent(3.0), 40)
    acc = quiet(lambda: HiddenStateAccountant(neighboring_relation=AR).compose(run))
    np.testing.assert_allclose(acc.get_rdp(), ref._rdp, rtol=1e-12)
    assert "mu = 2.10819" in r["bok_thm4.1"].detail  # sqrt(40)/3
    replace = rows(report_of(run, "REPLACE_ONE"))
    assert "mu = 4.21637" in replace["bok_thm4.1"].detail


def test_full_batch_hidden_state_halves_mu_and_checks_the_larger_batch():
    geom = LossGeometry(smoothness=1.0, strong_convexity=0.5)
    run = TrainingRunDpEvent(
        dataset_size=100,
        batch_size=100,
        steps=50,
        noise_multiplier=5.0,
        clip_norm=1.0,
        learning_rate=0.5,
        sampling="full",
        geometry=geom,
        l2_regularization=0.0,
    )
    a, r = rows(report_of(run)), rows(report_of(run, "REPLACE_ONE"))
    mu_a = float(a["bok_thm4.2"].detail.split("mu = ")[1].split(";")[0])
    mu_r = float(r["bok_thm4.2"].detail.split("mu = ")[1].split(";")[0])
    assert mu_a == pytest.approx(mu_r / 2, rel=1e-5)
    # n = 10, lr = 1.95/M: fine for D, but the batch of D' (11 records over divisor 10) is 1.1 M-smooth
    run = TrainingRunDpEvent(
        dataset_size=10,
        batch_size=10,
        steps=50,
        noise_multiplier=5.0,
        clip_norm=1.0,
        learning_rate=1.95,
        sampling="full",
        geometry=geom,
        l2_regularization=0.0,
    )
    a = rows(report_of(run))
    assert a["bok_thm4.2"].epsilon is None and "one record more than the divisor" in a["bok_thm4.2"].reason
    assert rows(report_of(run, "REPLACE_ONE"))["bok_thm4.2"].epsilon is not None
    assert a["bok_thm4.1"].epsilon is not None  # composition does not depend on the geometry


@pytest.mark.parametrize("sampling", ["cyclic", "shuffle_partition", "reshuffle", "without_replacement"])
def test_position_samplers_are_not_covered_under_add_remove(sampling):
    geom = LossGeometry(smoothness=1.0, strong_convexity=0.1, diameter=5.0)
    run = TrainingRunDpEvent(
        dataset_size=100,
        batch_size=10,
        steps=30,
        noise_multiplier=2.0,
        clip_norm=1.0,
        learning_rate=0.5,
        sampling=sampling,
        geometry=geom,
    )
    report = report_of(run)
    assert report.epsilon == math.inf
    applicable_here = [a for a in report.analyses if not a.reason or not a.reason.startswith("applies to")]
    assert applicable_here and all(a.reason == ADD_REMOVE_UNSUPPORTED[sampling] for a in applicable_here)
    assert report.to_dict()["neighboring_relation"] == AR
    assert math.isfinite(report_of(run, "REPLACE_ONE").epsilon)


def test_report_names_the_relation():
    run = poisson_run(steps=10)
    for rel in ("REPLACE_ONE", AR):
        report = report_of(run, rel)
        assert report.to_dict()["neighboring_relation"] == rel
        assert f"({rel})" in report.to_table()
        assert any(rel in n for n in report.notes)
    assert report_of(run).epsilon < report_of(run, "REPLACE_ONE").epsilon


@pytest.mark.parametrize("bad", ["replace", NR.REPLACE_SPECIAL, 2])
def test_bad_relation(bad):
    with pytest.raises(ParameterError, match="neighboring_relation"):
        HiddenStateAccountant(neighboring_relation=bad)


CLI_RUN = [
    "--dataset-size",
    "60000",
    "--batch-size",
    "600",
    "--epochs",
    "1",
    "--noise-multiplier",
    "1",
    "--clip-norm",
    "1",
    "--learning-rate",
    "0.1",
    "--sampling",
    "poisson",
    "--delta",
    "1e-5",
]


def run_cli(capsys, args):
    try:
        code = main(args)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("relation", ["replace_one", "add_or_remove_one"])
def test_cli_flag_and_json_field(capsys, relation):
    code, out, _ = run_cli(capsys, ["epsilon", *CLI_RUN, "--neighboring-relation", relation, "--json"])
    assert code == 0
    data = json.loads(out)
    assert data["neighboring_relation"] == relation.upper()
    expected = report_of(poisson_run(steps=100, n=60000), relation.upper()).epsilon
    assert data["epsilon"] == pytest.approx(expected, rel=1e-9)
    code, out, _ = run_cli(
        capsys,
        [
            "epochs",
            "--dataset-size",
            "60000",
            "--batch-size",
            "600",
            "--noise-multiplier",
            "1",
            "--clip-norm",
            "1",
            "--learning-rate",
            "0.1",
            "--sampling",
            "poisson",
            "--delta",
            "1e-5",
            "--target-epsilon",
            "2",
            "--max-epochs",
            "50",
            "--neighboring-relation",
            relation,
            "--json",
        ],
    )
    assert code == 0 and json.loads(out)["neighboring_relation"] == relation.upper()


def test_cli_noise_under_add_remove_needs_less_noise(capsys):
    base = [
        "noise",
        "--dataset-size",
        "60000",
        "--batch-size",
        "600",
        "--epochs",
        "1",
        "--clip-norm",
        "1",
        "--learning-rate",
        "0.1",
        "--sampling",
        "poisson",
        "--delta",
        "1e-5",
        "--target-epsilon",
        "1",
        "--json",
    ]
    code, out, _ = run_cli(capsys, base + ["--neighboring-relation", "add_or_remove_one"])
    ar = json.loads(out)
    code2, out, _ = run_cli(capsys, base)
    r1 = json.loads(out)
    assert code == code2 == 0
    assert ar["neighboring_relation"] == AR and r1["neighboring_relation"] == "REPLACE_ONE"
    assert ar["noise_multiplier"] < r1["noise_multiplier"]
    assert ar["epsilon"] <= 1.0


def test_cli_audit_refuses_add_remove(capsys):
    code, _, err = run_cli(
        capsys,
        [
            "audit",
            "--dataset-size",
            "100",
            "--batch-size",
            "100",
            "--epochs",
            "1",
            "--noise-multiplier",
            "1",
            "--clip-norm",
            "1",
            "--learning-rate",
            "0.5",
            "--sampling",
            "full",
            "--smoothness",
            "1",
            "--strong-convexity",
            "0.1",
            "--delta",
            "1e-5",
            "--neighboring-relation",
            "add_or_remove_one",
        ],
    )
    assert code == 2 and "--neighboring-relation" in err


def test_calibration_follows_the_relation():
    """Calibration uses only the analyses proved for the relation (it used to call every analysis of
    the schedule directly, which under ADD_OR_REMOVE_ONE would have used replace-one theorems)."""
    from hidden_state_accountants import calibrate_noise_multiplier

    geom = LossGeometry(smoothness=1.01, strong_convexity=0.01)
    run = TrainingRunDpEvent(
        dataset_size=6000,
        batch_size=60,
        steps=100,
        noise_multiplier=1.0,
        clip_norm=1.0,
        learning_rate=0.05,
        sampling="cyclic",
        geometry=geom,
    )
    with pytest.raises(ParameterError, match="neighboring_relation.*not covered under ADD_OR_REMOVE_ONE"):
        calibrate_noise_multiplier(run, 2.0, 1e-5, neighboring_relation=AR)
    full = TrainingRunDpEvent(
        dataset_size=1000,
        batch_size=1000,
        steps=100,
        noise_multiplier=1.0,
        clip_norm=1.0,
        learning_rate=0.05,
        sampling="full",
    )
    ar = quiet(lambda: calibrate_noise_multiplier(full, 2.0, 1e-5, neighboring_relation=AR))
    r1 = quiet(lambda: calibrate_noise_multiplier(full, 2.0, 1e-5))
    assert ar.noise_multiplier == pytest.approx(r1.noise_multiplier / 2, rel=2e-3)  # sensitivity C vs 2C
