"""A small neural network (an MLP on scikit-learn's digits, no download) trained with Opacus on balls-in-bins
batches, accounted by the hidden-state accountant's random-allocation composition.

A network is not convex, so no hidden-state claim is made: the accountant reports the composition bound (every
iterate released). With ``BallsInBinsBatchSampler`` every record is used exactly once per epoch, in a step it
draws uniformly and secretly, and that composition is amplified by the random allocation
(``composition_allocation_pld``; Chua et al., AISTATS 2025; Feldman & Shenfeld, ICML 2026): about what Opacus
reports for Poisson sampling, which needs a Poisson loader. The script prints

1. per epoch, our epsilon for the balls-in-bins run beside Opacus' PRV epsilon for its Poisson twin (same ``n``,
   expected batch size ``n / t``, noise and steps), both under ADD_OR_REMOVE_ONE, Opacus' relation;
2. the test accuracy at a fixed budget: Poisson sampling calibrated by Opacus' PRV accountant
   (``make_private_with_epsilon(accountant="prv")``) against balls-in-bins calibrated by ours (the engine's
   ``make_private_with_epsilon`` with the sampler configured), over a few seeds.

    python examples/opacus_balls_in_bins_mlp.py                  # 15 epochs, 3 seeds (a few minutes on a CPU)
    python examples/opacus_balls_in_bins_mlp.py --quick --json   # 2 epochs, 1 seed (the test)
"""

from __future__ import annotations

import argparse
import json
import warnings
from typing import Dict, List

import numpy as np
import torch
from opacus import PrivacyEngine
from opacus.accountants import PRVAccountant
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hidden_state_accountants.opacus as hso

DELTA = 1e-5


def load_data(seed: int = 0, n_train: int = 1500):
    """Digits (1797 images of 64 pixels in 0..16, 10 classes) split at random; pixels mapped from their known range
    to [-1, 1] (no statistics of the data, which would leak)."""
    x, y = load_digits(return_X_y=True)
    perm = np.random.default_rng(seed).permutation(len(y))
    x = torch.tensor(x[perm] / 8.0 - 1.0, dtype=torch.float32)
    y = torch.tensor(y[perm], dtype=torch.long)
    return TensorDataset(x[:n_train], y[:n_train]), x[n_train:], y[n_train:]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def train(model, optimizer, loader, epochs: int, on_epoch=None) -> None:
    for epoch in range(epochs):
        for xb, yb in loader:
            nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            optimizer.zero_grad()
        if on_epoch is not None:
            on_epoch(epoch + 1)


def accuracy(model, x, y) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def poisson_twin_epsilon(steps_per_epoch: int, noise: float, steps: int) -> float:
    """Opacus' PRV epsilon for Poisson sampling at rate ``1 / t`` (expected batch ``n / t``) for ``steps`` steps."""
    acc = PRVAccountant()
    acc.history = [(noise, 1.0 / steps_per_epoch, steps)]
    return float(acc.get_epsilon(delta=DELTA))


def balls_in_bins_run(data, batch_size: int, lr: float, *, noise=None, target=None, epochs: int, seed: int):
    """A balls-in-bins run with the hidden-state accountant: at ``noise``, or calibrated by it to ``target`` over
    ``epochs`` epochs. Returns the engine, the sampler and the trained model's optimizer after ``epochs``."""
    torch.manual_seed(seed)
    sampler = hso.BallsInBinsBatchSampler(len(data), batch_size, empty_batches="yield")
    model = mlp()
    engine = PrivacyEngine(accountant="hidden_state")
    engine.accountant.configure(sampler=sampler, model=model)  # no geometry: the composition bound
    common = dict(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        data_loader=hso.balls_in_bins_loader(data, sampler),
        max_grad_norm=1.0,
        poisson_sampling=False,
    )
    if target is None:
        model, opt, loader = engine.make_private(noise_multiplier=noise, **common)
    else:
        model, opt, loader = engine.make_private_with_epsilon(
            target_epsilon=target, target_delta=DELTA, epochs=epochs, **common
        )
    engine.accountant.configure(sampler=sampler, model=model, optimizer=opt)
    return engine, sampler, model, opt, loader


