"""A readable privacy statement for model cards, the counterpart of TF-Privacy's
``compute_dp_sgd_privacy_statement``.

TF-Privacy's statement reports composition (every checkpoint released) with each example
once per epoch, and a number "assuming Poisson sampling" that does not hold for a shuffled
``fit``. This one states what was actually run: the batch schedule, the declared geometry,
the best valid epsilon when only the final model is released, the composition epsilon that
covers every checkpoint, why no hidden-state claim is made when none is, and what the claim
rests on (the core recorder's notes). All numbers come from the core accountant.
"""

from __future__ import annotations

import itertools
import math
import textwrap
from typing import List, Optional, Sequence, Union

from hidden_state_accountants import BatchSchedule, LossGeometry, ParameterError, TrainingRunDpEvent
from hidden_state_accountants.accountant import PrivacyReport
from hidden_state_accountants.recording import NO_GEOMETRY, Claim, RunRecorder, StepFacts, batch_records
from hidden_state_accountants.relations import REPLACE_ONE
from hidden_state_accountants.schedules import DROPPED, FULL, KEPT_OWN_SIZE, POISSON, SAMPLING_DESCRIPTIONS

from .data import check_dataset_last_batch

RELATION = REPLACE_ONE
"""The TF-Privacy adapter's host default (the core's relation rule gives it for every schedule it
accepts): the papers' relation; the package's fixed-size schedules are not covered under
ADD_OR_REMOVE_ONE (docs/derivations.md section 11)."""

_WIDTH = 80


def compute_hidden_state_privacy_statement(
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
) -> str:
    """Produces a privacy report summarising the DP guarantee of a finished training run.

    The run is recorded by the core's :class:`RunRecorder` as the callback records it, so
    the text says what the callback's statement would: the declared geometry is taken as
    the user's claim (the model is not seen here, so the text says its convexity was
    asserted, and the L2 term and projection as declared), and a learning rate that changes
    ends the hidden-state claim, with the reason in the text.

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
      last_batch: for ``reshuffle``, ``"dropped"`` (the default) or ``"kept_own_size"``: the
        last ``n % b`` records of every epoch form a short batch that TF-Privacy divides by its
        own size, as ``model.fit(x, y, batch_size=b, shuffle=True)`` does.
      secret_batches: ``False`` when the batches' randomness is public (e.g. Keras' shuffle
        after ``tf.random.set_seed``): only the worst-position bounds apply.

    Returns:
      Text precisely articulating the guarantee, with the numbers.
    """
    check_dataset_last_batch(last_batch)
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
        default_relation=RELATION,
        feature_unobservable="the statement is computed without the data",
        loss=(None, "the statement is computed without the training code"),
    )
    declared = dict(weight_decay=geometry.strong_convexity, projection_diameter=geometry.diameter) if geometry else {}
    if len(runs) == 1:  # a constant learning rate: two epochs show every kind of step; the rest repeats them
        shown = min(int(steps), 2 * schedule.steps_per_epoch)
        per_step = itertools.repeat(runs[0][0], shown)
    else:  # one value per step, as given
        per_step = (lr for lr, count in runs for _ in range(count))
    # a kept short batch (the last step of every epoch) is divided by its own size, as TF-Privacy does
    divisors = (batch_records(schedule, t) for t in itertools.count())
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
    return render_statement(recorder, delta, steps=int(steps), include_analyses=include_analyses)


def render_statement(
    recorder: RunRecorder,
    delta: float,
    *,
    steps: Optional[int] = None,
    extra_notes: Sequence[str] = (),
    include_analyses: bool = False,
) -> str:
    """The statement for the run a recorder holds (``steps`` more than recorded: its last step
    repeated), with what the claim rests on (:meth:`RunRecorder.notes
    <hidden_state_accountants.recording.RunRecorder.notes>`) and ``extra_notes`` stated as qualifications."""
    run = recorder.run(steps=steps, warn=False)
    report = recorder.report(delta, steps=steps, warn=False)
    return _render(run, report, recorder.notes() + list(extra_notes), include_analyses)


def _fill(text: str) -> str:
    return textwrap.fill(text, width=_WIDTH, break_on_hyphens=False)


def _num(x: float) -> str:
    return f"{x:12.3f}" if math.isfinite(x) else f"{'inf':>12}"


def _render(run: TrainingRunDpEvent, report: PrivacyReport, notes: List[str], include_analyses: bool) -> str:
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
    refusal = run.hidden_state_refusal
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
            f"Example-level DP with replace-one adjacency ({report.neighboring_relation}) at delta = {report.delta:g}:"
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
            "Metrics computed on the training data during training (e.g. Keras' per-epoch loss and "
            "accuracy) are not covered by either number."
        )
    )
    if run.sampling != POISSON:
        paragraphs.append(
            _fill("TF-Privacy's 'assuming Poisson sampling' epsilon does not apply: batches were not Poisson sampled.")
        )
    if include_analyses:
        paragraphs.append(report.to_table())
    return "\n\n".join(paragraphs) + "\n"
