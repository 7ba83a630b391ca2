"""Resuming a Keras run (issue 10): the callback's state is saved with the model, a resumed
fit in a new process continues the ledger and the schedule, and a partial, edited or foreign
state is refused before any step."""

import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
pytest.importorskip("tensorflow_privacy")
pytestmark = pytest.mark.tf

from hidden_state_accountants import BatchSchedule, LossGeometry, ParameterError  # noqa: E402
from hidden_state_accountants.checkpoint import seal_state, unseal_state  # noqa: E402
from hidden_state_accountants.tf_privacy import STATE_ATTRIBUTE, HiddenStatePrivacyCallback  # noqa: E402

JOB = pathlib.Path(__file__).resolve().parent / "tf_resume_job.py"
spec = importlib.util.spec_from_file_location("tf_resume_job", JOB)
job = importlib.util.module_from_spec(spec)
spec.loader.exec_module(job)
SPE = job.N // job.B


def run_job(workdir, sampling, order, kill_at=None):
    args = [sys.executable, str(JOB), str(workdir), sampling, order] + ([str(kill_at)] if kill_at else [])
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)


def uninterrupted(sampling, epochs=job.EPOCHS):
    model, cb, ds = job.build(sampling)
    model.fit(ds, epochs=epochs, callbacks=[cb], verbose=0)
    return cb


@pytest.mark.parametrize(
    "sampling, order",
    [
        ("shuffle_partition", "callback_first"),
        pytest.param("without_replacement", "backup_first", marks=pytest.mark.slow),
    ],
)
def test_a_run_killed_and_resumed_in_a_new_process_is_the_uninterrupted_run(tmp_path, sampling, order):
    kill_at = 2 * SPE + 2  # BackupAndRestore saved after epoch 2; killed 2 steps into epoch 3
    first = run_job(tmp_path, sampling, order, kill_at)
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    resumed = run_job(tmp_path, sampling, order)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    out = json.loads(resumed.stdout.strip().splitlines()[-1])

    # the new process drew another secret seed for its new batched_dataset, and continued
    # the run's schedule instead: the steps it trained are those of the run's seed, kept
    # (secret) in the run's state
    killed = json.loads((tmp_path / "batches.json").read_text())
    assert len(killed) == kill_at and len(out["batches"]) == SPE
    # the two steps of epoch 3 the killed process took are the first two taken again
    assert out["batches"][:2] == killed[2 * SPE :]
    state = unseal_state(json.loads((tmp_path / "state.json").read_text()))
    assert state["claim"]["seed_is_secret"] and state["steps"] == kill_at
    schedule = BatchSchedule.from_description(state["claim"]["schedule"])
    expected = [sorted(schedule.batch(t).tolist()) for t in range(3 * SPE)]
    assert killed == expected[:kill_at]
    assert out["batches"] == expected[2 * SPE :]  # the last epoch, trained again in the new process

    reference = uninterrupted(sampling)
    assert out["steps"] == reference.steps == 3 * SPE
    assert out["ledger"] == reference.recorder.ledger_state()
    assert out["epsilon"] == reference.epsilon  # exactly


# ----------------------------------------------------------------- in one process
def trained(sampling="shuffle_partition", epochs=1):
    model, cb, ds = job.build(sampling)
    model.fit(ds, epochs=epochs, callbacks=[cb], verbose=0)
    return model, cb


def save(model, path):
    return tf.train.Checkpoint(model=model).write(str(path))


def test_tf_checkpoint_and_save_weights_carry_the_run(tmp_path):
    model, cb = trained()
    save(model, tmp_path / "ckpt")
    model.save_weights(str(tmp_path / "weights"))  # the TensorFlow format
    for restore in (
        lambda m: tf.train.Checkpoint(model=m).read(str(tmp_path / "ckpt")).expect_partial(),
        lambda m: m.load_weights(str(tmp_path / "weights")),
    ):
        model2, cb2, ds2 = job.build("shuffle_partition")
        restore(model2)
        model2.fit(ds2, epochs=1, callbacks=[cb2], verbose=0)
        assert cb2.steps == 2 * SPE
        assert cb2.recorder.claim.schedule == cb.recorder.claim.schedule and cb2.recorder.claim.schedule.seed_is_secret
        assert cb2.epsilon == uninterrupted("shuffle_partition", epochs=2).epsilon


