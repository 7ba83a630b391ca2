"""Plain PyTorch adapter, installed as ``hidden_state_accountants.pytorch``.

What needs torch but not Opacus (``pip install "hidden-state-accountants[torch]"``):

* :class:`~hidden_state_accountants.pytorch.sbcd.DPSBCD`: DP-SBCD, differentially private block
  coordinate descent for ReLU networks (*Differentially Private Network Training under Hidden
  State Assumption*, ICLR 2025 submission, arXiv:2407.08233), with its accountant. See
  ``docs/dp_sbcd.md``.

The Opacus integration (the ``"hidden_state"`` accountant, samplers, hooks) is
``hidden_state_accountants.opacus``.
"""

from .sbcd import DPSBCD, UnsupportedLayerError, parse_model

__all__ = ["DPSBCD", "UnsupportedLayerError", "parse_model"]
