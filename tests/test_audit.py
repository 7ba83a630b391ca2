"""Issue 6: empirical audits never exceed the reported epsilon, on every schedule and geometry."""

import json

import pytest

from hidden_state_accountants import LossGeometry, ParameterError, TrainingRunDpEvent
from hidden_state_accountants.audit import audit
from hidden_state_accountants.cli import main
from hidden_state_accountants.exact import exact_pair

SAMPLINGS = ["full", "cyclic", "shuffle_partition", "without_replacement", "poisson"]


def make(sampling, construction, z=0.6, steps=40, lr=0.5, m=0.5, D=0.3):
    n = 60
    geometry = (LossGeometry(strong_convexity=m, smoothness=max(m, 0.5)) if construction == "strongly_convex"
                else LossGeometry(strong_convexity=0.0, smoothness=0.5, diameter=D))
    return TrainingRunDpEvent(dataset_size=n, batch_size=n if sampling == "full" else 6, steps=steps,
                              noise_multiplier=z, clip_norm=1.0, learning_rate=lr, sampling=sampling,
                              geometry=geometry)


@pytest.mark.parametrize("construction", ["strongly_convex", "constrained"])
@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("z", [0.4, 1.5])
def test_reported_epsilon_is_above_audited_lower_bound(sampling, construction, z):
    result = audit(make(sampling, construction, z=z), construction=construction, repetitions=20000, seed=1)
    assert result.consistent, result
    assert result.epsilon_lower <= result.epsilon_reported


def test_audit_has_power_where_the_truth_is_known():
    # full batch, strongly convex: Bok Thm 4.2 is exact. A threshold test on 5e4 runs cannot
    # reach delta = 1e-5 tails, so the audit recovers a good fraction of the truth, not all of it.
    run = make("full", "strongly_convex", z=6.0, steps=30)
    truth = exact_pair(run).epsilon(1e-5)
    result = audit(run, repetitions=100000, seed=3)
    assert result.epsilon_reported == pytest.approx(truth, rel=1e-6)
    assert 0.4 * truth <= result.epsilon_lower <= truth


def test_audit_detects_an_overclaimed_bound():
    # claiming 16x the noise that was used: the audit of the real run refutes the claimed epsilon
    true_run = make("full", "strongly_convex", z=0.5, steps=30)
    result = audit(true_run, repetitions=50000, seed=2)
    claimed = make("full", "strongly_convex", z=8.0, steps=30)
    from hidden_state_accountants import HiddenStateAccountant
    assert HiddenStateAccountant().compose(claimed).get_epsilon(1e-5) < result.epsilon_lower


@pytest.mark.parametrize("kwargs,parameter", [
    (dict(construction="nonsense"), "construction"),
    (dict(repetitions=10), "repetitions"),
    (dict(delta=0.0), "delta"),
    (dict(confidence=1.0), "confidence"),
])
def test_bad_audit_arguments(kwargs, parameter):
    with pytest.raises(ParameterError) as err:
        audit(make("full", "strongly_convex"), **kwargs)
    assert err.value.parameter == parameter


def test_constructions_need_the_matching_geometry():
    with pytest.raises(ParameterError, match="diameter"):
        audit(make("full", "strongly_convex"), construction="constrained")
    with pytest.raises(ParameterError, match="diameter"):
        audit(make("full", "constrained"), construction="strongly_convex")
    with pytest.raises(ParameterError, match="geometry"):
        audit(make("full", "strongly_convex").replace(geometry=None))


def test_hsa_audit_command(capsys):
    code = main(["audit", "--dataset-size", "60", "--batch-size", "6", "--steps", "40", "--noise-multiplier", "0.6",
                 "--clip-norm", "1", "--learning-rate", "0.5", "--sampling", "shuffle_partition",
                 "--strong-convexity", "0.5", "--smoothness", "0.5", "--delta", "1e-5",
                 "--repetitions", "5000", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["consistent"] is True
    assert {"epsilon_lower", "epsilon_reported", "construction", "repetitions"} <= set(data)
