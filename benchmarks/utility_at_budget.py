"""Accuracy at a fixed privacy budget: what an Opacus user gains from hidden-state accounting.

L2-regularised (multi-class) logistic regression, trained with Opacus on CPU as users run it,
at epsilon in {0.5, 1, 2, 4} and delta = 1e-5. Every method searches the same hyperparameters
(batch size, epochs, learning rate below 2/M, L2 strength as weight decay through
``ProjectionHook``, projection radius or none), calibrates the noise multiplier z to the budget
for every configuration, picks the configuration with the best validation accuracy (trained with
``--select-seeds`` seeds), and reports its test accuracy over ``--seeds`` fresh seeds (mean, std,
min-max). Methods:

(A)  Opacus as users run it: the default Poisson loader, ``PrivacyEngine(accountant="prv")``,
     ``make_private_with_epsilon`` (ADD_OR_REMOVE_ONE).
(A2) (A) with the clip a hidden-state claim needs on more than two classes (C = 2.01, one that
     cannot bind), on those datasets only: (A) against (A2) is what that clip costs. Opacus' z does
     not depend on the clip: it is (A)'s. (B), (C) and (D) clip at 2.01 on those datasets where they
     declare a geometry (an L2 term or a projection); without either no hidden-state analysis can
     hold, so they declare none and keep clip 1, as a user would.
(B)  The same code with ``PrivacyEngine(accountant="hidden_state")``: the geometry of the
     ``ProjectionHook`` declared with ``engine.accountant.configure(geometry=..., model=...,
     dataset_size=...)`` and calibrated through ``make_private_with_epsilon(...,
     **engine.accountant.calibration_kwargs(...))`` (ADD_OR_REMOVE_ONE). The configurations are
     searched with the core's ``calibrate_noise_multiplier`` for the same ``TrainingRunDpEvent``;
     for the winner both z are printed, and the adapter's is used when the two agree (within
     5%), else the core's (the row says so).
(A') Opacus' Poisson loader under REPLACE_ONE, the papers' relation. Opacus has no replace-one
     accountant: z is calibrated with the package's composition accountant
     (``HiddenStateAccountant(neighboring_relation="REPLACE_ONE")`` on a geometry-free Poisson
     ``TrainingRunDpEvent``), and the run is accounted by the adapter without a geometry.
(C)  The package's fixed-size samplers (``--samplers``: shuffle_partition, reshuffle,
     balls_in_bins; cyclic on request) with ``PrivacyEngine(accountant="hidden_state")`` under
     REPLACE_ONE (``configure(neighboring_relation=...)``), the sampler chosen on validation like
     the other hyperparameters; calibrated as (B); against (A').
(D)  The package's balls-in-bins sampler (``BallsInBinsBatchSampler``: each record draws its step
     in every epoch) with ``PrivacyEngine(accountant="hidden_state")`` under ADD_OR_REMOVE_ONE,
     Opacus' relation; calibrated as (B); against (A).

plus the non-private reference: the same model and search space, Opacus' loader without noise or
clipping. After each final run the engine's own accountant reports the epsilon of the run actually
trained; it must be within the budget (Opacus' PRV row may exceed it by its own rounding of the
step count, which the table would show).

Data: scikit-learn's digits (10 classes) and breast cancer (2 classes), standardised with the
training split's statistics, and a synthetic linear-probe task (10 Gaussian classes in d = 256
with a shared covariance, n = 10000; its Bayes accuracy, 0.85, is exact: see
:func:`synthetic_linear_probe`). Every model starts with ``FeatureClip(1)``, so the declared
feature bound holds. What no method accounts for: the standardisation statistics of the real
datasets (taken from their training split, as the same preprocessing for all methods) and the
hyperparameter search itself.

    python benchmarks/utility_at_budget.py --quick    # digits, eps 1 and 4, a small grid (outputs/)
    python benchmarks/utility_at_budget.py --jobs 2    # full mode: writes docs/benchmark_utility.md and .png
    python benchmarks/utility_at_budget.py --grid reduced --datasets digits,synthetic --jobs 2  # reduced grids

Progress goes to stderr; one row per method and budget to stdout. ``--cache FILE`` keeps every
calibration and run (keyed by the package's source, so results of older code are never reused)
so that an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import hashlib
import importlib.util
import json
import math
import multiprocessing
import os
import pathlib
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
DELTA = 1e-5
BUDGETS = (0.5, 1.0, 2.0, 4.0)
FEATURE_NORM = 1.0  # R: FeatureClip(R) in front of the linear layer; the geometry's feature bound
CLIP_NORM = 1.0  # C, every method on two classes, and the composition methods on more
# C of a method that declares a geometry on three or more classes: a clip that cannot bind (sqrt(2 (R^2 + 1))
# plus Opacus' 1e-6 margin, rounded up): with a binding clip the clipped multi-class gradient is not monotone
# and no hidden-state claim holds (docs/derivations.md section 18)
NONBINDING_CLIP_NORM = 2.01
NON_PRIVATE_CLIP = 1e6  # "no clipping": far above any per-example gradient norm of this model (at most 2)
Z_AGREEMENT = 0.05  # the adapter's z and the core's z agree when they differ by at most 5%
EPSILON_SLACK = 1e-6  # reported epsilon vs the budget (relative), beyond float rounding
# Bump when anything that changes a calibration or a training run changes here (data, model, training
# loop, the methods' setup): ``--cache`` reuses results only under the same version and package source.
TASKS_VERSION = 3  # 2: a clip that cannot bind where a geometry is declared on three or more classes; 3: no geometry (clip 1) on more classes without L2 or projection
# Bump a dataset's entry when its data change (only its cached results are then recomputed).
DATA_VERSIONS = {"synthetic": 2}  # 2: identity covariance


# ----------------------------------------------------------------------------------------- data
@dataclass
class Data:
    """Train / validation / test splits (features standardised; FeatureClip in the model bounds them)."""

    name: str
    description: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    classes: int
    bayes_accuracy: Optional[float] = None

    @property
    def n(self) -> int:
        return len(self.y_train)

    @property
    def dim(self) -> int:
        return self.x_train.shape[1]


def _split_standardised(name, description, x, y, n_train, n_val, seed) -> Data:
    """A seeded permutation into train / val / test; standardised with the training split's moments."""
    perm = np.random.default_rng(seed).permutation(len(y))
    x, y = x[perm].astype(np.float64), y[perm].astype(np.int64)
    mean, std = x[:n_train].mean(0), x[:n_train].std(0)
    x = ((x - mean) / np.where(std > 0, std, 1.0)).astype(np.float32)
    cut = n_train + n_val
    return Data(
        name, description, x[:n_train], y[:n_train], x[n_train:cut], y[n_train:cut], x[cut:], y[cut:], int(y.max()) + 1
    )


def bayes_accuracy_simplex(separation: float, classes: int) -> float:
    """Accuracy of the Bayes rule for ``classes`` equiprobable Gaussians ``N(s u_k, I)`` whose means form
    a regular simplex (``u_j . u_k = delta_jk - 1/K``): ``int phi(t) Phi(t + s)^(K-1) dt``.

    Class ``k`` is chosen iff ``s + eta_k > eta_j`` for every ``j != k`` (``eta`` standard normal, the
    noise along the simplex's directions), hence the integral. For two classes it is
    ``Phi(s / sqrt(2))``.
    """
    from scipy import integrate, stats

    value, _ = integrate.quad(
        lambda t: stats.norm.pdf(t) * stats.norm.cdf(t + separation) ** (classes - 1),
        -np.inf,
        np.inf,
        epsabs=1e-12,
        epsrel=1e-12,
    )
    return float(value)


def synthetic_linear_probe(
    *,
    n_train: int = 10000,
    n_val: int = 2000,
    n_test: int = 5000,
    dim: int = 256,
    classes: int = 10,
    bayes: float = 0.85,
    eigenvalues: Tuple[float, float] = (1.0, 1.0),
    seed: int = 0,
) -> Data:
    """Gaussian classes with a shared random covariance, hard enough that noise limits accuracy.

    In whitened coordinates ``w ~ N(s u_y, I)`` with the ``u_k`` a randomly rotated regular simplex
    (equal norms, summing to zero) and ``s`` solved so that the Bayes accuracy is ``bayes``
    (:func:`bayes_accuracy_simplex`); the features are ``x = A w`` with ``A`` a random symmetric
    square root of a covariance whose eigenvalues are log-uniform in ``eigenvalues``, standardised with
    the population's (known, so nothing leaks) per-feature moments. The Bayes rule
    ``argmax_k u_k . A^-1 x`` is linear with no offset, so scaling an input (FeatureClip) never changes
    its decision: the Bayes accuracy of the clipped features is still ``bayes``, and a linear model can
    reach it. The default covariance is the identity: with eigenvalues in [0.2, 5] plain SGD at
    ``lr < 2/M`` on the clipped features was the bottleneck (0.71 validation accuracy without noise after
    20 epochs at b = 250, 0.82 after 100 at b = 100), not the privacy noise this task is meant to expose.
    """
    from scipy import optimize

    rng = np.random.default_rng(seed)
    separation = optimize.brentq(lambda s: bayes_accuracy_simplex(s, classes) - bayes, 0.0, 20.0, xtol=1e-12)
    rotation, _ = np.linalg.qr(rng.standard_normal((dim, dim)))
    simplex = np.eye(classes) - 1.0 / classes  # rows u_k: u_j . u_k = delta_jk - 1/K
    means = separation * simplex @ rotation[:, :classes].T  # (K, d) in whitened coordinates
    eig = np.exp(rng.uniform(np.log(eigenvalues[0]), np.log(eigenvalues[1]), dim))
    basis, _ = np.linalg.qr(rng.standard_normal((dim, dim)))
    root = (basis * np.sqrt(eig)) @ basis.T  # A, with A A^T the covariance
    n = n_train + n_val + n_test
    y = rng.integers(0, classes, n)
    w = means[y] + rng.standard_normal((n, dim))
    x = w @ root.T
    # population moments: mean 0 (the means sum to zero); variance diag(A (I + E[m m^T]) A^T)
    second = np.eye(dim) + means.T @ means / classes
    std = np.sqrt(np.einsum("ij,jk,ik->i", root, second, root))
    x = (x / std).astype(np.float32)
    bayes_rule = np.argmax((w @ means.T), axis=1)  # argmax_k m_k . w (equal norms: no offsets)
    cut = n_train + n_val
    data = Data(
        "synthetic",
        "",
        x[:n_train],
        y[:n_train],
        x[n_train:cut],
        y[n_train:cut],
        x[cut:],
        y[cut:],
        classes,
        bayes_accuracy_simplex(separation, classes),
    )
    cov = (
        "identity"
        if eigenvalues[0] == eigenvalues[1] == 1
        else f"eigenvalues log-uniform in [{eigenvalues[0]:g}, {eigenvalues[1]:g}]"
    )
    data.description = (
        f"synthetic linear probe: {classes} Gaussian classes, d = {dim}, shared covariance "
        f"({cov}), simplex means at separation {separation:.4f}; "
        f"n = {n_train} / {n_val} / {n_test} (train / val / test); Bayes accuracy "
        f"{data.bayes_accuracy:.4f} (exact), the Bayes rule scores "
        f"{float(np.mean(bayes_rule[cut:] == y[cut:])):.4f} on the test split"
    )
    return data


