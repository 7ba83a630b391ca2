"""Core: ``StepFacts.l2_after_reduction``, the L2 term applied once after the replicas combine
their noisy gradients (Opacus' ``DistributedDPOptimizer``), in ``effective_step`` and the recorder."""

import pytest

from hidden_state_accountants import LossGeometry, ParameterError
from hidden_state_accountants.recording import Claim, RunRecorder, StepFacts, effective_step
from hidden_state_accountants.schedules import CYCLIC, BatchSchedule


def opacus_like(replicas=2, divisor=50.0, **kw):
    return StepFacts(
        noise_multiplier=2.0,
        clip_norm=1.0,
        learning_rate=0.5,
        divisor=divisor,
        weight_decay=0.05,
        replicas=replicas,
        replica_reduction="mean",
        replica_share=replicas,
        **kw,
    )


@pytest.mark.parametrize("replicas", [2, 3, 8])
def test_l2_after_reduction_keeps_the_l2_term_and_scales_only_the_gradients(replicas):
    step = effective_step(opacus_like(replicas, divisor=120 / replicas, l2_after_reduction=True))
    assert (step.noise_multiplier, step.divisor, step.weight_decay) == pytest.approx((2.0, 120.0, 0.05))
    assert step.replicas == 1 and step.l2_after_reduction is False
    # without the flag each replica's L2 term is a 1/replicas share of the mean
    per_replica = effective_step(opacus_like(replicas, divisor=120 / replicas))
    assert per_replica.weight_decay == pytest.approx(0.05 / replicas)
    single = StepFacts(noise_multiplier=2.0, clip_norm=1.0, learning_rate=0.5, divisor=120, weight_decay=0.05)
    assert step == single, "the ledger holds the same one-device step as a single process"
    assert effective_step(StepFacts(noise_multiplier=1.0, l2_after_reduction=True)) == StepFacts(noise_multiplier=1.0)


def test_the_flag_decides_whether_a_declared_strong_convexity_is_backed():
    geometry = LossGeometry(smoothness=1.05, strong_convexity=0.05)
    recorder = RunRecorder(Claim(schedule=BatchSchedule(100, 10, CYCLIC), geometry=geometry, assume_convex_model=True))
    recorder.record(opacus_like(2, divisor=5.0, l2_after_reduction=True), 3)
    assert recorder.steps == 3 and recorder.ledger[0][0].weight_decay == 0.05
    with pytest.raises(ParameterError, match="^geometry: strong_convexity 0.05 exceeds"):
        RunRecorder(Claim(schedule=BatchSchedule(100, 10, CYCLIC), geometry=geometry, assume_convex_model=True)).record(
            opacus_like(2, divisor=5.0)
        )


def test_the_flag_is_validated_and_round_trips():
    with pytest.raises(ParameterError, match="^l2_after_reduction: must be True or False"):
        StepFacts(noise_multiplier=1.0, l2_after_reduction="yes")
    step = opacus_like(l2_after_reduction=True)
    assert StepFacts.from_dict(step.to_dict()) == step
