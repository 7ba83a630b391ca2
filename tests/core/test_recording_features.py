"""What the data decides (the feature norm) and the loss a geometry assumes: enforced by the
model's structure, checked before every step, or reported as the user's claim (the core's rule,
the same for every adapter)."""

import json
import math

import pytest

from hidden_state_accountants import LossGeometry, ParameterError
from hidden_state_accountants.checkpoint import RunState, open_run, seal_run
from hidden_state_accountants.events import CROSS_ENTROPY_ON_LOGITS, cross_entropy_smoothness
from hidden_state_accountants.recording import Claim, LayerFacts, ModelFacts, RunRecorder, StepFacts, parse_ledger
from hidden_state_accountants.schedules import SHUFFLE_PARTITION, BatchSchedule

GEOM = LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=0.01, num_classes=2)
LAYERS = [LayerFacts(name="Linear", kind="affine", trainable=True)]
CHECKED = ModelFacts(layers=LAYERS, complete=True)  # no feature clip: the inputs are checked per step
CLIPPED = ModelFacts(
    layers=[LayerFacts(name="FeatureClip", kind="other", trainable=False)] + LAYERS,
    complete=True,
    feature_clip_norm=1.0,
)


def step(**kw):
    return StepFacts(
        **{**dict(noise_multiplier=2.0, clip_norm=1.0, learning_rate=0.5, divisor=10, weight_decay=0.01), **kw}
    )


def recorder(geometry=GEOM, model=CHECKED, **kw):
    return RunRecorder(Claim(schedule=BatchSchedule(200, 10, SHUFFLE_PARTITION), geometry=geometry, model=model, **kw))


# ------------------------------------------------------------------ the geometry remembers
def test_logistic_regression_remembers_the_feature_bound_and_the_loss():
    g = LossGeometry.logistic_regression(feature_norm_bound=2.0, l2_regularization=0.05, num_classes=2)
    assert (g.feature_norm_bound, g.loss) == (2.0, CROSS_ENTROPY_ON_LOGITS)
    assert g.loss_smoothness == cross_entropy_smoothness(2.0) == 2.5  # Ye & Shokri Prop. 5.1: (R^2 + 1)/2
    assert g.smoothness == 2.55
    assert LossGeometry(smoothness=2.55).loss_smoothness is None  # given by constants: nothing derived


def test_a_huge_feature_bound_names_feature_norm_bound_not_smoothness():
    # probe: feature_norm_bound=1e200 overflowed (R^2 + 1)/2 to inf and was reported as `smoothness`
    with pytest.raises(ParameterError, match=r"^feature_norm_bound: must be at most 1.341e\+154") as err:
        LossGeometry.logistic_regression(feature_norm_bound=1e200, l2_regularization=0.01)
    assert err.value.parameter == "feature_norm_bound"
    with pytest.raises(ParameterError, match="^l2_regularization: makes the smoothness"):
        LossGeometry.logistic_regression(feature_norm_bound=1.3e154, l2_regularization=1.7e308)


@pytest.mark.parametrize(
    "kw,parameter",
    [
        (dict(smoothness=1.0, loss="hinge", feature_norm_bound=1.0), "loss"),
        (dict(smoothness=1.0, loss=CROSS_ENTROPY_ON_LOGITS), "feature_norm_bound"),
        (dict(smoothness=1.0, feature_norm_bound=-1.0), "feature_norm_bound"),
        (dict(smoothness=1.0, feature_norm_bound=math.nan), "feature_norm_bound"),
        # a smoothness below what the loss gives for that bound is a false derivation
        (
            dict(smoothness=1.0, strong_convexity=0.01, feature_norm_bound=1.0, loss=CROSS_ENTROPY_ON_LOGITS),
            "smoothness",
        ),
        (dict(smoothness=2.0, feature_norm_bound=2.0, loss=CROSS_ENTROPY_ON_LOGITS), "smoothness"),
    ],
)
def test_an_inconsistent_derived_geometry_is_refused(kw, parameter):
    with pytest.raises(ParameterError) as err:
        LossGeometry(**kw)
    assert err.value.parameter == parameter


def test_a_derived_smoothness_must_include_the_l2_the_update_applies():
    # derived with m_reg = 0.01 (M = 1.01) but the optimizer applies 0.02: the map is 1.02-smooth
    with pytest.raises(
        ParameterError,
        match=r"^geometry: smoothness 1.01 was derived with L2 strength 0.01, but "
        r"the update applies 0.02 .* 1.02-smooth",
    ):
        recorder(model=CLIPPED).check(step(weight_decay=0.02))
    recorder(model=CLIPPED).check(step(weight_decay=0.01))


# ------------------------------------------------------------------------- enforced
def test_a_feature_clip_feeding_the_trainable_layer_enforces_the_bound():
    rec = recorder(model=CLIPPED)
    assert rec.claim.feature_clip_norm == 1.0 and not rec.needs_feature_checks
    rec.record(step(), 40)  # nothing to check per step
    assert (
        "feature norm <= 1: enforced by the model's feature clip (max_norm=1) in front of the trainable layer"
        in rec.notes()
    )
    assert rec.largest_feature_norm == 1.0


