"""privacy_statement: readable text that carries the core's numbers (the TF-Privacy adapter's
``compute_hidden_state_privacy_statement`` is this text under TF-Privacy's rules: tests/tf/test_tf_statement.py)."""

import warnings

import pytest

from hidden_state_accountants import (
    HiddenStateAccountant,
    LossGeometry,
    ParameterError,
    TrainingRunDpEvent,
)
from hidden_state_accountants.calibration import run_differences
from hidden_state_accountants.relations import ADD_OR_REMOVE_ONE, REPLACE_ONE
from hidden_state_accountants.statement import privacy_statement

GEOMETRY = LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=0.01, num_classes=2)
ARGS = dict(number_of_examples=1437, batch_size=64, num_epochs=30, noise_multiplier=2.0, delta=1e-5)


def _flat(text):
    return " ".join(text.split())  # independent of line wrapping


def _report(geometry, sampling="shuffle_partition", epochs=30, lr=0.5, relation=REPLACE_ONE, **event):
    """The accountant's report for the run the statement describes."""
    run = TrainingRunDpEvent.from_epochs(
        dataset_size=1437,
        batch_size=64,
        epochs=epochs,
        noise_multiplier=2.0,
        clip_norm=1.0,
        learning_rate=lr,
        sampling=sampling,
        geometry=geometry,
        **event,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return HiddenStateAccountant(neighboring_relation=relation).compose(run).explain(1e-5)


def test_statement_carries_the_numbers():
    text = privacy_statement(
        **ARGS, l2_norm_clip=1.0, learning_rate=0.5, sampling="shuffle_partition", geometry=GEOMETRY
    )
    report = _report(GEOMETRY)
    composition = min(a.epsilon for a in report.analyses if not a.hidden_state and a.epsilon is not None)
    assert report.epsilon < composition
    for piece in [
        "1437 examples",
        "64 examples per iteration",
        "noise multiplier 2",
        "l2_norm_clip 1",
        "constant learning rate 0.5",
        "30 epochs (660 steps)",
        "29 examples left over",
        "'shuffle_partition'",
        "0.01-strongly convex",
        "1.01-smooth",
        "delta = 1e-05",
        "REPLACE_ONE",
        f"released: {report.epsilon:.3f} ({report.analysis})",
        f"released: {composition:.3f} (composition)",
        "only the final model is released",
        "never published",
        "not covered by either number",
    ]:
        assert piece in _flat(text), piece
    assert all(len(line) <= 100 for line in text.splitlines())


def test_statement_without_geometry_claims_composition_only():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the text says it; no stray warning
        text = privacy_statement(**ARGS, l2_norm_clip=1.0, learning_rate=0.5, sampling="cyclic", geometry=None)
    report = _report(None, "cyclic")
    assert "No loss geometry was declared" in _flat(text)
    assert "all model checkpoints" in _flat(text)
    assert "only the final model" not in _flat(text)
    assert f"released: {report.epsilon:.3f} (composition)" in _flat(text)


def test_statement_says_when_no_hidden_state_analysis_applies():
    lrs = tuple(0.5 * 0.99**i for i in range(660))  # a decaying rate: composition only
    text = privacy_statement(**ARGS, l2_norm_clip=1.0, learning_rate=lrs, sampling="cyclic", geometry=GEOMETRY)
    assert "learning-rate schedule from 0.5" in _flat(text)
    # the core's reason, as the callback's statement states it for the same run
    assert (
        "No hidden-state claim is made for this run: the learning rate changed during training; the "
        "hidden-state theorems assume it constant."
    ) in _flat(text)
    assert "only the final model" not in _flat(text) and "all model checkpoints" in _flat(text)


def test_statement_says_what_it_could_not_check():
    # the function sees no model: its statement says the convexity is the user's assertion
    text = privacy_statement(**ARGS, l2_norm_clip=1.0, learning_rate=0.5, sampling="cyclic", geometry=GEOMETRY)
    assert "Note: the model structure was not verified" in _flat(text)
    text = privacy_statement(**ARGS, l2_norm_clip=1.0, learning_rate=0.5, sampling="cyclic", geometry=None)
    assert "Note:" not in text  # no claim rests on the model


def test_statement_can_include_every_analysis():
    text = privacy_statement(
        **ARGS, l2_norm_clip=1.0, learning_rate=0.5, sampling="cyclic", geometry=GEOMETRY, include_analyses=True
    )
    for name in ("bok_thm4.4", "bok_thm4.5", "ye_shokri_thm3.3"):
        assert name in text


@pytest.mark.parametrize(
    "changes, parameter",
    [
        (dict(num_epochs=0.3), "num_epochs"),  # 6.6 steps: not whole
        (dict(learning_rate=2.5), "learning_rate"),  # >= 2/M
        (dict(sampling="reshufle"), "sampling"),
        (dict(batch_size=2000), "batch_size"),
        (dict(learning_rate=[0.5] * 3), "learning_rate"),  # 3 values for 660 steps
    ],
)
def test_bad_statement_arguments(changes, parameter):
    kwargs = dict(ARGS, l2_norm_clip=1.0, learning_rate=0.5, sampling="cyclic", geometry=GEOMETRY)
    kwargs.update(changes)
    with pytest.raises(ParameterError) as err:
        privacy_statement(**kwargs)
    assert err.value.parameter == parameter


def test_statement_under_add_or_remove_carries_that_relations_numbers():
    # Poisson sampling is covered under ADD_OR_REMOVE_ONE; the text names the relation it reports
    args = dict(ARGS, l2_norm_clip=1.0, learning_rate=0.5, sampling="poisson", geometry=GEOMETRY)
    text = _flat(privacy_statement(**args, neighboring_relation=ADD_OR_REMOVE_ONE))
    # the statement takes the geometry's strong convexity as the L2 term
    report = _report(GEOMETRY, "poisson", relation=ADD_OR_REMOVE_ONE, l2_regularization=0.01)
    replace_one = _report(GEOMETRY, "poisson", l2_regularization=0.01).epsilon
    assert "add/remove-one adjacency (ADD_OR_REMOVE_ONE)" in text
    assert f"released: {report.epsilon:.3f} ({report.analysis})" in text
    assert report.analysis == "si_poisson" and f"{report.epsilon:.3f}" != f"{replace_one:.3f}"
    assert "replace-one" not in _flat(privacy_statement(**args, neighboring_relation=ADD_OR_REMOVE_ONE))


def test_host_paragraphs_come_last():
    args = dict(ARGS, l2_norm_clip=1.0, learning_rate=0.5, sampling="cyclic", geometry=GEOMETRY)
    plain = privacy_statement(**args)
    text = privacy_statement(**args, host_paragraphs=["The host's own number does not apply."])
    assert text == plain.rstrip("\n") + "\n\nThe host's own number does not apply.\n"
    assert "TF-Privacy" not in plain  # the core's text names no framework


def test_run_differences_names_each_field_and_allows_more_noise():
    run = TrainingRunDpEvent(
        dataset_size=100,
        batch_size=10,
        steps=10,
        noise_multiplier=1.0,
        clip_norm=1.0,
        learning_rate=0.1,
        sampling="cyclic",
    )
    assert run_differences(run, run) == []
    assert run_differences(run.replace(noise_multiplier=1.5), run) == []  # more noise than calibrated
    assert run_differences(run.replace(noise_multiplier=0.9), run) == ["noise_multiplier 0.9 (calibrated: 1.0)"]
    assert run_differences(run.replace(steps=20, clip_norm=2.0), run) == [
        "steps 20 (calibrated: 10)",
        "clip_norm 2.0 (calibrated: 1.0)",
    ]


@pytest.mark.parametrize(
    "last_batch, divided", [("kept_own_size", "divided by its own size"), ("kept_batch_size", "divided by 64")]
)
def test_a_kept_short_batch_is_divided_as_the_host_divides_it(last_batch, divided):
    # TF-Privacy divides the short batch by its own size, Opacus by b: each is its own run
    args = dict(ARGS, l2_norm_clip=1.0, learning_rate=0.5, sampling="reshuffle", geometry=GEOMETRY)
    text = _flat(privacy_statement(**args, last_batch=last_batch))
    report = _report(GEOMETRY, "reshuffle", last_batch=last_batch)
    assert f"short last batch of the 29 examples left over (1437 mod 64) every epoch, {divided}" in text
    assert "30 epochs (690 steps)" in text
    assert f"released: {report.epsilon:.3f} ({report.analysis})" in text


def test_a_relation_other_than_the_hosts_default_is_explained():
    # a fixed-size schedule is not covered under a host's ADD_OR_REMOVE_ONE: reported under REPLACE_ONE, saying why
    args = dict(ARGS, l2_norm_clip=1.0, learning_rate=0.5, sampling="shuffle_partition", geometry=GEOMETRY)
    text = _flat(privacy_statement(**args, neighboring_relation=ADD_OR_REMOVE_ONE))
    assert "replace-one adjacency (REPLACE_ONE)" in text
    assert "Note: reported under REPLACE_ONE, not the host's ADD_OR_REMOVE_ONE: the shuffle_partition schedule" in text
    assert f"released: {_report(GEOMETRY).epsilon:.3f}" in text
    assert "not the host's" not in _flat(privacy_statement(**args))  # REPLACE_ONE is the default: nothing to explain
