"""Issue 11, section 2 (core): sampling="reshuffle", a kept short batch, public randomness, and
the recording path from a framework's own shuffle (DataLoader(shuffle=True), Keras
fit(shuffle=True)) to the event. Each test fails on the code before issue 11 (no reshuffle)."""

import json
import math
import warnings

import numpy as np
import pytest

from hidden_state_accountants import (
    HiddenStateAccountant,
    LossGeometry,
    ParameterError,
    TrainingRunDpEvent,
    calibrate_noise_multiplier,
    max_epochs_within_budget,
)
from hidden_state_accountants.analyses import bok
from hidden_state_accountants.analyses._common import Context
from hidden_state_accountants.cli import main
from hidden_state_accountants.recording import (
    BatchSourceFacts,
    Claim,
    LayerFacts,
    ModelFacts,
    RunRecorder,
    StepFacts,
    check_batch_source,
)
from hidden_state_accountants.schedules import (
    CYCLIC,
    DROPPED,
    KEPT_BATCH_SIZE,
    KEPT_OWN_SIZE,
    POISSON,
    RANDOM,
    RESHUFFLE,
    SAMPLINGS,
    SHUFFLE_PARTITION,
    WITHOUT_REPLACEMENT,
    BatchSchedule,
)

GEOM = LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=0.01, num_classes=2)
LINEAR = ModelFacts(
    layers=[
        LayerFacts(name="FeatureClip", kind="other", trainable=False),
        LayerFacts(name="Linear", kind="affine", trainable=True),
    ],
    complete=True,
    feature_clip_norm=1.0,
)


# ------------------------------------------------------------------------------ the schedule
def test_reshuffle_draws_a_fresh_permutation_every_epoch_and_resumes_anywhere():
    assert RESHUFFLE in SAMPLINGS and RESHUFFLE in RANDOM
    s = BatchSchedule(23, 5, RESHUFFLE, seed=3)
    assert s.steps_per_epoch == 4 and s.dropped_per_epoch == 3 and s.fixed_batch_size
    epochs = [[s.batch(e * 4 + j).tolist() for j in range(4)] for e in range(3)]
    for epoch in epochs:
        used = [i for batch in epoch for i in batch]
        assert len(used) == 20 and len(set(used)) == 20  # each record at most once, n % b dropped
    assert epochs[0] != epochs[1] != epochs[2]  # a new order every epoch
    again = BatchSchedule(23, 5, RESHUFFLE, seed=3)
    assert again.batch(4 * 1000 + 2).tolist() == s.batch(4 * 1000 + 2).tolist()  # O(1) resume
    assert BatchSchedule(23, 5, RESHUFFLE).seed_is_secret


def test_a_kept_short_batch_is_the_last_step_of_every_epoch():
    s = BatchSchedule(23, 5, RESHUFFLE, seed=1, last_batch=KEPT_OWN_SIZE)
    assert s.steps_per_epoch == 5 and s.dropped_per_epoch == 0 and not s.fixed_batch_size
    sizes = [len(s.batch(t)) for t in range(10)]
    assert sizes == [5, 5, 5, 5, 3] * 2
    assert sorted(np.concatenate([s.batch(t) for t in range(5, 10)]).tolist()) == list(range(23))
    # b divides n: nothing to keep
    assert BatchSchedule(20, 5, RESHUFFLE, last_batch=KEPT_BATCH_SIZE).last_batch == DROPPED


@pytest.mark.parametrize(
    "kwargs,parameter",
    [
        (dict(sampling=CYCLIC, last_batch=KEPT_OWN_SIZE), "last_batch"),
        (dict(sampling=RESHUFFLE, last_batch="keep"), "last_batch"),
        (dict(sampling=WITHOUT_REPLACEMENT, secret=False), "secret"),
        (dict(sampling=POISSON, secret=False), "secret"),
        (dict(sampling=RESHUFFLE, secret="no"), "secret"),
    ],
)
def test_bad_schedules_name_the_parameter(kwargs, parameter):
    with pytest.raises(ParameterError) as err:
        BatchSchedule(23, 5, kwargs.pop("sampling"), **kwargs)
    assert err.value.parameter == parameter


