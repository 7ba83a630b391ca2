"""Checkpoints of a run's accounting: one format and one set of checks for every adapter.

An adapter's resumable state is a :class:`RunState`: the
:class:`~hidden_state_accountants.recording.Claim` the run is accounted under (the batch schedule
with its seed, the declared geometry, the model's structure, the flags, the dataset size, the
neighbouring relation, what the adapter observed about the data), the core ledger of its steps, the
largest feature norm they stayed below and, where the framework writes the model's weights into the
same file, a digest of those weights. It is
written as one JSON payload sealed with a SHA-256 digest (:func:`seal_run`), next to the few
fields only the adapter's framework needs (Opacus: the sampler's class; Keras: the per-epoch
history).

On resume, :func:`open_run` checks the digest, the format and version, every field's type, and
records every stored step again through :class:`~hidden_state_accountants.recording.RunRecorder`'s
checks under the stored claim. An edited, partial, foreign or inconsistent state is refused
with :class:`~hidden_state_accountants.ParameterError` (``checkpoint: ...``) before anything is
applied; :meth:`RunState.continued` then compares it with the resuming process's claim (the same
comparison for every adapter), and the adapter applies it with its framework's steps.

What the digests protect against: a state edited or corrupted after it was written (the
payload digest), and a state spliced next to weights it does not describe (the weights digest,
e.g. the accountant state of an earlier checkpoint pasted into a later one). They are integrity
checks, not signatures: whoever can write a checkpoint can recompute both, so a checkpoint must
be kept as private and trusted as the data (it also holds the schedule's secret seed).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
import warnings
from typing import Any, BinaryIO, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import attr

from hidden_state_accountants import validation as v
from hidden_state_accountants.events import LossGeometry
from hidden_state_accountants.relations import parse_relation
from hidden_state_accountants.recording import (
    Claim,
    HiddenStateWarning,
    LayerFacts,
    ModelFacts,
    RunRecorder,
    parse_ledger,
)
from hidden_state_accountants.schedules import RANDOM, BatchSchedule

CLAIM_KEYS = (
    "schedule",
    "seed_is_secret",
    "geometry",
    "model",
    "assume_convex_model",
    "gaussian_initialization",
    "dataset_size",
    "neighboring_relation",
    "default_relation",
    "feature_unobservable",
    "loss",
)
"""The fields of a sealed state's ``claim`` (:func:`encode_claim`)."""

RUN_KEYS = ("steps", "ledger", "claim", "largest_feature_norm", "weights_digest")
"""The fields every sealed run state has besides ``format``, ``version`` and the adapter's own."""

_HEX = frozenset("0123456789abcdef")


def refusal(subject: str, what: str) -> v.ParameterError:
    """The error for a checkpoint that does not hold: ``checkpoint: <subject> <what>``."""
    return v.ParameterError("checkpoint", f"{subject} {what}")


# ------------------------------------------------------------------------ sealing
def _canonical(payload: Dict[str, Any], what: str) -> bytes:
    try:
        return json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError, RecursionError) as err:  # RecursionError: nested deeper than any state
        raise v.ParameterError(what, f"must hold plain finite JSON values only: {err}") from None


def seal_state(payload: Dict[str, Any]) -> Dict[str, Any]:
    """``payload`` (plain JSON types) plus ``"digest"``, the SHA-256 of its canonical JSON.

    The digest lets :func:`unseal_state` recognise a state that was edited or corrupted
    after it was written (a ledger shortened by hand, a changed seed). It is an integrity
    check, not a signature: whoever can write the checkpoint can recompute it, so a
    checkpoint must be kept as private and trusted as the data.

    >>> sealed = seal_state({"steps": 3})
    >>> unseal_state(sealed)
    {'steps': 3}
    >>> sealed["steps"] = 2
    >>> unseal_state(sealed, "checkpoint")
    Traceback (most recent call last):
    ...
    hidden_state_accountants.errors.ParameterError: checkpoint: its digest does not match its content (edited or corrupted after it was written); it cannot be trusted
    """
    if not isinstance(payload, dict) or "digest" in payload:
        raise v.ParameterError("payload", "must be a dict without a 'digest' key")
    return {**payload, "digest": hashlib.sha256(_canonical(payload, "payload")).hexdigest()}


