"""Keras adapter without TF-Privacy, installed as ``hidden_state_accountants.keras``.

What needs TensorFlow (Keras 2) but not ``tensorflow-privacy``:

* :class:`~hidden_state_accountants.keras.sbcd.DPSBCD`: DP-SBCD, differentially private block
  coordinate descent for ReLU networks (*Differentially Private Network Training under Hidden
  State Assumption*, ICLR 2025 submission, arXiv:2407.08233), with its accountant. See
  ``docs/dp_sbcd.md``.

The TF-Privacy integration (the Keras callback, ``tf.data`` schedules, optimizers) is
``hidden_state_accountants.tf_privacy``; ``hidden_state_accountants.tf_privacy.sbcd`` is this
package's ``sbcd`` module under its former name.
"""

from .sbcd import DPSBCD, UnsupportedLayerError, parse_model

__all__ = ["DPSBCD", "UnsupportedLayerError", "parse_model"]