def test_describe_round_trip_keeps_the_short_batch_and_the_secrecy():
    for s in (
        BatchSchedule(23, 5, RESHUFFLE, seed=4, last_batch=KEPT_BATCH_SIZE, secret=False),
        BatchSchedule.framework(61, 6, last_batch=KEPT_OWN_SIZE, secret=True),
    ):
        t = BatchSchedule.from_description(json.loads(json.dumps(s.describe())))
        assert t == s and t.last_batch == s.last_batch and t.secret == s.secret and t.external == s.external


def test_a_framework_schedule_describes_the_law_only():
    s = BatchSchedule.framework(61, 6, last_batch=KEPT_OWN_SIZE, secret=False)
    assert s.external and not s.secret and s.steps_per_epoch == 11 and "drawn by the framework" in repr(s)
    with pytest.raises(ParameterError, match="framework draws"):
        s.batch(0)
    assert s.same_law(BatchSchedule(61, 6, RESHUFFLE, last_batch=KEPT_OWN_SIZE))
    assert not s.same_law(BatchSchedule(61, 6, RESHUFFLE))
    with pytest.raises(ParameterError, match="sampling"):
        BatchSchedule.framework(61, 6, SHUFFLE_PARTITION, secret=True)


# --------------------------------------------------------------------------------- the event
def test_the_event_carries_the_short_batch_and_the_secrecy():
    run = TrainingRunDpEvent.from_epochs(
        dataset_size=61,
        batch_size=6,
        epochs=2,
        noise_multiplier=1.0,
        clip_norm=1.0,
        learning_rate=0.5,
        sampling=RESHUFFLE,
        last_batch=KEPT_OWN_SIZE,
        secret_batches=False,
    )
    assert run.steps == 22 and run.steps_per_epoch == 11 and not run.secret_batches
    with pytest.raises(ParameterError) as err:
        run.replace(sampling=SHUFFLE_PARTITION)
    assert err.value.parameter == "last_batch"
    with pytest.raises(ParameterError) as err:
        TrainingRunDpEvent(
            dataset_size=60,
            batch_size=6,
            steps=10,
            noise_multiplier=1.0,
            clip_norm=1.0,
            learning_rate=0.5,
            sampling=POISSON,
            secret_batches=False,
        )
    assert err.value.parameter == "secret_batches"


def test_composition_counts_one_use_per_epoch_at_any_position():
    """Bok Thm 4.4 for reshuffle: ceil(t / l) uses of G(2/z); a noise schedule charges each
    epoch its noisiest step (the record may sit anywhere in it)."""
    ctx = Context()
    run = TrainingRunDpEvent(
        dataset_size=61,
        batch_size=6,
        steps=23,
        noise_multiplier=2.0,
        clip_norm=1.0,
        learning_rate=0.5,
        sampling=RESHUFFLE,
        last_batch=KEPT_OWN_SIZE,
    )
    assert bok.thm_4_4(run, ctx).mu == pytest.approx(math.sqrt(3))  # epochs of 11 steps: 3 touched
    noise = tuple([4.0] * 10 + [1.0] + [4.0] * 11 + [2.0])
    scheduled = run.replace(noise_multiplier=noise)
    assert bok.thm_4_4(scheduled, ctx).mu == pytest.approx(math.sqrt(4.0 + 0.25 + 1.0))


def test_calibration_and_epoch_budget_handle_reshuffle():
    run = TrainingRunDpEvent.from_epochs(
        dataset_size=6000,
        batch_size=60,
        epochs=5,
        noise_multiplier=1.0,
        clip_norm=1.0,
        learning_rate=0.5,
        sampling=RESHUFFLE,
        geometry=LossGeometry(strong_convexity=0.1, smoothness=1.0),
    )
    cal = calibrate_noise_multiplier(run, 2.0, 1e-5)
    assert HiddenStateAccountant().compose(run.replace(noise_multiplier=cal.noise_multiplier)).get_epsilon(1e-5) <= 2.0
    assert cal.analysis.startswith("si_reshuffle")
    budget = max_epochs_within_budget(run.replace(noise_multiplier=cal.noise_multiplier), 3.0, 1e-5, max_epochs=64)
    assert budget.epsilon <= 3.0 and budget.epochs >= 5 and not budget.unlimited


