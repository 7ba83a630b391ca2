"""A readable privacy statement for model cards, computed from the numbers of a run.

It states what was actually run: the batch schedule, the declared geometry, the best valid epsilon
when only the final model is released, the composition epsilon that covers every checkpoint, why no
hidden-state claim is made when none is, and what the claim rests on (the recorder's notes). All
numbers come from the accountant. The TF-Privacy adapter's ``compute_hidden_state_privacy_statement``
(the counterpart of TF-Privacy's ``compute_dp_sgd_privacy_statement``) and its callback's
``privacy_statement()`` are this text.

>>> from hidden_state_accountants import LossGeometry
>>> text = privacy_statement(1000, 50, 10, 2.0, 1e-5, l2_norm_clip=1.0, learning_rate=0.5,
...     sampling="shuffle_partition",
...     geometry=LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=0.01, num_classes=2))
>>> "Epsilon if only the final model is released" in text
True
"""

from __future__ import annotations

import itertools
import math
import textwrap
from typing import List, Optional, Sequence, Union

from hidden_state_accountants.accountant import PrivacyReport
from hidden_state_accountants.errors import ParameterError
from hidden_state_accountants.events import LossGeometry, TrainingRunDpEvent
from hidden_state_accountants.recording import NO_GEOMETRY, Claim, RunRecorder, StepFacts, batch_records
from hidden_state_accountants.relations import REPLACE_ONE
from hidden_state_accountants.schedules import DROPPED, FULL, KEPT_OWN_SIZE, SAMPLING_DESCRIPTIONS, BatchSchedule

__all__ = ["privacy_statement", "render_statement"]

_WIDTH = 80
_ADJACENCY = {"REPLACE_ONE": "replace-one", "ADD_OR_REMOVE_ONE": "add/remove-one"}