def load_dataset(name: str) -> Data:
    """The benchmark's datasets; generated or shipped with scikit-learn (no download)."""
    if name == "synthetic":
        return synthetic_linear_probe()
    from sklearn import datasets

    if name == "digits":
        x, y = datasets.load_digits(return_X_y=True)
        return _split_standardised(
            name,
            "scikit-learn digits: 8x8 images, 10 classes; n = 1200 / 300 / 297 (train / val / test)",
            x,
            y,
            1200,
            300,
            0,
        )
    if name == "breast_cancer":
        x, y = datasets.load_breast_cancer(return_X_y=True)
        return _split_standardised(
            name,
            "scikit-learn breast cancer: 30 features, 2 classes; n = 360 / 109 / 100 (train / val / test)",
            x,
            y,
            360,
            109,
            0,
        )
    raise ValueError(f"unknown dataset {name!r}")


DATASETS = ("digits", "breast_cancer", "synthetic")
_LOADED: Dict[str, Data] = {}


def dataset(name: str) -> Data:
    if name not in _LOADED:
        _LOADED[name] = load_dataset(name)
    return _LOADED[name]


# ------------------------------------------------------------------------------ configurations
@dataclass(frozen=True)
class Config:
    """One point of the search space; ``sampler`` is None for Opacus' Poisson loader."""

    batch_size: int
    epochs: int
    lr: float
    l2: float
    radius: Optional[float]
    sampler: Optional[str] = None

    def describe(self) -> str:
        radius = "none" if self.radius is None else f"{self.radius:g}"
        text = f"b={self.batch_size} E={self.epochs} lr={self.lr:g} L2={self.l2:g} radius={radius}"
        return text + (f" {self.sampler}" if self.sampler else "")


@dataclass(frozen=True)
class Grid:
    batch_sizes: Tuple[int, ...]
    epochs: Tuple[int, ...]
    lrs: Tuple[float, ...]
    l2s: Tuple[float, ...]
    radii: Tuple[Optional[float], ...]
    samplers: Tuple[str, ...]

    def configs(self, samplers: Sequence[Optional[str]] = (None,)) -> List[Config]:
        return [
            Config(b, e, lr, l2, r, s)
            for s in samplers
            for b in self.batch_sizes
            for e in self.epochs
            for lr in self.lrs
            for l2 in self.l2s
            for r in self.radii
        ]


# The full mode's grids: the same for every method; batch sizes scale with the dataset and divide n
# (the fixed-size samplers leave the last n % b records of their order out). Every lr is below
# 2/M = 2 / ((R^2 + 1)/2 + L2) >= 1.9 (the hidden-state analyses' condition).
# No projection by default: a pilot (docs/benchmark_utility.md) found that every radius that could
# matter lowers the private accuracy, and at the radii that do not the constrained analyses add nothing;
# ``--radii none,10`` searches one.
FULL_GRIDS = {
    "digits": Grid(
        (50, 150, 400),
        (10, 30, 100),
        (0.5, 1.0),
        (0.0, 0.01, 0.05),
        (None,),
        ("shuffle_partition", "reshuffle", "balls_in_bins"),
    ),
    "breast_cancer": Grid(
        (24, 72, 180),
        (10, 30, 100),
        (0.5, 1.0),
        (0.0, 0.01, 0.05),
        (None,),
        ("shuffle_partition", "reshuffle", "balls_in_bins"),
    ),
    "synthetic": Grid(
        (250, 1000),
        (5, 20),
        (0.5, 1.0),
        (0.0, 0.01, 0.05),
        (None,),
        ("shuffle_partition", "reshuffle", "balls_in_bins"),
    ),
}
# A reduced full mode for a shared 2-core machine (--grid reduced): one lr (1), (C) choosing between
# shuffle_partition and balls_in_bins, and on the synthetic task 20 epochs only.
_REDUCED_SAMPLERS = ("shuffle_partition", "balls_in_bins")
REDUCED_GRIDS = {
    "digits": Grid((50, 150, 400), (10, 30, 100), (1.0,), (0.0, 0.01, 0.05), (None,), _REDUCED_SAMPLERS),
    "breast_cancer": Grid((24, 72, 180), (10, 30, 100), (1.0,), (0.0, 0.01, 0.05), (None,), _REDUCED_SAMPLERS),
    "synthetic": Grid((250, 1000), (20,), (1.0,), (0.0, 0.01, 0.05), (None,), _REDUCED_SAMPLERS),
}
QUICK_GRID = Grid((50, 200), (10, 40), (1.0,), (0.0, 0.05), (None,), ("shuffle_partition",))
QUICK = dict(datasets=("digits",), budgets=(1.0, 4.0))


# ------------------------------------------------------------------------------------- methods
@dataclass(frozen=True)
class Method:
    key: str
    label: str
    relation: str  # what the budget means
    poisson: bool  # Opacus' Poisson loader (else a fixed-size sampler of this package)
    accountant: str  # "prv", "hidden_state", "hidden_state_replace_one"; "" for the non-private reference
    hidden_state: bool  # a geometry is declared and the package's hidden-state analyses may apply
    sampler: Optional[str] = None  # a fixed-size method's one sampler (else it searches the grid's samplers)
    geometry_clip: bool = False  # the clip a geometry needs on 3+ classes without declaring one; 3+ classes only

    def samplers(self, grid: "Grid") -> Tuple[Optional[str], ...]:
        return (None,) if self.poisson else ((self.sampler,) if self.sampler else grid.samplers)

    def applies_to(self, classes: int) -> bool:
        """(A2) is (A) itself on two classes, where every method clips at 1."""
        return classes > 2 or not self.geometry_clip


METHODS = {
    "A": Method("A", "(A) Opacus PRV, Poisson", "ADD_OR_REMOVE_ONE", True, "prv", False),
    "A2": Method(
        "A2",
        f"(A2) Opacus PRV, Poisson, clip {NONBINDING_CLIP_NORM:g}",
        "ADD_OR_REMOVE_ONE",
        True,
        "prv",
        False,
        geometry_clip=True,
    ),
    "B": Method("B", "(B) hidden_state, Poisson", "ADD_OR_REMOVE_ONE", True, "hidden_state", True),
    "A'": Method("A'", "(A') composition, Poisson", "REPLACE_ONE", True, "hidden_state_replace_one", False),
    "C": Method("C", "(C) hidden_state, fixed-size sampler", "REPLACE_ONE", False, "hidden_state", True),
    "D": Method(
        "D", "(D) hidden_state, balls-in-bins", "ADD_OR_REMOVE_ONE", False, "hidden_state", True, "balls_in_bins"
    ),
}
SAMPLERS = ("cyclic", "shuffle_partition", "reshuffle", "balls_in_bins")
# each hidden-state method against its composition baseline in the same relation (the grid's noise ratios;
# (A2)'s z is (A)'s)
PAIRS = (("A", "B"), ("A", "D"), ("A'", "C"))
NO_L2_METHODS = ("A", "A2", "D")  # also compared on their best configuration without an L2 term
NON_PRIVATE = Method("non-private", "non-private (no noise, no clipping)", "-", True, "prv", False)


def poisson_plan(n: int, batch_size: int) -> Tuple[float, int, int]:
    """What Opacus' Poisson loader does with ``DataLoader(batch_size=b)``: sample rate
    ``q = 1/len(loader)``, ``expected_batch_size = int(n q)`` (the divisor) and ``int(1/q)`` steps per
    epoch (``DPDataLoader``'s length). Checked against the real loader after ``make_private``."""
    q = 1.0 / math.ceil(n / batch_size)
    return q, int(n * q), int(1 / q)