# ----------------------------------------------------------------------- the recording path
def step(divisor, **kw):
    return StepFacts(noise_multiplier=2.0, clip_norm=1.0, learning_rate=0.5, divisor=divisor, weight_decay=0.01, **kw)


def keras_fit_recorder(secret=True, last_batch=KEPT_OWN_SIZE):
    """What an adapter for fit(x, y, batch_size=6, shuffle=True) on 61 records hands over."""
    schedule = BatchSchedule.framework(61, 6, last_batch=last_batch, secret=secret)
    return RunRecorder(Claim(schedule=schedule, geometry=GEOM, model=LINEAR))


def test_a_framework_reshuffle_keeping_its_short_batch_becomes_the_event():
    rec = keras_fit_recorder(secret=False)
    for epoch in range(2):
        rec.record(step(6), count=10)
        rec.record(step(1))  # the short batch of 61 % 6 = 1 record, divided by its own size
    run = rec.run()
    assert (run.sampling, run.last_batch, run.secret_batches, run.steps) == (RESHUFFLE, KEPT_OWN_SIZE, False, 22)
    report = HiddenStateAccountant().compose(run).explain(1e-5)
    rows = {a.name: a for a in report.analyses}
    assert report.analysis == "si_reshuffle_worst" and "public" in rows["si_reshuffle_average"].reason
    assert any("public" in note for note in rec.notes())
    secret = keras_fit_recorder(secret=True)
    secret.record(step(6), count=10)
    secret.record(step(1))
    assert secret.run().secret_batches and any("drawn by the framework" in n for n in secret.notes())


@pytest.mark.parametrize(
    "last_batch,steps,message",
    [
        (KEPT_OWN_SIZE, [(6, 10), (6, 1)], "holds 1 records"),  # the short batch divided by b
        (KEPT_OWN_SIZE, [(6, 11)], "record that step on its own"),  # one entry across the short batch
        (KEPT_OWN_SIZE, [(None, 1)], "divisor is unknown"),
        (KEPT_BATCH_SIZE, [(6, 10), (1, 1)], "holds 6 records"),  # Opacus: every step divided by b
        (DROPPED, [(5, 1)], "holds 6 records"),
    ],
)
def test_the_divisor_of_every_step_is_checked(last_batch, steps, message):
    rec = keras_fit_recorder(last_batch=last_batch)
    with pytest.raises(ParameterError, match=message) as err:
        for divisor, count in steps:
            rec.record(step(divisor), count=count)
    assert err.value.parameter == "batch_size"


def test_opacus_keeping_its_short_batch_divided_by_b():
    rec = keras_fit_recorder(last_batch=KEPT_BATCH_SIZE)
    rec.record(step(6), count=33)
    run = rec.run()
    assert run.last_batch == KEPT_BATCH_SIZE and run.steps_per_epoch == 11
    assert HiddenStateAccountant().compose(run).explain(1e-5).analysis.startswith("si_reshuffle")


def test_batch_source_of_a_framework_shuffle():
    claim = BatchSchedule.framework(61, 6, last_batch=KEPT_OWN_SIZE, secret=True)
    source = BatchSourceFacts(
        schedule=BatchSchedule.framework(61, 6, last_batch=KEPT_OWN_SIZE, secret=True),
        description="fit(shuffle=True)",
        next_step=0,
    )
    check_batch_source(claim, source, 22)
    check_batch_source(BatchSchedule(61, 6, RESHUFFLE, last_batch=KEPT_OWN_SIZE), source, 0)  # same law
    with pytest.raises(ParameterError, match="stopped mid-epoch"):
        check_batch_source(claim, source, 5)
    public = BatchSourceFacts(
        schedule=BatchSchedule.framework(61, 6, last_batch=KEPT_OWN_SIZE, secret=False),
        description="a loader seeded with 0",
    )
    with pytest.raises(ParameterError, match="randomness is public"):
        check_batch_source(claim, public, 0)
    with pytest.raises(ParameterError, match="accountant was told"):
        check_batch_source(BatchSchedule.framework(61, 6, secret=True), source, 0)  # dropped vs kept


