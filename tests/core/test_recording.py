"""The recording layer (core): facts from a framework in, a training-run event and reasons out."""

import math
import warnings

import pytest

from hidden_state_accountants import HiddenStateAccountant, LossGeometry, ParameterError, TrainingRunDpEvent
from hidden_state_accountants.recording import (
    BatchSourceFacts,
    Claim,
    CompositionFallbackWarning,
    LayerFacts,
    ModelFacts,
    RunRecorder,
    StepFacts,
    check_batch_source,
    effective_step,
    model_refusal,
    parse_ledger,
)
from hidden_state_accountants.schedules import CYCLIC, POISSON, SHUFFLE_PARTITION, BatchSchedule

GEOM = LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=0.01, num_classes=2)
LINEAR = ModelFacts(
    layers=[
        LayerFacts(name="FeatureClip", kind="other", trainable=False),
        LayerFacts(name="Linear(64, 10)", kind="affine", trainable=True),
    ],
    complete=True,
    feature_clip_norm=1.0,
)
CONV_NET = ModelFacts(
    layers=[
        LayerFacts(name="Conv2d", kind="other", trainable=True),
        LayerFacts(name="ReLU", kind="other", trainable=False),
        LayerFacts(name="Linear", kind="affine", trainable=True),
        LayerFacts(name="ReLU", kind="other", trainable=False),
        LayerFacts(name="Linear", kind="affine", trainable=True),
    ],
    complete=True,
)


def step(**kw):
    args = dict(noise_multiplier=2.0, clip_norm=1.0, learning_rate=0.5, divisor=10, weight_decay=0.01)
    args.update(kw)
    return StepFacts(**args)


def recorder(geometry=GEOM, model=LINEAR, sampling=SHUFFLE_PARTITION, **kw):
    return RunRecorder(Claim(schedule=BatchSchedule(200, 10, sampling), geometry=geometry, model=model, **kw))


# ------------------------------------------------------------------ model structure
def test_a_network_with_hidden_layers_cannot_carry_a_geometry():
    reason = model_refusal(CONV_NET)
    assert "3 trainable layers" in reason and "not convex" in reason
    with pytest.raises(ParameterError, match="model: .*not convex"):
        recorder(model=CONV_NET)
    rec = recorder(
        model=CONV_NET,
        assume_convex_model=True,  # the documented opt-in, reported as such
        feature_unobservable="the adapter cannot see the trainable layer's inputs",
    )
    rec.record(step())
    assert any("assume_convex_model=True" in n for n in rec.notes())


@pytest.mark.parametrize(
    "layers,complete,expected",
    [
        ([("Linear", "affine", True)], True, None),
        ([("frozen encoder", "other", False), ("Linear", "affine", True)], True, None),
        ([("Linear", "affine", True), ("ReLU", "other", False)], True, "follow the trainable layer"),
        ([("Dropout", "random", False), ("Linear", "affine", True)], True, "randomness"),
        ([("Dense(relu)", "other", True)], True, "not an affine map"),
        ([("Linear", "affine", True)], False, "could not be read"),
    ],
)
def test_model_structure_rules(layers, complete, expected):
    model = ModelFacts(layers=[LayerFacts(name=n, kind=k, trainable=t) for n, k, t in layers], complete=complete)
    reason = model_refusal(model)
    assert reason is None if expected is None else expected in reason
    assert model_refusal(model, assume_convex_model=True) is None
    assert "model structure is unknown" in model_refusal(None)


# ---------------------------------------------- rule 1: contradictions before training
@pytest.mark.parametrize(
    "facts,param",
    [
        (dict(momentum=0.9), "momentum"),
        (dict(optimizer="adam"), "optimizer"),
        (dict(clipping="per_layer"), "clipping"),
        (dict(loss_reduction="sum"), "loss_reduction"),
        (dict(learning_rate=2.5), "learning_rate"),  # lr >= 2/M = 1.98
        (dict(weight_decay=0.001), "geometry"),  # m = 0.01 > the L2 term 0.001
        (dict(learning_rate=(0.5, 0.1)), "learning_rate"),  # parameter groups
    ],
)
def test_contradictions_known_before_training_raise_at_the_first_step(facts, param):
    rec = recorder()
    with pytest.raises(ParameterError) as err:
        rec.check(step(**facts))  # usable before any step runs (configure / on_train_begin)
    assert err.value.parameter == param
    with pytest.raises(ParameterError):
        rec.record(step(**facts))
    assert rec.steps == 0