def geometry_for(cfg: Config, classes: int = 2):
    """The geometry the ProjectionHook makes true (``hook.logistic_regression_geometry(R)``), before
    the hook exists (the calibration call needs it first)."""
    from hidden_state_accountants import LossGeometry

    radius = None if cfg.radius is None else 2.0 * cfg.radius
    return LossGeometry.logistic_regression(FEATURE_NORM, cfg.l2, radius, num_classes=classes)


def declares_geometry(method: Method, cfg: Optional[Config], classes: int) -> bool:
    """Whether a user of ``method`` declares the logistic geometry for this configuration: a hidden-state method
    does, except on three or more classes where the configuration has neither an L2 term nor a projection (no
    hidden-state analysis could hold, so the user keeps the clip at 1 and gets composition, without the larger
    clip a multi-class claim needs)."""
    if not method.hidden_state:
        return False
    return classes <= 2 or cfg is None or cfg.l2 > 0 or cfg.radius is not None


def clip_norm_for(method: Method, classes: int, cfg: Optional[Config] = None) -> float:
    """The clip a user of ``method`` sets: one that cannot bind where a geometry is declared for three or
    more classes (and for (A2), its baseline at that clip), else 1. ``cfg=None``: a configuration that can
    carry a hidden-state claim."""
    wide = method.geometry_clip or declares_geometry(method, cfg, classes)
    return NONBINDING_CLIP_NORM if wide and classes > 2 else CLIP_NORM


def core_event(method: Method, cfg: Config, n: int, classes: int):
    """The ``TrainingRunDpEvent`` the engine's accountant records for this configuration (noise 1)."""
    from hidden_state_accountants import TrainingRunDpEvent

    common = dict(noise_multiplier=1.0, clip_norm=clip_norm_for(method, classes, cfg), learning_rate=cfg.lr)
    geometry = geometry_for(cfg, classes) if declares_geometry(method, cfg, classes) else None
    if method.poisson:
        q, divisor, steps_per_epoch = poisson_plan(n, cfg.batch_size)
        if geometry is None:  # the recording layer describes a composition-only Poisson run by round(q n)
            from hidden_state_accountants.schedules import poisson_sizes

            divisor = poisson_sizes(q, n)[1]
        return TrainingRunDpEvent(
            dataset_size=n,
            batch_size=divisor,
            steps=cfg.epochs * steps_per_epoch,
            sampling="poisson",
            sampling_probability=q,
            geometry=geometry,
            l2_regularization=cfg.l2,
            **common,
        )
    return TrainingRunDpEvent.from_epochs(
        dataset_size=n,
        batch_size=cfg.batch_size,
        epochs=cfg.epochs,
        sampling=cfg.sampler,
        geometry=geometry,
        l2_regularization=cfg.l2,
        **common,
    )


def core_noise(method: Method, cfg: Config, n: int, classes: int, epsilon: float) -> Tuple[float, str]:
    """The core's ``calibrate_noise_multiplier`` for the method's event and relation: (z, analysis)."""
    from hidden_state_accountants import calibrate_noise_multiplier

    result = calibrate_noise_multiplier(
        core_event(method, cfg, n, classes), epsilon, DELTA, neighboring_relation=method.relation
    )
    return result.noise_multiplier, result.analysis


def window_noise(method: Method, cfg: Config, n: int, classes: int, epsilon: float) -> Dict[str, object]:
    """What a hidden-state winner's noise is worth in composed steps (docs/derivations.md section 19).

    The noise composition needs (the core's ``calibrate_noise_multiplier`` without the geometry: the same
    schedule, relation and budget) over the run's own ``T`` steps and, where the bound converges through
    the L2 term (no projection), over ``ceil(T_w)`` steps, ``T_w = composition_window(lr, L2)``: no valid
    converged hidden-state bound needs less noise than the latter."""
    from hidden_state_accountants import calibrate_noise_multiplier
    from hidden_state_accountants.lower_bounds import composition_window

    event = core_event(method, cfg, n, classes).replace(geometry=None)

    def composition(steps: int) -> Tuple[float, str]:
        result = calibrate_noise_multiplier(
            event.replace(steps=steps), epsilon, DELTA, neighboring_relation=method.relation
        )
        return result.noise_multiplier, result.analysis

    out: Dict[str, object] = {"steps": event.steps}
    out["z_run"], out["analysis_run"] = composition(event.steps)
    if cfg.l2 > 0 and cfg.radius is None:  # with a projection the window argument does not apply
        window = composition_window(cfg.lr, cfg.l2)
        out.update(window=window, window_steps=math.ceil(window))
        out["z_window"], out["analysis_window"] = composition(math.ceil(window))
    return out


# ------------------------------------------------------------------------- Opacus, as users run it
def _quiet() -> None:
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Secure RNG turned off")
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    warnings.filterwarnings("ignore", message="Optimal order is the")  # Opacus RDP at the order grid's edge
    from hidden_state_accountants import CompositionFallbackWarning

    warnings.filterwarnings("ignore", category=CompositionFallbackWarning)  # (A'): no geometry, by design


def _sampler(cfg: Config, n: int, seed: int):
    import hidden_state_accountants.opacus as hso

    classes = {
        "cyclic": lambda: hso.CyclicBatchSampler(n, cfg.batch_size),
        "shuffle_partition": lambda: hso.ShufflePartitionBatchSampler(n, cfg.batch_size, seed),
        "reshuffle": lambda: hso.ReshuffleBatchSampler(n, cfg.batch_size, seed),
        "balls_in_bins": lambda: hso.BallsInBinsBatchSampler(n, cfg.batch_size, seed),
    }
    return classes[cfg.sampler]()


