"""The projection and L2 hook that make a declared :class:`~hidden_state_accountants.LossGeometry` true in Opacus.

It extends Opacus' DP optimizer, so unlike the rest of :mod:`hidden_state_accountants.pytorch` it
needs Opacus; the package does not import it, and the Opacus adapter re-exports it
(``from hidden_state_accountants.opacus import ProjectionHook``). It refuses an update the analyses
do not cover as the adapter reads it (:func:`hidden_state_accountants.opacus.facts.step_facts`).

:class:`ProjectionHook` keeps all trained parameters in the L2 ball of radius ``R`` after every
optimiser step, rescaled a hair inside it by the core's rounding rule
(:mod:`hidden_state_accountants.projection`; the accountant learns the diameter ``D = 2R``), and
supplies the L2 regulariser as the base SGD optimiser's ``weight_decay``: applied *after* clipping
and noise, so the per-example map ``clip_C(grad l_i) + m_reg*theta`` is ``m_reg``-strongly convex.
It exposes that strength as :attr:`ProjectionHook.strong_convexity`. (The feature bound's pieces
are in :mod:`.features`.)

Why not a penalty in the loss: Opacus computes per-example gradients from layer
activations only, so a term like ``lam * ||w||^2`` added to the loss reaches ``p.grad`` but
not ``p.grad_sample``, and the DP optimiser then overwrites ``p.grad`` with the clipped,
noised per-example sum: the penalty silently vanishes (in frameworks that do include it
per example, it is clipped with the gradient and is no longer ``m_reg*theta``). The hook
checks the first step for such a term and warns.
"""

from __future__ import annotations

import math
import warnings
from typing import List, Optional

import torch
from opacus.optimizers import DPOptimizer

from hidden_state_accountants import LossGeometry
from hidden_state_accountants import validation as v
from hidden_state_accountants.errors import HiddenStateWarning
from hidden_state_accountants.projection import ball_product_diameter, inside_factor
from hidden_state_accountants.recording import unaccountable, update_departure

from hidden_state_accountants.opacus.facts import PROJECTION_ATTR, step_facts

__all__ = ["ProjectionHook"]


