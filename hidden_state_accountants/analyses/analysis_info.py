"""What an analysis is, without running it: :class:`AnalysisInfo` and the :func:`analysis`
decorator that attaches one to an analysis function.

A leaf of the analyses package: every analysis module imports it, and it imports no analysis,
so the registry (:mod:`hidden_state_accountants.analyses.registry`), which imports every analysis
module to list them, closes no circle.

>>> @analysis("example", "a citation", ("full",), needs="nothing")
... def example(run, ctx):
...     return NotApplicable(reason="an example")
>>> from hidden_state_accountants.analyses._common import Context
>>> example.info.name, example.info.relations, example(None, Context()).name
('example', ('REPLACE_ONE',), 'example')
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Tuple

from hidden_state_accountants.bounds import NotApplicable
from hidden_state_accountants.errors import ParameterError
from hidden_state_accountants.relations import ADD_OR_REMOVE_ONE, REPLACE_ONE, as_add_remove, schedule_reason
from hidden_state_accountants.schedules import check_sampling

# How an analysis covers ADD_OR_REMOVE_ONE (docs/derivations.md section 11):
NOT_COVERED = "no"  # proved for REPLACE_ONE only
NATIVE = "native"  # reads ctx.neighboring_relation itself
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


def analysis(
    name: str, citation: str, schedules, *, hidden_state: bool = True, needs: str = "", add_or_remove: str = NOT_COVERED
):
    """Declares ``f(run, ctx) -> Bound`` an analysis: the wrapper fills in the bound's name,
    citation and kind (hidden-state or composition) from its :class:`AnalysisInfo` (the
    wrapper's ``info``), so the analysis only computes. The registry
    (:mod:`hidden_state_accountants.analyses.registry`) lists which analyses account which event.

    ``add_or_remove`` says how the analysis covers ADD_OR_REMOVE_ONE: ``"no"`` (REPLACE_ONE only),
    ``"native"`` (it reads ``ctx.neighboring_relation``), or ``"sensitivity_c"`` (a fixed-divisor
    theorem whose proof uses the neighbours only through the per-step difference and both runs'
    geometry: the wrapper runs it on :func:`~hidden_state_accountants.relations.as_add_remove`
    of the run, docs/derivations.md section 11)."""
    schedules = tuple(check_sampling(s) for s in schedules)
    if add_or_remove not in ADD_REMOVE_MODES:
        raise ValueError(f"add_or_remove must be one of {ADD_REMOVE_MODES}, got {add_or_remove!r}")

    def declare(fn):
        @functools.wraps(fn)
        def run(event, ctx):
            cite = citation
            if add_or_remove == SENSITIVITY_C and ctx.neighboring_relation == ADD_OR_REMOVE_ONE:
                cite = citation + "; ADD_OR_REMOVE_ONE: sensitivity C, fixed divisor (docs/derivations.md section 11)"
                try:
                    event = as_add_remove(event, keep_geometry=hidden_state)
                except ParameterError as err:
                    bound = NotApplicable(
                        reason=(
                            "under ADD_OR_REMOVE_ONE the batch holding the added record has one record more than "
                            f"the divisor, and its curvature rules this analysis out: {err}"
                        )
                    )
                    bound.name, bound.citation, bound.hidden_state = name, cite, hidden_state
                    return bound
            bound = fn(event, ctx)
            if add_or_remove == NATIVE and ctx.neighboring_relation == ADD_OR_REMOVE_ONE and bound.citation:
                cite = bound.citation  # a native analysis names what it used under this relation
            bound.name, bound.citation, bound.hidden_state = name, cite, hidden_state
            return bound

        run.info = AnalysisInfo(name, citation, schedules, hidden_state, needs, run, add_or_remove)
        return run

    return declare


__all__ = ["AnalysisInfo", "analysis", "NOT_COVERED", "NATIVE", "SENSITIVITY_C", "ADD_REMOVE_MODES"]