def private_training(
    data: Data,
    method: Method,
    cfg: Config,
    seed: int,
    *,
    noise_multiplier: Optional[float] = None,
    target_epsilon: Optional[float] = None,
):
    """Model, DP optimizer, loader and engine, set up as a user of ``method`` does.

    With ``target_epsilon``, Opacus' ``make_private_with_epsilon`` chooses z (the hidden-state methods
    configure the accountant first and pass ``calibration_kwargs``); else ``make_private`` with
    ``noise_multiplier``. The seed fixes the initial model, the batches and the noise (experiments
    only: the guarantee rests on them being secret)."""
    import torch
    from opacus import PrivacyEngine
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import hidden_state_accountants.opacus as hso

    torch.manual_seed(seed)
    train = TensorDataset(torch.from_numpy(data.x_train), torch.from_numpy(data.y_train))
    model = nn.Sequential(hso.FeatureClip(FEATURE_NORM), nn.Linear(data.dim, data.classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, weight_decay=cfg.l2)
    engine = PrivacyEngine(
        accountant="hidden_state" if method.accountant.startswith("hidden_state") else method.accountant
    )
    if method.accountant == "hidden_state_replace_one":
        engine.accountant = hso.OpacusHiddenStateAccountant(neighboring_relation="REPLACE_ONE")
    sampler = None if method.poisson else _sampler(cfg, data.n, seed)
    loader = (
        DataLoader(train, batch_size=cfg.batch_size) if sampler is None else DataLoader(train, batch_sampler=sampler)
    )
    where = dict(dataset_size=data.n) if sampler is None else dict(sampler=sampler)
    common = dict(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        poisson_sampling=method.poisson,
        max_grad_norm=clip_norm_for(method, data.classes, cfg) if method is not NON_PRIVATE else NON_PRIVATE_CLIP,
    )
    declared = declares_geometry(method, cfg, data.classes)
    if target_epsilon is not None:
        kwargs = {}
        if method.hidden_state:  # the configuration Opacus' calibration cannot see
            engine.accountant.configure(
                geometry=geometry_for(cfg, data.classes) if declared else None,
                model=model,
                neighboring_relation=method.relation,
                **where,
            )
            kwargs = engine.accountant.calibration_kwargs(
                optimizer=optimizer, max_grad_norm=clip_norm_for(method, data.classes, cfg)
            )
        model, optimizer, loader = engine.make_private_with_epsilon(
            target_epsilon=target_epsilon, target_delta=DELTA, epochs=cfg.epochs, **common, **kwargs
        )
    else:
        model, optimizer, loader = engine.make_private(noise_multiplier=noise_multiplier, **common)
    hook = hso.ProjectionHook(optimizer, radius=cfg.radius, l2_regularization=cfg.l2)
    if method.hidden_state:
        engine.accountant.configure(
            geometry=hook.logistic_regression_geometry(FEATURE_NORM, num_classes=data.classes) if declared else None,
            model=model,
            optimizer=optimizer,
            neighboring_relation=method.relation,
            **where,
        )
    return model, optimizer, loader, engine


def _accuracy(model, x: np.ndarray, y: np.ndarray) -> float:
    import torch

    with torch.no_grad():
        return float((model(torch.from_numpy(x)).argmax(1).numpy() == y).mean())


def train_run(data: Data, method: Method, cfg: Config, z: float, seed: int, *, account: bool) -> Dict[str, object]:
    """Trains one configuration; validation and test accuracy, and with ``account`` what the engine's
    accountant reports for the run actually trained (epsilon, analysis, relation)."""
    from torch import nn

    model, optimizer, loader, engine = private_training(data, method, cfg, seed, noise_multiplier=z)
    if method.poisson:  # the run the core calibrated for is the run Opacus makes
        q, divisor, steps_per_epoch = poisson_plan(data.n, cfg.batch_size)
        assert (len(loader), optimizer.expected_batch_size) == (steps_per_epoch, divisor), (len(loader), divisor)
    model.train()
    for _ in range(cfg.epochs):
        for xb, yb in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
    model.eval()
    out: Dict[str, object] = {
        "val": _accuracy(model, data.x_val, data.y_val),
        "test": _accuracy(model, data.x_test, data.y_test),
    }
    if account and method is not NON_PRIVATE:
        if method.accountant == "prv":
            out.update(epsilon=float(engine.get_epsilon(DELTA)), analysis="opacus prv", relation="ADD_OR_REMOVE_ONE")
        else:
            report = engine.accountant.explain(DELTA)
            out.update(epsilon=float(report.epsilon), analysis=report.analysis, relation=report.neighboring_relation)
            if method.hidden_state:  # the run the core's z was calibrated for is the run the engine recorded
                expected = core_event(method, cfg, data.n, data.classes).replace(noise_multiplier=z)
                recorded = engine.accountant.training_run()
                if expected.geometry is None:  # the recording layer notes why no hidden-state claim is made
                    recorded = recorded.replace(hidden_state_refusal=None)
                out["same_event"] = recorded == expected
    return out


def opacus_noise(data: Data, method: Method, cfg: Config, epsilon: float) -> float:
    """The z that ``make_private_with_epsilon`` chooses for ``method`` (Opacus' own calibration, with
    the adapter's ``calibration_kwargs`` for the hidden-state methods)."""
    _, optimizer, _, _ = private_training(data, method, cfg, 0, target_epsilon=epsilon)
    return float(optimizer.noise_multiplier)


# ------------------------------------------------------------------------- tasks (worker side)
def _task(task: Dict[str, object]) -> Dict[str, object]:
    """One unit of work, run in a worker process: a calibration or a training run."""
    _quiet()
    data = dataset(task["dataset"])
    method = NON_PRIVATE if task["method"] == NON_PRIVATE.key else METHODS[task["method"]]
    cfg = Config(**task["config"])
    start = time.perf_counter()
    if task["kind"] == "core":
        z, analysis = core_noise(method, cfg, data.n, data.classes, task["epsilon"])
        out = {"z": z, "analysis": analysis}
    elif task["kind"] == "opacus":
        out = {"z": opacus_noise(data, method, cfg, task["epsilon"])}
    elif task["kind"] == "window":
        out = window_noise(method, cfg, data.n, data.classes, task["epsilon"])
    else:
        out = train_run(data, method, cfg, task["z"], task["seed"], account=task["account"])
    out["seconds"] = time.perf_counter() - start
    return out


def source_fingerprint() -> str:
    """What a cached result depends on: the package and adapters' source, the library versions and
    :data:`TASKS_VERSION` (this script's tasks; the report's formatting may change without it)."""
    from importlib.metadata import version

    digest = hashlib.sha256()
    for folder in ("hidden_state_accountants", "adapters"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            digest.update(path.read_bytes())
    for name in ("torch", "opacus", "dp-accounting", "numpy", "scipy", "scikit-learn"):
        digest.update(f"{name} {version(name)};".encode())
    digest.update(f"tasks {TASKS_VERSION}".encode())
    return digest.hexdigest()[:16]


class Runner:
    """Runs tasks (in ``jobs`` worker processes), remembering results in an optional JSON-lines cache."""

    def __init__(self, jobs: int, cache: Optional[str], progress: bool) -> None:
        self.jobs, self.cache_path, self.progress = jobs, cache, progress
        self.fingerprint = source_fingerprint()
        self.done: Dict[str, Dict[str, object]] = {}
        self.task_seconds = 0.0  # the work behind every result handed out, cached or not
        if cache and os.path.exists(cache):
            with open(cache) as f:
                for line in f:
                    entry = json.loads(line)
                    if entry.get("fingerprint") == self.fingerprint:
                        self.done[entry["key"]] = entry["result"]
        self.pool = None
        if jobs > 1:
            self.pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"))

    @staticmethod
    def key(task: Dict[str, object]) -> str:
        return json.dumps(task, sort_keys=True)

    def map(self, tasks: List[Dict[str, object]], desc: str) -> List[Dict[str, object]]:
        from tqdm import tqdm

        keys = [self.key(t) for t in tasks]
        todo = {k: t for k, t in zip(keys, tasks) if k not in self.done}
        bar = tqdm(total=len(todo), desc=desc, file=sys.stderr, disable=not self.progress, dynamic_ncols=True)
        results = map(_task, todo.values()) if self.pool is None else self.pool.map(_task, todo.values())
        for k, result in zip(todo, results):
            self.done[k] = result
            if self.cache_path:
                with open(self.cache_path, "a") as f:
                    f.write(json.dumps({"fingerprint": self.fingerprint, "key": k, "result": result}) + "\n")
            bar.update()
        bar.close()
        self.task_seconds += sum(self.done[k]["seconds"] for k in dict.fromkeys(keys))
        return [self.done[k] for k in keys]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


# ------------------------------------------------------------------------------- the benchmark
@dataclass
class Row:
    dataset: str
    method: str
    label: str
    relation: str
    epsilon_budget: Optional[float]
    config: Config
    z: float
    z_core: Optional[float]
    z_adapter: Optional[float]
    z_source: str
    validation: float
    test: List[float]
    reported_epsilon: Optional[float] = None
    analysis: str = ""
    note: str = ""
    window: Optional[Dict[str, object]] = None  # a hidden-state winner's composition window (window_noise)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.test)

    @property
    def std(self) -> float:
        return statistics.stdev(self.test) if len(self.test) > 1 else 0.0


def _task_of(data: Data, method: Method, cfg: Config, **fields) -> Dict[str, object]:
    version = {"data_version": DATA_VERSIONS[data.name]} if data.name in DATA_VERSIONS else {}
    return {"dataset": data.name, "method": method.key, "config": asdict(cfg), **version, **fields}


def benchmark_dataset(
    runner: Runner,
    data: Data,
    grid: Grid,
    methods: Sequence[Method],
    budgets: Sequence[float],
    select_seeds: Sequence[int],
    test_seeds: Sequence[int],
) -> Tuple[List[Row], List[Dict[str, object]], List[Row]]:
    """Search, select on validation and evaluate on test, for every method and budget; and the reference.
    Returns the rows, every configuration searched (method, budget, z, validation accuracy), and the rows
    of (A), (A2) and (D) selected among the configurations without an L2 term."""
    methods = [m for m in methods if m.applies_to(data.classes)]
    configs = {m.key: grid.configs(m.samplers(grid)) for m in methods}
    # 1. z for every configuration searched: Opacus' own for (A) and (A2) (it depends on b and E only, not
    #    on the clip: (A2) shares (A)'s task), the core's for the others (composition under REPLACE_ONE for (A'))
    noise_tasks, where = [], {}
    for m in methods:
        for eps in budgets:
            for cfg in configs[m.key]:
                if m.accountant == "prv":
                    opacus_cfg = replace(cfg, lr=1.0, l2=0.0, radius=None)
                    task = _task_of(data, METHODS["A"], opacus_cfg, kind="opacus", epsilon=eps)
                elif m.key == "A'":
                    task = _task_of(data, m, replace(cfg, lr=1.0, l2=0.0, radius=None), kind="core", epsilon=eps)
                else:
                    task = _task_of(data, m, cfg, kind="core", epsilon=eps)
                where[(m.key, eps, cfg)] = len(noise_tasks)
                noise_tasks.append(task)
    noises = runner.map(noise_tasks, f"{data.name}: calibrate")
    noise = {k: noises[i] for k, i in where.items()}
    # 2. the search: every configuration, method and budget, on validation; and the non-private reference
    run_tasks, where = [], {}
    for m in methods:
        for eps in budgets:
            for cfg in configs[m.key]:
                for s in select_seeds:
                    where[(m.key, eps, cfg, s)] = len(run_tasks)
                    run_tasks.append(
                        _task_of(data, m, cfg, kind="run", z=noise[(m.key, eps, cfg)]["z"], seed=s, account=False)
                    )
    plain = grid.configs()
    for cfg in plain:
        for s in select_seeds:
            where[(NON_PRIVATE.key, None, cfg, s)] = len(run_tasks)
            run_tasks.append(_task_of(data, NON_PRIVATE, cfg, kind="run", z=0.0, seed=s, account=False))
    runs = runner.map(run_tasks, f"{data.name}: search")

    def best(key, eps, candidates) -> Tuple[Config, float]:
        scored = [
            (statistics.fmean(runs[where[(key, eps, c, s)]]["val"] for s in select_seeds), -i, c)
            for i, c in enumerate(candidates)
        ]
        val, _, cfg = max(scored, key=lambda t: t[:2])
        return cfg, val

    winners = {(m.key, eps): best(m.key, eps, configs[m.key]) for m in methods for eps in budgets}
    search = [
        dict(
            dataset=data.name,
            method=m.key,
            epsilon=eps,
            config=asdict(cfg),
            z=noise[(m.key, eps, cfg)]["z"],
            analysis=noise[(m.key, eps, cfg)].get("analysis"),
            val=statistics.fmean(runs[where[(m.key, eps, cfg, s)]]["val"] for s in select_seeds),
        )
        for m in methods
        for eps in budgets
        for cfg in configs[m.key]
    ]
    # without an L2 term every method accounts by composition: (D) against (A) and (A2) there compares the
    # accountants (random allocation against Opacus' PRV), whatever wins overall
    no_l2 = {
        (m.key, eps): best(m.key, eps, [c for c in configs[m.key] if c.l2 == 0])
        for m in methods
        if m.key in NO_L2_METHODS and any(c.l2 == 0 for c in configs[m.key])
        for eps in budgets
    }
    # 3. the selected configurations of the hidden-state methods: Opacus' calibration through the adapter,
    #    next to the core's z
    adapter_keys = list(
        dict.fromkeys(
            (m.key, eps, cfg)
            for m in methods
            if m.hidden_state
            for eps in budgets
            for cfg, _ in [winners[(m.key, eps)]] + ([no_l2[(m.key, eps)]] if (m.key, eps) in no_l2 else [])
        )
    )
    adapter = runner.map(
        [_task_of(data, METHODS[k], cfg, kind="opacus", epsilon=eps) for k, eps, cfg in adapter_keys],
        f"{data.name}: adapter calibration",
    )
    adapter_z = {key: out["z"] for key, out in zip(adapter_keys, adapter)}

    def selected(m: Method, eps: float, cfg: Config, val: float) -> Row:
        found = noise[(m.key, eps, cfg)]
        z_core, z_adapter, z, source, note = None, None, found["z"], "", ""
        if m.accountant == "prv":
            source = "Opacus make_private_with_epsilon (prv)"
        elif m.key == "A'":
            z_core, source = z, "core composition (REPLACE_ONE)"
        else:
            z_core, z_adapter = z, adapter_z[(m.key, eps, cfg)]
            if abs(z_adapter - z_core) <= Z_AGREEMENT * z_core:
                z, source = z_adapter, "adapter (make_private_with_epsilon)"
            else:
                source = "core (the adapter's calibration disagrees)"
                note = (
                    f"make_private_with_epsilon chose z = {z_adapter:.3f} (the core: {z_core:.3f}, "
                    f"{found['analysis']}); trained with the core's z"
                )
        return Row(data.name, m.key, m.label, m.relation, eps, cfg, z, z_core, z_adapter, source, val, [], note=note)

    rows = [selected(m, eps, *winners[(m.key, eps)]) for m in methods for eps in budgets]
    cfg, val = best(NON_PRIVATE.key, None, plain)
    rows.append(Row(data.name, NON_PRIVATE.key, NON_PRIVATE.label, "-", None, cfg, 0.0, None, None, "-", val, []))
    without_l2 = [selected(METHODS[k], eps, *no_l2[(k, eps)]) for k, eps in no_l2]
    # 4. the selected configurations on fresh seeds: test accuracy, and what the engine reports for the run
    evaluate(runner, data, rows + without_l2, test_seeds)
    # 5. each hidden-state winner's composition window (docs/derivations.md section 19)
    held = [r for r in rows if _is_hidden_state(r.analysis)]
    windows = runner.map(
        [_task_of(data, METHODS[r.method], r.config, kind="window", epsilon=r.epsilon_budget) for r in held],
        f"{data.name}: composition windows",
    )
    for r, w in zip(held, windows):
        r.window = w
    return rows, search, without_l2


def evaluate(runner: Runner, data: Data, rows: List[Row], test_seeds: Sequence[int]) -> None:
    """Trains each row's configuration on the test seeds: its test accuracies and what the engine's
    accountant reports for the run actually trained (checked against the row's relation and budget)."""
    final = [
        _task_of(
            data,
            NON_PRIVATE if r.method == NON_PRIVATE.key else METHODS[r.method],
            r.config,
            kind="run",
            z=r.z,
            seed=s,
            account=True,
        )
        for r in rows
        for s in test_seeds
    ]
    results = runner.map(final, f"{data.name}: test")
    for i, r in enumerate(rows):
        mine = results[i * len(test_seeds) : (i + 1) * len(test_seeds)]
        r.test = [x["test"] for x in mine]
        if r.method != NON_PRIVATE.key:
            r.reported_epsilon = max(x["epsilon"] for x in mine)
            r.analysis = mine[0]["analysis"]
            if mine[0]["relation"] != r.relation:
                raise AssertionError(f"{r.label}: the engine reports {mine[0]['relation']}, not {r.relation}")
            if not all(x.get("same_event", True) for x in mine):
                raise AssertionError(f"{r.label}: the engine recorded another run than the core calibrated for")
            if r.reported_epsilon > r.epsilon_budget * (1 + EPSILON_SLACK):
                r.note = (r.note + "; " if r.note else "") + "the reported epsilon exceeds the budget"


# ------------------------------------------------------------------------------------- output
def format_row(r: Row) -> str:
    acc = f"{r.mean:.3f} ± {r.std:.3f} [{min(r.test):.3f}, {max(r.test):.3f}]"
    budget = "-" if r.epsilon_budget is None else f"{r.epsilon_budget:g}"
    reported = "-" if r.reported_epsilon is None else f"{r.reported_epsilon:.3f}"
    z_both = "-"
    if r.z_core is not None and r.z_adapter is not None:
        z_both = f"{r.z_core:.3f} / {r.z_adapter:.3f}"
    z = "-" if r.method == NON_PRIVATE.key else f"{r.z:.3f}"
    return (
        f"| {r.label} | {budget} | {acc} | {r.validation:.3f} | {z} | {z_both} | {reported} | "
        f"{r.analysis or '-'} | {r.config.describe()} | {r.note} |"
    )


HEADER = (
    "| method | eps | test accuracy: mean ± std [min, max] | val | z | z core / adapter | "
    "reported eps | analysis | configuration | note |"
)


def summary_table(rows: List[Row], budgets: Sequence[float]) -> List[str]:
    """Test accuracy (mean ± std) per dataset, method and budget: the README's table."""
    lines = [
        "| dataset | method | " + " | ".join(f"eps = {e:g}" for e in budgets) + " | non-private |",
        "|---|---|" + "---:|" * (len(budgets) + 1),
    ]
    for name in dict.fromkeys(r.dataset for r in rows):
        mine = [r for r in rows if r.dataset == name]
        ref = next(r for r in mine if r.method == NON_PRIVATE.key)
        for key in dict.fromkeys(r.method for r in mine if r.method != NON_PRIVATE.key):
            by = {r.epsilon_budget: r for r in mine if r.method == key}
            cells = [f"{by[e].mean:.3f} ± {by[e].std:.3f}" if e in by else "-" for e in budgets]
            lines.append(
                f"| {name} | {by[budgets[0]].label} ({by[budgets[0]].relation}) | "
                + " | ".join(cells)
                + f" | {ref.mean:.3f} |"
            )
    return lines


def plot(rows: List[Row], path: str) -> None:
    """Test accuracy (mean, std bars) against epsilon per method, one panel per dataset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.dataset for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(max(8.0, 5.0 * len(names)), 4.8), squeeze=False)
    styles = {
        "A": ("tab:gray", "o"),
        "A2": ("tab:brown", "x"),
        "B": ("tab:blue", "s"),
        "D": ("tab:purple", "v"),
        "A'": ("tab:orange", "^"),
        "C": ("tab:green", "D"),
    }
    for ax, name in zip(axes[0], names):
        mine = [r for r in rows if r.dataset == name]
        budgets = sorted({r.epsilon_budget for r in mine if r.epsilon_budget is not None})
        for i, (key, (color, marker)) in enumerate(styles.items()):
            pts = sorted((r.epsilon_budget, r.mean, r.std) for r in mine if r.method == key)
            if pts:
                label = next(r for r in mine if r.method == key).label + f" ({METHODS[key].relation.lower()})"
                e, mean, std = zip(*pts)
                dodge = 1.04 ** (i - (len(styles) - 1) / 2)  # side by side, so equal results stay visible
                ax.errorbar([x * dodge for x in e], mean, yerr=std, color=color, marker=marker, capsize=3, label=label)
        ref = next(r for r in mine if r.method == NON_PRIVATE.key)
        ax.axhline(ref.mean, color="black", linestyle="--", linewidth=1, label="non-private")
        bayes = dataset(name).bayes_accuracy
        if bayes is not None:
            ax.axhline(bayes, color="black", linestyle=":", linewidth=1, label="Bayes accuracy (synthetic)")
        ax.set_xscale("log")
        ax.set_xticks(budgets, [f"{e:g}" for e in budgets])
        ax.minorticks_off()
        ax.set_xlabel(f"epsilon (delta = {DELTA:g})")
        ax.set_ylabel("test accuracy")
        ax.set_title(name)
    handles = {}
    for ax in axes[0]:  # every method and reference line once
        for h, l in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(l, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=2 if len(names) == 1 else 3, fontsize=8)
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> str:
    import dp_accounting  # noqa: F401
    import opacus
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = ""
    if hasattr(os, "getloadavg"):
        load = f", load average {os.getloadavg()[0]:.1f} at the end"
    from importlib.metadata import version

    return (
        f"{os.cpu_count()} cores ({cpu}){load}; Python {platform.python_version()}, torch {torch.__version__}, "
        f"opacus {opacus.__version__}, dp-accounting {version('dp-accounting')}, numpy {np.__version__}"
    )


def _best_val(records: List[Dict[str, object]]) -> str:
    return f"{max(r['val'] for r in records):.3f}" if records else "-"


def _noise(r: Row) -> str:
    """The noise's standard deviation on the averaged gradient, ``z C / b``: what the selected configurations
    trade (the clip counts: at the same z, C = 2.01 is twice the noise of C = 1)."""
    clip = clip_norm_for(METHODS[r.method], dataset(r.dataset).classes, r.config)
    return f"{r.z * clip / r.config.batch_size:.3f}"


def _pairs_present(keys, pairs=PAIRS) -> List[Tuple[str, str]]:
    return [(a, b) for a, b in pairs if a in keys and b in keys]


def _by_dataset(rows: List[Row]) -> Dict[str, Dict[Tuple[str, Optional[float]], Row]]:
    """The selected rows of each dataset (in order of appearance), by ``(method, epsilon budget)``."""
    out: Dict[str, Dict[Tuple[str, Optional[float]], Row]] = {}
    for r in rows:
        out.setdefault(r.dataset, {})[(r.method, r.epsilon_budget)] = r
    return out


def _matched(by: Dict[Tuple[str, Optional[float]], Row], base: str, key: str, budgets: Sequence[float]):
    """``(eps, base row, key row)`` at every budget where one dataset has both methods' selected rows."""
    for eps in budgets:
        if (base, eps) in by and (key, eps) in by:
            yield eps, by[(base, eps)], by[(key, eps)]


def _verdict(x: Row, y: Row) -> Tuple[float, str]:
    """``y``'s test mean minus ``x``'s, and whether it exceeds twice its standard error over the test seeds
    (``sqrt((s_x^2 + s_y^2) / seeds)``; a rough rule with 3 seeds)."""
    diff = y.mean - x.mean
    se = math.sqrt((x.std**2 + y.std**2) / max(1, min(len(x.test), len(y.test))))
    return diff, "better" if diff > 2 * se else "worse" if diff < -2 * se else "no clear difference"


def noise_table(search: List[Dict[str, object]], budgets: Sequence[float]) -> List[str]:
    """How much less noise each hidden-state calibration needs than its baseline over the whole grid,
    and what the configurations where it needs at least 10% less score on validation."""
    pairs = _pairs_present({r["method"] for r in search})
    lines = [
        "| dataset | eps | pair | z(base) / z(hidden state): median, max | configs with ratio >= 1.1 | "
        "best val: base, hidden state, hidden state where ratio >= 1.1 |",
        "|---|---:|---|---|---:|---|",
    ]

    def strip(cfg):
        return json.dumps({k: v for k, v in cfg.items() if k != "sampler"}, sort_keys=True)

    for name in dict.fromkeys(r["dataset"] for r in search):
        for eps in budgets:
            for base, key in pairs:
                here = [r for r in search if r["dataset"] == name and r["epsilon"] == eps]
                bases = [r for r in here if r["method"] == base]
                z = {strip(r["config"]): r["z"] for r in bases}
                ratios = [
                    (z[strip(r["config"])] / r["z"], r) for r in here if r["method"] == key and strip(r["config"]) in z
                ]
                if not ratios:
                    continue
                top, where = max(ratios, key=lambda t: t[0])
                gains = [r for x, r in ratios if x >= 1.1]
                lines.append(
                    f"| {name} | {eps:g} | ({base}) / ({key}) | "
                    f"{statistics.median(x for x, _ in ratios):.2f}, {top:.2f} "
                    f"({Config(**where['config']).describe()}) | {len(gains)} / {len(ratios)} | "
                    f"{_best_val(bases)}, {_best_val([r for _, r in ratios])}, {_best_val(gains)} |"
                )
    return lines


def comparison_table(rows: List[Row], budgets: Sequence[float]) -> List[str]:
    """Per dataset and budget: each hidden-state method against its composition baseline, test accuracy
    (mean ± std), the difference, the winners' noise ``z C / b`` and the analysis that gave the
    hidden-state winner's epsilon."""
    lines = [
        "| dataset | eps | pair | base | hidden state | difference | noise zC/b: base, hidden state | "
        "analysis, sampler |",
        "|---|---:|---|---:|---:|---:|---|---|",
    ]
    pairs = _pairs_present({r.method for r in rows})
    for name, by in _by_dataset(rows).items():
        for eps in budgets:
            for base, key in pairs:
                for _, x, y in _matched(by, base, key, (eps,)):
                    lines.append(
                        f"| {name} | {eps:g} | ({base}) / ({key}) | {x.mean:.3f} ± {x.std:.3f} | "
                        f"{y.mean:.3f} ± {y.std:.3f} | {y.mean - x.mean:+.3f} | {_noise(x)}, {_noise(y)} | "
                        f"{y.analysis}, {y.config.sampler or 'poisson'} |"
                    )
    return lines


def _is_hidden_state(analysis: str) -> bool:
    """Whether the bound that gave a row's epsilon is a hidden-state (last-iterate) analysis."""
    from hidden_state_accountants.analyses.registry import get

    try:
        return get(analysis).hidden_state
    except KeyError:  # Opacus' "prv": not ours
        return False


def findings(rows: List[Row], budgets: Sequence[float]) -> List[str]:
    """Where hidden-state accounting changes the selected model's accuracy, pair by pair: the
    difference of the test means against twice its standard error over the test seeds
    (``sqrt((s_base^2 + s_hs^2) / seeds)``; a rough rule with 3 seeds), and whether the winner's
    epsilon came from a hidden-state analysis at all."""
    lines = []
    pairs = _pairs_present({r.method for r in rows})
    for name, by in _by_dataset(rows).items():
        for base, key in pairs:
            cells, verdicts = [], []
            for eps, x, y in _matched(by, base, key, budgets):
                diff, verdict = _verdict(x, y)
                verdicts.append(verdict)
                how = (
                    f"hidden state ({y.analysis}), noise zC/b {_noise(x)} -> {_noise(y)}"
                    if _is_hidden_state(y.analysis)
                    else f"composition ({y.analysis})"
                )
                cells.append(f"eps {eps:g}: {diff:+.3f} ({verdict}; {how})")
            if cells:
                count = ", ".join(f"{verdicts.count(v)} {v}" for v in VERDICTS if v in verdicts)
                lines.append(
                    f"* **{name}, ({key}) against ({base})** ({METHODS[key].relation}; {count}): "
                    + "; ".join(cells)
                    + "."
                )
    return lines


def clip_table(rows: List[Row], budgets: Sequence[float]) -> List[str]:
    """What the clip that cannot bind costs Opacus' own run: (A) at C = 1 against (A2) at C = 2.01, each
    with its own selected configuration (the same z for the same configuration, twice the noise)."""
    lines = [
        f"| dataset | eps | (A) C = {CLIP_NORM:g} | (A2) C = {NONBINDING_CLIP_NORM:g} | difference | "
        "noise zC/b: (A), (A2) | configurations: (A); (A2) |",
        "|---|---:|---:|---:|---|---|---|",
    ]
    for name, by in _by_dataset(rows).items():
        for eps, x, y in _matched(by, "A", "A2", budgets):
            diff, verdict = _verdict(x, y)
            lines.append(
                f"| {name} | {eps:g} | {x.mean:.3f} ± {x.std:.3f} | {y.mean:.3f} ± {y.std:.3f} | "
                f"{diff:+.3f} ({verdict}) | {_noise(x)}, {_noise(y)} | {x.config.describe()}; "
                f"{y.config.describe()} |"
            )
    return lines if len(lines) > 2 else []


VERDICTS = ("better", "worse", "no clear difference")


def _differences(rows: List[Row], base: str, key: str, budgets: Sequence[float]) -> Dict[str, List[Tuple[float, str]]]:
    """Per dataset, ``key``'s test mean minus ``base``'s and its verdict at every budget where both exist."""
    out = {}
    for name, by in _by_dataset(rows).items():
        cells = [_verdict(x, y) for _, x, y in _matched(by, base, key, budgets)]
        if cells:
            out[name] = cells
    return out


def _spread(values: Sequence[float], fmt: str = "{:+.3f}") -> str:
    lo, hi = min(values), max(values)
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)} to {fmt.format(hi)}"