def privacy_statement(
    number_of_examples: int,
    batch_size: int,
    num_epochs: float,
    noise_multiplier: float,
    delta: float,
    *,
    l2_norm_clip: float,
    learning_rate: Union[float, Sequence[float]],
    sampling: str,
    geometry: Optional[LossGeometry],
    include_analyses: bool = False,
    last_batch: str = DROPPED,
    secret_batches: bool = True,
    neighboring_relation=REPLACE_ONE,
    host_paragraphs: Sequence[str] = (),
) -> str:
    """The statement for a finished run of DP-SGD described by its numbers.

    The run is recorded by the core's :class:`~hidden_state_accountants.recording.RunRecorder` as
    an adapter records it, so the text says what an adapter's statement would: the declared
    geometry is taken as the user's claim (the model is not seen here, so the text says its
    convexity was asserted, and the L2 term and projection as declared), and a learning rate that
    changes ends the hidden-state claim, with the reason in the text.

    Args:
      number_of_examples: ``n``, the number of training examples.
      batch_size: ``b``, examples per step (one example per microbatch).
      num_epochs: epochs trained; ``num_epochs * steps_per_epoch`` must be a whole number of
        steps (``steps_per_epoch = n // b``, 1 for ``full``, ``ceil(n / b)`` when the short
        batch is kept).
      noise_multiplier: ``z``.
      delta: the target delta.
      l2_norm_clip: ``C``.
      learning_rate: the constant step size, or one value per step.
      sampling: the batch schedule (one of ``hidden_state_accountants.SAMPLINGS``).
      geometry: the declared :class:`LossGeometry`, or ``None`` (composition only).
      include_analyses: append the accountant's table of every analysis and why the others
        do not apply.
      last_batch: for ``reshuffle``, ``"dropped"`` (the default), ``"kept_own_size"`` (the last
        ``n % b`` records of every epoch form a short batch divided by its own size, as
        TF-Privacy does) or ``"kept_batch_size"`` (divided by ``b``, as Opacus does).
      secret_batches: ``False`` when the batches' randomness is public (e.g. a shuffle after a
        published random seed): only the worst-position bounds apply.
      neighboring_relation: the relation the run is reported under (the claim's host default).
      host_paragraphs: paragraphs the host framework appends (e.g. what its own statement says
        that does not apply).

    Returns:
      Text precisely articulating the guarantee, with the numbers.
    """
    if not isinstance(secret_batches, bool):  # named here: the schedule calls it `secret`
        raise ParameterError("secret_batches", f"must be True or False, got {secret_batches!r}")
    # its seed plays no part in the numbers
    schedule = BatchSchedule(number_of_examples, batch_size, sampling, last_batch=last_batch, secret=secret_batches)
    steps = float(num_epochs) * schedule.steps_per_epoch
    if not (math.isfinite(steps) and steps >= 1 and steps.is_integer()):
        raise ParameterError(
            "num_epochs",
            f"{num_epochs!r} epochs of {schedule.steps_per_epoch} steps is not a positive whole number of steps",
        )
    if isinstance(learning_rate, (int, float)):
        runs = [(learning_rate, int(steps))]
    else:
        runs = [(lr, len(list(group))) for lr, group in itertools.groupby(learning_rate)]
        if sum(count for _, count in runs) != steps:
            raise ParameterError("learning_rate", f"needs one value per step ({int(steps)} steps)")
    claim = Claim(
        schedule=schedule,
        geometry=geometry,
        assume_convex_model=geometry is not None,
        default_relation=neighboring_relation,
        feature_unobservable="the statement is computed without the data",
        loss=(None, "the statement is computed without the training code"),
    )
    declared = dict(weight_decay=geometry.strong_convexity, projection_diameter=geometry.diameter) if geometry else {}
    if len(runs) == 1:  # a constant learning rate: two epochs show every kind of step; the rest repeats them
        shown = min(int(steps), 2 * schedule.steps_per_epoch)
        per_step = itertools.repeat(runs[0][0], shown)
    else:  # one value per step, as given
        per_step = (lr for lr, count in runs for _ in range(count))
    # a kept short batch (the last step of every epoch) is divided by its own size under kept_own_size
    # (TF-Privacy), by b under kept_batch_size (Opacus)
    divisors = (
        batch_records(schedule, t) if schedule.last_batch == KEPT_OWN_SIZE else schedule.batch_size
        for t in itertools.count()
    )
    recorder = claim.recorder(
        (
            StepFacts(
                noise_multiplier=noise_multiplier, clip_norm=l2_norm_clip, learning_rate=lr, divisor=d, **declared
            ),
            sum(1 for _ in group),
        )
        for (lr, d), group in itertools.groupby(zip(per_step, divisors))
    )
    # the text states why no hidden-state claim is made, so no warning is added
    return render_statement(
        recorder, delta, steps=int(steps), include_analyses=include_analyses, host_paragraphs=host_paragraphs
    )


def render_statement(
    recorder: RunRecorder,
    delta: float,
    *,
    steps: Optional[int] = None,
    extra_notes: Sequence[str] = (),
    include_analyses: bool = False,
    host_paragraphs: Sequence[str] = (),
) -> str:
    """The statement for the run a recorder holds (``steps`` more than recorded: its last step
    repeated), with what the claim rests on (:meth:`RunRecorder.notes
    <hidden_state_accountants.recording.RunRecorder.notes>`: among them why the relation is not the host's
    default, when it is not) and ``extra_notes`` stated as qualifications, and the host's paragraphs last."""
    run = recorder.run(steps=steps, warn=False)
    report = recorder.report(delta, steps=steps, warn=False)
    paragraphs = _render(run, report, recorder.notes() + list(extra_notes), include_analyses)
    return "\n\n".join(paragraphs + [_fill(p) for p in host_paragraphs]) + "\n"


def _fill(text: str) -> str:
    return textwrap.fill(text, width=_WIDTH, break_on_hyphens=False)


def _num(x: float) -> str:
    return f"{x:12.3f}" if math.isfinite(x) else f"{'inf':>12}"


