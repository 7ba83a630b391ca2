"""Neighbouring relations: REPLACE_ONE (the papers') and ADD_OR_REMOVE_ONE (Opacus', dp_accounting's default).

The values are dp_accounting's ``NeighboringRelation`` members. Under ADD_OR_REMOVE_ONE one record
moves a step with a fixed divisor ``B`` by at most ``lr C / B`` (present vs absent) instead of
``2 lr C / B`` (``+C`` vs ``-C``). Which schedules and analyses carry over is derived in
docs/derivations.md, section 11; this module holds the parts every analysis shares.

>>> parse_relation("add_or_remove_one").name
'ADD_OR_REMOVE_ONE'
>>> sensitivity_factor(REPLACE_ONE), sensitivity_factor(ADD_OR_REMOVE_ONE)
(2.0, 1.0)
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import attr
from dp_accounting import privacy_accountant

from hidden_state_accountants import validation as v
from hidden_state_accountants.schedules import (
    BALLS_IN_BINS,
    CYCLIC,
    FULL,
    POISSON,
    RESHUFFLE,
    SHUFFLE_PARTITION,
    WITHOUT_REPLACEMENT,
)

NeighborRel = privacy_accountant.NeighboringRelation
REPLACE_ONE = NeighborRel.REPLACE_ONE
ADD_OR_REMOVE_ONE = NeighborRel.ADD_OR_REMOVE_ONE
RELATIONS = (REPLACE_ONE, ADD_OR_REMOVE_ONE)

# The schedules whose analyses carry over to ADD_OR_REMOVE_ONE (docs/derivations.md section 11 and "Balls-in-bins sampling"):
# each record's steps are drawn independently of the others', so adding one changes nothing else.
ADD_REMOVE_SCHEDULES = (FULL, POISSON, BALLS_IN_BINS)

# Why the others do not (docs/derivations.md section 11): the package's samplers place records by position.
ADD_REMOVE_UNSUPPORTED = {
    WITHOUT_REPLACEMENT: (
        "not covered under ADD_OR_REMOVE_ONE: with b-of-n sampling without replacement an added record "
        "changes every inclusion probability (b/n -> b/(n+1)) and, when drawn, displaces one of the others "
        "(the batch size is fixed), a replace-one change of sensitivity 2C; no bound with sensitivity C holds "
        "(dp_accounting has none either)"
    ),
    CYCLIC: (
        "not covered under ADD_OR_REMOVE_ONE: the package's partition samplers cut the ordered dataset into "
        "n//b blocks, so an added record shifts every later record to another batch or completes a new batch "
        "(the steps per epoch and the dropped remainder change); the two runs differ in more than one "
        "record's schedule"
    ),
    SHUFFLE_PARTITION: (
        "not covered under ADD_OR_REMOVE_ONE: a random partition of n+1 records restricted to the n common "
        "ones is not a partition of n records; the added record displaces one record into the dropped "
        "remainder, a replace-one change"
    ),
    RESHUFFLE: (
        "not covered under ADD_OR_REMOVE_ONE: the added record displaces a record of its batch order every "
        "epoch (the same position effect as for the partition samplers); with the short batch dropped and "
        "1 <= n % b <= b - 2 the add/remove pair is a replace-one change in every epoch that uses the record, so "
        "the REPLACE_ONE si_reshuffle_average number bounds it too (docs/derivations.md B.6; not reported "
        "automatically), with nothing gained from the relation; sampling='balls_in_bins' "
        "(BallsInBinsBatchSampler) has an add/remove analysis"
    ),
}


def parse_relation(value: Union[str, NeighborRel], name: str = "neighboring_relation") -> NeighborRel:
    """A ``NeighboringRelation`` from itself or its name (any case); REPLACE_SPECIAL is refused."""
    if isinstance(value, NeighborRel):
        rel = value
    elif isinstance(value, str) and value.strip().upper() in ("REPLACE_ONE", "ADD_OR_REMOVE_ONE"):
        rel = NeighborRel[value.strip().upper()]
    else:
        raise v.ParameterError(name, f"must be REPLACE_ONE or ADD_OR_REMOVE_ONE, got {value!r}")
    if rel not in RELATIONS:
        raise v.ParameterError(name, f"must be REPLACE_ONE or ADD_OR_REMOVE_ONE, got {rel.name}")
    return rel


def resolve_relation(
    explicit: Optional[NeighborRel], default: NeighborRel, sampling: str
) -> Tuple[NeighborRel, Optional[str]]:
    """The relation a run of ``sampling`` is reported under, and why it is not ``default`` when it is
    not: ``explicit`` if given; else the host library's ``default`` wherever the schedule is covered
    under it, and REPLACE_ONE otherwise (this package's fixed-size samplers under ADD_OR_REMOVE_ONE).
    The one rule for every adapter; each states only its host's default (Opacus: ADD_OR_REMOVE_ONE,
    TF-Privacy for this package: REPLACE_ONE).

    >>> resolve_relation(None, ADD_OR_REMOVE_ONE, "poisson")[0].name
    'ADD_OR_REMOVE_ONE'
    >>> relation, note = resolve_relation(None, ADD_OR_REMOVE_ONE, "cyclic")
    >>> relation.name, note.startswith("reported under REPLACE_ONE, not the host's ADD_OR_REMOVE_ONE")
    ('REPLACE_ONE', True)
    """
    if explicit is not None:
        return explicit, None
    reason = schedule_reason(default, sampling)
    if reason:
        return REPLACE_ONE, (
            f"reported under REPLACE_ONE, not the host's {default.name}: the {sampling} schedule is {reason}"
        )
    return default, None


def sensitivity_factor(relation: NeighborRel) -> float:
    """How many clip norms one record moves a step's clipped sum by: 2 (replace) or 1 (add/remove)."""
    return 2.0 if relation == REPLACE_ONE else 1.0