def test_without_geometry_the_same_facts_are_accounted_by_composition():
    rec = recorder(geometry=None)
    rec.record(step(momentum=0.9), 100)
    with pytest.warns(CompositionFallbackWarning, match="no loss geometry"):
        run = rec.run()
    assert run.hidden_state_refusal and run.geometry is None and run.steps == 100


def test_declared_diameter_needs_a_projection_no_larger():
    geom = LossGeometry.logistic_regression(1.0, 0.01, diameter=4.0, num_classes=2)
    with pytest.raises(ParameterError, match="not projected"):
        recorder(geometry=geom).check(step())
    with pytest.raises(ParameterError, match="smaller than"):
        recorder(geometry=geom).check(step(projection_diameter=5.0))
    rec = recorder(geometry=GEOM)
    rec.record(step(projection_diameter=3.0), 40)
    assert rec.run().geometry.diameter == 3.0  # the projection's diameter is used when none is declared


def test_loose_strong_convexity_is_accepted_with_advice():
    rec = recorder(geometry=LossGeometry(strong_convexity=0.001, smoothness=1.01))
    with pytest.warns(UserWarning, match="valid but loose"):
        rec.record(step())


# ------------------------------------------------- rule 2: departures during training
@pytest.mark.parametrize(
    "change,text",
    [
        (dict(learning_rate=0.25), "learning rate changed"),
        (dict(noise_multiplier=3.0), "noise multiplier changed"),
        (dict(momentum=0.9), "momentum"),
        (dict(weight_decay=0.02), "L2 regularisation changed"),
        (dict(clip_norm=2.0), "clip norm changed"),
    ],
)
def test_departures_during_training_fall_back_to_composition_with_one_warning(change, text):
    rec = recorder()
    rec.record(step(), 50)
    rec.record(step(**change), 50)
    with pytest.warns(CompositionFallbackWarning, match=text):
        run = rec.run()
    assert text in run.hidden_state_refusal
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        rec.run()
    report = HiddenStateAccountant().compose(run).explain(1e-5)
    assert report.analysis == "bok_thm4.4" and any(text in n for n in report.notes)


def test_a_clean_run_is_the_core_event():
    rec = recorder()
    rec.record(step(), 400)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run = rec.run()
    assert run == TrainingRunDpEvent(
        dataset_size=200,
        batch_size=10,
        steps=400,
        noise_multiplier=2.0,
        clip_norm=1.0,
        learning_rate=0.5,
        sampling=SHUFFLE_PARTITION,
        geometry=GEOM,
        l2_regularization=0.01,
    )
    assert rec.run(steps=800).steps == 800  # planning: the last step repeated
    assert rec.notes() == [  # a secret seed, a checked model: only what the geometry rests on
        "feature norm <= 1: enforced by the model's feature clip (max_norm=1) in front of the trainable layer",
        "the loss is the user's claim: the geometry assumes softmax cross-entropy with one-hot or integer labels "
        "on the trainable layer's outputs (logits), or sigmoid cross-entropy on its one output (binary), one "
        "unweighted loss per example; the adapter did not observe it",
    ]


def test_a_user_chosen_seed_is_stated():
    rec = RunRecorder(Claim(schedule=BatchSchedule(200, 10, SHUFFLE_PARTITION, seed=5), geometry=GEOM, model=LINEAR))
    assert any("seed chosen by the user" in n for n in rec.notes())


# ----------------------------------------------------- rule 4: not even composition
def test_adaptive_clipping_and_wrong_divisor_are_errors():
    with pytest.raises(ParameterError, match="clipping"):
        recorder(geometry=None).record(step(clipping="adaptive"))
    with pytest.raises(ParameterError, match="batch_size: the update divides the clipped sum by 12"):
        recorder(geometry=None).record(step(divisor=12))
    with pytest.raises(ParameterError, match="accumulation"):
        recorder(geometry=None).record(step(accumulation=2))


