"""Inputs: clear one-line errors naming the parameter; geometry constructors."""

import math

import pytest

from hidden_state_accountants import LossGeometry, ParameterError, TrainingRunDpEvent

BASE = dict(
    dataset_size=1000,
    batch_size=50,
    steps=100,
    noise_multiplier=1.0,
    clip_norm=1.0,
    learning_rate=0.1,
    sampling="cyclic",
)


@pytest.mark.parametrize(
    "field,value,fragment",
    [
        ("dataset_size", 0, "positive integer"),
        ("dataset_size", -5, "positive integer"),
        ("dataset_size", 10.5, "positive integer"),
        ("batch_size", 0, "positive integer"),
        ("batch_size", 2000, "<= dataset_size"),
        ("steps", 0, "positive integer"),
        ("noise_multiplier", 0.0, "> 0"),
        ("noise_multiplier", -1.0, "> 0"),
        ("noise_multiplier", math.nan, "finite"),
        ("noise_multiplier", math.inf, "finite"),
        ("clip_norm", 0.0, "> 0"),
        ("learning_rate", -0.1, "> 0"),
        ("learning_rate", "0.1", "finite number"),
        ("sampling", "shuffle", "must be one of"),
    ],
)
def test_bad_run_parameters_name_the_parameter(field, value, fragment):
    with pytest.raises(ParameterError) as err:
        TrainingRunDpEvent(**{**BASE, field: value})
    assert err.value.parameter == field
    assert str(err.value).startswith(field + ":")
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_schedule_rules():
    with pytest.raises(ParameterError, match="noise_multiplier: per-step schedule has 3 entries"):
        TrainingRunDpEvent(**{**BASE, "noise_multiplier": (1.0, 1.0, 2.0)})
    constant = TrainingRunDpEvent(**{**BASE, "learning_rate": [0.1] * 100})
    assert constant.learning_rate == 0.1 and constant.is_constant
    with pytest.raises(ParameterError, match="learning_rate"):
        TrainingRunDpEvent(**{**BASE, "learning_rate": [0.1] * 99 + [0.0]})


def test_schedule_specific_rules():
    with pytest.raises(ParameterError, match="batch_size: must equal dataset_size"):
        TrainingRunDpEvent(**{**BASE, "sampling": "full"})
    with pytest.raises(ParameterError, match="batch_size: cyclic needs at least two batches"):
        TrainingRunDpEvent(**{**BASE, "batch_size": 600})
    # sampling without replacement may use more than half the data per step
    TrainingRunDpEvent(**{**BASE, "batch_size": 600, "sampling": "without_replacement"})


@pytest.mark.parametrize(
    "kw,parameter",
    [
        (dict(smoothness=0.0), "smoothness"),
        (dict(smoothness=-1.0), "smoothness"),
        (dict(smoothness=1.0, strong_convexity=2.0), "strong_convexity"),
        (dict(smoothness=1.0, strong_convexity=-0.1), "strong_convexity"),
        (dict(smoothness=1.0, diameter=0.0), "diameter"),
        (dict(smoothness=1.0, diameter=math.inf), "diameter"),
        (dict(smoothness=math.nan), "smoothness"),
        (dict(smoothness=1.0, lsi_constant=-1.0), "lsi_constant"),
    ],
)
def test_bad_geometry(kw, parameter):
    with pytest.raises(ParameterError) as err:
        LossGeometry(**kw)
    assert err.value.parameter == parameter


def test_learning_rate_must_make_steps_contractive():
    with pytest.raises(ParameterError, match=r"learning_rate: must be < 2/smoothness = 0.5"):
        TrainingRunDpEvent(**{**BASE, "learning_rate": 0.5, "geometry": LossGeometry(smoothness=4.0)})


def test_logistic_regression_geometry_ye_shokri_prop_5_2():
    g = LossGeometry.logistic_regression(feature_norm_bound=3.0, l2_regularization=0.01, diameter=2.0)
    assert g.smoothness == pytest.approx((9 + 1) / 2 + 0.01)
    assert g.strong_convexity == 0.01 and g.diameter == 2.0
    assert g.contraction_factor(0.1) == pytest.approx(max(abs(1 - 0.001), abs(1 - 0.1 * 5.01)))


def test_from_epochs_and_epoch_arithmetic():
    run = TrainingRunDpEvent.from_epochs(**{k: v for k, v in BASE.items() if k != "steps"}, epochs=3)
    assert run.steps == 60 and run.steps_per_epoch == 20 and run.epochs == 3
    odd = TrainingRunDpEvent.from_epochs(
        **{**{k: v for k, v in BASE.items() if k != "steps"}, "dataset_size": 1049}, epochs=2
    )
    assert odd.steps_per_epoch == 20  # the remainder of 49 records is dropped each epoch
    with pytest.raises(ParameterError, match="epochs"):
        TrainingRunDpEvent.from_epochs(**{k: v for k, v in BASE.items() if k != "steps"}, epochs=0.01)
    full = TrainingRunDpEvent.from_epochs(
        **{**{k: v for k, v in BASE.items() if k != "steps"}, "batch_size": 1000, "sampling": "full"}, epochs=7
    )
    assert full.steps == 7


def test_events_are_hashable_and_comparable_for_the_ledger():
    a = TrainingRunDpEvent(**BASE)
    assert a == TrainingRunDpEvent(**BASE) and hash(a) == hash(TrainingRunDpEvent(**BASE))
    assert a != a.replace(steps=101)
