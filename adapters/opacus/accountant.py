"""``PrivacyEngine(accountant="hidden_state")``: Opacus accounting by the core's best valid bound.

The accountant is an Opacus ``IAccountant``. At every optimizer step it reads from the DP
optimizer what Opacus knows (noise multiplier, ``max_grad_norm``, expected batch size,
learning rate, ``weight_decay``, whether a :class:`~.hooks.ProjectionHook` is attached)
into a run-length-encoded ledger. :meth:`OpacusHiddenStateAccountant.configure` adds what
Opacus cannot see: the loss geometry and the batch sampler. ``get_epsilon`` turns the
ledger into the core's :class:`~hidden_state_accountants.TrainingRunDpEvent` and returns
exactly :class:`~hidden_state_accountants.HiddenStateAccountant`'s number for it.

No geometry, no hidden-state claim: without :meth:`~OpacusHiddenStateAccountant.configure`
the accountant reports the composition bound of Opacus' own Poisson schedule, with a
geometry-less ``configure(sampler=...)`` the composition bound of that sampler; both warn
once. All numbers are under REPLACE_ONE adjacency.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import attr
from opacus.accountants.accountant import IAccountant
from opacus.optimizers import DPOptimizer

from hidden_state_accountants import HiddenStateAccountant, LossGeometry, PrivacyReport, TrainingRunDpEvent
from hidden_state_accountants import validation as v
from hidden_state_accountants.accountant import NO_GEOMETRY

from .hooks import _MARK, _unsupported_clipping, base_optimizer_issue, hidden_state_update_issue
from .samplers import HiddenStateBatchSampler, sampler_from_state_dict

__all__ = ["OpacusHiddenStateAccountant", "HiddenStateCalibration", "MECHANISM"]

MECHANISM = "hidden_state"
_CALIBRATION_KWARG = "hidden_state_calibration"
_CORE_NO_GEOMETRY = re.escape(NO_GEOMETRY)  # the core's warning: the adapter gives its own, once


class _Step(NamedTuple):
    """What one optimizer step looked like; equal consecutive steps share a ledger entry
    (a tuple: cheap to build and compare at every step)."""

    noise_multiplier: float
    max_grad_norm: float
    batch_size: Optional[float]  # Opacus' divisor: expected_batch_size x world size
    learning_rate: float
    weight_decay: float
    sample_rate: float  # Opacus' sample rate x accumulated iterations
    projection_radius: Optional[float]
    issue: Optional[str]  # why the step is not DESIGN's update rule (composition still holds)


@dataclass(frozen=True)
class HiddenStateCalibration:
    """What Opacus' calibration call needs but cannot see; made by
    :meth:`OpacusHiddenStateAccountant.calibration_kwargs`."""

    sampler: Dict[str, Any]
    geometry: Optional[LossGeometry]
    learning_rate: float
    max_grad_norm: float
    gaussian_initialization: bool = False


def _poisson_sizes(q: float) -> Tuple[int, int]:
    """``(n, b)`` with ``b / n >= q`` (the core reads Poisson's rate as ``b / n``)."""
    if not 0 < q <= 1:
        raise v.ParameterError("sample_rate", f"must lie in (0, 1], got {q!r}")
    frac = Fraction(q).limit_denominator(10**9)
    if frac < q:  # never round the rate down
        frac = Fraction(frac.numerator + 1, frac.denominator)
    return frac.denominator, min(frac.numerator, frac.denominator)


class OpacusHiddenStateAccountant(IAccountant):
    """Opacus accountant reporting the hidden-state (last-iterate) bound of the core.

    Registered as ``"hidden_state"`` when :mod:`hidden_state_accountants.opacus` is imported::

        engine = PrivacyEngine(accountant="hidden_state")
        engine.accountant.configure(geometry=LossGeometry(...), sampler=sampler)

    ``get_epsilon(delta)`` equals ``HiddenStateAccountant().compose(self.training_run())
    .get_epsilon(delta)``. A learning rate or noise multiplier that changes during
    training makes the core refuse every hidden-state analysis (composition is reported,
    with the reason in :meth:`explain`); so do a non-SGD base optimizer, momentum,
    ``loss_reduction="sum"`` or a changing ``max_grad_norm``/``weight_decay``.
    """

    def __init__(self) -> None:
        self._ledger: List[List[Any]] = []  # [_Step, count]
        self._steps = 0  # sum of the ledger's counts
        self._external: Optional[List[Tuple[float, float, int]]] = None  # history set by Opacus' calibration
        self.geometry: Optional[LossGeometry] = None
        self.sampler: Optional[HiddenStateBatchSampler] = None
        self.gaussian_initialization = False
        self._warned: set = set()
        self._cache: Dict[Any, PrivacyReport] = {}

    # ------------------------------------------------------------------- IAccountant
    @classmethod
    def mechanism(cls) -> str:
        return MECHANISM

    def __len__(self) -> int:
        if self._external is not None:
            return sum(int(t) for _, _, t in self._external)
        return self._steps

    @property
    def history(self) -> List[Tuple[float, float, int]]:
        """Opacus' view of the ledger: ``(noise_multiplier, sample_rate, steps)`` runs."""
        if self._external is not None:
            return list(self._external)
        out: List[Tuple[float, float, int]] = []
        for rec, count in self._ledger:
            key = (rec.noise_multiplier, rec.sample_rate)
            if out and out[-1][:2] == key:
                out[-1] = (*key, out[-1][2] + count)
            else:
                out.append((*key, count))
        return out

    @history.setter
    def history(self, value) -> None:
        # Opacus' get_noise_multiplier writes [(sigma, sample_rate, steps)] into a fresh
        # accountant and asks for its epsilon: a hypothetical run, no optimizer behind it.
        self._ledger, self._steps = [], 0
        self._external = [tuple(h) for h in value] if value else None
        self._cache.clear()

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Records a step known only by its noise and sample rate (no optimizer to read).

        Composition still holds; hidden-state analyses are refused for such steps, since
        the learning rate and clip norm are unknown. Training through ``make_private`` uses
        :meth:`get_optimizer_hook_fn` instead.
        """
        self._append(_Step(float(noise_multiplier), 1.0, None, 1.0, 0.0, float(sample_rate), None,
                           "step() was called without the optimizer: learning rate and clip norm unknown"))

    def get_optimizer_hook_fn(self, sample_rate: float):
        def hook_fn(optim: DPOptimizer) -> None:
            self._record(optim, sample_rate)

        return hook_fn

    def get_epsilon(self, delta: float, *args, **kwargs) -> float:
        """Best valid epsilon at ``delta`` (REPLACE_ONE); see :meth:`explain`."""
        return self.explain(delta, **kwargs).epsilon

    # ------------------------------------------------------------------ configuration
    def configure(
        self,
        *,
        geometry: Optional[LossGeometry] = None,
        sampler: Optional[HiddenStateBatchSampler] = None,
        gaussian_initialization: bool = False,
    ) -> "OpacusHiddenStateAccountant":
        """Declares what Opacus cannot see. Call before training (or before loading a checkpoint).

        Args:
          geometry: the loss geometry of the per-example map ``clip_C(grad l_i) + m_reg*theta``;
            ``strong_convexity`` may not exceed the optimizer's ``weight_decay``; a ``diameter``
            needs a :class:`~.hooks.ProjectionHook` of radius ``<= diameter/2`` on every step
            (without one, the hook's ``2R`` is used). ``None``: composition only.
          sampler: the batch sampler the ``DataLoader`` draws from (``batch_sampler=sampler``,
            ``make_private(..., poisson_sampling=False)``). Needed for any hidden-state claim.
          gaussian_initialization: declares Chourasia et al.'s initialisation (see the core).

        >>> from hidden_state_accountants.opacus import CyclicBatchSampler
        >>> acc = OpacusHiddenStateAccountant().configure(sampler=CyclicBatchSampler(100, 10))
        >>> acc.sampler.sampling
        'cyclic'
        """
        if geometry is not None and not isinstance(geometry, LossGeometry):
            raise v.ParameterError("geometry", f"must be a LossGeometry or None, got {geometry!r}")
        if sampler is not None and not isinstance(sampler, HiddenStateBatchSampler):
            raise v.ParameterError(
                "sampler", f"must be a sampler of hidden_state_accountants.opacus, got {type(sampler).__name__} "
                "(DataLoader(shuffle=True) reshuffles every epoch, a schedule no analysis here covers)")
        if geometry is not None and sampler is None:
            raise v.ParameterError(
                "sampler", "a hidden-state claim needs the batch schedule: pass one of this package's samplers "
                "(Opacus' Poisson sampling has no hidden-state analysis)")
        if len(self) > 0 and (geometry, _describe(sampler)) != (self.geometry, _describe(self.sampler)):
            raise v.ParameterError("configure", f"called after {len(self)} steps; configure before training")
        self.geometry, self.sampler = geometry, sampler
        self.gaussian_initialization = bool(gaussian_initialization)
        self._cache.clear()
        return self

    def calibration_kwargs(self, *, optimizer, max_grad_norm: float) -> Dict[str, HiddenStateCalibration]:
        """Keyword arguments that carry this configuration into ``make_private_with_epsilon``.

        Opacus' calibration builds a *fresh* accountant by name and asks it for epsilon, so
        the configuration cannot reach it by itself; Opacus forwards extra keyword arguments
        of ``make_private_with_epsilon`` to that accountant's ``get_epsilon`` (and to the DP
        optimizer, which ignores them)::

            engine.accountant.configure(geometry=geometry, sampler=sampler)
            model, optimizer, loader = engine.make_private_with_epsilon(
                module=model, optimizer=optimizer, data_loader=loader, target_epsilon=1.0,
                target_delta=1e-5, epochs=20, max_grad_norm=1.0, poisson_sampling=False,
                **engine.accountant.calibration_kwargs(optimizer=optimizer, max_grad_norm=1.0))

        ``optimizer`` is the base optimizer passed to ``make_private_with_epsilon``; its
        learning rate and ``weight_decay`` are read now (change them later and the
        accountant still reports the truth, but the calibration no longer applies).
        """
        if self.sampler is None:
            raise v.ParameterError("sampler", "configure(sampler=...) before calibrating with the hidden-state analysis")
        base = optimizer.original_optimizer if isinstance(optimizer, DPOptimizer) else optimizer
        lr = float(base.param_groups[0]["lr"])
        wd = float(base.param_groups[0].get("weight_decay", 0.0))
        if self.geometry is not None:
            issue = base_optimizer_issue(base)
            if issue:
                raise v.ParameterError("optimizer", issue)
            self._check_strong_convexity(wd)
        spec = HiddenStateCalibration(
            sampler=self.sampler.describe(), geometry=self.geometry, learning_rate=lr,
            max_grad_norm=v.positive_float("max_grad_norm", max_grad_norm),
            gaussian_initialization=self.gaussian_initialization)
        return {_CALIBRATION_KWARG: spec}

    # ---------------------------------------------------------------------- recording
    def _record(self, optim: DPOptimizer, sample_rate: float) -> None:
        unsupported = _unsupported_clipping(optim)
        if unsupported:
            raise v.ParameterError("clipping", unsupported)
        k = optim.accumulated_iterations
        world = getattr(optim, "world_size", 1)
        b = None if optim.expected_batch_size is None else float(optim.expected_batch_size) * world
        s = self.sampler
        if s is not None:
            if k != 1:
                raise v.ParameterError(
                    "accumulated_iterations", f"{k} batches per step (gradient accumulation) are not the "
                    f"schedule of {type(s).__name__}; take one optimizer step per batch")
            if s.position < len(self) + 1:
                raise v.ParameterError(
                    "data_loader", f"the configured {type(s).__name__} has handed out {s.position} batches "
                    f"for {len(self) + 1} steps: build the loader as DataLoader(dataset, batch_sampler=sampler) "
                    "and pass poisson_sampling=False to make_private")
            if optim.loss_reduction == "mean" and abs(b - s.batch_size) > 1e-9 * s.batch_size:
                raise v.ParameterError(
                    "expected_batch_size", f"Opacus divides the summed gradients by {b:g} (expected_batch_size "
                    f"x world size) but the sampler's batches hold {s.batch_size} records; set "
                    f"optimizer.expected_batch_size = {s.batch_size / world:g} after make_private")
        group = optim.param_groups[0]
        proj = getattr(optim, _MARK, None)
        self._append(_Step(
            noise_multiplier=float(optim.noise_multiplier),
            max_grad_norm=float(optim.max_grad_norm),
            batch_size=b,
            learning_rate=float(group["lr"]),
            weight_decay=float(group.get("weight_decay", 0.0)),
            sample_rate=float(sample_rate) * k,
            projection_radius=None if proj is None else proj.radius,
            issue=hidden_state_update_issue(optim),
        ))

    def _append(self, rec: _Step) -> None:
        if self._external is not None:
            raise v.ParameterError("history", "was set from outside (a calibration); use a fresh accountant to train")
        if self._ledger and self._ledger[-1][0] == rec:
            self._ledger[-1][1] += 1
        else:
            self._ledger.append([rec, 1])
        self._steps += 1

    # ----------------------------------------------------------------------- the run
    def training_run(self) -> TrainingRunDpEvent:
        """The core event for the steps recorded so far (what :meth:`get_epsilon` accounts)."""
        return self._run_and_reasons()[0]

    def _run_and_reasons(self, calibration: Optional[HiddenStateCalibration] = None):
        if self._external is not None:
            return self._calibration_run(calibration)
        if not self._ledger:
            raise v.ParameterError("steps", "no optimizer step has been recorded yet")
        recs = [r for r, _ in self._ledger]
        counts = [c for _, c in self._ledger]
        steps = sum(counts)
        reasons = sorted({r.issue for r in recs if r.issue})

        def schedule(name):
            values = [getattr(r, name) for r in recs]
            if len(set(values)) == 1:
                return values[0]
            return tuple(x for x, c in zip(values, counts) for _ in range(c))

        clip = {r.max_grad_norm for r in recs}
        if len(clip) > 1:
            reasons.append("max_grad_norm changed during training; the hidden-state analyses assume one clip norm")
        wds = {r.weight_decay for r in recs}
        if len(wds) > 1:
            reasons.append("weight_decay changed during training; the strong convexity must hold throughout")
        common = dict(steps=steps, noise_multiplier=schedule("noise_multiplier"),
                      clip_norm=max(clip), learning_rate=schedule("learning_rate"))
        s = self.sampler
        if s is None:
            rates = {r.sample_rate for r in recs}
            # the Poisson composition grows with the rate: the largest covers every step
            n, b = _poisson_sizes(max(rates))
            return TrainingRunDpEvent(dataset_size=n, batch_size=b, sampling="poisson", **common), reasons
        geometry = None
        if self.geometry is not None:
            radii = {r.projection_radius for r in recs}
            proj_d = 2.0 * radii.pop() if len(radii) == 1 and None not in radii else None
            geometry = self._effective_geometry(proj_d, wds)
        run = TrainingRunDpEvent(dataset_size=s.dataset_size, batch_size=s.batch_size, sampling=s.sampling,
                                 geometry=geometry, gaussian_initialization=self.gaussian_initialization,
                                 hidden_state_refusal="; ".join(reasons) if reasons else None, **common)
        return run, reasons

    def _check_strong_convexity(self, weight_decay: float) -> None:
        m = self.geometry.strong_convexity
        if m > weight_decay * (1 + 1e-12):
            raise v.ParameterError(
                "geometry", f"strong_convexity {m:g} exceeds the optimizer's weight_decay {weight_decay:g}: in "
                "Opacus only weight_decay (applied after clipping and noise) makes the update strongly convex "
                "(use ProjectionHook(l2_regularization=...))")
        if m < weight_decay and "m<wd" not in self._warned:
            self._warned.add("m<wd")
            warnings.warn(
                f"hidden_state accountant: declared strong_convexity {m:g} is below weight_decay "
                f"{weight_decay:g}; the declared smoothness must include weight_decay", UserWarning, stacklevel=4)

    def _effective_geometry(self, proj_d: Optional[float], wds) -> Optional[LossGeometry]:
        g = self.geometry
        if len(wds) == 1:
            self._check_strong_convexity(next(iter(wds)))
        if g.diameter is not None:
            if proj_d is None:
                raise v.ParameterError(
                    "geometry", f"diameter {g.diameter:g} is declared but the parameters were not projected "
                    f"after every step: attach ProjectionHook(optimizer, radius={g.diameter / 2:g}) before training")
            if proj_d > g.diameter * (1 + 1e-12):
                raise v.ParameterError(
                    "geometry", f"declared diameter {g.diameter:g} is smaller than the projection's 2R = {proj_d:g}")
            return g
        if proj_d is not None:
            return attr.evolve(g, diameter=proj_d)
        return g

    def _calibration_run(self, spec: Optional[HiddenStateCalibration]):
        """The hypothetical run Opacus' ``get_noise_multiplier`` asks about."""
        if len(self._external) != 1:
            raise v.ParameterError("history", "calibration expects one (noise, sample_rate, steps) entry")
        z, q, steps = self._external[0]
        if spec is None:
            n, b = _poisson_sizes(q)
            run = TrainingRunDpEvent(dataset_size=n, batch_size=b, steps=int(steps), noise_multiplier=z,
                                     clip_norm=1.0, learning_rate=1.0, sampling="poisson")
            return run, ["no configuration reached Opacus' calibration call (pass "
                         "**engine.accountant.calibration_kwargs(...)): calibrated for Poisson sampling"]
        if not isinstance(spec, HiddenStateCalibration):
            raise v.ParameterError(_CALIBRATION_KWARG, f"must come from calibration_kwargs(), got {spec!r}")
        s = spec.sampler
        sampler = sampler_from_state_dict({**s, "position": 0}, num_replicas=1, rank=0)
        spe = sampler.steps_per_epoch
        if abs(q * spe - 1.0) > 1e-9:
            raise v.ParameterError(
                "data_loader", f"Opacus' sample rate 1/len(data_loader) = {q:.6g}, but the configured sampler "
                f"has {spe} steps per epoch: pass the DataLoader built on the configured sampler")
        # int(epochs / sample_rate) can land one step short of whole epochs: round up
        epochs = steps * q
        if abs(epochs - round(epochs)) < 1e-6:
            steps = max(int(steps), int(round(epochs)) * spe)
        run = TrainingRunDpEvent(
            dataset_size=s["dataset_size"], batch_size=s["batch_size"], steps=int(steps), noise_multiplier=z,
            clip_norm=spec.max_grad_norm, learning_rate=spec.learning_rate, sampling=s["sampling"],
            geometry=spec.geometry, gaussian_initialization=spec.gaussian_initialization)
        return run, []

    # ---------------------------------------------------------------------- reporting
    def explain(self, delta: float, **kwargs) -> PrivacyReport:
        """The core's report (every analysis with its epsilon or the reason it does not apply),
        with the adapter's own reasons among the notes."""
        spec = kwargs.pop(_CALIBRATION_KWARG, None)
        if not self._ledger and self._external is None:
            return HiddenStateAccountant().explain(delta)  # no steps: epsilon 0
        run, reasons = self._run_and_reasons(spec)
        key = (run, float(delta))
        report = self._cache.get(key)
        if report is None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_CORE_NO_GEOMETRY, category=UserWarning)
                report = HiddenStateAccountant().compose(run).explain(delta)
            if not run.hidden_state_refusal:  # a refusal is in the core's notes already
                report.notes.extend(reasons)
            self._cache = {key: report}  # one entry: the run only grows
        self._warn_if_composition_only(run, reasons)
        return report

    def composition_epsilon(self, delta: float) -> float:
        """The best composition bound for the same run (valid even if every iterate is released)."""
        return self.explain(delta).composition_epsilon

    def _warn_if_composition_only(self, run: TrainingRunDpEvent, reasons: List[str]) -> None:
        if run.geometry is not None and not run.hidden_state_refusal:
            return
        if reasons:
            why = "; ".join(reasons)
        elif self.sampler is None and self._external is None:
            why = ("not configured: Opacus' Poisson sampling at its sample rate is assumed (valid only with "
                   "make_private(poisson_sampling=True)); call engine.accountant.configure(geometry=..., sampler=...)")
        else:
            why = "no loss geometry configured (engine.accountant.configure(geometry=...))"
        if why in self._warned:
            return
        self._warned.add(why)
        warnings.warn(f"hidden_state accountant: no hidden-state analysis applied ({why}); reporting the "
                      f"composition bound for sampling={run.sampling!r}", UserWarning, stacklevel=4)

    # -------------------------------------------------------------------- checkpoints
    def state_dict(self, destination=None):
        """Ledger and configuration, in plain Python types (``torch.save``-able)."""
        out = {} if destination is None else destination
        out["mechanism"] = self.mechanism()
        out["history"] = self.history
        out["hidden_state"] = {
            "version": 1,
            "ledger": [[rec._asdict(), count] for rec, count in self._ledger],
            "external": None if self._external is None else [list(h) for h in self._external],
            "geometry": None if self.geometry is None else attr.asdict(self.geometry),
            # the schedule continues at the number of batches trained on, whatever was prefetched
            "sampler": None if self.sampler is None else {**self.sampler.describe(), "position": len(self)},
            "gaussian_initialization": self.gaussian_initialization,
        }
        return out

    def load_state_dict(self, state_dict) -> None:
        """Restores the ledger and configuration; a configured sampler continues where the run stopped."""
        if not state_dict or state_dict.get("mechanism") != self.mechanism():
            got = None if not state_dict else state_dict.get("mechanism")
            raise ValueError(f"state_dict of {got} cannot be loaded into the {self.mechanism()} accountant")
        hs = state_dict.get("hidden_state")
        if not hs or hs.get("version") != 1:
            raise ValueError("state_dict has no 'hidden_state' entry of version 1")
        geometry = None if hs["geometry"] is None else LossGeometry(**hs["geometry"])
        if self.geometry is not None and self.geometry != geometry:
            raise v.ParameterError("geometry", f"the checkpoint was taken with {geometry}, this accountant "
                                   f"is configured with {self.geometry}")
        saved = hs["sampler"]
        if self.sampler is not None and saved is None:
            raise v.ParameterError("sampler", "the checkpoint was taken without a sampler (Poisson sampling)")
        if self.sampler is not None:
            self.sampler.load_state_dict(saved)  # checks it is the same schedule
        elif saved is not None:
            self.sampler = sampler_from_state_dict(saved)
        self.geometry = geometry
        self.gaussian_initialization = bool(hs["gaussian_initialization"])
        self._ledger = [[_Step(**rec), int(count)] for rec, count in hs["ledger"]]
        self._steps = sum(count for _, count in self._ledger)
        self._external = None if hs["external"] is None else [tuple(h) for h in hs["external"]]
        self._cache.clear()


def _describe(sampler: Optional[HiddenStateBatchSampler]):
    return None if sampler is None else sampler.describe()