# ------------------------------------------------------------------------------- command line
def test_hsa_epsilon_with_reshuffle(capsys):
    code = main(
        [
            "epsilon",
            "--dataset-size",
            "61",
            "--batch-size",
            "6",
            "--steps",
            "25",
            "--noise-multiplier",
            "2",
            "--clip-norm",
            "1",
            "--learning-rate",
            "0.5",
            "--sampling",
            "reshuffle",
            "--last-batch",
            "kept_own_size",
            "--strong-convexity",
            "0.5",
            "--smoothness",
            "0.5",
            "--delta",
            "1e-5",
            "--json",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["epsilon"] < data["composition_epsilon"]
    names = {a["name"] for a in data["analyses"] if a["epsilon"] is not None}
    assert {"si_reshuffle_average", "si_reshuffle_worst", "bok_thm4.4"} <= names
    code = main(
        [
            "epsilon",
            "--dataset-size",
            "61",
            "--batch-size",
            "6",
            "--steps",
            "25",
            "--noise-multiplier",
            "2",
            "--clip-norm",
            "1",
            "--learning-rate",
            "0.5",
            "--sampling",
            "cyclic",
            "--last-batch",
            "kept_own_size",
            "--delta",
            "1e-5",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("hsa: error: --last-batch:")


def test_reshuffled_runs_are_never_accounted_as_one_partition():
    """The same run as shuffle_partition reports less than the reshuffle truth when it ends
    inside an epoch (derivations 2.4); as reshuffle it reports at least the truth."""
    from hidden_state_accountants.exact import exact_pair

    run = TrainingRunDpEvent(
        dataset_size=20,
        batch_size=4,
        steps=6,
        noise_multiplier=0.5,
        clip_norm=1.0,
        learning_rate=1.0,
        sampling=RESHUFFLE,
        geometry=LossGeometry(strong_convexity=0.43, smoothness=0.43),
    )
    truth = exact_pair(run).epsilon(1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert HiddenStateAccountant().compose(run).get_epsilon(1e-5) >= truth
    assert HiddenStateAccountant().compose(run.replace(sampling=SHUFFLE_PARTITION)).get_epsilon(1e-5) < truth


def test_kept_batch_size_with_a_projection_needs_the_recorded_l2_in_m_to_M():
    """derivations.md 3.5: a short batch divided by b contracts like the others when the L2 term
    lies in [m, M]; with a projection only the recorded l2_regularization can show it."""
    from hidden_state_accountants import HiddenStateAccountant, LossGeometry, TrainingRunDpEvent

    geometry = LossGeometry(smoothness=1.0, strong_convexity=0.1, diameter=4.0)

    def report(l2):
        run = TrainingRunDpEvent(
            dataset_size=64,
            batch_size=10,
            steps=21,
            noise_multiplier=2.0,
            clip_norm=1.0,
            learning_rate=0.5,
            sampling="reshuffle",
            geometry=geometry,
            last_batch="kept_batch_size",
            l2_regularization=l2,
        )
        return {a.name: a for a in HiddenStateAccountant().compose(run).explain(1e-5).analyses}

    assert "not recorded" in report(None)["si_reshuffle_average"].reason
    assert "[m, M]" in report(2.0)["si_reshuffle_average"].reason
    assert report(0.05)["si_reshuffle_average"].reason is not None  # below m
    inside = report(0.5)
    assert inside["si_reshuffle_average"].epsilon is not None and inside["si_reshuffle_worst"].epsilon is not None
