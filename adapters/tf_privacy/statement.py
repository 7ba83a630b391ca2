"""A readable privacy statement for model cards, the counterpart of TF-Privacy's
``compute_dp_sgd_privacy_statement``.

TF-Privacy's statement reports composition (every checkpoint released) with each example
once per epoch, and a number "assuming Poisson sampling" that does not hold for a shuffled
``fit``. This one states what was actually run: the batch schedule, the declared geometry,
the best valid epsilon when only the final model is released, and the composition epsilon
that covers every checkpoint. All numbers come from the core accountant.
"""

from __future__ import annotations

import math
import textwrap
import warnings
from typing import Optional, Sequence, Union

from hidden_state_accountants import HiddenStateAccountant, LossGeometry, ParameterError, TrainingRunDpEvent
from hidden_state_accountants.accountant import PrivacyReport
from hidden_state_accountants.schedules import SAMPLING_DESCRIPTIONS, steps_per_epoch

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
) -> str:
    """Produces a privacy report summarising the DP guarantee of a finished training run.

    Args:
      number_of_examples: ``n``, the number of training examples.
      batch_size: ``b``, examples per step (one example per microbatch).
      num_epochs: epochs trained; ``num_epochs * steps_per_epoch`` must be a whole number of
        steps (``steps_per_epoch = n // b``, 1 for ``full``).
      noise_multiplier: ``z``.
      delta: the target delta.
      l2_norm_clip: ``C``.
      learning_rate: the constant step size, or one value per step.
      sampling: the batch schedule (one of ``hidden_state_accountants.SAMPLINGS``).
      geometry: the declared :class:`LossGeometry`, or ``None`` (composition only).
      include_analyses: append the accountant's table of every analysis and why the others
        do not apply.

    Returns:
      Text precisely articulating the guarantee, with the numbers.
    """
    n = int(number_of_examples)
    spe = steps_per_epoch(n, int(batch_size), sampling) if n >= 1 and int(batch_size) >= 1 else 1
    steps = float(num_epochs) * spe
    if not (math.isfinite(steps) and steps >= 1 and float(steps).is_integer()):
        raise ParameterError(
            "num_epochs", f"{num_epochs!r} epochs of {spe} steps is not a positive whole number of steps"
        )
    if not isinstance(learning_rate, (int, float)):
        learning_rate = tuple(float(x) for x in learning_rate)
    run = TrainingRunDpEvent(
        dataset_size=n, batch_size=batch_size, steps=int(steps), noise_multiplier=noise_multiplier,
        clip_norm=l2_norm_clip, learning_rate=learning_rate, sampling=sampling, geometry=geometry,
    )
    return statement_for_run(run, delta, include_analyses=include_analyses)


def statement_for_run(run: TrainingRunDpEvent, delta: float, *, include_analyses: bool = False) -> str:
    """The statement for a :class:`TrainingRunDpEvent` (what the callback has recorded)."""
    with warnings.catch_warnings():
        if run.geometry is None:  # said in the text below
            warnings.simplefilter("ignore", UserWarning)
        report = HiddenStateAccountant().compose(run).explain(delta)
    return _render(run, report, include_analyses)


def _fill(text: str) -> str:
    return textwrap.fill(text, width=_WIDTH, break_on_hyphens=False)


def _num(x: float) -> str:
    return f"{x:12.3f}" if math.isfinite(x) else f"{'inf':>12}"


def _render(run: TrainingRunDpEvent, report: PrivacyReport, include_analyses: bool) -> str:
    n, b, spe = run.dataset_size, run.batch_size, run.steps_per_epoch
    if isinstance(run.learning_rate, tuple):
        lr = f"a learning-rate schedule from {run.learning_rate[0]:g} to {run.learning_rate[-1]:g}"
    else:
        lr = f"constant learning rate {run.learning_rate:g}"
    z = run.noise_multiplier
    z_text = f"noise multiplier {z:g}" if not isinstance(z, tuple) else "a noise-multiplier schedule"
    epochs = run.steps / spe
    paragraphs = [_fill(
        f"DP-SGD performed over {n} examples with {b} examples per iteration (one example per "
        f"microbatch), {z_text}, l2_norm_clip {run.clip_norm:g} and {lr}, for {epochs:g} epochs "
        f"({run.steps} steps)."
    )]
    schedule = f"Batch schedule '{run.sampling}': {SAMPLING_DESCRIPTIONS[run.sampling]}"
    if run.sampling != "full" and n % b:
        schedule += f"; the {n % b} examples left over ({n} mod {b}) are dropped each epoch"
    paragraphs.append(_fill(schedule + "."))

    geom = run.geometry
    if geom is None:
        paragraphs.append(_fill(
            "No loss geometry was declared, so no hidden-state claim is made: the guarantee below is "
            "the composition bound and protects the release of all model checkpoints in addition to "
            "the final model."
        ))
    else:
        domain = (f"projected after every step onto a convex set of diameter {geom.diameter:g}"
                  if geom.diameter is not None else "not projected (unconstrained)")
        paragraphs.append(_fill(
            f"Declared loss geometry (an assumption, not checked by the accountant): the per-example "
            f"update map clip(grad loss) + l2 * theta is {geom.strong_convexity:g}-strongly convex and "
            f"{geom.smoothness:g}-smooth, with any L2 regularisation applied outside per-example "
            f"clipping; the parameters are {domain}."
        ))

    hidden = next((a for a in report.analyses if a.name == report.analysis), None)
    hidden_won = hidden is not None and hidden.hidden_state
    comp = report.composition_epsilon
    lines = [_fill(
        f"Example-level DP with replace-one adjacency ({report.neighboring_relation}) at delta = "
        f"{report.delta:g}:"
    )]
    if geom is not None:
        lines.append(f"    Epsilon if only the final model is released:     {_num(report.epsilon)}  ({report.analysis})")
    lines.append(f"    Epsilon if every checkpoint is released:         {_num(comp)}  (composition)")
    paragraphs.append("\n".join(lines))

    if geom is not None and hidden_won:
        paragraphs.append(_fill(
            "The first number holds only if intermediate models are never published (no checkpoints "
            "and nothing computed from them); otherwise the composition number applies."
        ))
    elif geom is not None:
        reasons = [a for a in report.analyses if a.hidden_state and a.reason]
        why = f" (e.g. {reasons[0].name}: {reasons[0].reason})" if reasons else ""
        paragraphs.append(_fill(
            "No hidden-state analysis improves on composition for this run" + why
            + "; the reported epsilon also protects every checkpoint."
        ))
    paragraphs.append(_fill(
        "Metrics computed on the training data during training (e.g. Keras' per-epoch loss and "
        "accuracy) are not covered by either number."
    ))
    if run.sampling != "poisson":
        paragraphs.append(_fill(
            "TF-Privacy's 'assuming Poisson sampling' epsilon does not apply: batches were not "
            "Poisson sampled."
        ))
    if include_analyses:
        paragraphs.append(report.to_table())
    return "\n\n".join(paragraphs) + "\n"
