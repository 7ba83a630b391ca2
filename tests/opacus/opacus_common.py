"""Helpers shared by the Opacus tests (importable: pytest puts this folder on sys.path)."""

import importlib
import pathlib
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

D, K = 5, 2  # features, classes of the small logistic-regression runs (two: the geometry holds under any clip)


def random_classification(n: int, d: int = D, k: int = K) -> TensorDataset:
    """``n`` Gaussian feature vectors with uniform labels, the same for every call (generator seed 0)."""
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, d, generator=g), torch.randint(0, k, (n,), generator=g))


def train_epochs(model, optimizer, loader, epochs: int) -> list:
    """Plain cross-entropy training for ``epochs`` passes over ``loader``; returns the batch sizes seen."""
    sizes = []
    for _ in range(epochs):
        for xb, yb in loader:
            sizes.append(len(xb))
            nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            optimizer.zero_grad()
    return sizes


def private_logistic(loader, *, lr: float, z: float, clip: float = 1.0, poisson_sampling: bool = False):
    """``(engine, model, optimizer, loader)``: logistic regression on ``FeatureClip(1.0)`` features, made
    private over ``loader`` by a fresh ``PrivacyEngine(accountant="hidden_state")`` (torch seeded with 0 first,
    the public seed a typical script sets)."""
    from opacus import PrivacyEngine

    import hidden_state_accountants.opacus as hso

    torch.manual_seed(0)
    model = nn.Sequential(hso.FeatureClip(1.0), nn.Linear(D, K))
    engine = PrivacyEngine(accountant="hidden_state")
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        data_loader=loader,
        noise_multiplier=z,
        max_grad_norm=clip,
        poisson_sampling=poisson_sampling,
    )
    return engine, model, opt, loader


def import_benchmark(name: str):
    """A script of ``benchmarks/`` as a module, with ``benchmarks/`` on the path as when the script runs."""
    folder = str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)
