"""Finite-difference checks of the map a DP-SBCD optimizer runs on one weight block (numpy only;
the PyTorch and Keras tests of docs/dp_sbcd.md, "Audit: per-example clipping keeps each
sub-problem convex", share them).

The accountant (``hidden_state_accountants.analyses.sbcd.layer_constants``) uses, per block, the
smoothness ``beta = gamma rho_eff^2`` (Lemma 3.1) and the step's Lipschitz constant ``L_F L_T``
(Lemmas 4.1, 4.2). Both hold only if every example's clipped gradient is the gradient of a convex
``beta``-smooth function of ``theta``: its Jacobian is then a Hessian, symmetric, with eigenvalues in
``[0, beta]``. Clipping a vector-valued gradient by its own norm breaks that in general (issue 27);
:func:`check_gradient_field` is what catches it.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

Map = Callable[[np.ndarray], np.ndarray]

STEP_OPTIONS = {
    "plain": dict(),
    "l2": dict(regularizer="l2", regularization=0.5),
    "l1+ball": dict(regularizer="l1", regularization=0.05, radius=50.0),
    "appendix_c": dict(variant="appendix_c", radius=50.0, step_size=3.0),
    "expansive": dict(step_size=2.0),  # eta beta > 2 on a dense block: L_F = eta beta - 1 > 1
}
"""Trainer options under which the tests check one step against ``L_F L_T``."""


def jacobian(f: Map, theta: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """Central-difference Jacobian of ``f: R^m -> R^m`` at ``theta`` (float64)."""
    theta = np.asarray(theta, dtype=np.float64).ravel()
    cols = []
    for j in range(theta.size):
        e = np.zeros_like(theta)
        e[j] = h
        cols.append((np.asarray(f(theta + e), dtype=np.float64) - np.asarray(f(theta - e), dtype=np.float64)) / (2 * h))
    return np.stack(cols, axis=1)


def check_gradient_field(field: Map, theta: np.ndarray, beta: float, tol: float = 1e-6) -> np.ndarray:
    """Asserts that ``field`` looks, at ``theta``, like the gradient of a convex ``beta``-smooth
    function: (a) its Jacobian is symmetric and positive semi-definite, (b) its largest eigenvalue
    is at most ``beta``. Returns the eigenvalues of the Jacobian's symmetric part."""
    jac = jacobian(field, theta)
    scale = max(1.0, beta)
    asym = float(np.abs(jac - jac.T).max())
    eig = np.linalg.eigvalsh((jac + jac.T) / 2)
    assert asym <= tol * scale, f"the Jacobian is not symmetric (max |J - J^T| = {asym:.3g}): not a gradient field"
    assert eig[0] >= -tol * scale, (
        f"the Jacobian's symmetric part has eigenvalue {eig[0]:.3g} < 0: not the gradient of a convex function"
    )
    assert eig[-1] <= beta * (1 + tol), f"largest eigenvalue {eig[-1]:.6g} exceeds the smoothness beta = {beta:.6g}"
    return eig


def check_lipschitz(step: Map, theta: np.ndarray, bound: float, seed: int = 0, pairs: int = 20) -> float:
    """(c) Asserts that ``step`` is ``bound``-Lipschitz around ``theta``: the spectral norm of its
    Jacobian there, and the ratio ``|G(a) - G(b)| / |a - b|`` over random pairs at distances from
    ``1e-3`` to ``1`` (the map is only piecewise smooth). Returns the largest value seen."""
    theta = np.asarray(theta, dtype=np.float64).ravel()
    worst = float(np.linalg.norm(jacobian(step, theta), 2))
    rng = np.random.default_rng(seed)
    for scale in np.geomspace(1e-3, 1.0, pairs):
        a = theta + scale * rng.normal(size=theta.size)
        b = a + scale * rng.normal(size=theta.size)
        worst = max(worst, float(np.linalg.norm(step(a) - step(b)) / np.linalg.norm(a - b)))
    assert worst <= bound * (1 + 1e-6), f"the step is {worst:.6g}-Lipschitz here, above L_F L_T = {bound:.6g}"
    return worst
