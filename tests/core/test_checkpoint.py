"""The core checkpoint module: sealed states, the one RunState both adapters save and open, the
weights digest and atomic writes."""

import copy
import json
import os

import pytest

from hidden_state_accountants import LossGeometry, ParameterError
from hidden_state_accountants.checkpoint import (
    RunState,
    open_run,
    open_state,
    seal_run,
    seal_state,
    unseal_state,
    weights_digest,
    write_atomically,
)
from hidden_state_accountants.recording import Claim, LayerFacts, ModelFacts, RunRecorder, StepFacts
from hidden_state_accountants.schedules import CYCLIC, SHUFFLE_PARTITION, BatchSchedule

GEOM = LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=0.01, num_classes=2)
LINEAR = ModelFacts(layers=[LayerFacts(name="Linear(64, 10)", kind="affine", trainable=True)], complete=True)


def step(**kw):
    args = dict(noise_multiplier=2.0, clip_norm=1.0, learning_rate=0.5, divisor=10, weight_decay=0.01)
    args.update(kw)
    return StepFacts(**args)


def live(steps=30, sampling=SHUFFLE_PARTITION, geometry=GEOM):
    rec = RunRecorder(Claim(schedule=BatchSchedule(200, 10, sampling), geometry=geometry, model=LINEAR))
    rec.check_feature_norm(0.9, "the data", steps=None)  # rule 1b: the data of every step, before it
    rec.record(step(), steps)
    return rec


def test_a_sealed_state_refuses_any_edit():
    rec = live()
    sealed = seal_state({"ledger": rec.ledger_state(), "seed": 12345})
    assert unseal_state(json.loads(json.dumps(sealed))) == {"ledger": rec.ledger_state(), "seed": 12345}
    edits = [
        lambda s: s["ledger"][0].__setitem__(1, 29),
        lambda s: s.__setitem__("seed", 12346),
        lambda s: s["ledger"][0][0].__setitem__("noise_multiplier", 2.5),
        lambda s: s.__setitem__("x", 1),
    ]
    for edit in edits:
        forged = json.loads(json.dumps(sealed))
        edit(forged)
        with pytest.raises(ParameterError, match="^checkpoint: its digest does not match its content"):
            unseal_state(forged, "checkpoint")
    with pytest.raises(ParameterError, match="^checkpoint: has no digest"):
        unseal_state({"seed": 1}, "checkpoint")
    with pytest.raises(ParameterError, match="^checkpoint: must be a dict"):
        unseal_state([], "checkpoint")
    with pytest.raises(ParameterError, match="^payload: must hold plain finite JSON values"):
        seal_state({"x": float("nan")})


def test_open_state_checks_format_keys_and_steps():
    with pytest.raises(ParameterError, match="^checkpoint: the state lacks ledger$"):
        open_state(
            seal_state({"format": "f", "version": 2, "steps": 0}),
            subject="the state",
            fmt="f",
            version=2,
            keys=("ledger",),
        )
    with pytest.raises(ParameterError, match=r"^checkpoint: the state has steps=-1; must be an integer >= 0$"):
        open_state(
            seal_state({"format": "f", "version": 2, "steps": -1}), subject="the state", fmt="f", version=2, keys=()
        )


def test_a_run_round_trips_through_json_exactly():
    rec = live()
    sealed = seal_run(RunState.of(rec, weights_digest="ab" * 32), fmt="f", version=1, extra_field=[1, 2])
    run, extra = open_run(json.loads(json.dumps(sealed)), fmt="f", version=1, extra=("extra_field",))
    assert extra == {"extra_field": [1, 2]}
    assert run.recorder.ledger == rec.ledger and run.steps == 30
    assert run.recorder.run(warn=False) == rec.run(warn=False)
    assert run.claim == rec.claim and (run.schedule, run.claim.geometry, run.claim.model) == (
        rec.claim.schedule,
        GEOM,
        LINEAR,
    )
    assert run.claim.relation()[0].name == "REPLACE_ONE" and run.weights_digest == "ab" * 32
    assert run.recorder.largest_feature_norm == 0.9
    assert seal_run(run, fmt="f", version=1, extra_field=[1, 2]) == sealed
    assert open_run(seal_run(None, fmt="f", version=1), fmt="f", version=1) == (None, {})


