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

from hidden_state_accountants.schedules import SAMPLINGS, check_sampling


@dataclasses.dataclass(frozen=True)
class AnalysisInfo:
    """What an analysis is, without running it."""

    name: str
    citation: str
    schedules: Tuple[str, ...]
    hidden_state: bool
    needs: str
    function: Callable = dataclasses.field(repr=False, compare=False, default=None)

    def not_applicable_reason(self, sampling: str) -> str:
        return f"applies to sampling {' / '.join(self.schedules)}, not {sampling}"


_REGISTRY: Dict[str, AnalysisInfo] = {}


def analysis(name: str, citation: str, schedules, *, hidden_state: bool = True, needs: str = ""):
    """Registers ``f(run, ctx) -> Bound``; the registry fills in the bound's name, citation
    and kind (hidden-state or composition), so the analysis only computes."""
    schedules = tuple(check_sampling(s) for s in schedules)

    def register(fn):
        @functools.wraps(fn)
        def run(event, ctx):
            bound = fn(event, ctx)
            bound.name, bound.citation, bound.hidden_state = name, citation, hidden_state
            return bound

        if name in _REGISTRY:
            raise ValueError(f"analysis {name!r} is registered twice")
        info = AnalysisInfo(name, citation, schedules, hidden_state, needs, run)
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
        shifted_interpolation,
        ye_shokri,
    )


__all__ = ["AnalysisInfo", "analysis", "all_analyses", "analyses_for", "get", "SAMPLINGS"]
