"""compute_hidden_state_privacy_statement: readable text that carries the core's numbers."""

import warnings

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("tensorflow_privacy")
pytestmark = pytest.mark.tf

from hidden_state_accountants import (  # noqa: E402
    HiddenStateAccountant,
    LossGeometry,
    ParameterError,
    TrainingRunDpEvent,
)
from hidden_state_accountants.tf_privacy import compute_hidden_state_privacy_statement  # noqa: E402

GEOMETRY = LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=0.01)
ARGS = dict(number_of_examples=1437, batch_size=64, num_epochs=30, noise_multiplier=2.0, delta=1e-5)


def _flat(text):
    return " ".join(text.split())  # independent of line wrapping


def _report(geometry, sampling="shuffle_partition", epochs=30, lr=0.5):
    run = TrainingRunDpEvent.from_epochs(
        dataset_size=1437,
        batch_size=64,
        epochs=epochs,
        noise_multiplier=2.0,
        clip_norm=1.0,
        learning_rate=lr,
        sampling=sampling,
        geometry=geometry,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return HiddenStateAccountant().compose(run).explain(1e-5)


def test_statement_carries_the_numbers():
    text = compute_hidden_state_privacy_statement(
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
        text = compute_hidden_state_privacy_statement(
            **ARGS, l2_norm_clip=1.0, learning_rate=0.5, sampling="cyclic", geometry=None
        )
    report = _report(None, "cyclic")
    assert "No loss geometry was declared" in _flat(text)
    assert "all model checkpoints" in _flat(text)
    assert "only the final model" not in _flat(text)
    assert f"released: {report.epsilon:.3f} (composition)" in _flat(text)


def test_statement_says_when_no_hidden_state_analysis_applies():
    lrs = tuple(0.5 * 0.99**i for i in range(660))  # a decaying rate: composition only
    text = compute_hidden_state_privacy_statement(
        **ARGS, l2_norm_clip=1.0, learning_rate=lrs, sampling="cyclic", geometry=GEOMETRY
    )
    assert "learning-rate schedule from 0.5" in _flat(text)
    # the core's reason, as the callback's statement states it for the same run
    assert (
        "No hidden-state claim is made for this run: the learning rate changed during training; the "
        "hidden-state theorems assume it constant."
    ) in _flat(text)
    assert "only the final model" not in _flat(text) and "all model checkpoints" in _flat(text)


def test_statement_says_what_it_could_not_check():
    # the function sees no model: its statement says the convexity is the user's assertion
    text = compute_hidden_state_privacy_statement(
        **ARGS, l2_norm_clip=1.0, learning_rate=0.5, sampling="cyclic", geometry=GEOMETRY
    )
    assert "Note: the model structure was not verified" in _flat(text)
    text = compute_hidden_state_privacy_statement(
        **ARGS, l2_norm_clip=1.0, learning_rate=0.5, sampling="cyclic", geometry=None
    )
    assert "Note:" not in text  # no claim rests on the model


def test_statement_can_include_every_analysis():
    text = compute_hidden_state_privacy_statement(
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
        compute_hidden_state_privacy_statement(**kwargs)
    assert err.value.parameter == parameter