# --------------------------------------------------------------------- Poisson
def test_poisson_steps_keep_their_exact_rate():
    """Opacus' rates 1/k used to be rounded to fractions that doubled some of them."""
    rec = RunRecorder(Claim(schedule=None))
    rec.record(StepFacts(noise_multiplier=1.5, sampling_probability=0.04), 2250)
    with pytest.warns(CompositionFallbackWarning):
        run = rec.run()
    assert run.sampling == POISSON and run.sampling_rate == 0.04
    direct = TrainingRunDpEvent(
        dataset_size=100,
        batch_size=4,
        steps=2250,
        noise_multiplier=1.5,
        clip_norm=1.0,
        learning_rate=1.0,
        sampling=POISSON,
    )
    with pytest.warns(UserWarning):
        want = HiddenStateAccountant().compose(direct).get_epsilon(1e-5)
    assert math.isclose(HiddenStateAccountant().compose(run).get_epsilon(1e-5), want, rel_tol=1e-9)


def test_a_run_without_a_schedule_states_the_poisson_assumption():
    rec = RunRecorder(Claim(schedule=None))
    rec.record(StepFacts(noise_multiplier=1.0, sampling_probability=0.01), 10)
    assert any("accounted as Poisson sampling" in n for n in rec.notes())
    assert not any("Poisson" in n for n in recorder(geometry=None).notes())


def test_a_hidden_state_claim_without_a_schedule_needs_the_dataset_size():
    with pytest.raises(ParameterError, match="dataset_size"):
        RunRecorder(Claim(schedule=None, geometry=GEOM, model=LINEAR))


def poisson_step(**kw):
    args = dict(
        noise_multiplier=1.0,
        clip_norm=1.0,
        learning_rate=0.5,
        divisor=256,
        weight_decay=0.01,
        sampling_probability=1 / 234,
    )
    args.update(kw)
    return StepFacts(**args)


def test_a_poisson_run_without_a_package_schedule_gets_the_poisson_hidden_state_analyses():
    """Opacus' default loader: the rate per step, n from the recorder, b the fixed divisor."""
    rec = RunRecorder(Claim(schedule=None, geometry=GEOM, model=LINEAR, dataset_size=60000))
    rec.record(poisson_step(), 2340)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        run = rec.run()
    assert (run.sampling, run.dataset_size, run.batch_size, run.sampling_rate) == (POISSON, 60000, 256, 1 / 234)
    assert run.geometry == GEOM and run.l2_regularization == 0.01 and run.hidden_state_refusal is None
    rows = {
        a.name: a
        for a in HiddenStateAccountant(neighboring_relation="ADD_OR_REMOVE_ONE").compose(run).explain(1e-5).analyses
    }
    assert rows["si_poisson"].epsilon is not None
    assert rows["si_poisson"].epsilon < rows["composition_poisson_pld"].epsilon


@pytest.mark.parametrize(
    "bad, param",
    [
        (dict(sampling_probability=None), "sampling_probability"),
        (dict(divisor=None), "divisor"),
        (dict(divisor=255.5), "divisor"),
        (dict(loss_reduction="sum"), "loss_reduction"),
    ],
)
def test_a_poisson_hidden_state_claim_needs_rate_and_divisor(bad, param):
    rec = RunRecorder(Claim(schedule=None, geometry=GEOM, model=LINEAR, dataset_size=60000))
    with pytest.raises(ParameterError, match=param):
        rec.record(poisson_step(**bad))


def test_a_poisson_rate_that_changes_ends_the_claim():
    rec = RunRecorder(Claim(schedule=None, geometry=GEOM, model=LINEAR, dataset_size=60000))
    rec.record(poisson_step(), 10)
    rec.record(poisson_step(sampling_probability=1 / 200), 10)
    with pytest.warns(CompositionFallbackWarning, match="sampling rate changed"):
        run = rec.run()
    assert run.geometry is None and run.sampling_rate == 1 / 200  # composition at the larger rate


def test_a_package_poisson_schedule_with_a_geometry():
    sched = BatchSchedule(1000, 10, POISSON)
    rec = RunRecorder(Claim(schedule=sched, geometry=GEOM, model=LINEAR))
    with pytest.raises(ParameterError, match="batch_size"):
        rec.record(poisson_step(divisor=12))
    rec.record(poisson_step(divisor=10, sampling_probability=None), 50)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run = rec.run()
    assert run.sampling == POISSON and run.geometry == GEOM and run.l2_regularization == 0.01


