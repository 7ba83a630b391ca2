"""Settings shared by the Keras tests (importable: pytest puts this folder on sys.path)."""

from hidden_state_accountants import LossGeometry

# A small logistic-regression run: 6 steps per epoch.
N, B, DIM, CLASSES = 120, 20, 5, 2  # two classes: the geometry holds under any clip (docs/derivations.md 18)
SPE = N // B
Z, C, LR, L2, DELTA = 1.5, 1.0, 0.5, 0.05, 1e-5
GEOMETRY = LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=L2, num_classes=CLASSES)