def _render(run: TrainingRunDpEvent, report: PrivacyReport, notes: List[str], include_analyses: bool) -> List[str]:
    n, b, spe = run.dataset_size, run.batch_size, run.steps_per_epoch
    if isinstance(run.learning_rate, tuple):
        lr = f"a learning-rate schedule from {run.learning_rate[0]:g} to {run.learning_rate[-1]:g}"
    else:
        lr = f"constant learning rate {run.learning_rate:g}"
    z = run.noise_multiplier
    z_text = f"noise multiplier {z:g}" if not isinstance(z, tuple) else "a noise-multiplier schedule"
    paragraphs = [
        _fill(
            f"DP-SGD performed over {n} examples with {b} examples per iteration (one example per "
            f"microbatch), {z_text}, l2_norm_clip {run.clip_norm:g} and {lr}, for {run.steps / spe:g} epochs "
            f"({run.steps} steps)."
        )
    ]
    schedule = f"Batch schedule '{run.sampling}': {SAMPLING_DESCRIPTIONS[run.sampling]}"
    if run.sampling != FULL and n % b and run.last_batch == KEPT_OWN_SIZE:
        schedule += (
            f", plus a short last batch of the {n % b} examples left over ({n} mod {b}) every epoch, "
            "divided by its own size"
        )
    elif run.sampling != FULL and n % b and run.last_batch != DROPPED:
        schedule += (
            f", plus a short last batch of the {n % b} examples left over ({n} mod {b}) every epoch, divided by {b}"
        )
    elif run.sampling != FULL and n % b:
        schedule += f"; the {n % b} examples left over ({n} mod {b}) are dropped each epoch"
    paragraphs.append(_fill(schedule + "."))

    geom = run.geometry
    refusal = run.hidden_state_reason()
    if geom is None and refusal in (None, NO_GEOMETRY):
        paragraphs.append(
            _fill(
                "No loss geometry was declared, so no hidden-state claim is made: the guarantee below is "
                "the composition bound and protects the release of all model checkpoints in addition to "
                "the final model."
            )
        )
    elif refusal:
        paragraphs.append(
            _fill(
                f"No hidden-state claim is made for this run: {refusal}. The guarantee below is the composition "
                "bound and protects the release of all model checkpoints in addition to the final model."
            )
        )
    else:
        domain = (
            f"projected after every step onto a convex set of diameter {geom.diameter:g}"
            if geom.diameter is not None
            else "not projected (unconstrained)"
        )
        paragraphs.append(
            _fill(
                f"Declared loss geometry (an assumption; the notes below say which parts of it were enforced or "
                f"checked): the per-example "
                f"update map clip(grad loss) + l2 * theta is {geom.strong_convexity:g}-strongly convex and "
                f"{geom.smoothness:g}-smooth, with any L2 regularisation applied outside per-example "
                f"clipping; the parameters are {domain}."
            )
        )

    best = next((a for a in report.analyses if a.name == report.analysis), None)
    comp = report.composition_epsilon
    lines = [
        _fill(
            f"Example-level DP with {_ADJACENCY.get(report.neighboring_relation, report.neighboring_relation)} "
            f"adjacency ({report.neighboring_relation}) at delta = {report.delta:g}:"
        )
    ]
    if geom is not None:
        lines.append(
            f"    Epsilon if only the final model is released:     {_num(report.epsilon)}  ({report.analysis})"
        )
    lines.append(f"    Epsilon if every checkpoint is released:         {_num(comp)}  (composition)")
    paragraphs.append("\n".join(lines))

    if geom is not None and best is not None and best.hidden_state:
        paragraphs.append(
            _fill(
                "The first number holds only if intermediate models are never published (no checkpoints "
                "and nothing computed from them); otherwise the composition number applies."
            )
        )
    elif geom is not None:
        reasons = [a for a in report.analyses if a.hidden_state and a.reason]
        why = f" (e.g. {reasons[0].name}: {reasons[0].reason})" if reasons else ""
        paragraphs.append(
            _fill(
                "No hidden-state analysis improves on composition for this run"
                + why
                + "; the reported epsilon also protects every checkpoint."
            )
        )
    paragraphs += [_fill(f"Note: {note}.") for note in notes]
    paragraphs.append(
        _fill(
            "Metrics computed on the training data during training (e.g. the per-epoch loss and "
            "accuracy) are not covered by either number."
        )
    )
    if include_analyses:
        paragraphs.append(report.to_table())
    return paragraphs