def unseal_state(state: Any, what: str = "state") -> Dict[str, Any]:
    """The payload of a :func:`seal_state` result, after checking its digest.

    Raises :class:`~hidden_state_accountants.ParameterError` naming ``what`` when ``state``
    is not such a dict or its digest does not match its content.
    """
    if not isinstance(state, dict):
        raise v.ParameterError(what, f"must be a dict written by seal_state, got {type(state).__name__}")
    if not isinstance(state.get("digest"), str):
        raise v.ParameterError(what, "has no digest (not written by this package, or edited); it cannot be trusted")
    payload = {k: x for k, x in state.items() if k != "digest"}
    if hashlib.sha256(_canonical(payload, what)).hexdigest() != state["digest"]:
        raise v.ParameterError(
            what,
            "its digest does not match its content (edited or corrupted after it was written); it cannot be trusted",
        )
    return payload


def open_state(state: Any, *, subject: str, fmt: str, version: int, keys: Sequence[str]) -> Dict[str, Any]:
    """The payload of a sealed checkpoint state (:func:`seal_state`), after the checks every
    state needs: the digest, the format and version, the keys, and ``steps`` a non-negative
    integer. Errors name ``checkpoint`` and begin with ``subject``.

    >>> state = seal_state({"format": "demo", "version": 1, "steps": 2, "ledger": []})
    >>> open_state(state, subject="the demo state", fmt="demo", version=1, keys=("ledger",))["steps"]
    2
    >>> open_state(state, subject="the demo state", fmt="demo", version=2, keys=())
    Traceback (most recent call last):
    ...
    hidden_state_accountants.errors.ParameterError: checkpoint: the demo state is of format 'demo' version 1; this version of the package reads 'demo' version 2
    """
    payload = unseal_state(state, "checkpoint")
    if payload.get("format") != fmt or payload.get("version") != version:
        raise refusal(
            subject,
            f"is of format {payload.get('format')!r} version {payload.get('version')!r}; this "
            f"version of the package reads {fmt!r} version {version}",
        )
    missing = sorted((set(keys) | {"steps"}) - set(payload))
    if missing:
        raise refusal(subject, f"lacks {', '.join(missing)}")
    _check_steps(payload["steps"], subject)
    return payload


def _check_steps(steps: Any, subject: str) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise refusal(subject, f"has steps={steps!r}; must be an integer >= 0")
    return steps


