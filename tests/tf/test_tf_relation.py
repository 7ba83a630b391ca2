"""Issue 12: the TF-Privacy adapter's numbers are REPLACE_ONE and its statement says so."""

import warnings

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("tensorflow_privacy")
pytestmark = pytest.mark.tf

from hidden_state_accountants import HiddenStateAccountant, LossGeometry, TrainingRunDpEvent  # noqa: E402
from hidden_state_accountants.tf_privacy import compute_hidden_state_privacy_statement  # noqa: E402


def test_statement_is_replace_one_and_names_it():
    geometry = LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=0.01, num_classes=2)
    text = compute_hidden_state_privacy_statement(
        number_of_examples=1437,
        batch_size=64,
        num_epochs=30,
        noise_multiplier=2.0,
        delta=1e-5,
        l2_norm_clip=1.0,
        learning_rate=0.5,
        sampling="shuffle_partition",
        geometry=geometry,
    )
    flat = " ".join(text.split())
    assert "replace-one adjacency (REPLACE_ONE)" in flat
    run = TrainingRunDpEvent.from_epochs(
        dataset_size=1437,
        batch_size=64,
        epochs=30,
        noise_multiplier=2.0,
        clip_norm=1.0,
        learning_rate=0.5,
        sampling="shuffle_partition",
        geometry=geometry,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        r1 = HiddenStateAccountant(neighboring_relation="REPLACE_ONE").compose(run).explain(1e-5)
    assert f"{r1.epsilon:12.3f}".strip() in flat
