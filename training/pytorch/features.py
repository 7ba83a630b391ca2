"""The feature bound in PyTorch: enforced by :class:`FeatureClip`, or checked by :class:`FeatureNormMonitor`.

* :func:`clip_features` / :class:`FeatureClip` scale every input to L2 norm ``<= R``, the feature
  bound of :meth:`LossGeometry.logistic_regression <hidden_state_accountants.LossGeometry.logistic_regression>`,
  a hair inside the ball by the core's rounding rule (:mod:`hidden_state_accountants.projection`);
  the Opacus accountant recognises a ``FeatureClip`` in front of the trainable layer from the
  model's structure (the bound is then *enforced*).
* :class:`FeatureNormMonitor` sees the inputs of the trainable layer in every training forward
  pass, so that without a ``FeatureClip`` the accountant *checks* the bound on every batch before
  its step.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from hidden_state_accountants import validation as v
from hidden_state_accountants.projection import inside_factor

__all__ = ["FeatureClip", "clip_features", "FeatureNormMonitor"]


def clip_features(x: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scales each example (row; trailing dimensions flattened) to L2 norm ``<= max_norm``.

    The norm is computed in float64 and the row scaled a hair inside the ball, so that rounding
    can never leave a row above ``max_norm``.

    >>> x = torch.tensor([[3.0, 4.0], [0.3, 0.4]])
    >>> clip_features(x, 1.0).norm(dim=1).tolist() <= [1.0, 1.0]
    True
    >>> clip_features(x, 1.0)[1].tolist() == x[1].tolist()  # inside: unchanged
    True
    """
    r = v.positive_float("max_norm", max_norm)
    if x.dim() == 0:
        raise v.ParameterError("x", "needs a batch dimension")
    norms = torch.linalg.vector_norm(x.reshape(x.shape[0], -1), dim=1, dtype=torch.float64)
    eps = torch.finfo(x.dtype).eps if x.dtype.is_floating_point else 0.0
    scale = torch.clamp(r * inside_factor(eps) / norms.clamp_min(1e-300), max=1.0)
    return x * scale.reshape((-1,) + (1,) * (x.dim() - 1)).to(x.dtype)


class FeatureClip(nn.Module):
    """A parameter-free first layer: ``clip_features(x, max_norm)``.

    Put it in front of the model so the feature bound of
    :meth:`LossGeometry.logistic_regression` holds for every input, in training and after.

    >>> layer = FeatureClip(2.0)
    >>> float(layer(torch.ones(1, 16)).norm()) <= 2.0
    True
    """

    def __init__(self, max_norm: float) -> None:
        super().__init__()
        self._max_norm = v.positive_float("max_norm", max_norm)

    @property
    def max_norm(self) -> float:
        """The radius (fixed: the accountant read it from the model's structure at ``configure``)."""
        return self._max_norm

    @property
    def feature_norm_bound(self) -> float:
        return self._max_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return clip_features(x, self.max_norm)

    def extra_repr(self) -> str:
        return f"max_norm={self.max_norm:g}"


class FeatureNormMonitor:
    """The largest L2 norm of an input of ``module`` (per example: all dimensions but the first, as
    :class:`FeatureClip` bounds it) in the forward passes that train, since it was last read.

    A forward pre-hook sees the module's input when the module is in training mode with gradients
    enabled (when Opacus captures the activations it computes per-example gradients from);
    evaluation under ``torch.no_grad()`` or ``model.eval()`` is not counted. The norm is computed
    in float64 on the input's device; :meth:`take` reads it on the host (one sync per step).
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._largest: Optional[torch.Tensor] = None
        self._handle = module.register_forward_pre_hook(self._see)

    def _see(self, module: nn.Module, args) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor):
            return
        if x.numel() == 0:  # an empty (Poisson) batch: no input at all
            largest = torch.zeros((), dtype=torch.float64, device=x.device)
        else:  # detached: no autograd graph, so no torch.no_grad() needed (it costs as much as the norm)
            rows = x.detach().reshape(x.shape[0] if x.dim() > 1 else 1, -1)
            largest = torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64).max()
        self._largest = largest if self._largest is None else torch.maximum(self._largest, largest)

    def take(self, world_size: int = 1) -> Optional[float]:
        """The largest norm seen since the last call (``None``: no training forward pass), and
        reset. With ``world_size > 1`` the largest over the ranks of the process group (every rank
        calls it at the same step)."""
        seen, self._largest = self._largest, None
        if world_size > 1:
            device = next(self.module.parameters()).device
            buf = (seen if seen is not None else torch.tensor(-1.0, dtype=torch.float64)).to(device)
            torch.distributed.all_reduce(buf, op=torch.distributed.ReduceOp.MAX)
            value = buf.item()
            return None if value < 0 else value
        return None if seen is None else seen.item()  # .item(): float(tensor) costs 50 times more

    def detach(self) -> None:
        """Removes the hook."""
        self._handle.remove()