def headline(
    rows: List[Row], without_l2: List[Row], search: List[Dict[str, object]], budgets: Sequence[float]
) -> List[str]:
    """The findings in a few lines, computed from the tables below: what the clip that cannot bind costs,
    what the swap does, (D) against Poisson without L2 (accuracy and noise), and the hidden-state winners
    against their composition windows."""
    lines = []

    def compare(base: str, key: str, which: List[Row], what: str) -> None:
        for name, cells in _differences(which, base, key, budgets).items():
            counts = ", ".join(f"{n} {v}" for v in VERDICTS if (n := sum(c[1] == v for c in cells)))
            lines.append(
                f"* {what}, {name}: ({key}) - ({base}) = {_spread([c[0] for c in cells])} in test accuracy "
                f"over eps {', '.join(f'{e:g}' for e in budgets)} ({counts})."
            )

    compare("A", "A2", rows, f"**The clip that cannot bind** ({NONBINDING_CLIP_NORM:g} against {CLIP_NORM:g})")
    compare("A", "B", rows, '**The swap** (the same code with `accountant="hidden_state"`)')
    cells = [r for r in rows if r.method == "B"]
    held = [f"{r.dataset} eps {r.epsilon_budget:g}" for r in cells if _is_hidden_state(r.analysis)]
    lines.append(
        f"* (B)'s selected configuration was accounted by a hidden-state analysis in {len(held)} of {len(cells)} "
        f"cells ({', '.join(held) or 'none'}); elsewhere by composition, Opacus' number."
    )
    compare("A", "D", without_l2, "**Balls-in-bins without L2** (both clip at 1, no geometry declared)")
    ratios = _no_l2_noise_ratios(search)
    if ratios:
        lines.append(
            "* Without L2, over the whole grid, random allocation needs z(A)/z(D) = "
            + "; ".join(
                f"{name} {_spread(values, '{:.3f}')} (median {statistics.median(values):.3f}, {len(values)} "
                "configurations)"
                for name, values in ratios.items()
            )
            + " times less noise than Opacus' PRV for the same configuration."
        )
    windows = [r for r in rows if r.window and "window" in r.window and r.method in ("B", "D")]
    if windows:
        lines.append(
            f"* The {len(windows)} hidden-state winners of (B) and (D) need "
            f"{_spread([r.z / r.window['z_window'] for r in windows], '{:.2f}')} times the noise composition needs "
            "over their window ceil(T_w) and "
            f"{_spread([r.z / r.window['z_run'] for r in windows], '{:.2f}')} times what it needs over their T steps."
        )
    return lines