# ----------------------------------------------------------------- persistence
def test_ledger_round_trip_and_validation():
    rec = recorder()
    rec.record(step(), 30)
    rec.record(step(learning_rate=0.25), 5)
    other = recorder()
    other.record_restored(parse_ledger(rec.ledger_state()))
    assert other.ledger == rec.ledger and other.steps == 35
    for bad in (
        [[{"noise_multiplier": 1.0}, 1.5]],
        [[{"nonsense": 1}, 1]],
        [[{"noise_multiplier": 1.0}, 0]],
        "x",
        [[1, 2, 3]],
        [[{"noise_multiplier": 1.0, "optimizer": "Adam"}, 1]],
    ):
        with pytest.raises(ParameterError, match="ledger"):
            parse_ledger(bad)


# ------------------------------------------------------------------ data parallelism
def test_replicas_that_share_the_step_add_up_to_the_one_device_step():
    one = step(divisor=10)
    shared = step(divisor=10, replicas=4, replica_share=4)  # each: 1/4 of the noise variance and L2, / b
    assert effective_step(shared) == one  # exactly
    rec = recorder()
    rec.record(shared, 5)
    assert rec.ledger == [(one, 5)] and rec.ledger_state()[0][0]["replicas"] == 1
    averaged = effective_step(step(divisor=2.5, weight_decay=0.01, replicas=4, replica_reduction="mean"))
    assert (averaged.divisor, averaged.weight_decay, averaged.noise_multiplier) == (10, 0.01, 4.0)


def test_replicas_that_each_take_the_whole_step_are_refused_with_the_reason():
    # TF-Privacy's optimizer under MirroredStrategy: each of 2 replicas divides its 5
    # records' clipped sum and all the noise by 5, and Keras sums the two updates
    with pytest.raises(
        ParameterError,
        match=r"^batch_size: the update divides the clipped sum by 5 but the "
        r"schedule's batch at step 0 holds 10 records \(2 replicas each divide their "
        r"part of the batch by 5 and the framework sums their updates: the "
        r"effective learning rate is 2 times the one set\)",
    ):
        recorder(geometry=None).record(step(divisor=5, replicas=2))
    assert effective_step(step(divisor=5, replicas=2)).noise_multiplier == pytest.approx(2.0 * math.sqrt(2))
    for bad, name in (
        (dict(replicas=0), "replicas"),
        (dict(replica_share=1.5), "replica_share"),
        (dict(replica_reduction="max"), "replica_reduction"),
    ):
        with pytest.raises(ParameterError, match=f"^{name}: must be"):
            step(**bad)


def test_a_divisor_that_stops_matching_the_batches_is_refused_at_that_step():
    rec = recorder(geometry=None)
    rec.record(step(), 3)
    with pytest.raises(ParameterError, match="^batch_size: the update divides the clipped sum by 5"):
        rec.record(step(divisor=5, replicas=2))  # e.g. a later fit under a strategy
    with pytest.raises(ParameterError, match="^batch_size: the update divides the clipped sum by 5"):
        rec.check_plan([step(), step(divisor=5, replicas=2)])
    assert rec.steps == 3


def test_a_planned_departure_is_an_error_before_training():
    rec = recorder()
    with pytest.raises(ParameterError, match="learning_rate: the planned run the learning rate changed"):
        rec.check_plan([step(learning_rate=0.5), step(learning_rate=0.4)])
    rec.check_plan([step(), step()])  # a constant plan is fine
    recorder(geometry=None).check_plan([step(learning_rate=0.5), step(learning_rate=0.4)])  # composition only


def test_a_plan_with_a_kept_short_batch_is_checked_at_the_schedule_positions():
    """Keras' fit keeps a short last batch divided by its own size (kept_own_size): a plan
    holding that step is valid where the schedule puts it (the last step of every epoch) and
    refused anywhere else; before positions were known every planned step was checked as the
    next one, refusing every such plan."""
    schedule = BatchSchedule(23, 5, "reshuffle", last_batch="kept_own_size")  # 4 full batches and 3 records
    rec = RunRecorder(Claim(schedule=schedule, geometry=GEOM, model=LINEAR))
    full, short = step(divisor=5), step(divisor=3)
    rec.check_plan([full, short, full, short], counts=[4, 1, 4, 1])  # two epochs
    rec.check_plan([short, full], start=4, counts=[1, 4])  # a resumed run: the last step, then an epoch
    with pytest.raises(ParameterError, match="^batch_size: the update divides the clipped sum by 3"):
        rec.check_plan([full, short], counts=[3, 1])  # the short batch one step early
    with pytest.raises(ParameterError, match="^counts: needs one count per planned step"):
        rec.check_plan([full, short], counts=[4])
    with pytest.raises(ParameterError, match="^start: must be an integer >= 0"):
        rec.check_plan([full], start=-1)
    rec.record(full, 4)
    rec.record(short)
    assert rec.run().last_batch == "kept_own_size"