def test_a_feature_clip_wider_than_the_bound_is_refused():
    wide = ModelFacts(layers=CLIPPED.layers, complete=True, feature_clip_norm=2.0)
    with pytest.raises(
        ParameterError,
        match=r"^feature_norm_bound: the model's feature clip \(max_norm=2\) lets "
        r"inputs of norm up to 2 .* above the declared bound 1",
    ):
        recorder(model=wide)
    narrow = ModelFacts(layers=CLIPPED.layers, complete=True, feature_clip_norm=0.5)
    assert recorder(model=narrow).claim.feature_clip_norm == 0.5  # a tighter clip enforces it too


# -------------------------------------------------------------------------- checked
def test_every_step_needs_its_inputs_checked_before_it_is_recorded():
    rec = recorder()
    assert rec.needs_feature_checks
    with pytest.raises(
        ParameterError,
        match=r"^feature_norm_bound: the inputs of the trainable layer in step 0 "
        r"were not checked",
    ):
        rec.record(step())
    assert rec.steps == 0
    rec.check_feature_norm(0.75, "the batch of step 0")
    rec.record(step())
    with pytest.raises(ParameterError, match="in step 1 were not checked"):  # one check covers one step
        rec.record(step())
    rec.check_feature_norm(0.5, "the batch of step 1")
    with pytest.raises(ParameterError, match="in step 2 were not checked"):  # ... not two
        rec.record(step(), 2)
    rec.record(step())
    assert rec.steps == 2
    assert (
        "feature norm <= 1: checked on the trainable layer's inputs before every step (largest seen 0.75)"
        in rec.notes()
    )
    assert rec.largest_feature_norm == 0.75


def test_data_checked_in_full_covers_every_step_until_the_next_check():
    rec = recorder()
    rec.check_feature_norm(0.9, "the 200 records fit trains on", steps=None)
    rec.record(step(), 1000)
    assert rec.steps == 1000 and rec.run().geometry is not None


@pytest.mark.parametrize("observed", [1.0000001192092896, 76.9, math.inf, math.nan])
def test_an_input_above_the_bound_ends_the_claim_with_the_observed_norm(observed):
    """Every digit of the observed norm is printed (issue 27: a float32 unit-normalised row of norm
    1.0000001 was refused as "an input of norm 1, above the declared bound 1")."""
    rec = recorder()
    rec.check_feature_norm(0.5, "the batch of step 0")
    rec.record(step())
    with pytest.raises(ParameterError) as err:
        rec.check_feature_norm(observed, "the batch of step 1")
    assert err.value.parameter == "feature_norm_bound"
    assert (
        f"in the batch of step 1, the trainable layer has an input of norm {observed!r}, above the declared "
        "bound 1" in str(err.value)
    )
    if math.isfinite(observed):
        assert f"above the declared bound 1 by {observed - 1:.3g}:" in str(err.value)
        assert "FeatureClip or clip_features, which round inside the ball" in str(err.value)
    with pytest.raises(ParameterError, match="not checked"):  # and no later step is covered by it
        rec.record(step())
    assert rec.steps == 1


def test_the_bound_itself_is_accepted():
    rec = recorder()
    rec.check_feature_norm(1.0, "the batch of step 0")
    rec.record(step())


def test_a_step_that_departs_from_the_analysed_update_needs_no_check():
    rec = recorder()
    rec.check_feature_norm(0.5, "the batch of step 0")
    rec.record(step())
    with pytest.warns(Warning):
        rec.record(step(momentum=0.9))  # composition from here on: the feature bound no longer matters
        assert rec.run().geometry is None


def test_a_planned_run_needs_no_checks():
    rec = recorder(planned=True)
    assert not rec.needs_feature_checks
    rec.record(step(), 100)
    assert rec.run().geometry is not None


def test_replayed_steps_were_checked_when_they_were_taken():
    rec = recorder()
    rec.check_feature_norm(0.5, "the data", steps=None)
    rec.record(step(), 30)
    again = recorder()
    again.record_restored(rec.ledger)
    assert any("the 30 steps restored from a checkpoint were checked when they were taken" in n for n in again.notes())
    with pytest.raises(ParameterError, match="step 30 were not checked"):  # new steps need their own checks
        again.record(step())
    with pytest.raises(ParameterError, match="step 0 were not checked"):  # recorded, not restored: checked
        recorder().record(step(), 30)


def test_a_checkpoint_replays_its_ledger_as_restored_steps_and_keeps_the_feature_facts():
    rec = recorder(model=CLIPPED)
    rec.record(step(), 30)
    sealed = seal_run(RunState.of(rec), fmt="f", version=1)
    run, _ = open_run(json.loads(json.dumps(sealed)), fmt="f", version=1)
    assert (run.claim.geometry, run.claim.model) == (GEOM, CLIPPED)  # the bound, the loss, the clip
    checked = recorder()
    checked.check_feature_norm(0.5, "the data", steps=None)
    checked.record(step(), 30)
    run, _ = open_run(seal_run(RunState.of(checked), fmt="f", version=1), fmt="f", version=1)
    assert run.steps == 30  # replayed without a feature check: the steps were checked when taken
    assert any(
        "the 30 steps restored from a checkpoint were checked when they were taken" in n for n in run.recorder.notes()
    )
    with pytest.raises(ParameterError, match="step 30 were not checked"):
        run.recorder.record(step())