def _no_l2_noise_ratios(search: List[Dict[str, object]]) -> Dict[str, List[float]]:
    """Per dataset, z(A)/z(D) over every configuration without L2 (both composition: the accountants)."""
    z = {
        (
            r["method"],
            r["dataset"],
            r["epsilon"],
            r["config"]["batch_size"],
            r["config"]["epochs"],
            r["config"]["lr"],
            r["config"]["radius"],
        ): r["z"]
        for r in search
        if r["config"]["l2"] == 0
    }
    out: Dict[str, List[float]] = {}
    for (method, *key), zd in z.items():
        if method == "D" and ("A", *key) in z:
            out.setdefault(key[0], []).append(z[("A", *key)] / zd)
    return out


def no_l2_table(rows: List[Row], budgets: Sequence[float]) -> List[str]:
    """(D) against (A), each selected among the configurations without an L2 term, where both account by
    composition at the same clip: Opacus' PRV for Poisson batches against random allocation for
    balls-in-bins. "within (A)'s spread": (D)'s test mean is at least the lowest of (A)'s test seeds."""
    lines = [
        "| dataset | eps | (A) | (D) | (D) - (A) | (D) within or above (A)'s spread | "
        "noise zC/b: (A), (D) | (D)'s analysis, configuration |",
        "|---|---:|---:|---:|---|---|---|---|",
    ]
    for name, by in _by_dataset(rows).items():
        for eps, a, d in _matched(by, "A", "D", budgets):
            inside = "yes" if d.mean >= min(a.test) else "no"
            lines.append(
                f"| {name} | {eps:g} | {a.mean:.3f} ± {a.std:.3f} | {d.mean:.3f} ± {d.std:.3f} | "
                "{:+.3f} ({}) | ".format(*_verdict(a, d))
                + f"{inside} | {_noise(a)}, {_noise(d)} | {d.analysis}, {d.config.describe()} |"
            )
    return lines if len(lines) > 2 else []