def test_model_checkpoint_weights_carry_the_run(tmp_path):
    model, cb, ds = job.build("cyclic")
    saver = tf.keras.callbacks.ModelCheckpoint(str(tmp_path / "w"), save_weights_only=True)
    model.fit(ds, epochs=1, callbacks=[cb, saver], verbose=0)
    model2, cb2, ds2 = job.build("cyclic")
    model2.load_weights(str(tmp_path / "w"))
    model2.fit(ds2, epochs=2, callbacks=[cb2], verbose=0)
    assert cb2.steps == 3 * SPE and cb2.epsilon == uninterrupted("cyclic").epsilon


def test_the_issue_scenario_restored_weights_and_a_fresh_optimizer_is_refused(tmp_path):
    # issue 10: restored weights, a fresh optimizer and callback, one more epoch reported the
    # epsilon of that epoch alone
    model, _ = trained()
    save(model, tmp_path / "ckpt")
    model2, cb2, ds2 = job.build("shuffle_partition")
    tf.train.Checkpoint(model=model2).read(str(tmp_path / "ckpt")).expect_partial()
    model2.compile(
        optimizer=job.DecoupledL2DPKerasSGDOptimizer(
            l2_norm_clip=job.C, noise_multiplier=job.Z, l2_regularization=job.L2, learning_rate=job.LR
        ),
        loss=model2.loss,
    )
    with pytest.raises(
        ParameterError,
        match=r"^optimizer: has taken 0 steps but the callback's state accounts 6: "
        "the optimizer was not restored",
    ):
        model2.fit(ds2, epochs=1, callbacks=[cb2], verbose=0)
    assert int(model2.optimizer.iterations.numpy()) == 0


def test_a_restored_optimizer_without_the_callback_state_is_refused_with_how_to_resume(tmp_path):
    model, _, ds = job.build("cyclic")
    model.fit(ds, epochs=1, verbose=0)  # trained without the callback: no state in the checkpoint
    save(model, tmp_path / "ckpt")
    model2, cb2, ds2 = job.build("cyclic")
    tf.train.Checkpoint(model=model2).read(str(tmp_path / "ckpt")).expect_partial()
    with pytest.raises(
        ParameterError,
        match=r"^optimizer: has taken 6 steps but this callback accounted 0: "
        r"reporting 0 steps as the whole run would under-report .* to resume a "
        r"run, restore the callback's state together with the model",
    ):
        model2.fit(ds2, epochs=1, callbacks=[cb2], verbose=0)


class Forged(tf.train.experimental.PythonState):
    """Writes the given text where the callback's state would be."""

    def __init__(self, text):
        super().__init__()
        self.text = text

    def serialize(self):
        return self.text

    def deserialize(self, value):
        pass


def forged_checkpoint(tmp_path, edit, sampling="shuffle_partition"):
    model, cb = trained(sampling)
    state = cb.privacy_state()
    text = edit(state)
    setattr(model, STATE_ATTRIBUTE, Forged(text if isinstance(text, str) else json.dumps(text)))
    return save(model, tmp_path / "forged")


def resume_from(path, sampling="shuffle_partition"):
    model, cb, ds = job.build(sampling)
    tf.train.Checkpoint(model=model).read(path).expect_partial()
    model.fit(ds, epochs=1, callbacks=[cb], verbose=0)
    return model, cb


def shortened(state):
    state["ledger"][0][1] -= 1  # hand-edited: one step fewer
    state["steps"] -= 1
    return state


def resealed(change):
    def edit(state):
        payload = unseal_state(state)
        change(payload)
        return seal_state(payload)

    return edit


