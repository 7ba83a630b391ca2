"""A readable privacy statement for model cards, the counterpart of TF-Privacy's
``compute_dp_sgd_privacy_statement``.

TF-Privacy's statement reports composition (every checkpoint released) with each example
once per epoch, and a number "assuming Poisson sampling" that does not hold for a shuffled
``fit``. This one states what was actually run: the core's
:func:`~hidden_state_accountants.statement.privacy_statement` under TF-Privacy's rules (every batch
divided by its own size, REPLACE_ONE), with what TF-Privacy's own statement says that does not
apply.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

from hidden_state_accountants import LossGeometry, ParameterError
from hidden_state_accountants.keras.data import check_dataset_last_batch
from hidden_state_accountants.relations import REPLACE_ONE
from hidden_state_accountants.schedules import BALLS_IN_BINS, DROPPED, POISSON
from hidden_state_accountants.statement import privacy_statement

RELATION = REPLACE_ONE
"""The TF-Privacy adapter's host default (the core's relation rule gives it for every schedule it
accepts): the papers' relation; the package's fixed-size schedules are not covered under
ADD_OR_REMOVE_ONE (docs/derivations.md section 11)."""


def host_paragraphs(sampling: str) -> List[str]:
    """What TF-Privacy's own statement says that does not apply to a run of ``sampling``."""
    if sampling == POISSON:
        return []
    return ["TF-Privacy's 'assuming Poisson sampling' epsilon does not apply: batches were not Poisson sampled."]


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

    The arguments are those of :func:`~hidden_state_accountants.statement.privacy_statement`
    (TF-Privacy's first five, then the clip norm, the learning rate or one per step, the batch
    schedule and the declared geometry); ``last_batch`` is ``"dropped"`` or ``"kept_own_size"``
    (``model.fit(x, y, batch_size=b, shuffle=True)`` keeps the last ``n % b`` records of every
    epoch as a short batch, which TF-Privacy divides by its own size), and ``secret_batches`` is
    ``False`` when the batches' randomness is public (Keras' shuffle after ``tf.random.set_seed``).
    The text is the callback's :meth:`~.callback.HiddenStatePrivacyCallback.privacy_statement` for
    such a run, under REPLACE_ONE.
    """
    check_dataset_last_batch(last_batch)
    if sampling == BALLS_IN_BINS:
        # the Keras pipeline spreads an epoch over balls_in_bins_steps(n, b) padded steps, not the n // b this
        # function would state, and its delta leaves out the chance of an overflowing batch
        raise ParameterError(
            "sampling",
            f"{BALLS_IN_BINS!r} is stated by the callback (HiddenStatePrivacyCallback.privacy_statement), which "
            "knows the run's steps per epoch and padding",
        )
    return privacy_statement(
        number_of_examples,
        batch_size,
        num_epochs,
        noise_multiplier,
        delta,
        l2_norm_clip=l2_norm_clip,
        learning_rate=learning_rate,
        sampling=sampling,
        geometry=geometry,
        include_analyses=include_analyses,
        last_batch=last_batch,
        secret_batches=secret_batches,
        neighboring_relation=RELATION,
        host_paragraphs=host_paragraphs(sampling),
    )
