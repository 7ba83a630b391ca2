"""``HiddenStateAccountant``: the best valid bound for training runs, behind dp_accounting's API.

>>> from hidden_state_accountants import HiddenStateAccountant, TrainingRunDpEvent, LossGeometry
>>> run = TrainingRunDpEvent.from_epochs(
...     dataset_size=60000, batch_size=1500, epochs=50, noise_multiplier=3.0, clip_norm=1.0,
...     learning_rate=0.05, sampling="cyclic",
...     geometry=LossGeometry(strong_convexity=0.002, smoothness=1.002))
>>> acc = HiddenStateAccountant().compose(run)
>>> round(acc.get_epsilon(1e-5), 2)
4.34
>>> acc.explain(1e-5).analysis
'bok_thm4.5'
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
from dp_accounting import dp_event, privacy_accountant

from hidden_state_accountants import fdp
from hidden_state_accountants import lower_bounds
from hidden_state_accountants import rdp as rdp_tools
from hidden_state_accountants import validation as v
from hidden_state_accountants.analyses import composition, long_composition, registry
from hidden_state_accountants.analyses._common import Context
from hidden_state_accountants.bounds import Bound
from hidden_state_accountants.errors import NO_GEOMETRY, CompositionFallbackWarning
from hidden_state_accountants.events import LossGeometry, TrainingRunDpEvent
from hidden_state_accountants.lower_bounds import LowerBound
from hidden_state_accountants.relations import ADD_OR_REMOVE_ONE, REPLACE_ONE, NeighborRel, parse_relation
from hidden_state_accountants.schedules import BALLS_IN_BINS, FULL, POISSON, SAMPLINGS, balls_in_bins_note
from hidden_state_accountants.selection import RDP_POINTWISE_MIN, RDP_POINTWISE_MIN_CITATION, bound_epsilon, select_best


def normalised(run: TrainingRunDpEvent) -> TrainingRunDpEvent:
    """The same run in units where the clip norm is 1.

    The privacy of DP-SGD is invariant under ``theta -> theta / C``: the rescaled losses
    ``l(C theta')/C^2`` keep ``m`` and ``M``, their clipped gradients are the old ones over
    ``C``, the noise becomes ``z``, a domain of diameter ``D`` becomes ``D/C`` and an LSI
    constant ``c`` becomes ``c C^2``. Analysing the normalised run keeps every formula free of
    over- and underflow in ``C`` (e.g. ``sigma^2 = lr z^2 C^2 / (2 b^2)``).

    A Poisson run with ``q = 1`` and ``b = n`` (:func:`uses_every_record`) is analysed as the
    full-batch run it is.
    """
    if uses_every_record(run):
        run = run.replace(sampling=FULL, sampling_probability=None)
    C = run.clip_norm
    if C == 1.0:
        return run
    geom = run.geometry
    if geom is not None:
        geom = geom.rescaled(C)  # drops what the clip is checked against: the verdict is kept below
    return run.replace(clip_norm=1.0, geometry=geom, hidden_state_refusal=run.hidden_state_reason())


def uses_every_record(run: TrainingRunDpEvent) -> bool:
    """A Poisson run whose rate is 1 and whose divisor is the dataset size: every step averages all
    ``n`` records, exactly full-batch training (NoisyGD), so the full-batch analyses hold for it."""
    return run.sampling == POISSON and run.sampling_rate >= 1.0 and run.batch_size == run.dataset_size


FULL_BATCH_NOTE = (
    "sampling_probability 1 with batch_size = dataset_size: every step uses every record, which is full-batch "
    "training; accounted with the full-batch analyses"
)


def analyze_training_run(run: TrainingRunDpEvent, ctx: Context = Context()) -> List[Bound]:
    """Every analysis for ``run`` under ``ctx.neighboring_relation``: its schedule's composition
    baselines and all hidden-state analyses, those that do not apply carrying the reason (from
    the registry, without running them: another schedule, or a relation the analysis is not
    proved for). The run is analysed in units where the clip norm is 1 (:func:`normalised`)."""
    return registry.analyze(normalised(run), ctx)


@dataclass
class AnalysisReport:
    """One line of the explanation: an analysis with its epsilon, or why it does not apply."""

    name: str
    citation: str
    epsilon: Optional[float]
    reason: Optional[str]
    hidden_state: bool
    kind: str
    detail: str = ""
    # the bound never decreases with the run's length (it then bounds every shorter run)
    monotone_in_steps: bool = False

    def to_dict(self) -> dict:
        reason = self.reason
        if reason is None and self.epsilon is not None and not math.isfinite(self.epsilon):
            # JSON has no infinity: an applicable bound that says nothing here still gets a reason
            reason = "the bound is infinite here" + (f" ({self.detail})" if self.detail else "")
        return {
            "name": self.name,
            "epsilon": _json_number(self.epsilon),
            "reason": reason,
            "hidden_state": self.hidden_state,
            "kind": self.kind,
            "citation": self.citation,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class _LowerBoundQuery:
    """The best known lower bound of one training run, computed when a report first shows it."""

    run: TrainingRunDpEvent
    delta: float
    relation: str

    def __call__(self) -> LowerBound:
        return lower_bounds.best_known_lower_bound(self.run, self.delta, self.relation)


@dataclass
class PrivacyReport:
    """The best valid epsilon, which analysis gave it, and every analysis considered.

    Beside it, where one can be computed in under a second, the best known LOWER bound
    (:attr:`lower_bound`, :attr:`lower_bound_note`; :mod:`hidden_state_accountants.lower_bounds`): the
    epsilon some run of the declared class really reaches, so the truth lies between the two. It is
    computed only when shown, and never used as the epsilon, in calibration or in budgets.
    """

    epsilon: float
    delta: float
    analysis: str
    neighboring_relation: str
    analyses: List[AnalysisReport]
    notes: List[str] = field(default_factory=list)
    # the best known lower bound, or a query giving it when first asked for (never part of the epsilon)
    lower_bound_source: Union[None, LowerBound, Callable[[], LowerBound]] = field(
        default=None, repr=False, compare=False
    )

    @property
    def best_known_lower_bound(self) -> LowerBound:
        """The best known lower bound with its note (computed on first use, then kept)."""
        source = self.lower_bound_source
        if source is None:
            source = LowerBound(None, "not computed for this report")
        elif not isinstance(source, LowerBound):
            source = source()
        self.lower_bound_source = source
        return source

    @property
    def lower_bound(self) -> Optional[float]:
        """The best known lower bound on the true epsilon (``None`` where none is available): NOT a
        privacy guarantee; the guarantee is :attr:`epsilon`."""
        return self.best_known_lower_bound.epsilon

    @property
    def lower_bound_note(self) -> str:
        """The lower bound's construction and caveat, or why there is none."""
        lower = self.best_known_lower_bound
        if lower.epsilon is not None and lower.epsilon > self.epsilon * (1 + 1e-6) + 1e-9:
            return (
                f"{lower.note}; ABOVE the reported bound {self.epsilon:.6g}: one of the two is wrong, "
                "please report this"
            )
        return lower.note

    @property
    def composition_epsilon(self) -> float:
        """The best composition baseline listed (valid even if every iterate is released)."""
        values = [a.epsilon for a in self.analyses if not a.hidden_state and a.epsilon is not None]
        return min(values) if values else math.inf

    def to_dict(self) -> dict:
        return {
            "epsilon": _json_number(self.epsilon),
            "composition_epsilon": _json_number(self.composition_epsilon),
            "delta": self.delta,
            "analysis": self.analysis,
            "neighboring_relation": self.neighboring_relation,
            "analyses": [a.to_dict() for a in self.analyses],
            "notes": list(self.notes),
            "lower_bound": _json_number(self.lower_bound),
            "lower_bound_note": self.lower_bound_note,
        }

    def to_table(self) -> str:
        w = max([26] + [len(a.name) for a in self.analyses])  # names up to 31 characters
        k = max([5] + [len(a.kind) for a in self.analyses])
        lines = [
            f"epsilon = {_fmt(self.epsilon)} at delta = {self.delta:g} "
            f"({self.neighboring_relation}), from {self.analysis}",
            self._lower_bound_line(),
            "",
            f"{'analysis':<{w}} {'kind':<{k}} {'epsilon':>10}  notes",
            f"{'-' * w} {'-' * k} {'-' * 10}  {'-' * 40}",
        ]
        for a in self.analyses:
            tag = "" if a.hidden_state else "[composition] "
            text = a.reason if a.reason else a.detail
            mark = "*" if a.name == self.analysis else " "
            lines.append(f"{a.name:<{w}} {a.kind:<{k}} {_fmt(a.epsilon):>10}{mark} {tag}{text}")
        lines += [""] + [f"note: {n}" for n in self.notes]
        return "\n".join(lines).rstrip()

    def _lower_bound_line(self) -> str:
        if self.lower_bound is None:
            return f"best known lower bound: none ({self.lower_bound_note})"
        return (
            f"best known lower bound: {_fmt(self.lower_bound)} ({self.lower_bound_note}): the true epsilon of "
            "the declared class is at least this; the guarantee is the bound above"
        )


def _hashable(event: dp_event.DpEvent) -> Optional[dp_event.DpEvent]:
    """The event as a dictionary key (equal events merge into one component), ``None`` if unhashable."""
    try:
        hash(event)
    except TypeError:
        return None
    return event


def _delta_or_one(delta: float) -> float:
    return 1.0 if math.isnan(delta) else delta


def _fmt(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else f"{x:.4f}"


def _json_number(x: Optional[float]):
    if x is None:
        return None
    return x if math.isfinite(x) else None


def geometry_note(geometry: LossGeometry) -> str:
    """What a declared geometry is in the core API: the user's claim, taken as given."""
    g = geometry
    inputs = "" if g.feature_norm_bound is None else f", for inputs of norm <= {g.feature_norm_bound:g}"
    domain = "unconstrained" if g.diameter is None else f"D = {g.diameter:g}"
    projected = (
        ""
        if g.diameter is None
        else ", and the parameters are projected onto a convex set of diameter D after every step"
    )
    classes = ""
    if g.loss is not None:
        classes = ", 2 classes" if g.num_classes == 2 else f", {g.num_classes or 'an undeclared number of'} classes"
    return (
        f"the geometry (m = {g.strong_convexity:g}, M = {g.smoothness:g}, {domain}{inputs}{classes}) is declared, "
        f"not verified: the accountant takes it as given, and every hidden-state bound holds only if each "
        f"per-example update clip(grad l_i) + m_reg theta is m-strongly monotone and M-Lipschitz{projected}. "
        "That holds for a loss of one linear form of the parameters (binary logistic regression, a scalar GLM), "
        "for squared-loss regression, and for any smooth convex loss whose clip never binds; for softmax "
        "cross-entropy over 3 or more classes only when the clip cannot bind (clip norm >= sqrt(2 (R^2 + 1)) "
        "for features of norm <= R; docs/derivations.md section 18)"
    )


def accountant_with(accountant_kwargs: Dict[str, Any]) -> "HiddenStateAccountant":
    """``HiddenStateAccountant(**accountant_kwargs)`` for the helpers that pass keywords on
    (calibration, budgets, plots, audits): a keyword the accountant does not take is refused by name.

    >>> accountant_with({"neighboring_relation": "ADD_OR_REMOVE_ONE"}).neighboring_relation.name
    'ADD_OR_REMOVE_ONE'
    """
    known = [p for p in inspect.signature(HiddenStateAccountant).parameters]
    for name in accountant_kwargs:
        if name not in known:
            raise v.ParameterError(
                name, f"is not a parameter of this function or of the accountant (which takes {', '.join(known)})"
            )
    return HiddenStateAccountant(**accountant_kwargs)


RELATION_NOTES = {
    REPLACE_ONE: "neighbouring datasets differ by replacing one record (REPLACE_ONE)",
    ADD_OR_REMOVE_ONE: "neighbouring datasets differ by adding or removing one record (ADD_OR_REMOVE_ONE)",
}


@dataclass
class _Component:
    """One event composed ``count`` times. A standard dp_accounting event's bounds are of the
    whole ``count``-fold composition (``folded``: a Gaussian self-composed ``k`` times is
    ``G(sqrt(k) mu)``, composed before any PLD is built); other events' bounds are of one
    occurrence and composed ``repeat = count`` times.

    A *ledger* (``law`` set) holds every sampled Gaussian event of one sampling law, whatever its
    noise (``noises``: noise multiplier -> steps; ``event`` is the first one composed): its bounds
    compose them all at once, in a bounded number of noise groups
    (:func:`~hidden_state_accountants.analyses.composition.ledger_bounds`), so a thousand events
    with distinct noise cost what a few cost."""

    event: dp_event.DpEvent
    count: int
    bounds: Optional[List[Bound]] = None
    folded: bool = False
    law: Optional[Tuple] = None
    noises: Optional[Counter] = None

    def add(self, count: int, noise: Optional[float] = None) -> None:
        """Composes ``count`` more of an equal event (or, for a ledger, one of the same law with ``noise``,
        its noise multiplier from :func:`~hidden_state_accountants.analyses.composition.sampled_gaussian`)."""
        self.count += count
        if self.law is not None:
            self.noises[noise] += count
        if self.folded:
            self.bounds = None  # the bounds are of the whole composition: recomputed when asked for

    @property
    def repeat(self) -> int:
        """How often the bounds still have to be composed."""
        return 1 if self.folded else self.count


class HiddenStateAccountant(privacy_accountant.PrivacyAccountant):
    """A ``dp_accounting.PrivacyAccountant`` reporting the best valid bound.

    It accepts :class:`TrainingRunDpEvent` and the standard events (``GaussianDpEvent``,
    ``PoissonSampledDpEvent`` / ``SampledWithoutReplacementDpEvent`` of a Gaussian,
    ``LaplaceDpEvent``, composed, self-composed, no-op, non-private). For one training run
    the result is the minimum over: the RDP curves of all applicable analyses, taken
    pointwise per order before converting; each GDP bound (exact conversion); each f-DP
    bound. Composition baselines are among the candidates, so the result is never worse
    than composition. Compositions of several events are accounted both by adding RDP
    curves and by composing PLDs; the smaller epsilon is reported.

    Args:
      orders: RDP orders (dp_accounting's default grid if ``None``).
      neighboring_relation: ``REPLACE_ONE`` (default, the papers' relation) or
        ``ADD_OR_REMOVE_ONE`` (Opacus' and dp_accounting's default), as dp_accounting's
        ``NeighboringRelation`` or its name. Under ADD_OR_REMOVE_ONE the full-batch and Poisson
        analyses apply with sensitivity ``C`` (docs/derivations.md sections 6-11); the fixed-size
        schedules of this package do not (an added record displaces others: every analysis is
        listed as not applicable with that reason, so the epsilon is ``inf``), nor does
        ``SampledWithoutReplacementDpEvent`` (as in dp_accounting).
      pld_discretization: discretisation of privacy-loss distributions.

    >>> from dp_accounting import dp_event
    >>> acc = HiddenStateAccountant(neighboring_relation="ADD_OR_REMOVE_ONE")
    >>> _ = acc.compose(dp_event.GaussianDpEvent(2.0))
    >>> acc.explain(1e-5).neighboring_relation, round(acc.get_epsilon(1e-5), 4)
    ('ADD_OR_REMOVE_ONE', 1.9931)
    """

    def __init__(
        self,
        orders: Optional[Sequence[float]] = None,
        neighboring_relation: NeighborRel = REPLACE_ONE,
        pld_discretization: float = 1e-3,
    ):
        relation = parse_relation(neighboring_relation)
        super().__init__(relation)
        d = v.positive_float("pld_discretization", pld_discretization)
        if d > 0.1:
            raise v.ParameterError("pld_discretization", f"must be <= 0.1 for meaningful PLDs, got {d:g}")
        self._ctx = Context(orders=rdp_tools.check_orders(orders), discretization=d, neighboring_relation=relation)
        self._components: List[_Component] = []
        self._index: Dict[Any, int] = {}  # an event (or a ledger's law) -> its component
        self._warned = False

    # ------------------------------------------------------------ PrivacyAccountant API
    def _maybe_compose(self, event, count, do_compose):
        if isinstance(event, dp_event.NoOpDpEvent) or composition.is_no_op(event):
            return None
        if isinstance(event, dp_event.SelfComposedDpEvent):
            return self._maybe_compose(event.event, event.count * count, do_compose)
        if isinstance(event, dp_event.ComposedDpEvent):
            for e in event.events:
                err = self._maybe_compose(e, count, do_compose)
                if err is not None:
                    return err
            return None
        if isinstance(event, dp_event.NonPrivateDpEvent) or registry.event_analyses(type(event)) is not None:
            if do_compose:
                self._add(event, count)
            return None
        try:
            composition.check_standard_event(event, self._ctx)
        except composition.UnsupportedEvent as err:
            return self.CompositionErrorDetails(invalid_event=event, error_message=str(err))
        if do_compose:
            self._add(event, count)
        return None

    def _add(self, event, count):
        if count <= 0:
            return
        # the recording layer warned of its own refusals; the core warns of no geometry, and of a geometry
        # that is not proved for the run's clip
        if isinstance(event, TrainingRunDpEvent) and not event.hidden_state_refusal and not self._warned:
            why = NO_GEOMETRY if event.geometry is None else event.hidden_state_reason()
            if why:
                self._warned = True
                warnings.warn(
                    f"{why}; reporting the composition bound for sampling={event.sampling!r}",
                    CompositionFallbackWarning,
                    stacklevel=4,
                )
        # a standard event's count is folded into its bounds (composition.standard_event_bounds)
        standard = registry.event_analyses(type(event)) is None
        ledger = composition.sampled_gaussian(event) if standard else None
        key = ("ledger", ledger[0]) if ledger is not None else _hashable(event)
        if key is not None and key in self._index:  # an equal event, or one of the same sampling law
            self._components[self._index[key]].add(count, None if ledger is None else ledger[1])
            return
        component = _Component(event, count, folded=standard)
        if ledger is not None:
            component.law, component.noises = ledger[0], Counter({ledger[1]: count})
        if key is not None:
            self._index[key] = len(self._components)
        self._components.append(component)

    def get_epsilon(self, target_delta: float) -> float:
        return self.explain(target_delta).epsilon

    def get_delta(self, target_epsilon: float) -> float:
        """Smallest delta the bounds give at ``target_epsilon`` (``inf`` allowed, as in dp_accounting)."""
        if not (isinstance(target_epsilon, (int, float)) and target_epsilon == math.inf):
            v.nonnegative_float("target_epsilon", target_epsilon)
        if not self._components:
            return 0.0
        if target_epsilon == math.inf:
            # only an infinite privacy loss exceeds it: a non-private event, or none at all
            finite = [np.any(np.isfinite(self._event_rdp(c, self._ctx.orders))) for c in self._components]
            return 0.0 if all(finite) else 1.0
        rdp = self.get_rdp()  # pointwise minimum over every RDP-capable bound (and sum over events)
        if self._single() is not None:
            own = [_delta_or_one(b.delta(target_epsilon)) for b in self._single().bounds if b.applicable]
            return min(own + [rdp_tools.rdp_to_delta(self._ctx.orders, rdp, target_epsilon)])
        d_rdp = rdp_tools.rdp_to_delta(self._ctx.orders, rdp, target_epsilon)
        d_fdp = float(self._composed_delta(np.array([float(target_epsilon)]), 1e-5)[0])
        return min(d_rdp, d_fdp)

    # --------------------------------------------------------------------- reporting
    def explain(self, target_delta: float) -> PrivacyReport:
        """Every analysis with its epsilon (or reason), and the best valid one."""
        v.probability("target_delta", target_delta, allow_zero=True, allow_one=True)
        notes = [RELATION_NOTES[self.neighboring_relation]]
        if not self._components:
            return PrivacyReport(
                0.0, target_delta, "none", self._relation_name, [], notes, LowerBound(None, "nothing composed")
            )
        single = self._single()
        if single is not None:
            report = self._explain_single(single, target_delta, notes)
        else:
            report = self._explain_composed(target_delta, notes)
        report.lower_bound_source = self._lower_bound_source(single, target_delta)
        for c in self._components:
            if not isinstance(c.event, TrainingRunDpEvent):
                continue
            if uses_every_record(c.event) and FULL_BATCH_NOTE not in report.notes:
                report.notes.append(FULL_BATCH_NOTE)
            if c.event.hidden_state_reason():
                note = f"hidden-state analyses refused: {c.event.hidden_state_reason()}"
            elif c.event.geometry is None:
                note = f"{NO_GEOMETRY}: the composition bound is reported"
            else:
                note = geometry_note(c.event.geometry)
            if note not in report.notes:
                report.notes.append(note)
            if c.event.sampling == BALLS_IN_BINS:
                note = balls_in_bins_note(c.event.steps_per_epoch, c.event.epoch_steps is not None)
                if note not in report.notes:
                    report.notes.append(note)
        return report

    def _lower_bound_source(self, single: Optional[_Component], delta: float) -> Union[LowerBound, _LowerBoundQuery]:
        """The report's best known lower bound: a query for a single training run (run only when shown),
        else why there is none."""
        if single is None:
            return LowerBound(None, "several events are composed: a lower bound is shown for a single training run")
        if not isinstance(single.event, TrainingRunDpEvent):
            return LowerBound(None, f"shown for a single training run, not for a {type(single.event).__name__}")
        return _LowerBoundQuery(normalised(single.event), delta, self._relation_name)

    @property
    def context(self) -> Context:
        """The order grid, PLD discretisation and neighbouring relation this accountant analyses with."""
        return self._ctx

    @property
    def _relation_name(self) -> str:
        return self.neighboring_relation.name

    def _single(self) -> Optional[_Component]:
        """The only component, when its bounds describe everything composed (count 1, or a
        standard event whose count is folded into its bounds)."""
        if len(self._components) == 1:
            c = self._components[0]
            self._ensure_bounds(c)
            if c.repeat == 1:
                return c
        return None

    def _ensure_bounds(self, c: _Component) -> List[Bound]:
        if c.bounds is None:
            if isinstance(c.event, TrainingRunDpEvent):
                c.bounds = analyze_training_run(c.event, self._ctx)
            elif registry.event_analyses(type(c.event)) is not None:
                c.bounds = registry.analyze(c.event, self._ctx)
            elif isinstance(c.event, dp_event.NonPrivateDpEvent):
                c.bounds = [composition.non_private_bound("NonPrivateDpEvent")]
            elif c.law is not None:
                c.bounds = composition.ledger_bounds(c.law, c.noises, self._ctx)
            else:
                c.bounds = composition.standard_event_bounds(c.event, self._ctx, c.count)
        return c.bounds

    def _explain_single(self, c: _Component, delta: float, notes: List[str]) -> PrivacyReport:
        best = select_best(c.bounds, delta, self._ctx.orders)  # the rule calibration searches with
        rows = []
        for b, eps in zip(c.bounds, best.epsilons):
            if eps is None:
                rows.append(AnalysisReport(b.name, b.citation, None, b.reason, b.hidden_state, b.kind))
            else:
                rows.append(
                    AnalysisReport(
                        b.name, b.citation, eps, None, b.hidden_state, b.kind, b.detail(delta), b.monotone_in_steps
                    )
                )
        p = best.pointwise
        if p is not None:
            rows.append(
                AnalysisReport(
                    RDP_POINTWISE_MIN,
                    RDP_POINTWISE_MIN_CITATION,
                    p.epsilon,
                    None,
                    p.hidden_state,
                    "rdp",
                    f"order {p.order:g} from {p.winner}",
                    p.monotone_in_steps,
                )
            )
        return PrivacyReport(best.epsilon, delta, best.analysis, self._relation_name, rows, notes)

    def _explain_composed(self, delta: float, notes: List[str]) -> PrivacyReport:
        rows = []
        for i, c in enumerate(self._components):
            self._ensure_bounds(c)
            prefix = f"event{i}" + (f"x{c.count}" if c.count > 1 else "")
            for b in c.bounds:
                if b.applicable:
                    rows.append(
                        AnalysisReport(
                            f"{prefix}.{b.name}",
                            b.citation,
                            bound_epsilon(b, delta),
                            None,
                            b.hidden_state,
                            b.kind,
                            b.detail(delta),
                        )
                    )
                else:
                    rows.append(
                        AnalysisReport(f"{prefix}.{b.name}", b.citation, None, b.reason, b.hidden_state, b.kind)
                    )
        eps_rdp = rdp_tools.rdp_to_epsilon(self._ctx.orders, self.get_rdp(), delta)[0]
        parts = self._composed_fdp(delta)
        eps_pld = math.inf
        if parts is not None:
            mu, pld, _ = parts
            eps_pld = fdp.gdp_epsilon(mu, delta) if pld is None else fdp.pld_epsilon(pld, delta)
        rows.append(AnalysisReport("composed_rdp", "RDP curves added over events", eps_rdp, None, True, "rdp"))
        rows.append(
            AnalysisReport(
                "composed_fdp",
                "PLDs composed over events (Gaussian parts exactly: "
                "mu = sqrt(sum mu_i^2), Dong, Roth & Su 2022, Cor. 3.3)",
                eps_pld,
                None,
                True,
                "fdp",
            )
        )
        notes.append("several events: each event contributes its best bound to each composition")
        if eps_pld < eps_rdp:
            return PrivacyReport(eps_pld, delta, "composed_fdp", self._relation_name, rows, notes)
        return PrivacyReport(eps_rdp, delta, "composed_rdp", self._relation_name, rows, notes)

    # ------------------------------------------------------------------- curves
    def get_rdp(self, orders: Optional[Sequence[float]] = None) -> np.ndarray:
        """The composed RDP curve at ``orders`` (the accountant's grid when ``None``; else validated as
        the constructor's, values in the order given): per event the pointwise minimum over its analyses."""
        orders = self._ctx.orders if orders is None else rdp_tools.check_orders(orders, as_given=True)
        total = np.zeros(len(orders))
        for c in self._components:
            total = total + c.repeat * self._event_rdp(c, orders)
        return total

    def _event_rdp(self, c: _Component, orders) -> np.ndarray:
        curves = [b.rdp(orders) for b in self._ensure_bounds(c) if b.applicable]
        curves = [rdp_tools.sanitized(x) for x in curves if x is not None]
        return np.min(np.vstack(curves), axis=0) if curves else np.full(len(orders), np.inf)

    def _composed_fdp(self, delta: float) -> Optional[Tuple[float, Optional[fdp.PLD], float]]:
        """The composition of every event's best bound at ``delta`` as ``G(mu) (x) pld``:
        ``(mu, pld, grid)``, ``pld`` ``None`` when every part is Gaussian (then the composition
        is exactly ``G(mu)``, ``mu = sqrt(sum_i k_i mu_i^2)``: Dong, Roth & Su 2022, Cor. 3.3,
        whatever the epsilon). ``None`` when some event has no bound or no PLD."""
        chosen = []
        for c in self._components:
            options = [b for b in self._ensure_bounds(c) if b.applicable]
            if not options:
                return None
            chosen.append((c, min(options, key=lambda b: bound_epsilon(b, delta))))
        mu_sq = math.fsum(c.repeat * b.mu * b.mu for c, b in chosen if b.kind == "gdp")
        others = [(c, b) for c, b in chosen if b.kind != "gdp"]
        # one grid for all parts: the coarsest any part needs
        d = max([self._ctx.discretization] + [getattr(b, "discretization", 0.0) for _, b in others])
        total = None
        try:
            for c, best in others:
                part = best.pld(delta, d)
                if part is None:
                    return None
                if c.repeat > 1:
                    part = long_composition.self_compose(part, c.repeat)  # repeated squaring for huge counts
                total = part if total is None else total.compose(part)
            if total is not None and mu_sq > 0:
                total = total.compose(fdp.gaussian_pld(math.sqrt(mu_sq), d))
        except fdp.VacuousBound:  # most mass at losses beyond the grid: the RDP composition answers
            return None
        return math.sqrt(mu_sq), total, d

    def _composed_delta(self, eps: np.ndarray, delta_hint: float) -> np.ndarray:
        """``delta(eps)`` of :meth:`_composed_fdp` (1 where there is none)."""
        parts = self._composed_fdp(delta_hint)
        if parts is None:
            return np.ones_like(eps)
        mu, pld, _ = parts
        if pld is None:
            return np.atleast_1d(fdp.gdp_delta(mu, eps))
        out = np.asarray(pld.get_delta_for_epsilon(eps), dtype=float)
        return np.where(np.isnan(out), 1.0, out)

    def privacy_profile(self, epsilons: Sequence[float], delta_hint: float = 1e-5) -> np.ndarray:
        """``delta(eps)`` on a grid of finite ``epsilons >= 0``: the smallest over the bounds (each
        valid at every eps). ``delta_hint``, in ``(0, 1)``, tunes the PLDs' grids only."""
        eps = v.real_vector("epsilons", epsilons, low=0.0)
        delta_hint = v.probability("delta_hint", delta_hint)
        single = self._single()
        if single is not None:
            out = np.ones_like(eps)
            for b in single.bounds:
                if not b.applicable:
                    continue
                if b.kind == "gdp":
                    out = np.minimum(out, fdp.gdp_delta(b.mu, eps))
                elif b.kind == "fdp":
                    out = np.minimum(
                        out, np.asarray(b.pld(delta_hint, self._ctx.discretization).get_delta_for_epsilon(eps))
                    )
                else:
                    out = np.minimum(out, [b.delta(e) for e in eps])
            return np.clip(out, 0.0, 1.0)
        rdp = self.get_rdp()
        out = np.array([rdp_tools.rdp_to_delta(self._ctx.orders, rdp, e) for e in eps])
        out = np.minimum(out, self._composed_delta(eps, delta_hint))
        return np.clip(out, 0.0, 1.0)

    def tradeoff_curve(self, alphas: Sequence[float], delta_hint: float = 1e-5) -> np.ndarray:
        """Type II error ``beta(alpha)`` of the best valid f-DP guarantee at type I errors ``alphas``
        in ``[0, 1]`` (for plotting)."""
        alphas = v.real_vector("alphas", alphas, low=0.0, high=1.0)
        eps = np.concatenate([[0.0], np.geomspace(1e-3, 50.0, 400)])
        return fdp.profile_tradeoff(self.privacy_profile(eps, delta_hint), eps, alphas)


__all__ = [
    "NO_GEOMETRY",
    "HiddenStateAccountant",
    "PrivacyReport",
    "AnalysisReport",
    "analyze_training_run",
    "accountant_with",
    "SAMPLINGS",
]