@pytest.mark.parametrize(
    "edit, message",
    [
        (shortened, "checkpoint: its digest does not match its content"),
        (lambda s: {k: x for k, x in s.items() if k != "digest"}, "checkpoint: has no digest"),
        (lambda s: "not json", "checkpoint: the hidden-state privacy state is not JSON"),
        (
            resealed(lambda p: p.update(format="opacus")),
            "checkpoint: the hidden-state privacy state is of format "
            "'opacus' version 4; this version of the package reads",
        ),
        (
            resealed(lambda p: p.update(steps=7)),
            "checkpoint: the hidden-state privacy state says 7 steps were taken but its ledger accounts 6",
        ),
        (resealed(lambda p: p["ledger"][0].__setitem__(1, 2.5)), "checkpoint: .* invalid ledger .*positive integer"),
        (
            resealed(lambda p: p["claim"]["schedule"].update(dataset_size=100)),
            "checkpoint: the hidden-state privacy state is a run of sampling='shuffle_partition', dataset_size=100, "
            "batch_size=20, but this callback was declared with sampling='shuffle_partition', dataset_size=120, "
            "batch_size=20",
        ),
        (
            resealed(lambda p: p["claim"]["schedule"].update(batch_size=30)),  # its ledger divides by 20: not its run
            "checkpoint: the hidden-state privacy state has an invalid ledger .*divides the clipped sum by 20",
        ),
        (
            resealed(lambda p: p["claim"].update(geometry={"smoothness": 1.0})),
            "geometry: the checkpoint's geometry has no feature_norm_bound",
        ),
        (resealed(lambda p: p.pop("ledger")), "checkpoint: the hidden-state privacy state lacks ledger"),
    ],
)
def test_an_edited_or_foreign_state_is_refused_before_any_step(tmp_path, edit, message):
    path = forged_checkpoint(tmp_path, edit)
    model, cb, ds = job.build("shuffle_partition")
    tf.train.Checkpoint(model=model).read(path).expect_partial()
    with pytest.raises(ParameterError, match=message):
        model.fit(ds, epochs=1, callbacks=[cb], verbose=0)
    assert cb.steps == 0 and int(model.optimizer.iterations.numpy()) == SPE  # restored, no step taken


def test_a_state_of_another_schedule_is_refused():
    _, cb = trained("cyclic")
    other = HiddenStatePrivacyCallback(
        geometry=None, sampling="shuffle_partition", dataset_size=job.N, batch_size=job.B, delta=job.DELTA, verbose=0
    )
    with pytest.raises(ParameterError, match="^checkpoint: .* is a run of sampling='cyclic'"):
        other.load_privacy_state(cb.privacy_state())


def test_a_state_of_another_geometry_is_refused():
    """The state carries the run's claim: a resumed callback declaring another geometry (here the
    run's without its L2 term) would account the steps already taken under a claim they were not
    checked against; it is refused as the Opacus accountant refuses it."""
    _, cb = trained("cyclic")
    other = HiddenStatePrivacyCallback(
        geometry=LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=0.0),
        sampling="cyclic",
        dataset_size=job.N,
        batch_size=job.B,
        delta=job.DELTA,
        verbose=0,
    )
    with pytest.raises(
        ParameterError,
        match=r"^geometry: the checkpoint was taken with "
        r"geometry=LossGeometry\(smoothness=1.05, strong_convexity=0.05",
    ):
        other.load_privacy_state(cb.privacy_state())


def test_a_dataset_seed_the_user_chose_must_be_the_runs(tmp_path):
    model, cb = trained()
    save(model, tmp_path / "ckpt")
    model2, cb2, _ = job.build("shuffle_partition")
    tf.train.Checkpoint(model=model2).read(str(tmp_path / "ckpt")).expect_partial()
    x = np.zeros((job.N, job.DIM), np.float32)
    ds = job.batched_dataset(x, np.zeros(job.N, np.int64), job.B, "shuffle_partition", seed=5)
    with pytest.raises(
        ParameterError,
        match="^seed: the batched_dataset has a seed you chose, but the run's "
        "shuffle_partition schedule has another one",
    ):
        model2.fit(ds, epochs=1, callbacks=[cb2], verbose=0)


def test_the_state_is_plain_json_with_the_seed_and_its_secrecy():
    _, cb = trained("without_replacement")
    state = cb.privacy_state()
    payload = unseal_state(json.loads(json.dumps(state)))
    assert payload["steps"] == SPE and payload["claim"]["seed_is_secret"] is True
    assert payload["claim"]["schedule"] == cb.recorder.claim.schedule.describe()
    assert payload["ledger"] == cb.recorder.ledger_state()


# --------------------------------- issue 29, U4: weights from storage without the callback's state
def callback(**extra):
    return HiddenStatePrivacyCallback(
        geometry=LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=job.L2),
        sampling="cyclic",
        dataset_size=job.N,
        batch_size=job.B,
        delta=job.DELTA,
        verbose=0,
        **extra,
    )