def window_table(rows: List[Row]) -> List[str]:
    """Each hidden-state winner next to composition on the same schedule, relation and budget: over its
    composition window ``ceil(T_w)`` steps (no valid converged bound needs less noise) and over the run's
    own ``T`` steps (what the hidden-state bound saved)."""
    lines = [
        "| dataset | method | eps | analysis | configuration | steps T | T_w = composition_window(lr, L2) | "
        "z (winner) | z composition, ceil(T_w) steps | z composition, T steps |",
        "|---|---|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        w = r.window
        if w is None:
            continue
        if "window" in w:
            window, z_window = f"{w['window']:.1f}", f"{w['z_window']:.3f} ({w['analysis_window']})"
        else:
            window, z_window = "- (projection)", "-"
        lines.append(
            f"| {r.dataset} | ({r.method}) | {r.epsilon_budget:g} | {r.analysis} | {r.config.describe()} | "
            f"{w['steps']} | {window} | {r.z:.3f} | {z_window} | {w['z_run']:.3f} ({w['analysis_run']}) |"
        )
    return lines if len(lines) > 2 else []


NOTES = """## Reading the tables and what they leave out

* **z** is the noise multiplier the run was trained with; for (B) and (C) **z core / adapter** are the
  core's `calibrate_noise_multiplier` for the same `TrainingRunDpEvent` and relation, and what
  `make_private_with_epsilon(..., **engine.accountant.calibration_kwargs(...))` chose (the adapter's is
  used when the two agree within 5%; Opacus' own search stops within 0.01 of the target epsilon, so
  its z is slightly larger). Where the adapter hands Opacus no hidden-state configuration it
  calibrates by composition, and the row says it was trained with the core's z.
* **reported eps** is what the engine's own accountant says after the run that was actually trained
  (Opacus' PRV for (A); the adapter, with its relation, for the others), the largest over the test
  seeds; **analysis** is the bound that gave it. The script checks that the adapter recorded exactly
  the event the core calibrated for, and that the relation is the one in the row.
* The search uses one seed per configuration (`--select-seeds`), the test rows fresh seeds; the
  privacy cost of the search itself and of standardising the real datasets with their training
  split's moments is accounted by no method (the same for all).
* **(C)** chooses among the grid's samplers (`shuffle_partition`, `reshuffle`, `balls_in_bins` in
  full mode). `cyclic` is left out by default (`--samplers cyclic,...` adds it): it trains on a
  fixed partition exactly like `shuffle_partition` (the dataset order is itself a random
  permutation), but that partition is public, so only the worst-position bounds apply and its z is
  never smaller.
* **No projection by default.** A pilot on digits, (A) at eps = 1, b = 50, lr = 1
  (`--datasets digits --methods A --budgets 1 --batch-sizes 50 --epochs 10,30 --lrs 1 --l2s 0,0.01
  --radii none,1,3,10 --seeds 1`), gave validation accuracy 0.92 / 0.88 / 0.60 / 0.22 without
  projection and with radius 10 / 3 / 1 (10 epochs, L2 = 0; 0.83 / 0.57 / 0.26 / 0.18 at 30 epochs):
  a ball small enough for the constrained analyses to matter (its diameter comparable to the noise
  of one step) forgets the signal along with the noise. `--radii none,10` searches a radius.
"""


def _doc_paragraphs() -> List[str]:
    """The module docstring's description of the benchmark, as markdown (the methods as a list)."""
    what, methods, reference, data = __doc__.split("\n\n")[1:5]
    return [what, "", "* " + methods.replace("\n(", "\n* ("), "", reference, "", data]


def report(
    rows: List[Row],
    search: List[Dict[str, object]],
    without_l2: List[Row],
    args,
    command: str,
    cost: Tuple[float, float],
    grids: Dict[str, Grid],
) -> str:
    """The markdown page: command, machine, date, the summary, the comparisons and the rows."""
    wall, tasks = cost
    picture = os.path.relpath(args.plot, os.path.dirname(os.path.abspath(args.out)))
    lines = [
        "# Accuracy at a fixed budget (issue 20)",
        "",
        *_doc_paragraphs(),
        "",
        f"Produced by `{command}` on {datetime.date.today().isoformat()}: {machine()}. The work took "
        f"{tasks / 3600:.1f} process-hours, summed over every calibration and run whether this invocation "
        f"computed it or read it from --cache (this invocation: {wall / 60:.0f} minutes of wall time, {args.jobs} "
        f"worker process(es); a shared machine, so times are upper ends). Seeds: search "
        f"{list(args.select_seed_list)}, test {list(args.test_seed_list)}; delta = {DELTA:g}, C = {CLIP_NORM:g} "
        f"({NONBINDING_CLIP_NORM:g} for a declared geometry on more than two classes, and (A2)), features clipped to norm R = {FEATURE_NORM:g} (FeatureClip).",
        "",
        f"![test accuracy against epsilon]({picture})",
        "",
    ]
    lines += ["## What the numbers show", ""] + headline(rows, without_l2, search, args.budgets) + [""]
    lines += ["## Test accuracy, mean ± std over the test seeds", ""] + summary_table(rows, args.budgets)
    lines += [
        "",
        "## Hidden-state accounting against its composition baseline",
        "",
        "Test accuracy of the selected configurations (same relation in each pair):",
        "",
    ]
    lines += comparison_table(rows, args.budgets)
    lines += [
        "",
        "Where hidden-state accounting changes the selected model (test mean difference against twice "
        "its standard error over the test seeds; the analysis that gave the hidden-state winner's epsilon "
        "and the two winners' noise zC/b on the averaged gradient):",
        "",
    ] + findings(rows, args.budgets)
    clip = clip_table(rows, args.budgets)
    if clip:
        lines += [
            "",
            "## What the clip that cannot bind costs: (A) against (A2)",
            "",
            f"On more than two classes a hidden-state claim needs C = {NONBINDING_CLIP_NORM:g} (docs/derivations.md "
            "section 18); the bounds see only z, so at the same z the noise on the averaged gradient doubles. "
            f"Opacus' own run at C = {CLIP_NORM:g} against the same run at C = {NONBINDING_CLIP_NORM:g}, each "
            "selected on validation (test mean difference against twice its standard error):",
            "",
        ] + clip
    no_l2 = no_l2_table(without_l2, args.budgets)
    if no_l2:
        lines += [
            "",
            "## Balls-in-bins against Poisson without an L2 term: (D) against (A)",
            "",
            "Each method's best configuration on validation among those with L2 = 0, where no hidden-state "
            "bound applies and both account by composition (Opacus' PRV for Poisson batches; random "
            "allocation, `composition_allocation_pld`, for balls-in-bins), so the difference is the batches "
            "and their accountant. Without L2 or a projection (D) declares no geometry, so it clips at "
            f"{CLIP_NORM:g} like (A) on every dataset.",
            "",
        ] + no_l2
    window = window_table(rows)
    if window:
        lines += [
            "",
            "## Each hidden-state winner against composition over its window",
            "",
            "A converged hidden-state bound for an L2-regularised class certifies at best composition over "
            "`T_w = composition_window(lr, L2)` = (2 - lr L2)/(lr L2) steps (docs/derivations.md section 19): "
            "the noise it needs is at least what composition needs over that window, on the same schedule, "
            "relation and budget. Each winner whose epsilon came from a hidden-state analysis, with the "
            "composition noise over ceil(T_w) steps and over the run's own T steps. For (B) and (D) "
            "composition is amplified by the sampling (Poisson PLD, random allocation), and the window's "
            "noise is close to the lower bound of section 19. For (C) the package's composition for a "
            "fixed-size sampler charges each epoch as one unamplified Gaussian (`bok_thm4.4`), while its "
            "hidden-state analyses average over the record's random position: a (C) winner can sit far below "
            "that line, and the gap is amplification by shuffling, not convergence.",
            "",
        ] + window
    lines += [
        "",
        "Over the whole grid: how much less noise the hidden-state calibration needs for the same "
        "configuration (z(A)/z(B), z(A)/z(D): Opacus' PRV; z(A')/z(C): Poisson composition against the "
        "fixed-size sampler with hidden state, both REPLACE_ONE, below 1 where the sampler needs more), and "
        "the best validation accuracy overall and where the saving is at least 10%. A ratio of noise "
        f"multipliers: on more than two classes a configuration with an L2 term or a projection (a declared "
        f"geometry) clips at {NONBINDING_CLIP_NORM:g} against (A)'s {CLIP_NORM:g}, so there the ratio of the "
        f"noise zC/b is the ratio shown divided by {NONBINDING_CLIP_NORM:g}:",
        "",
    ]
    lines += noise_table(search, args.budgets)
    for name in dict.fromkeys(r.dataset for r in rows):
        data, grid = dataset(name), grids[name]
        lines += [
            "",
            f"## {name}",
            "",
            data.description + ".",
            "",
            f"Search space (every method): batch size {list(grid.batch_sizes)}, epochs {list(grid.epochs)}, "
            f"lr {list(grid.lrs)}, L2 {list(grid.l2s)}, projection radius "
            f"{['none' if r is None else r for r in grid.radii]}; (C) also the sampler {list(grid.samplers)}.",
            "",
            HEADER,
            "|---" * 10 + "|",
        ]
        lines += [format_row(r) for r in rows if r.dataset == name]
    return "\n".join(lines) + "\n\n" + NOTES


def _floats(text: str) -> Tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def _radii(text: str) -> Tuple[Optional[float], ...]:
    return tuple(None if x.strip().lower() == "none" else float(x) for x in text.split(","))


def parse_args(argv: Optional[List[str]]):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="digits, eps 1 and 4, a small grid (minutes)")
    p.add_argument(
        "--grid",
        choices=("full", "reduced"),
        default="full",
        help="the full mode's grids, or the reduced ones (REDUCED_GRIDS); flags below override either",
    )
    p.add_argument("--datasets", default=None, help=f"comma-separated, from {', '.join(DATASETS)}")
    p.add_argument("--budgets", type=_floats, default=None, help="comma-separated epsilons (default 0.5,1,2,4)")
    p.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)} (A2: 3+ classes)"
    )
    p.add_argument("--seeds", type=int, default=3, help="test seeds per winning configuration (>= 1)")
    p.add_argument("--select-seeds", type=int, default=1, help="seeds per configuration in the search (>= 1)")
    for flag, kind in (
        ("--batch-sizes", "int"),
        ("--epochs", "int"),
        ("--lrs", "float"),
        ("--l2s", "float"),
        ("--radii", "float or none"),
        ("--samplers", "name"),
    ):
        p.add_argument(flag, default=None, help=f"override the grid: comma-separated {kind}s")
    p.add_argument("--jobs", type=int, default=1, help="worker processes")
    p.add_argument("--cache", default=None, help="JSON-lines file of finished work, to resume an interrupted run")
    p.add_argument(
        "--out",
        default=None,
        help="markdown report (default: docs/benchmark_utility.md; with --quick outputs/utility_at_budget_quick.md)",
    )
    p.add_argument(
        "--plot",
        default=None,
        help="plot (default: docs/benchmark_utility.png; with --quick outputs/utility_at_budget_quick.png)",
    )
    p.add_argument("--json", default=None, help="the rows as JSON")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    defaults = QUICK if args.quick else dict(datasets=DATASETS, budgets=BUDGETS)
    args.dataset_list = tuple(args.datasets.split(",")) if args.datasets else defaults["datasets"]
    args.budgets = tuple(args.budgets or defaults["budgets"])
    args.method_list = tuple(args.methods.split(","))
    for name in args.dataset_list:
        if name not in DATASETS:
            p.error(f"--datasets: unknown dataset {name!r} (choose from {', '.join(DATASETS)})")
    for key in args.method_list:
        if key not in METHODS:
            p.error(f"--methods: unknown method {key!r} (choose from {', '.join(METHODS)})")
    if not all(e > 0 and math.isfinite(e) for e in args.budgets):
        p.error(f"--budgets: every epsilon must be positive and finite, got {args.budgets}")
    if args.seeds < 1 or args.select_seeds < 1 or args.jobs < 1:
        p.error("--seeds, --select-seeds and --jobs must be >= 1")
    args.select_seed_list = tuple(range(args.select_seeds))
    args.test_seed_list = tuple(1000 + i for i in range(args.seeds))  # fresh: not the seeds the search saw
    where, stem = ("outputs", "utility_at_budget_quick") if args.quick else ("docs", "benchmark_utility")
    args.out = args.out or str(ROOT / where / f"{stem}.md")
    args.plot = args.plot or str(ROOT / where / f"{stem}.png")
    return p, args


