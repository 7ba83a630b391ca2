"""compute_hidden_state_privacy_statement: the core's statement (tests/core/test_statement.py) under
TF-Privacy's rules: every batch divided by its own size, REPLACE_ONE, and what TF-Privacy's own
statement says that does not apply."""

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("tensorflow_privacy")
pytestmark = pytest.mark.tf

from hidden_state_accountants import LossGeometry, ParameterError  # noqa: E402
from hidden_state_accountants.statement import privacy_statement  # noqa: E402
from hidden_state_accountants.tf_privacy import compute_hidden_state_privacy_statement  # noqa: E402

GEOMETRY = LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=0.01, num_classes=2)
ARGS = dict(number_of_examples=1437, batch_size=64, num_epochs=30, noise_multiplier=2.0, delta=1e-5)
SETTINGS = dict(l2_norm_clip=1.0, learning_rate=0.5, geometry=GEOMETRY)
TF_PARAGRAPH = "TF-Privacy's 'assuming Poisson sampling' epsilon does not apply: batches were not Poisson sampled."


@pytest.mark.parametrize("last_batch", ["dropped", "kept_own_size"])
def test_statement_is_the_cores_under_replace_one_with_tf_privacys_paragraph(last_batch):
    args = dict(ARGS, **SETTINGS, sampling="reshuffle", last_batch=last_batch)
    text = compute_hidden_state_privacy_statement(**args)
    core = privacy_statement(**args)  # REPLACE_ONE by default
    assert text.startswith(core.rstrip("\n") + "\n\n") and " ".join(text[len(core) :].split()) == TF_PARAGRAPH
    assert "replace-one adjacency (REPLACE_ONE)" in " ".join(text.split())


def test_tf_privacys_rule_on_the_short_batch():
    # TF-Privacy divides every batch by its own size: a short batch divided by b is not its run
    with pytest.raises(ParameterError) as err:
        compute_hidden_state_privacy_statement(**ARGS, **SETTINGS, sampling="reshuffle", last_batch="kept_batch_size")
    assert err.value.parameter == "last_batch" and "own size" in err.value.reason
    assert "own size" not in privacy_statement(**ARGS, **SETTINGS, sampling="reshuffle", last_batch="kept_batch_size")