def test_a_restored_ledger_must_be_known_to_respect_the_bound():
    loaded = recorder()
    loaded.record_restored(parse_ledger([[step().to_dict(), 5]]))
    with pytest.raises(
        ParameterError,
        match=r"^checkpoint: the state has 5 steps whose largest input norm is not "
        r"known .* does not cover them",
    ):
        loaded.restore_feature_norm(None, "the state")
    with pytest.raises(ParameterError, match="largest input norm is 1.5"):
        loaded.restore_feature_norm(1.5, "the state")
    loaded.restore_feature_norm(0.8, "the state")
    loaded.check_feature_norm(0.6, "the data", steps=None)
    loaded.record(step(), 2)
    assert loaded.largest_feature_norm == 0.8


def test_unobservable_inputs_are_an_error_unless_the_model_is_assumed():
    with pytest.raises(
        ParameterError,
        match=r"^feature_norm_bound: 1 can be neither enforced nor checked: no "
        r"inputs in sight",
    ):
        recorder().observe(feature_unobservable="no inputs in sight")
    rec = recorder(assume_convex_model=True)
    rec.observe(feature_unobservable="no inputs in sight")
    assert not rec.needs_feature_checks
    rec.record(step())
    assert "feature norm <= 1 is the user's claim: no inputs in sight" in rec.notes()


def test_a_run_whose_feature_bound_is_the_users_claim_resumes_from_its_checkpoint():
    """Issue 18's open item (a), in the core: the reason the inputs cannot be observed was kept on the
    live recorder only, so the checkpoint of an ``assume_convex_model=True`` run stored no largest
    feature norm and the resumed run was refused for not knowing it. The claim carries the reason now."""
    rec = recorder(assume_convex_model=True, feature_unobservable="no inputs in sight")
    rec.record(step(), 30)
    sealed = json.loads(json.dumps(seal_run(RunState.of(rec), fmt="f", version=1)))
    run, _ = open_run(sealed, fmt="f", version=1)
    assert run.claim.feature_unobservable == "no inputs in sight" and run.recorder.largest_feature_norm is None
    run.recorder.record(step())  # no check needed: the bound is the user's claim, and the notes say so
    assert "feature norm <= 1 is the user's claim: no inputs in sight" in run.recorder.notes()
    # without the reason an unknown norm still does not cover restored steps
    with pytest.raises(ParameterError, match="whose largest input norm is not known"):
        RunState(
            Claim(schedule=run.schedule, geometry=GEOM, model=CHECKED, assume_convex_model=True),
            ledger=run.recorder.ledger_state(),
            steps=31,
            subject="the state",
        )


# -------------------------------------------------------------- the user's claim, and the loss
def test_a_geometry_given_by_its_constants_is_noted_as_the_users_claim():
    rec = recorder(geometry=LossGeometry(smoothness=1.01, strong_convexity=0.01), model=CHECKED)
    assert not rec.needs_feature_checks  # nothing about the data is claimed, so nothing to check
    rec.record(step(), 10)
    notes = rec.notes()
    assert notes == [
        "the declared geometry (smoothness=1.01, strong_convexity=0.01) is the user's claim: given by "
        "its constants, not derived from a loss, it cannot be observed from the training run"
    ]
    partly = recorder(geometry=LossGeometry(smoothness=1.01, strong_convexity=0.01, feature_norm_bound=1.0))
    partly.check_feature_norm(0.5, "the data", steps=None)
    partly.record(step())
    assert "for inputs of norm <= 1) is the user's claim" in partly.notes()[0]  # the features are still checked
    assert "largest seen 0.5" in partly.notes()[1]


def test_the_loss_is_compared_or_noted():
    rec = recorder(model=CLIPPED)
    rec.record(step())
    assert any(
        n.startswith("the loss is the user's claim: the geometry assumes softmax cross-entropy") for n in rec.notes()
    )
    rec.observe(loss=(None, "the framework does not show it"))
    assert rec.notes()[-1].endswith("; the framework does not show it")
    rec.observe(loss=(CROSS_ENTROPY_ON_LOGITS, "SparseCategoricalCrossentropy(from_logits=True)"))
    assert rec.notes()[-1] == "loss: SparseCategoricalCrossentropy(from_logits=True), as the geometry assumes"
    with pytest.raises(
        ParameterError,
        match=r"^loss: MeanSquaredError is not the loss the geometry was derived from "
        r"\(softmax cross-entropy",
    ):
        rec.observe(loss=("other", "MeanSquaredError"))
    recorder(geometry=LossGeometry(smoothness=1.01), model=CHECKED).observe(loss=("other", "anything"))  # none assumed