# ----------------------------------------------------------------- model weights
def weights_digest(arrays: Iterable[Tuple[str, str, Sequence[int], Any]]) -> str:
    """SHA-256 of a model's named arrays, each ``(name, dtype, shape, buffer)`` with ``buffer``
    the array's bytes (anything ``hashlib`` reads: ``bytes``, a contiguous NumPy array, ...).
    The order of ``arrays`` does not matter; names, dtypes and shapes count as well as the bytes.

    >>> a = weights_digest([("w", "float32", (2,), bytes(8)), ("b", "float32", (), bytes(4))])
    >>> a == weights_digest([("b", "float32", (), bytes(4)), ("w", "float32", (2,), bytes(8))])
    True
    >>> a == weights_digest([("w", "float32", (2,), bytes(8)), ("b", "float32", (1,), bytes(4))])
    False
    """
    h = hashlib.sha256()
    for name, dtype, shape, buffer in sorted(arrays, key=lambda a: a[0]):
        head = json.dumps([name, dtype, [int(d) for d in shape]]).encode()
        data = memoryview(buffer).cast("B")
        h.update(len(head).to_bytes(8, "big") + head + len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()


# --------------------------------------------------------------------- the run
class RunState:
    """A run's accounting as a checkpoint holds it: the :class:`~hidden_state_accountants.recording.Claim`,
    the ledger, the largest feature norm its steps stayed below and (optionally) the digest of the
    model weights it describes.

    The constructor checks every field and records every ledger entry again through the checks of
    a recorder of ``claim`` (:meth:`RunRecorder.record_restored
    <hidden_state_accountants.recording.RunRecorder.record_restored>`: the types and counts, the claim
    itself, the schedule's divisors), that the ledger accounts ``steps`` steps, and that the feature
    bound covers them (:meth:`~hidden_state_accountants.recording.RunRecorder.restore_feature_norm`);
    the result is a state the run could have recorded. Errors are
    :class:`~hidden_state_accountants.ParameterError` naming ``checkpoint`` and beginning with
    ``subject`` (or, from :meth:`continued`, naming the configuration's parameter).

    Args:
      claim: what the run is accounted under.
      ledger: :meth:`RunRecorder.ledger_state <hidden_state_accountants.recording.RunRecorder.ledger_state>`
        of the run.
      steps: the number of steps the run took.
      largest_feature_norm: :attr:`RunRecorder.largest_feature_norm
        <hidden_state_accountants.recording.RunRecorder.largest_feature_norm>` of the run.
      weights_digest: :func:`weights_digest` of the weights the state describes, or ``None``.
      subject: how errors name the state (e.g. "the hidden-state accountant state").

    >>> from hidden_state_accountants.recording import StepFacts
    >>> claim = Claim(schedule=BatchSchedule(100, 10, "cyclic"))
    >>> run = RunState(claim, steps=3, ledger=[
    ...     [StepFacts(noise_multiplier=1, clip_norm=1, learning_rate=0.1, divisor=10).to_dict(), 3]])
    >>> run.steps, open_run(seal_run(run, fmt="demo", version=1), fmt="demo", version=1)[0].steps
    (3, 3)
    >>> RunState(claim, steps=4, ledger=run.recorder.ledger_state())
    Traceback (most recent call last):
    ...
    hidden_state_accountants.errors.ParameterError: checkpoint: the run's state says 4 steps were taken but its ledger accounts 3
    """

    def __init__(
        self,
        claim: Claim,
        *,
        ledger: Sequence[Sequence[Any]] = (),
        steps: int = 0,
        largest_feature_norm: Optional[float] = None,
        weights_digest: Optional[str] = None,
        subject: str = "the run's state",
    ) -> None:
        if not isinstance(claim, Claim):
            raise v.ParameterError("claim", f"must be a Claim, got {type(claim).__name__}")
        steps = _check_steps(steps, subject)
        if weights_digest is not None and not (
            isinstance(weights_digest, str) and len(weights_digest) == 64 and set(weights_digest) <= _HEX
        ):
            raise refusal(subject, f"has weights_digest={weights_digest!r}; must be a SHA-256 hex digest or null")
        largest = largest_feature_norm
        if largest is not None and (
            isinstance(largest, bool)
            or not isinstance(largest, (int, float))
            or not math.isfinite(largest)
            or largest < 0
        ):
            raise refusal(subject, f"has largest_feature_norm={largest!r}; must be a number >= 0 or null")
        recorder = claim.recorder()
        try:
            entries = parse_ledger(ledger)  # types and counts
        except v.ParameterError as err:
            raise refusal(subject, f"has an invalid ledger ({err})") from None
        with warnings.catch_warnings():  # given when the steps were first recorded
            warnings.simplefilter("ignore", HiddenStateWarning)
            try:
                recorder.record_restored(entries)  # the checks each step passed when it was first recorded
            except v.ParameterError as err:
                raise refusal(subject, f"has an invalid ledger ({err})") from None
        if recorder.steps != steps:
            raise refusal(subject, f"says {steps} steps were taken but its ledger accounts {recorder.steps}")
        # its steps' inputs must be known to respect the declared bound (checked when they were taken)
        recorder.restore_feature_norm(largest, subject)
        self.recorder, self.weights_digest, self.subject = recorder, weights_digest, subject

    @classmethod
    def of(
        cls, recorder: RunRecorder, *, weights_digest: Optional[str] = None, subject: str = "the run's state"
    ) -> "RunState":
        """The state of a live recorder (checked as it recorded: nothing is replayed)."""
        if not isinstance(recorder, RunRecorder):
            raise v.ParameterError("recorder", f"must be a RunRecorder, got {type(recorder).__name__}")
        if recorder.claim.planned:
            raise v.ParameterError("recorder", "holds a planned run, not one that was trained")
        run = cls.__new__(cls)
        run.recorder, run.weights_digest, run.subject = recorder, weights_digest, subject
        return run

    @property
    def steps(self) -> int:
        return self.recorder.steps

    @property
    def claim(self) -> Claim:
        return self.recorder.claim

    @property
    def schedule(self) -> Optional[BatchSchedule]:
        return self.recorder.claim.schedule

    def continued(self, claim: Claim) -> "RunState":
        """This run under ``claim``, the configuration of the process that resumes it, after
        :func:`check_continues` (``claim`` is the run's in everything its numbers and checks rest on);
        what ``claim`` leaves open (the schedule, the model, the dataset size, the relation) is the
        run's. The ledger is replayed under the result."""
        stored = self.claim
        check_continues(
            stored,
            geometry=claim.geometry,
            assume_convex_model=claim.assume_convex_model,
            gaussian_initialization=claim.gaussian_initialization,
            schedule=claim.schedule,
            dataset_size=claim.dataset_size,
            model=claim.model,
            neighboring_relation=claim.neighboring_relation,
        )
        resumed = attr.evolve(
            claim,
            **{
                name: getattr(stored, name)
                for name in ("schedule", "model", "dataset_size", "neighboring_relation")
                if getattr(claim, name) is None
            },
        )
        return RunState(
            resumed,
            ledger=self.recorder.ledger_state(),
            steps=self.steps,
            largest_feature_norm=self.recorder.largest_feature_norm,
            weights_digest=self.weights_digest,
            subject=self.subject,
        )

    def check_weights(self, digest: str, what: str) -> None:
        """Raises unless the state was saved with the weights whose :func:`weights_digest` is
        ``digest`` (``what`` names them in the error)."""
        if self.weights_digest is None:
            raise refusal(
                self.subject,
                f"is not bound to model weights (it was not written with them, e.g. by "
                f"save_checkpoint), so it cannot be shown to describe {what}",
            )
        if self.weights_digest != digest:
            raise refusal(
                self.subject,
                f"was saved with other model weights than {what} (spliced from another "
                "checkpoint?): its ledger is not the run of these weights",
            )


def check_continues(
    stored: Claim,
    *,
    geometry: Optional[LossGeometry],
    assume_convex_model: bool,
    gaussian_initialization: bool = False,
    schedule: Optional[BatchSchedule] = None,
    dataset_size: Optional[int] = None,
    model: Optional[ModelFacts] = None,
    neighboring_relation=None,
) -> None:
    """Raises :class:`~hidden_state_accountants.ParameterError` naming the parameter where a resuming
    process's configuration differs from the claim ``stored`` of the run it resumes: the geometry and
    the flags always; the schedule, the dataset size, the model's structure (:meth:`ModelFacts.structure
    <hidden_state_accountants.recording.ModelFacts.structure>`) and the relation where the configuration
    names them (``None``: the run's). The one comparison of every adapter."""

    def differs(name: str, mine, theirs) -> None:
        raise v.ParameterError(
            name, f"the checkpoint was taken with {name}={theirs}, this run is configured with {name}={mine}"
        )

    if schedule is not None and stored.schedule is not None and not schedule.same_schedule(stored.schedule):
        differs("schedule", repr(schedule), repr(stored.schedule))
    if None not in (dataset_size, stored.dataset_size) and dataset_size != stored.dataset_size:
        differs("dataset_size", dataset_size, stored.dataset_size)
    if geometry != stored.geometry:
        if (
            None not in (geometry, stored.geometry)
            and stored.geometry.feature_norm_bound is None
            and geometry.feature_norm_bound is not None
        ):
            raise v.ParameterError(
                "geometry",
                "the checkpoint's geometry has no feature_norm_bound (it was declared by its "
                "constants), so its steps are not known to respect "
                f"feature_norm_bound={geometry.feature_norm_bound:g}; train again, or configure the "
                "geometry by its constants (LossGeometry(smoothness=..., strong_convexity=..., ...), "
                "reported as your claim)",
            )
        differs("geometry", geometry, stored.geometry)
    for name, mine in (
        ("assume_convex_model", assume_convex_model),
        ("gaussian_initialization", gaussian_initialization),
    ):
        if mine != getattr(stored, name):
            differs(name, mine, getattr(stored, name))
    if None not in (model, stored.model) and model.structure() != stored.model.structure():
        raise v.ParameterError(
            "model",
            f"the checkpoint was taken with {stored.model.description or 'a model'} "
            "of another structure than the configured one",
        )
    # a checkpoint written before the outputs were read has outputs None (unknown): not compared
    if model is not None and stored.model is not None and stored.model.outputs not in (None, model.outputs):
        differs("outputs", model.outputs, stored.model.outputs)
    relation = None if neighboring_relation is None else parse_relation(neighboring_relation)
    if None not in (relation, stored.neighboring_relation) and relation != stored.neighboring_relation:
        differs("neighboring_relation", relation.name, stored.neighboring_relation.name)


def encode_claim(claim: Claim) -> Dict[str, Any]:
    """The claim in plain JSON types (the ``claim`` field of :func:`seal_run`)."""
    s, m = claim.schedule, claim.model
    return {
        "schedule": None if s is None else s.describe(),
        "seed_is_secret": bool(s is not None and s.seed_is_secret),
        "geometry": None if claim.geometry is None else attr.asdict(claim.geometry),
        "model": None
        if m is None
        else {
            "layers": [layer.to_dict() for layer in m.layers],
            "complete": m.complete,
            "description": m.description,
            "feature_clip_norm": m.feature_clip_norm,
            "outputs": m.outputs,
        },
        "assume_convex_model": claim.assume_convex_model,
        "gaussian_initialization": claim.gaussian_initialization,
        "dataset_size": claim.dataset_size,
        "neighboring_relation": None if claim.neighboring_relation is None else claim.neighboring_relation.name,
        "default_relation": claim.default_relation.name,
        "feature_unobservable": claim.feature_unobservable,
        "loss": None if claim.loss is None else list(claim.loss),
    }


def seal_run(run: Optional[RunState], *, fmt: str, version: int, **extra: Any) -> Dict[str, Any]:
    """``run`` (``None``: nothing recorded yet) with the adapter's ``extra`` fields (plain JSON),
    as one sealed payload (:func:`seal_state`)."""
    clash = set(extra) & {"format", "version", *RUN_KEYS}
    if clash:
        raise v.ParameterError("extra", f"must not redefine {sorted(clash)}")
    if run is None:
        fields = {"steps": 0, "ledger": [], "claim": None, "largest_feature_norm": None, "weights_digest": None}
    else:
        fields = {
            "steps": run.steps,
            "ledger": run.recorder.ledger_state(),
            "claim": encode_claim(run.claim),
            "largest_feature_norm": run.recorder.largest_feature_norm,
            "weights_digest": run.weights_digest,
        }
    return seal_state({"format": fmt, "version": version, **fields, **extra})


def open_run(
    state: Any, *, fmt: str, version: int, subject: str = "the run's state", extra: Sequence[str] = ()
) -> Tuple[Optional[RunState], Dict[str, Any]]:
    """The :class:`RunState` of a :func:`seal_run` result (``None`` if nothing was recorded) and
    the adapter's ``extra`` fields (present, not checked: the adapter checks them), after every
    check of :func:`open_state` and :class:`RunState`."""
    payload = open_state(state, subject=subject, fmt=fmt, version=version, keys=RUN_KEYS + tuple(extra))
    unknown = sorted(set(payload) - {"format", "version", *RUN_KEYS, *extra})
    if unknown:
        raise refusal(subject, f"has unknown fields {', '.join(unknown)}")
    extras = {k: payload[k] for k in extra}
    if payload["claim"] is None:
        if (
            payload["steps"]
            or payload["ledger"]
            or payload["weights_digest"] is not None
            or payload["largest_feature_norm"] is not None
        ):
            raise refusal(subject, f"accounts {payload['steps']} steps without a claim (no batch schedule)")
        return None, extras
    run = RunState(
        decode_claim(payload["claim"], subject),
        ledger=payload["ledger"],
        steps=payload["steps"],
        largest_feature_norm=payload["largest_feature_norm"],
        weights_digest=payload["weights_digest"],
        subject=subject,
    )
    return run, extras


def decode_claim(claim: Any, subject: str) -> Claim:
    """:func:`encode_claim`'s JSON back as a :class:`~hidden_state_accountants.recording.Claim`, every
    type checked."""
    if not isinstance(claim, dict) or set(claim) != set(CLAIM_KEYS):
        got = sorted(claim) if isinstance(claim, dict) else type(claim).__name__
        raise refusal(subject, f"has a claim with fields {got}; must have {sorted(CLAIM_KEYS)}")
    for flag in ("seed_is_secret", "assume_convex_model", "gaussian_initialization"):
        if not isinstance(claim[flag], bool):
            raise refusal(subject, f"has {flag}={claim[flag]!r}; must be true or false")
    schedule = claim["schedule"]
    if schedule is not None:
        if (
            isinstance(schedule, dict)
            and schedule.get("seed") is None
            and schedule.get("sampling") in RANDOM
            and not schedule.get("external", False)
        ):
            raise refusal(subject, f"has a {schedule['sampling']} schedule without its seed")
        try:
            schedule = BatchSchedule.from_description(schedule, seed_is_secret=claim["seed_is_secret"])
        except (v.ParameterError, TypeError, ValueError) as err:
            raise refusal(subject, f"has an invalid schedule ({err})") from None
    size = claim["dataset_size"]
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise refusal(subject, f"has dataset_size={size!r}; must be a positive integer or null")
    why, loss = claim["feature_unobservable"], claim["loss"]
    if why is not None and not isinstance(why, str):
        raise refusal(subject, f"has feature_unobservable={why!r}; must be a reason or null")
    if loss is not None and not (
        isinstance(loss, list)
        and len(loss) == 2
        and isinstance(loss[1], str)
        and (loss[0] is None or isinstance(loss[0], str))
    ):
        raise refusal(subject, f"has loss={loss!r}; must be [kind or null, description] or null")
    try:
        geometry = None if claim["geometry"] is None else LossGeometry(**claim["geometry"])
        model = None if claim["model"] is None else _decode_model(claim["model"])
    except (TypeError, ValueError, KeyError) as err:  # ParameterError included
        raise refusal(subject, f"has an invalid geometry or model ({err})") from None
    try:
        return Claim(
            schedule=schedule,
            geometry=geometry,
            model=model,
            assume_convex_model=claim["assume_convex_model"],
            gaussian_initialization=claim["gaussian_initialization"],
            dataset_size=size,
            neighboring_relation=claim["neighboring_relation"],
            default_relation=claim["default_relation"],
            feature_unobservable=why,
            loss=None if loss is None else tuple(loss),
        )
    except v.ParameterError as err:
        raise refusal(subject, f"has a claim that does not hold ({err})") from None


def _decode_model(d: Dict[str, Any]) -> ModelFacts:
    if (
        not isinstance(d, dict)
        # "outputs" is absent from checkpoints written before it was read (unknown: None)
        or set(d) - {"outputs"} != {"layers", "complete", "description", "feature_clip_norm"}
        or not isinstance(d["layers"], list)
        or not isinstance(d["complete"], bool)
        or not isinstance(d["description"], str)
    ):
        raise ValueError(
            f"a model must be {{layers: [...], complete: bool, description: str, feature_clip_norm: "
            f"number or null, outputs: integer or null}}, got {d!r}"
        )
    layers: List[LayerFacts] = []
    for layer in d["layers"]:
        if (
            not isinstance(layer, dict)
            or not isinstance(layer.get("name"), str)
            or not isinstance(layer.get("trainable"), bool)
        ):
            raise ValueError(f"a layer must be {{name: str, kind: str, trainable: bool}}, got {layer!r}")
        layers.append(LayerFacts(**layer))
    clip = d["feature_clip_norm"]  # a bool or a string would pass ModelFacts' float converter
    return ModelFacts(
        layers=layers,
        complete=d["complete"],
        description=d["description"],
        feature_clip_norm=None if clip is None else v.positive_float("feature_clip_norm", clip),
        outputs=d.get("outputs"),
    )


# -------------------------------------------------------------------------- files
def write_atomically(path: Union[str, "os.PathLike[str]"], write: Callable[[BinaryIO], None]) -> None:
    """Calls ``write`` on a new temporary file in ``path``'s directory, flushes it to disk and
    renames it onto ``path``: a process killed at any point leaves either the previous file or
    the new one, never a partial file (POSIX rename). The file is readable by its owner only
    (a checkpoint is as private as the data). A failed ``write`` removes the temporary file."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename itself survives a crash once the directory is synced
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


__all__ = [
    "CLAIM_KEYS",
    "RUN_KEYS",
    "RunState",
    "check_continues",
    "encode_claim",
    "decode_claim",
    "open_run",
    "open_state",
    "refusal",
    "seal_run",
    "seal_state",
    "unseal_state",
    "weights_digest",
    "write_atomically",
]