def schedule_reason(relation: NeighborRel, sampling: str) -> Optional[str]:
    """Why no analysis of ``sampling`` holds under ``relation`` (``None`` when some may)."""
    if relation == ADD_OR_REMOVE_ONE and sampling not in ADD_REMOVE_SCHEDULES:
        return ADD_REMOVE_UNSUPPORTED[sampling]
    return None


def as_add_remove(run, *, keep_geometry: bool = True):
    """The add/remove pair of a fixed-divisor run in the replace-one parametrisation (docs/derivations.md
    sections 11 and 16).

    Every fixed-schedule analysis reads one record's effect on a step as ``2 C lr / B`` and the noise
    as ``z C / B``. Halving the clip norm and doubling the noise multiplier keeps the noise and makes
    the effect ``C lr / B``: the add/remove pair with the divisor ``B`` fixed. The batch holding the
    added record has ``B + 1`` records over the divisor ``B`` and the L2 term ``m_reg`` once: with every
    per-example update ``m``-strongly convex and ``M``-smooth (L2 included), its curvature lies in
    ``[m_reg + ((B+1)/B)(m - m_reg), m_reg + ((B+1)/B)(M - m_reg)]``. The smoothness grows; the strong
    convexity *shrinks* when ``m_reg > m`` (the data part may then be locally concave). Both ends are
    used, so the L2 strength must be declared (``l2_regularization``, 0 without weight decay): with it
    unknown the lower end is unbounded. Raises ``ParameterError`` naming ``l2_regularization`` when it
    is unknown or the added record's batch is not convex, and ``learning_rate`` when the step size is
    too large for the larger smoothness (``lr >= 2/M'``).

    >>> from hidden_state_accountants import TrainingRunDpEvent, LossGeometry
    >>> run = TrainingRunDpEvent(dataset_size=10, batch_size=10, steps=5, noise_multiplier=1.0, clip_norm=1.0,
    ...     learning_rate=0.1, sampling="full", geometry=LossGeometry(smoothness=1.0, strong_convexity=0.5),
    ...     l2_regularization=0.0)
    >>> r = as_add_remove(run)
    >>> r.clip_norm, r.noise_multiplier, round(r.geometry.smoothness, 6), r.geometry.strong_convexity
    (0.5, 2.0, 1.1, 0.5)
    >>> round(as_add_remove(run.replace(l2_regularization=0.8)).geometry.strong_convexity, 6)  # 0.8 + 1.1 (0.5 - 0.8)
    0.47
    """
    g = run.geometry if keep_geometry else None
    if g is not None:
        B = run.batch_size
        m_reg = run.l2_regularization
        if m_reg is None:
            raise v.ParameterError(
                "l2_regularization",
                "must be declared under ADD_OR_REMOVE_ONE (0 when the optimizer applies no "
                "L2 term outside the per-example gradients): the batch holding the added record has B + 1 records "
                "over the divisor B, and its strong convexity m_reg + ((B+1)/B)(m - m_reg) depends on the L2 "
                "strength m_reg (docs/derivations.md section 16)",
            )
        larger = m_reg + (B + 1) / B * (g.smoothness - m_reg)
        smaller = m_reg + (B + 1) / B * (g.strong_convexity - m_reg)
        if smaller < 0:
            raise v.ParameterError(
                "l2_regularization",
                f"{m_reg:g} exceeds the declared strong convexity {g.strong_convexity:g} so much "
                f"that the batch holding the added record (B + 1 = {B + 1} records over the divisor {B}) is not "
                f"convex: curvature down to {smaller:.6g} (docs/derivations.md section 16)",
            )
        g = attr.evolve(g, smoothness=max(larger, g.smoothness), strong_convexity=min(smaller, g.strong_convexity))
    noise = run.noise_multiplier
    noise = tuple(2.0 * z for z in noise) if isinstance(noise, tuple) else 2.0 * noise
    return run.replace(clip_norm=run.clip_norm / 2.0, noise_multiplier=noise, geometry=g)


__all__ = [
    "REPLACE_ONE",
    "ADD_OR_REMOVE_ONE",
    "RELATIONS",
    "NeighborRel",
    "parse_relation",
    "resolve_relation",
    "sensitivity_factor",
    "schedule_reason",
    "as_add_remove",
    "ADD_REMOVE_UNSUPPORTED",
    "ADD_REMOVE_SCHEDULES",
]