def test_a_framework_shuffle_drawn_in_several_processes_is_not_the_schedule():
    """DataLoader(shuffle=True) on several ranks, Keras fit(shuffle=True) on several workers:
    each process draws its own permutation, so the global batches follow no one schedule.
    The core refuses it for every adapter; one process (or a shared draw) is the schedule."""
    law = BatchSchedule.framework(100, 10, last_batch="dropped", secret=True)
    check_batch_source(law, BatchSourceFacts(schedule=law, description="one loader"))
    with pytest.raises(ParameterError, match=r"^data: two loaders: 2 processes each draw their own permutation"):
        check_batch_source(law, BatchSourceFacts(schedule=law, description="two loaders", independent_draws=2))
    shared = BatchSchedule(100, 10, "reshuffle")  # the package's sampler: every process follows one seed
    check_batch_source(
        shared, BatchSourceFacts(schedule=shared, description="ReshuffleBatchSampler", independent_draws=2)
    )


def test_module_doctests():
    import doctest

    from hidden_state_accountants import recording

    result = doctest.testmod(recording)
    assert result.failed == 0 and result.attempted > 0


# ------------------------------------------------------------- the claim and the hand-over
def test_the_hand_over_vocabularies_are_closed_and_validated_when_the_facts_are_made():
    from hidden_state_accountants.recording import Clipping, LayerKind, LossReduction, OptimizerKind, ReplicaReduction

    s = step(optimizer="adam", clipping="per_layer", loss_reduction="sum", replica_reduction="mean")
    assert (s.optimizer, s.clipping, s.loss_reduction, s.replica_reduction) == (
        OptimizerKind.ADAM,
        Clipping.PER_LAYER,
        LossReduction.SUM,
        ReplicaReduction.MEAN,
    )
    assert s.optimizer == "adam" and f"{s.clipping}" == "per_layer"  # members are their values
    assert s.to_dict()["optimizer"] == "adam" and type(s.to_dict()["optimizer"]) is str  # plain JSON
    # the adapters disagreed ("Adam" from Opacus, "adam" from Keras): one spelling, anything else refused
    for field, bad in (
        ("optimizer", "Adam"),
        ("clipping", "flat "),
        ("loss_reduction", "avg"),
        ("replica_reduction", "max"),
    ):
        with pytest.raises(ParameterError, match=f"^{field}: must be one of"):
            step(**{field: bad})
    with pytest.raises(ParameterError, match="^kind: must be one of affine, random, other, got 'dense'"):
        LayerFacts(name="Dense", kind="dense", trainable=True)
    assert LayerFacts(name="x", kind=LayerKind.AFFINE, trainable=True) == LayerFacts(
        name="x", kind="affine", trainable=True
    )
    assert OptimizerKind.named("Adam") is OptimizerKind.ADAM and OptimizerKind.named("SGD") is OptimizerKind.OTHER
    assert OptimizerKind.named("Adadelta") is OptimizerKind.OTHER


def test_the_relation_rule_is_the_cores_and_each_claim_states_its_hosts_default():
    opacus = dict(default_relation="ADD_OR_REMOVE_ONE")
    assert Claim(**opacus).relation() == (Claim(**opacus).default_relation, None)  # Opacus' Poisson loader
    relation, note = Claim(schedule=BatchSchedule(200, 10, CYCLIC), **opacus).relation()
    assert relation.name == "REPLACE_ONE" and "not the host's ADD_OR_REMOVE_ONE" in note and "cyclic" in note
    full = Claim(schedule=BatchSchedule(10, 10, "full"), **opacus)
    assert full.relation()[0].name == "ADD_OR_REMOVE_ONE"
    asked = Claim(schedule=BatchSchedule(200, 10, CYCLIC), neighboring_relation="add_or_remove_one", **opacus)
    assert asked.relation()[0].name == "ADD_OR_REMOVE_ONE" and asked.relation()[1] is None  # as asked
    assert Claim(schedule=BatchSchedule(10, 10, "full")).relation()[0].name == "REPLACE_ONE"  # the default default
    with pytest.raises(ParameterError, match="^neighboring_relation: must be REPLACE_ONE or ADD_OR_REMOVE_ONE"):
        Claim(neighboring_relation="both")