def epsilon_per_epoch(data, batch_size: int, noise: float, epochs: int, lr: float, seed: int) -> List[Dict]:
    """Part 1: our epsilon of a balls-in-bins run at a fixed noise and its Poisson twin's, after each epoch."""
    engine, sampler, model, opt, loader = balls_in_bins_run(data, batch_size, lr, noise=noise, epochs=epochs, seed=seed)
    rows: List[Dict] = []

    def record(epoch: int) -> None:
        report = engine.accountant.explain(DELTA)
        t = sampler.steps_per_epoch
        rows.append(
            dict(
                epoch=epoch,
                balls_in_bins=report.epsilon,
                analysis=report.analysis,
                poisson_twin_prv=poisson_twin_epsilon(t, noise, epoch * t),
            )
        )
        print(
            f"  epoch {epoch:3d}: balls-in-bins (ours) {report.epsilon:.4f}   "
            f"Poisson twin (Opacus PRV) {rows[-1]['poisson_twin_prv']:.4f}",
            flush=True,
        )

    train(model, opt, loader, epochs, record)
    return rows


def accuracy_at_budget(data, x_test, y_test, batch_size, target, epochs, lr, seed) -> Dict:
    """Part 2, one seed: Poisson calibrated by Opacus' PRV accountant against balls-in-bins calibrated by ours."""
    torch.manual_seed(seed)
    model = mlp()
    engine = PrivacyEngine(accountant="prv")
    model, opt, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        data_loader=DataLoader(data, batch_size=len(data) // (len(data) // batch_size)),
        target_epsilon=target,
        target_delta=DELTA,
        epochs=epochs,
        max_grad_norm=1.0,
        poisson_sampling=True,
    )
    train(model, opt, loader, epochs)
    poisson = dict(
        accuracy=accuracy(model, x_test, y_test), noise=opt.noise_multiplier, epsilon=engine.get_epsilon(DELTA)
    )
    engine, _, model, opt, loader = balls_in_bins_run(data, batch_size, lr, target=target, epochs=epochs, seed=seed)
    train(model, opt, loader, epochs)
    ours = dict(accuracy=accuracy(model, x_test, y_test), noise=opt.noise_multiplier, epsilon=engine.get_epsilon(DELTA))
    return dict(seed=seed, poisson_prv=poisson, balls_in_bins=ours)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--noise-multiplier", type=float, default=1.0, help="part 1's noise")
    p.add_argument("--target-epsilon", type=float, default=2.0, help="part 2's budget")
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="2 epochs, 1 seed (for the tests)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs, args.seeds = 2, 1
    warnings.filterwarnings("ignore")  # Opacus' notices (secure RNG, hooks); the reports say what matters
    data, x_test, y_test = load_data()
    print(f"1. epsilon per epoch at noise {args.noise_multiplier:g} (delta {DELTA:g}, ADD_OR_REMOVE_ONE)")
    rows = epsilon_per_epoch(data, args.batch_size, args.noise_multiplier, args.epochs, args.lr, seed=0)
    print(f"2. test accuracy at epsilon {args.target_epsilon:g} after {args.epochs} epochs")
    runs = [
        accuracy_at_budget(data, x_test, y_test, args.batch_size, args.target_epsilon, args.epochs, args.lr, seed)
        for seed in range(args.seeds)
    ]
    for name, label in (("poisson_prv", "Poisson + Opacus PRV calibration"), ("balls_in_bins", "balls-in-bins + ours")):
        acc = np.array([r[name]["accuracy"] for r in runs])
        noise = np.mean([r[name]["noise"] for r in runs])
        print(f"  {label:34s} accuracy {acc.mean():.4f} +- {acc.std():.4f}  (noise {noise:.3f}, {len(acc)} seeds)")
    if args.json:
        print(json.dumps(dict(epsilon_per_epoch=rows, accuracy_at_budget=runs, epochs=args.epochs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