def compiled_like(model):
    model.compile(
        optimizer=job.DecoupledL2DPKerasSGDOptimizer(
            l2_norm_clip=job.C, noise_multiplier=job.Z, l2_regularization=job.L2, learning_rate=job.LR
        ),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=tf.keras.losses.Reduction.NONE),
    )
    return model


def test_weights_loaded_from_hdf5_without_the_state_are_refused_before_any_step(tmp_path):
    """Issue 29, U4: a model trained 2 epochs, its weights saved to HDF5 (which holds neither the callback's
    state nor the optimizer's step count) and loaded into a fresh model, fresh optimizer and fresh
    callback: the resumed fit reported the epsilon of its own steps only (before: accepted)."""
    model, _ = trained("cyclic", epochs=2)
    model.save_weights(str(tmp_path / "w.h5"))
    model2, _, ds2 = job.build("cyclic")
    model2.load_weights(str(tmp_path / "w.h5"))
    for _ in range(2):  # a second fit is refused too: the refusal does not use the load up
        with pytest.raises(
            ParameterError,
            match=r"^model: its weights were loaded by model.load_weights\('.*w.h5'\) without the run's privacy "
            r"state: if they were trained on the private data, the steps that trained them are not in the ledger "
            r".* with HiddenStatePrivacyCallback\(public_initial_weights=True\); to resume a run, restore the "
            r"callback's state",
        ):
            model2.fit(ds2, epochs=1, callbacks=[callback()], verbose=0)
    assert int(model2.optimizer.iterations.numpy()) == 0


def test_a_full_model_loaded_without_the_state_is_refused(tmp_path):
    model, _ = trained("cyclic")
    model.save(str(tmp_path / "m.h5"), include_optimizer=False)
    model2 = compiled_like(tf.keras.models.load_model(str(tmp_path / "m.h5"), compile=False))
    with pytest.raises(ParameterError, match=r"^model: its weights were loaded by load_model\('.*m.h5'\)"):
        model2.fit(job.build("cyclic")[2], epochs=1, callbacks=[callback()], verbose=0)


def test_weights_declared_public_are_accepted_and_said_in_the_notes_and_the_statement(tmp_path):
    model, _ = trained("cyclic")
    model.save_weights(str(tmp_path / "pretrained.h5"))  # stands for public pre-training
    model2, _, ds2 = job.build("cyclic")
    model2.load_weights(str(tmp_path / "pretrained.h5"))
    cb = callback(public_initial_weights=True)
    model2.fit(ds2, epochs=1, callbacks=[cb], verbose=0)
    model2.fit(ds2, epochs=1, callbacks=[cb], verbose=0)  # the run continues: nothing new was loaded
    fresh_model, _, fresh_ds = job.build("cyclic")
    fresh = callback()
    fresh_model.fit(fresh_ds, epochs=2, callbacks=[fresh], verbose=0)
    assert cb.steps == 2 * SPE and cb.epsilon == fresh.epsilon  # the steps from there
    note = "the run starts from weights loaded by model.load_weights("
    assert any(n.startswith(note) and "declared public" in n for n in cb.notes())
    assert note in " ".join(cb.privacy_statement().split())
    assert not any(n.startswith(note) for n in fresh.notes())
    with pytest.raises(ParameterError, match="^public_initial_weights: must be True or False"):
        callback(public_initial_weights="yes")


def test_a_state_nested_deeper_than_json_decodes_is_refused_as_the_checkpoint():
    """The Keras side of issue 29's unreadable checkpoint: a restored text nested too deep for JSON raised
    RecursionError out of TensorFlow's restore; a deep state dict, out of the digest check."""
    cb = callback()
    cb._restore_from_checkpoint("[" * 100_000)
    with pytest.raises(ParameterError, match="^checkpoint: the hidden-state privacy state is JSON nested deeper"):
        cb._raise_restore_error()
    deep = inner = {}
    for _ in range(100_000):
        inner["x"] = {}
        inner = inner["x"]
    with pytest.raises(ParameterError, match="^checkpoint: must hold plain finite JSON values only"):
        cb.load_privacy_state({**deep, "digest": "0" * 64})