def grids_for(p, args) -> Dict[str, Grid]:
    grids = {}
    for name in args.dataset_list:
        grid = QUICK_GRID if args.quick else (REDUCED_GRIDS if args.grid == "reduced" else FULL_GRIDS)[name]
        changes = {}
        for field, flag, parse in (
            ("batch_sizes", "batch_sizes", int),
            ("epochs", "epochs", int),
            ("lrs", "lrs", float),
            ("l2s", "l2s", float),
        ):
            if getattr(args, flag):
                changes[field] = tuple(parse(x) for x in getattr(args, flag).split(","))
        if args.radii:
            changes["radii"] = _radii(args.radii)
        if args.samplers:
            changes["samplers"] = tuple(args.samplers.split(","))
        grid = replace(grid, **changes)
        for s in grid.samplers:
            if s not in SAMPLERS:
                p.error(f"--samplers: {s!r} is not a fixed-size sampler ({', '.join(SAMPLERS)})")
        if min(grid.batch_sizes) < 1 or max(grid.batch_sizes) > dataset(name).n // 2:
            p.error(f"--batch-sizes: must be in 1..n/2 = {dataset(name).n // 2} for {name}")
        if min(grid.epochs) < 1 or min(grid.l2s) < 0 or any(r is not None and r <= 0 for r in grid.radii):
            p.error("--epochs must be >= 1, --l2s >= 0, --radii positive or none")
        for lr in grid.lrs:
            limit = 2.0 / geometry_for(Config(1, 1, 1.0, max(grid.l2s), None)).smoothness
            if not 0 < lr < limit:
                p.error(f"--lrs: every lr must be in (0, 2/M) = (0, {limit:.4g}), got {lr:g}")
        grids[name] = grid
    return grids


def main(argv: Optional[List[str]] = None) -> Dict[str, object]:
    p, args = parse_args(argv)
    for module in ("torch", "opacus", "sklearn"):
        if importlib.util.find_spec(module) is None:
            p.error(
                f"needs {module}: install the package with its extras, pip install -e '.[all]' (scripts/test.sh does)"
            )
    _quiet()
    grids = grids_for(p, args)
    command = "python benchmarks/utility_at_budget.py " + " ".join(sys.argv[1:] if argv is None else argv)
    methods = [METHODS[k] for k in args.method_list]
    start = time.perf_counter()
    runner = Runner(args.jobs, args.cache, not args.no_progress)
    rows: List[Row] = []
    search: List[Dict[str, object]] = []
    without_l2: List[Row] = []
    try:
        for name in args.dataset_list:
            data = dataset(name)
            print(f"\n{name}: {data.description}", flush=True)
            mine, searched, mine_without_l2 = benchmark_dataset(
                runner, data, grids[name], methods, args.budgets, args.select_seed_list, args.test_seed_list
            )
            print(HEADER + "\n" + "|---" * 10 + "|")
            for r in mine:
                print(format_row(r), flush=True)
            rows += mine
            search += searched
            without_l2 += mine_without_l2
    finally:
        runner.close()
    seconds = time.perf_counter() - start
    print("\n" + "\n".join(headline(rows, without_l2, search, args.budgets)))
    print("\n" + "\n".join(summary_table(rows, args.budgets)))
    print("\n" + "\n".join(comparison_table(rows, args.budgets)))
    for table in (clip_table(rows, args.budgets), no_l2_table(without_l2, args.budgets), window_table(rows)):
        if table:
            print("\n" + "\n".join(table))
    print("\n" + "\n".join(noise_table(search, args.budgets)))
    print(f"\n{seconds / 60:.1f} minutes ({runner.task_seconds / 60:.1f} minutes of work); {machine()}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(report(rows, search, without_l2, args, command, (seconds, runner.task_seconds), grids))
        print(f"report written to {args.out}")
    if args.plot:
        plot(rows, args.plot)
        print(f"plot written to {args.plot}")
    result = {
        "rows": [dict(asdict(r), mean=r.mean, std=r.std) for r in rows],
        "without_l2": [dict(asdict(r), mean=r.mean, std=r.std) for r in without_l2],
        "search": search,
        "seconds": seconds,
        "command": command,
        "machine": machine(),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