def test_a_geometry_with_new_optional_fields_round_trips():
    """The geometry is stored field by field (attr.asdict / LossGeometry(**d)): every field does."""
    geometry = LossGeometry(smoothness=2.0, strong_convexity=0.01, diameter=3.0, lsi_constant=0.5)
    rec = RunRecorder(Claim(schedule=BatchSchedule(200, 10, CYCLIC), geometry=geometry, model=LINEAR))
    rec.record(step(learning_rate=0.5, projection_diameter=3.0), 3)
    run, _ = open_run(seal_run(RunState.of(rec), fmt="f", version=1), fmt="f", version=1)
    assert run.claim.geometry == geometry
    # the feature bound and the loss of a derived geometry, and the model's feature clip
    geometry = LossGeometry.logistic_regression(
        feature_norm_bound=0.5, l2_regularization=0.01, diameter=3.0, num_classes=2
    )
    clipped = ModelFacts(layers=LINEAR.layers, complete=True, feature_clip_norm=0.25)
    rec = RunRecorder(Claim(schedule=BatchSchedule(200, 10, CYCLIC), geometry=geometry, model=clipped))
    rec.record(step(learning_rate=0.5, projection_diameter=3.0), 3)  # enforced by the clip: nothing to check
    run, _ = open_run(json.loads(json.dumps(seal_run(RunState.of(rec), fmt="f", version=1))), fmt="f", version=1)
    assert (run.claim.geometry, run.claim.model) == (geometry, clipped)


def _resealed(edit):
    payload = unseal_state(seal_run(RunState.of(live()), fmt="f", version=1))
    payload = copy.deepcopy(payload)
    edit(payload)
    return seal_state(payload)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda p: p.update(steps=31), "says 31 steps were taken but its ledger accounts 30$"),
        (lambda p: p["ledger"][0][0].update(divisor=7), "has an invalid ledger .*divides the clipped sum by 7"),
        (
            lambda p: p["ledger"][0][0].update(learning_rate=5.0),
            "has an invalid ledger .*learning_rate: must be < 2/smoothness",
        ),
        (lambda p: p["claim"].update(model=None), "has a claim that does not hold .*model structure is unknown"),
        (lambda p: p["claim"].update(seed_is_secret="yes"), "has seed_is_secret='yes'; must be true or false"),
        (lambda p: p["claim"]["schedule"].update(seed=None), "has a shuffle_partition schedule without its seed"),
        (lambda p: p["claim"]["schedule"].update(sampling="sometimes"), "has an invalid schedule"),
        (lambda p: p["claim"].update(dataset_size=True), "has dataset_size=True; must be a positive integer or null"),
        (lambda p: p["claim"].update(neighboring_relation="REPLACE_SPECIAL"), "has a claim that does not hold"),
        (lambda p: p["claim"].update(default_relation=None), "has a claim that does not hold"),
        (
            lambda p: p["claim"].update(loss=["other"]),
            "has loss=\\['other'\\]; must be \\[kind or null, description\\]",
        ),
        (lambda p: p["claim"].update(loss=["other", "MeanSquaredError"]), "has a claim that does not hold .*loss"),
        (lambda p: p["claim"].update(feature_unobservable=3), "has feature_unobservable=3; must be a reason or null"),
        (
            lambda p: p["claim"].update(feature_unobservable="unseen"),  # only with assume_convex_model
            "has a claim that does not hold .*feature_norm_bound: 1 can be neither enforced nor checked: unseen",
        ),
        (lambda p: p.update(largest_feature_norm=1.5), "has 30 steps whose largest input norm is 1.5"),
        (lambda p: p.update(largest_feature_norm=None), "has 30 steps whose largest input norm is not known"),
        (lambda p: p.update(largest_feature_norm="0.5"), "has largest_feature_norm='0.5'; must be a number"),
        (lambda p: p["ledger"][0][0].update(optimizer="Adam"), "has an invalid ledger .*optimizer: must be one of sgd"),
        (lambda p: p["claim"]["model"]["layers"][0].update(trainable=1), "has an invalid geometry or model"),
        (lambda p: p["claim"].update(geometry={"smoothness": -1}), "has an invalid geometry or model .*smoothness"),
        (lambda p: p["claim"].pop("geometry"), "has a claim with fields"),
        (lambda p: p["claim"]["geometry"].update(loss="hinge"), "has an invalid geometry or model .*loss"),
        (lambda p: p["claim"]["model"].pop("feature_clip_norm"), "has an invalid geometry or model"),
        (
            lambda p: p["claim"]["model"].update(feature_clip_norm=True),
            "has an invalid geometry or model .*feature_clip",
        ),
        (
            lambda p: p["claim"]["model"].update(feature_clip_norm=2.0),
            "has a claim that does not hold .*feature clip \\(max_norm=2\\) .* above the declared bound 1",
        ),
        (lambda p: p.update(weights_digest=12), "has weights_digest=12; must be a SHA-256 hex digest or null"),
        (lambda p: p.update(extra=1), "has unknown fields extra"),
        (lambda p: p.update(claim=None), "accounts 30 steps without a claim"),
    ],
)
def test_an_inconsistent_run_is_refused_with_what_does_not_hold(edit, message):
    with pytest.raises(ParameterError, match="^checkpoint: the state " + message):
        open_run(_resealed(edit), fmt="f", version=1, subject="the state")