def _params(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _project_(params: List[torch.Tensor], radius: float) -> None:
    """Scales ``params`` (one vector) onto the ball of ``radius`` if outside, a hair inside it (the
    core's rounding rule for their dtype) so that float rounding never leaves the declared ball.

    On CPU the norm is read on the host and nothing is written when inside (cheapest); on an
    accelerator everything stays on the device (no host sync).
    """
    target = radius * inside_factor(max(torch.finfo(p.dtype).eps for p in params))
    with torch.no_grad():
        same = len({(p.device, p.dtype) for p in params}) == 1
        if same and params[0].device.type == "cpu":
            total = math.sqrt(sum(float(n) ** 2 for n in torch._foreach_norm(params)))
            if total > target:
                torch._foreach_mul_(params, target / total)
            return
        norms = (
            torch._foreach_norm(params) if same else [torch.linalg.vector_norm(p).to(params[0].device) for p in params]
        )
        total = torch.linalg.vector_norm(torch.stack(norms))
        scale = torch.clamp(target / total, max=1.0)  # total = 0: inf, clamped to 1
        if same:
            torch._foreach_mul_(params, scale)
        else:
            for p in params:
                p.mul_(scale.to(device=p.device, dtype=p.dtype))


class ProjectionHook:
    """Projection onto ``{theta : ||theta||_2 <= radius}`` after every step, and the L2 regulariser.

    Attach it to the ``DPOptimizer`` returned by ``PrivacyEngine.make_private``. It
    projects the current parameters at once (so ``theta_0`` is in the set) and after every
    base-optimiser step; the ``hidden_state`` accountant reads it from the optimizer at
    every step and uses ``D = 2 * radius`` for the steps it covered.

    Args:
      optimizer: the DP optimizer; its update must be the analysed one (plain SGD, flat clipping,
        mean reduction), as the core's ``update_departure`` says.
      radius: ``R``; ``None`` for no projection (regularisation only).
      l2_regularization: ``m_reg``, set as ``weight_decay`` on every parameter group (which
        must hold none or the same value); ``None`` keeps the optimizer's own weight_decay.
      check_loss_penalty: on the first step, warn if ``p.grad`` differs from the mean of the
        per-example gradients (a penalty in the loss, which Opacus drops).

    Raises:
      ParameterError: naming ``optimizer``, ``radius``, ``l2_regularization`` or what the
        core finds wrong with the update (``momentum``, ``clipping``, ...).

    Example (``optimizer`` from ``make_private``)::

        hook = ProjectionHook(optimizer, radius=5.0, l2_regularization=0.01)
        geometry = hook.logistic_regression_geometry(feature_norm_bound=1.0)
        engine.accountant.configure(geometry=geometry, sampler=sampler, model=model, optimizer=optimizer)
    """

    def __init__(
        self,
        optimizer: DPOptimizer,
        *,
        radius: Optional[float] = None,
        l2_regularization: Optional[float] = None,
        check_loss_penalty: bool = True,
    ) -> None:
        if not isinstance(optimizer, DPOptimizer):
            raise v.ParameterError(
                "optimizer",
                f"must be the DPOptimizer returned by PrivacyEngine.make_private (the L2 term and the "
                f"projection must follow clipping and noise), got {type(optimizer).__name__}",
            )
        if radius is None and l2_regularization is None:
            raise v.ParameterError("radius", "give a radius, an l2_regularization, or both")
        # the hook makes the analysed update's assumptions true; on another update it has nothing to make true
        facts = step_facts(optimizer, accumulation=1)
        problem = unaccountable(facts) or update_departure(facts)
        if problem and problem[0] != "weight_decay":  # the hook sets one weight_decay itself
            raise v.ParameterError(*problem)
        if getattr(optimizer, PROJECTION_ATTR, None) is not None:
            raise v.ParameterError("optimizer", "already has a ProjectionHook; detach() it first")
        self.optimizer = optimizer
        self.radius = None if radius is None else v.positive_float("radius", radius)
        base = optimizer.original_optimizer
        if l2_regularization is not None:
            m = v.nonnegative_float("l2_regularization", l2_regularization)
            for g in base.param_groups:
                wd = float(g.get("weight_decay", 0.0))
                if wd not in (0.0, m):
                    raise v.ParameterError(
                        "l2_regularization", f"the optimizer already has weight_decay={wd:g}; give one L2 strength"
                    )
            for g in base.param_groups:
                g["weight_decay"] = m
        elif len({float(g.get("weight_decay", 0.0)) for g in base.param_groups}) > 1:
            raise v.ParameterError("optimizer", "parameter groups have different weight_decay")
        self._handle = None
        if self.radius is not None:
            _project_(_params(base), self.radius)
            self._handle = base.register_step_post_hook(lambda opt, args, kwargs: self.project())
        self._patched_pre_step = False
        world = getattr(optimizer, "world_size", 1)
        if check_loss_penalty and world == 1:  # under DDP p.grad is averaged over ranks
            self._patch_first_step()
        setattr(optimizer, PROJECTION_ATTR, self)

    # ------------------------------------------------------------------ properties
    @property
    def diameter(self) -> Optional[float]:
        """``2 * radius``: the diameter of the set the parameters stay in."""
        return None if self.radius is None else ball_product_diameter([self.radius])

    @property
    def strong_convexity(self) -> float:
        """``m_reg``: the base optimizer's ``weight_decay`` (read live)."""
        return float(self.optimizer.original_optimizer.param_groups[0].get("weight_decay", 0.0))

    def logistic_regression_geometry(
        self, feature_norm_bound: float, num_classes: Optional[int] = None
    ) -> LossGeometry:
        """:meth:`LossGeometry.logistic_regression` with this hook's ``m_reg`` and ``D``.

        ``feature_norm_bound`` must hold for every input of the trainable layer: a
        :class:`FeatureClip` in front of it enforces it; without one the accountant checks the
        inputs of every batch before its step and refuses a batch above the bound. ``num_classes``
        (default: the model's ``out_features``, read by the accountant) decides whether the clip may
        bind: for three or more classes the claim needs ``max_grad_norm >= sqrt(2 (R^2 + 1)) + 1e-6``."""
        return LossGeometry.logistic_regression(
            feature_norm_bound=feature_norm_bound,
            l2_regularization=self.strong_convexity,
            diameter=self.diameter,
            num_classes=num_classes,
        )

    # ------------------------------------------------------------------- mechanics
    def project(self) -> None:
        """Projects the optimizer's parameters onto the ball now."""
        if self.radius is not None:
            _project_(_params(self.optimizer.original_optimizer), self.radius)

    def _patch_first_step(self) -> None:
        opt = self.optimizer
        original = opt.pre_step

        def pre_step_once(*args, **kwargs):
            self._restore_pre_step()
            self._check_loss_penalty()
            return original(*args, **kwargs)

        opt.pre_step = pre_step_once  # instance attribute: only this optimizer, only once
        self._patched_pre_step = True

    def _restore_pre_step(self) -> None:
        if self._patched_pre_step:
            del self.optimizer.pre_step
            self._patched_pre_step = False

    def _check_loss_penalty(self) -> None:
        """Warns when ``p.grad`` (all of the loss) is not the mean of ``p.grad_sample``."""
        opt = self.optimizer
        worst = 0.0
        with torch.no_grad():
            for p in opt.params:
                gs = getattr(p, "grad_sample", None)
                if p.grad is None or not isinstance(gs, torch.Tensor) or gs.shape[0] == 0:
                    return  # ghost clipping, accumulation, empty batch: nothing to compare
                ref = gs.sum(0) if opt.loss_reduction == "sum" else gs.mean(0)
                gap = torch.linalg.vector_norm(p.grad - ref) / (torch.linalg.vector_norm(ref) + 1e-12)
                worst = max(worst, float(gap))
        if worst > 1e-3:
            warnings.warn(
                "ProjectionHook: p.grad differs from the mean per-example gradient (relative gap "
                f"{worst:.3g}); a penalty in the loss (e.g. lam*||w||^2) is dropped by Opacus' DP "
                "optimizer, so it neither regularises nor gives strong convexity. Use "
                "ProjectionHook(l2_regularization=...) (weight_decay, applied after clipping and noise).",
                HiddenStateWarning,
                stacklevel=4,
            )

    def detach(self) -> None:
        """Stops projecting; the accountant then sees unprojected steps (no diameter)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._restore_pre_step()
        if getattr(self.optimizer, PROJECTION_ATTR, None) is self:
            delattr(self.optimizer, PROJECTION_ATTR)

    def __repr__(self) -> str:
        return f"ProjectionHook(radius={self.radius}, strong_convexity={self.strong_convexity:g})"
