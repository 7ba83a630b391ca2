"""Former name of :mod:`hidden_state_accountants.keras.sbcd`, the Keras DP-SBCD trainer (which
needs TensorFlow but not TF-Privacy): importing it gives that module itself."""

import sys

from hidden_state_accountants.keras import sbcd as _sbcd

sys.modules[__name__] = _sbcd