def test_the_weights_binding():
    run = RunState.of(live(), weights_digest="0" * 64, subject="the state")
    run.check_weights("0" * 64, "the weights")
    with pytest.raises(
        ParameterError, match="^checkpoint: the state was saved with other model weights than the weights"
    ):
        run.check_weights("1" * 64, "the weights")
    with pytest.raises(ParameterError, match="^checkpoint: the run's state is not bound to model weights"):
        RunState.of(live()).check_weights("0" * 64, "the weights")


def test_the_weights_digest_sees_every_byte_name_and_shape():
    base = [("w", "float32", (2, 2), bytes(16)), ("b", "float32", (2,), bytes(8))]
    digest = weights_digest(base)
    assert digest == weights_digest(list(reversed(base)))
    changed = [
        [("w", "float32", (2, 2), bytes(15) + b"\x01"), base[1]],
        [("w", "float32", (4,), bytes(16)), base[1]],
        [("w", "int32", (2, 2), bytes(16)), base[1]],
        [("v", "float32", (2, 2), bytes(16)), base[1]],
        [base[0]],
        # the bytes move from one array to the other: the length prefixes tell them apart
        [("w", "float32", (2, 2), bytes(20)), ("b", "float32", (2,), bytes(4))],
    ]
    assert len({digest} | {weights_digest(c) for c in changed}) == len(changed) + 1


def test_write_atomically_leaves_the_previous_file_when_the_write_fails(tmp_path):
    path = tmp_path / "ckpt.bin"
    write_atomically(path, lambda f: f.write(b"first"))
    assert path.read_bytes() == b"first" and oct(path.stat().st_mode & 0o777) == oct(0o600)

    def killed(f):
        f.write(b"half of the sec")
        raise KeyboardInterrupt  # e.g. the process is interrupted mid-write

    with pytest.raises(KeyboardInterrupt):
        write_atomically(path, killed)
    assert path.read_bytes() == b"first"
    assert os.listdir(tmp_path) == ["ckpt.bin"], "the temporary file is removed"
    write_atomically(str(path), lambda f: f.write(b"second"))
    assert path.read_bytes() == b"second" and os.listdir(tmp_path) == ["ckpt.bin"]
