"""The registry of analyses: which analyses account which event type, in the order reports list them.

Each analysis describes itself (:class:`~hidden_state_accountants.analyses.analysis_info.AnalysisInfo`:
name, citation, schedules, needs, relations) through the ``@analysis`` decorator of the leaf module
:mod:`~hidden_state_accountants.analyses.analysis_info`; this module lists them explicitly, per
event type, so the accountant asks the registry which analyses hold for a run instead of
hard-coding lists, and lists the others with the reason they do not apply, without calling them.
A training run (:class:`~hidden_state_accountants.TrainingRunDpEvent`) and a DP-SBCD run
(:class:`~hidden_state_accountants.DpSbcdRunDpEvent`) are registered the same way.

>>> from hidden_state_accountants.analyses import registry
>>> [a.name for a in registry.analyses_for("full") if not a.hidden_state]
['bok_thm4.1']
>>> [a.name for a in registry.all_analyses(DpSbcdRunDpEvent)]
['dp_sbcd_composition', 'dp_sbcd_thm4.5']
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from hidden_state_accountants.analyses import altschuler_talwar as at
from hidden_state_accountants.analyses import balls_in_bins as bib
from hidden_state_accountants.analyses import bok, chourasia, composition, sbcd
from hidden_state_accountants.analyses import poisson_hidden_state as ph
from hidden_state_accountants.analyses import random_allocation as ra
from hidden_state_accountants.analyses import shifted_interpolation as si
from hidden_state_accountants.analyses import shuffle_amplification as sa
from hidden_state_accountants.analyses import ye_shokri as ys
from hidden_state_accountants.analyses._common import Context
from hidden_state_accountants.analyses.analysis_info import AnalysisInfo, analysis
from hidden_state_accountants.analyses.sbcd import DpSbcdRunDpEvent
from hidden_state_accountants.bounds import Bound, NotApplicable
from hidden_state_accountants.events import TrainingRunDpEvent
from hidden_state_accountants.schedules import SAMPLINGS


def _infos(*functions) -> Tuple[AnalysisInfo, ...]:
    return tuple(f.info for f in functions)


TRAINING_RUN_ANALYSES: Tuple[AnalysisInfo, ...] = _infos(
    # composition baselines: valid even if every iterate is released
    composition.without_replacement_rdp,
    composition.poisson_pld,
    composition.poisson_rdp,
    bok.thm_4_1,
    bok.thm_4_4,
    bok.thm_4_8,
    bib.composition,
    ra.allocation_composition,
    # hidden-state (last-iterate) analyses
    at.eq_3_3,
    at.eq_3_3_poisson,
    bok.thm_4_2,
    bok.thm_4_3,
    bok.thm_4_5,
    bok.thm_4_6,
    bok.thm_4_9,
    bok.thm_4_10,
    si.position_average,
    si.position_average_rdp,
    si.position_average_constrained,
    si.reshuffle_average,
    si.reshuffle_average_rdp,
    si.reshuffle_worst,
    si.reshuffle_worst_constrained,
    si.affine_exact_average,
    ph.si_poisson,
    bib.si_balls_in_bins,
    bib.si_balls_in_bins_any_length,
    chourasia.thm_2,
    chourasia.cor_1,
    sa.reshuffle_amplified,
    sa.position_amplified,
    ys.thm_2_1,
    ys.thm_3_3,
    ys.thm_4_2,
    ys.thm_4_3,
    ys.thm_4_3_poisson,
)
"""Every analysis of a :class:`~hidden_state_accountants.TrainingRunDpEvent`."""

DP_SBCD_ANALYSES: Tuple[AnalysisInfo, ...] = _infos(sbcd.composition, sbcd.thm_4_5)
"""Every analysis of a :class:`~hidden_state_accountants.DpSbcdRunDpEvent`."""

ANALYSES: Dict[type, Tuple[AnalysisInfo, ...]] = {
    TrainingRunDpEvent: TRAINING_RUN_ANALYSES,
    DpSbcdRunDpEvent: DP_SBCD_ANALYSES,
}
"""The analyses of each event type the accountant accounts by its own analyses."""


def event_analyses(event_type: type) -> Optional[Tuple[AnalysisInfo, ...]]:
    """The analyses registered for ``event_type`` (or a base class of it), ``None`` if none."""
    for t in event_type.__mro__:
        if t in ANALYSES:
            return ANALYSES[t]
    return None


def all_analyses(event_type: type = TrainingRunDpEvent) -> List[AnalysisInfo]:
    """Composition baselines first, then hidden-state analyses, each in the registry's order."""
    infos = event_analyses(event_type) or ()
    return [a for a in infos if not a.hidden_state] + [a for a in infos if a.hidden_state]


def analyses_for(sampling: str, event_type: type = TrainingRunDpEvent) -> List[AnalysisInfo]:
    """The analyses whose theorem covers ``sampling``."""
    return [a for a in all_analyses(event_type) if sampling in a.schedules]


def get(name: str) -> AnalysisInfo:
    """The analysis called ``name`` (of any event type); ``KeyError`` if there is none."""
    for infos in ANALYSES.values():
        for info in infos:
            if info.name == name:
                return info
    raise KeyError(name)


def analyze(event, ctx: Context = Context()) -> List[Bound]:
    """Every analysis of ``event``'s type under ``ctx.neighboring_relation``: the composition
    baselines of its schedule and all hidden-state analyses, those that do not apply carrying
    the reason, without running them (another schedule, or a relation the analysis is not
    proved for)."""
    bounds = []
    for info in all_analyses(type(event)):
        if event.sampling in info.schedules:
            reason = info.relation_reason(ctx.neighboring_relation, event.sampling)
            if reason:
                bounds.append(
                    NotApplicable(name=info.name, citation=info.citation, hidden_state=info.hidden_state, reason=reason)
                )
            else:
                bounds.append(info.function(event, ctx))
        elif info.hidden_state:
            reason = info.not_applicable_reason(event.sampling)
            bounds.append(NotApplicable(name=info.name, citation=info.citation, hidden_state=True, reason=reason))
    return bounds


def _check_unique() -> None:
    names = [i.name for infos in ANALYSES.values() for i in infos]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"analyses registered twice: {twice}")


_check_unique()

__all__ = [
    "AnalysisInfo",
    "analysis",
    "ANALYSES",
    "TRAINING_RUN_ANALYSES",
    "DP_SBCD_ANALYSES",
    "event_analyses",
    "all_analyses",
    "analyses_for",
    "analyze",
    "get",
    "SAMPLINGS",
]