def test_a_claim_is_checked_when_it_is_made():
    with pytest.raises(ParameterError, match="^dataset_size: 100 is not the schedule's 200"):
        Claim(schedule=BatchSchedule(200, 10, CYCLIC), dataset_size=100)
    assert Claim(schedule=BatchSchedule(200, 10, CYCLIC), dataset_size=200).dataset_size is None  # not twice
    with pytest.raises(ParameterError, match="^loss: MeanSquaredError is not the loss the geometry was derived"):
        Claim(schedule=BatchSchedule(200, 10, CYCLIC), geometry=GEOM, model=LINEAR, loss=("other", "MeanSquaredError"))
    # a bound that is enforced needs no reason why it cannot be observed; no geometry claims nothing
    assert (
        Claim(
            schedule=BatchSchedule(200, 10, CYCLIC), geometry=GEOM, model=LINEAR, feature_unobservable="unseen"
        ).feature_unobservable
        is None
    )
    assert Claim(feature_unobservable="unseen").feature_unobservable is None
    with pytest.raises(ParameterError, match="^claim: must be a Claim"):
        RunRecorder(BatchSchedule(200, 10, CYCLIC))


def test_the_report_is_one_call_with_the_notes_and_the_relation():
    rec = recorder(model=LINEAR)
    rec.record(step(), 400)
    report = rec.report(1e-5)
    want = HiddenStateAccountant().compose(rec.run(warn=False)).explain(1e-5)
    assert (report.epsilon, report.analysis, report.neighboring_relation) == (
        want.epsilon,
        want.analysis,
        "REPLACE_ONE",
    )
    assert report.notes == want.notes + rec.notes()
    assert rec.report(1e-5) is report  # cached for the same run
    planned = rec.report(1e-5, plan=[(step(), 400)], warn=False)  # 400 more steps, planned
    assert planned.epsilon == HiddenStateAccountant().compose(rec.run(steps=800)).get_epsilon(1e-5)
    assert rec.steps == 400
    note = RunRecorder(Claim(schedule=BatchSchedule(200, 10, CYCLIC), default_relation="ADD_OR_REMOVE_ONE"))
    note.record(step(), 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompositionFallbackWarning)
        assert any("not the host's ADD_OR_REMOVE_ONE" in n for n in note.report(1e-5).notes)
    assert recorder().report(1e-5).epsilon == 0.0  # no step yet


def test_a_poisson_plan_is_checked_under_the_claim_with_its_dataset_size():
    """Issue 21: ``check_plan`` rebuilt the claim by hand without ``dataset_size``, so a valid Poisson
    hidden-state claim passed ``check()`` and failed ``check_plan([s, s])``."""
    rec = RunRecorder(Claim(schedule=None, geometry=GEOM, model=LINEAR, dataset_size=60000))
    rec.check(poisson_step())
    rec.check_plan([poisson_step(), poisson_step()])


def test_the_first_steps_checks_run_once_per_kind_of_step(monkeypatch):
    from hidden_state_accountants import recording

    calls = []
    real = recording.check_geometry
    monkeypatch.setattr(recording, "check_geometry", lambda *a, **k: calls.append(1) or real(*a, **k))
    rec = recorder()
    rec.check(step())  # configure / fit begin
    rec.record(step(), 10)  # the same step: not checked again
    assert len(calls) == 1
    rec.report(1e-5)  # the accounted geometry, once per report
    assert len(calls) == 2


def test_the_short_batch_is_the_last_step_of_every_epoch():
    from hidden_state_accountants.recording import batch_records

    kept = BatchSchedule(23, 5, "reshuffle", last_batch="kept_own_size")
    assert [batch_records(kept, t) for t in range(10)] == [5, 5, 5, 5, 3] * 2
    assert {batch_records(BatchSchedule(23, 5, "reshuffle"), t) for t in range(10)} == {5}  # dropped
