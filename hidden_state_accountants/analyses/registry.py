"""The registry of analyses: each one describes itself (name, citation, schedules, needs).

An analysis is a function ``f(run, ctx) -> Bound`` decorated with :func:`analysis`; the
accountant asks the registry which analyses hold for a schedule instead of hard-coding lists,
and lists the others with the reason they do not apply, without calling them.

>>> from hidden_state_accountants.analyses import registry
>>> [a.name for a in registry.analyses_for("full") if not a.hidden_state]
['bok_thm4.1']
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, List, Tuple

from hidden_state_accountants import validation as v
from hidden_state_accountants.bounds import NotApplicable
from hidden_state_accountants.relations import ADD_OR_REMOVE_ONE, REPLACE_ONE, as_add_remove, schedule_reason
from hidden_state_accountants.schedules import SAMPLINGS, check_sampling

# How an analysis covers ADD_OR_REMOVE_ONE (docs/derivations.md section 11):
NOT_COVERED = "no"            # proved for REPLACE_ONE only
NATIVE = "native"             # reads ctx.neighboring_relation itself
SENSITIVITY_C = "sensitivity_c"  # a fixed-divisor theorem: run on as_add_remove(run) (sensitivity C, M')
ADD_REMOVE_MODES = (NOT_COVERED, NATIVE, SENSITIVITY_C)


@dataclasses.dataclass(frozen=True)
class AnalysisInfo:
    """What an analysis is, without running it."""

    name: str
    citation: str
    schedules: Tuple[str, ...]
    hidden_state: bool
    needs: str
    function: Callable = dataclasses.field(repr=False, compare=False, default=None)
    add_or_remove: str = NOT_COVERED

    @property
    def relations(self) -> Tuple[str, ...]:
        """Names of the neighbouring relations this analysis is proved for."""
        return ("REPLACE_ONE",) if self.add_or_remove == NOT_COVERED else ("REPLACE_ONE", "ADD_OR_REMOVE_ONE")

    def not_applicable_reason(self, sampling: str) -> str:
        return f"applies to sampling {' / '.join(self.schedules)}, not {sampling}"

    def relation_reason(self, relation, sampling: str):
        """Why this analysis does not hold under ``relation`` for ``sampling`` (``None`` if it may)."""
        if relation == REPLACE_ONE:
            return None
        reason = schedule_reason(relation, sampling)
        if reason:
            return reason
        if self.add_or_remove == NOT_COVERED:
            return "proved for REPLACE_ONE only; no ADD_OR_REMOVE_ONE version is derived"
        return None


_REGISTRY: Dict[str, AnalysisInfo] = {}


def analysis(name: str, citation: str, schedules, *, hidden_state: bool = True, needs: str = "",
             add_or_remove: str = NOT_COVERED):
    """Registers ``f(run, ctx) -> Bound``; the registry fills in the bound's name, citation
    and kind (hidden-state or composition), so the analysis only computes.

    ``add_or_remove`` says how the analysis covers ADD_OR_REMOVE_ONE: ``"no"`` (REPLACE_ONE only),
    ``"native"`` (it reads ``ctx.neighboring_relation``), or ``"sensitivity_c"`` (a fixed-divisor
    theorem whose proof uses the neighbours only through the per-step difference and both runs'
    geometry: the registry runs it on :func:`~hidden_state_accountants.relations.as_add_remove`
    of the run, docs/derivations.md section 11)."""
    schedules = tuple(check_sampling(s) for s in schedules)
    if add_or_remove not in ADD_REMOVE_MODES:
        raise ValueError(f"add_or_remove must be one of {ADD_REMOVE_MODES}, got {add_or_remove!r}")

    def register(fn):
        @functools.wraps(fn)
        def run(event, ctx):
            cite = citation
            if add_or_remove == SENSITIVITY_C and ctx.neighboring_relation == ADD_OR_REMOVE_ONE:
                cite = citation + "; ADD_OR_REMOVE_ONE: sensitivity C, fixed divisor (docs/derivations.md section 11)"
                try:
                    event = as_add_remove(event, keep_geometry=hidden_state)
                except v.ParameterError as err:
                    bound = NotApplicable(reason=(
                        "under ADD_OR_REMOVE_ONE the batch holding the added record has one record more than "
                        f"the divisor, and its curvature rules this analysis out: {err}"))
                    bound.name, bound.citation, bound.hidden_state = name, cite, hidden_state
                    return bound
            bound = fn(event, ctx)
            if add_or_remove == NATIVE and ctx.neighboring_relation == ADD_OR_REMOVE_ONE and bound.citation:
                cite = bound.citation  # a native analysis names what it used under this relation
            bound.name, bound.citation, bound.hidden_state = name, cite, hidden_state
            return bound

        if name in _REGISTRY:
            raise ValueError(f"analysis {name!r} is registered twice")
        info = AnalysisInfo(name, citation, schedules, hidden_state, needs, run, add_or_remove)
        _REGISTRY[name] = info
        run.info = info
        return run

    return register


def all_analyses() -> List[AnalysisInfo]:
    """Composition baselines first, then hidden-state analyses, each in registration order."""
    _load()
    infos = list(_REGISTRY.values())
    return [a for a in infos if not a.hidden_state] + [a for a in infos if a.hidden_state]


def analyses_for(sampling: str) -> List[AnalysisInfo]:
    """The analyses whose theorem covers ``sampling``."""
    return [a for a in all_analyses() if sampling in a.schedules]


def get(name: str) -> AnalysisInfo:
    _load()
    return _REGISTRY[name]


def _load() -> None:
    # the analysis modules register on import; importing them here keeps the order fixed
    from hidden_state_accountants.analyses import (  # noqa: F401
        altschuler_talwar,
        bok,
        chourasia,
        composition,
        poisson_hidden_state,
        shifted_interpolation,
        ye_shokri,
    )


__all__ = ["AnalysisInfo", "analysis", "all_analyses", "analyses_for", "get", "SAMPLINGS"]
