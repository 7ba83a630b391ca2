"""DP logistic regression with Opacus, accounted by the hidden-state accountant.

Trains multi-class logistic regression on scikit-learn's bundled digits (no download) with
DP-SGD, and prints per epoch the hidden-state epsilon (only the final model is released)
next to the composition epsilon (every iterate released), then the final test accuracy,
and saves a plot.

    python examples/opacus_logistic_regression.py --epochs 40 --output outputs/opacus_logreg.png
    python examples/opacus_logistic_regression.py --distributed 2   # two CPU processes (gloo, DPDDP)

What makes the hidden-state bound hold, line by line (see docs/opacus.md):
  * ``PrivacyEngine(accountant="hidden_state")`` after ``import hidden_state_accountants.opacus``;
  * a ``ShufflePartitionBatchSampler``: one random partition, reused every epoch;
  * ``FeatureClip(1.0)`` in front of the linear layer: every input has norm <= 1;
  * ``max_grad_norm=2.01``: ten classes need a clip that never binds, at least
    sqrt(2 (R^2 + 1)) = 2 plus Opacus' 1e-6 (a binding clip makes the clipped multi-class
    gradient non-monotone: docs/derivations.md section 18); the epsilon does not depend on it;
  * ``ProjectionHook(radius=R, l2_regularization=m)``: weight_decay m after clipping and
    noise (m-strong convexity) and projection onto the ball of radius R (diameter 2R);
  * ``engine.accountant.configure(geometry=..., sampler=..., model=..., optimizer=...)`` declares
    the above; the core checks it against the model's structure and the optimizer before training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Dict, List, Optional

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

from opacus import PrivacyEngine
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

import hidden_state_accountants.opacus as hso

SAMPLERS = {
    "cyclic": lambda n, b, seed: hso.CyclicBatchSampler(n, b),
    "shuffle_partition": lambda n, b, seed: hso.ShufflePartitionBatchSampler(n, b, seed),
    "without_replacement": lambda n, b, seed: hso.WithoutReplacementBatchSampler(n, b, seed),
}


def load_data(seed: int = 0, n_train: int = 1500):
    """Digits (1797 images, 64 pixels in 0..16, 10 classes), split at random into train/test.

    Pixels are mapped from the known range 0..16 to [-1, 1] (not by statistics of the data,
    which would leak); FeatureClip in the model then bounds every input norm by 1.
    """
    x, y = load_digits(return_X_y=True)
    perm = np.random.default_rng(seed).permutation(len(y))
    x = torch.tensor(x[perm] / 8.0 - 1.0, dtype=torch.float32)
    y = torch.tensor(y[perm], dtype=torch.long)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> float:
    with torch.no_grad():
        return float((model(x.to(device)).argmax(1) == y.to(device)).float().mean())


def train(
    *,
    epochs: int = 40,
    batch_size: int = 100,
    noise_multiplier: float = 4.0,
    max_grad_norm: float = 2.01,
    learning_rate: float = 0.5,
    l2_regularization: float = 0.01,
    radius: float = 5.0,
    feature_norm_bound: float = 1.0,
    sampling: str = "shuffle_partition",
    delta: float = 1e-5,
    seed: int = 0,
    device: str = "cpu",
    progress: bool = True,
    reproducible: bool = False,
    distributed: bool = False,
) -> Dict[str, object]:
    """Runs the example; returns per-epoch epsilons and accuracies (and the final model).

    ``seed`` fixes the data split and the initial model. The batch schedule and the noise
    are the secret randomness the guarantee rests on: fresh secret draws unless
    ``reproducible`` (then seeded from ``seed``, for experiments only).

    ``distributed``: this process is one rank of an initialised ``torch.distributed`` group;
    the model is wrapped in Opacus' ``DifferentiallyPrivateDistributedDataParallel`` and every
    rank takes its share of the sampler's global batches (the sampler reads the group, and the
    ranks share rank 0's secret seed).
    """
    torch.manual_seed(seed)
    dev = torch.device(device)
    x_tr, y_tr, x_te, y_te = load_data(seed)
    n = len(y_tr)
    sampler = SAMPLERS[sampling](n, batch_size, seed if reproducible else None)
    loader = DataLoader(TensorDataset(x_tr, y_tr), batch_sampler=sampler)
    model = nn.Sequential(hso.FeatureClip(feature_norm_bound), nn.Linear(x_tr.shape[1], 10)).to(dev)
    rank = torch.distributed.get_rank() if distributed else 0
    if distributed:
        model = DPDDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)

    engine = PrivacyEngine(accountant="hidden_state")  # the one-line switch
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        poisson_sampling=False,  # keep our sampler's schedule
        noise_generator=torch.Generator(device=dev).manual_seed(seed + rank) if reproducible else None,
    )
    hook = hso.ProjectionHook(optimizer, radius=radius, l2_regularization=l2_regularization)
    engine.accountant.configure(
        geometry=hook.logistic_regression_geometry(feature_norm_bound),
        sampler=sampler,
        model=model,
        optimizer=optimizer,
    )

    history: List[Dict[str, float]] = []
    bar = tqdm(range(1, epochs + 1), desc=f"DP-SGD ({sampling})", disable=not progress, file=sys.stdout)
    for epoch in bar:
        model.train()
        for xb, yb in loader:
            loss = nn.functional.cross_entropy(model(xb.to(dev)), yb.to(dev))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        row = {
            "epoch": epoch,
            "hidden_state_epsilon": engine.get_epsilon(delta),
            "composition_epsilon": engine.accountant.composition_epsilon(delta),
            "test_accuracy": accuracy(model, x_te, y_te, dev),
        }
        history.append(row)
        bar.set_postfix(eps=f"{row['hidden_state_epsilon']:.3f}", acc=f"{row['test_accuracy']:.3f}")
        if progress:
            tqdm.write(
                f"epoch {epoch:3d}  hidden-state eps {row['hidden_state_epsilon']:.4f}  "
                f"composition eps {row['composition_epsilon']:.4f}  test acc {row['test_accuracy']:.4f}",
                file=sys.stdout,
            )
    report = engine.accountant.explain(delta)
    return {
        "relation": report.neighboring_relation,
        "history": history,
        "final_accuracy": history[-1]["test_accuracy"],
        "epsilon": history[-1]["hidden_state_epsilon"],
        "composition_epsilon": history[-1]["composition_epsilon"],
        "analysis": report.analysis,
        "delta": delta,
        "run": repr(engine.accountant.training_run()),
        "model": model,
    }


def plot(history: List[Dict[str, float]], path: str, delta: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ep = [h["epoch"] for h in history]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(ep, [h["composition_epsilon"] for h in history], label="composition (all iterates)", color="tab:gray")
    ax.plot(ep, [h["hidden_state_epsilon"] for h in history], label="hidden state (final model)", color="tab:blue")
    ax.set_xlabel("epoch")
    ax.set_ylabel(f"epsilon at delta={delta:g}")
    ax2 = ax.twinx()
    ax2.plot(ep, [h["test_accuracy"] for h in history], color="tab:green", linestyle="--", label="test accuracy")
    ax2.set_ylabel("test accuracy")
    ax2.set_ylim(0, 1)
    lines = ax.get_lines() + ax2.get_lines()
    ax.legend(lines, [l.get_label() for l in lines], loc="center right")
    ax.set_title("DP logistic regression on digits (Opacus)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _rank(rank: int, world: int, port: int, kwargs: Dict[str, object], out_path: str) -> None:
    """One process of ``--distributed``: joins the gloo group and trains; rank 0 keeps the results."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    _quiet()
    try:
        res = train(**kwargs, distributed=True, progress=rank == 0)
        if rank == 0:
            torch.save({k: x for k, x in res.items() if k != "model"}, out_path)
    finally:
        torch.distributed.destroy_process_group()


def train_distributed(world: int, **kwargs) -> Dict[str, object]:
    """``train`` on ``world`` CPU processes of one machine (gloo); the results of rank 0."""
    import socket
    import tempfile

    with socket.socket() as sock:  # a free port for the group's rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rank0.pt")
        torch.multiprocessing.spawn(_rank, args=(world, port, kwargs, out_path), nprocs=world, join=True)
        res = torch.load(out_path, weights_only=False)
    return {**res, "model": None}


def _quiet() -> None:
    warnings.filterwarnings("ignore", message="Secure RNG turned off")
    warnings.filterwarnings("ignore", message="Full backward hook is firing")


def main(argv: Optional[List[str]] = None) -> Dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--noise-multiplier", type=float, default=4.0)
    p.add_argument("--max-grad-norm", type=float, default=2.01, help="clip; >= 2.000001 for a hidden-state claim")
    p.add_argument("--learning-rate", type=float, default=0.5)
    p.add_argument("--l2", type=float, default=0.01, help="L2 regularisation = strong convexity")
    p.add_argument("--radius", type=float, default=5.0, help="projection radius R (diameter 2R)")
    p.add_argument("--sampling", choices=sorted(SAMPLERS), default="shuffle_partition")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0, help="data split and initial model")
    p.add_argument(
        "--reproducible",
        action="store_true",
        help="also seed the batch schedule and the noise (experiments only: a known seed is no secret)",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--output", default="outputs/opacus_logistic_regression.png")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    p.add_argument(
        "--distributed",
        type=int,
        default=1,
        metavar="N",
        help="train on N CPU processes of this machine (gloo, Opacus DPDDP); the same epsilon as one",
    )
    a = p.parse_args(argv)
    if a.distributed < 1:
        p.error(f"--distributed: must be >= 1, got {a.distributed}")
    if a.distributed > 1 and a.device != "cpu":
        p.error("--distributed: runs on CPU processes (gloo); pass --device cpu")
    _quiet()
    kwargs = dict(
        epochs=a.epochs,
        batch_size=a.batch_size,
        noise_multiplier=a.noise_multiplier,
        max_grad_norm=a.max_grad_norm,
        learning_rate=a.learning_rate,
        l2_regularization=a.l2,
        radius=a.radius,
        sampling=a.sampling,
        delta=a.delta,
        seed=a.seed,
        device=a.device,
        reproducible=a.reproducible,
    )
    res = train_distributed(a.distributed, **kwargs) if a.distributed > 1 else train(**kwargs)
    print(f"run: {res['run']}")
    print(
        f"final: hidden-state epsilon {res['epsilon']:.4f} ({res['analysis']}), composition epsilon "
        f"{res['composition_epsilon']:.4f} at delta={a.delta:g} ({res['relation']}); "
        f"test accuracy {res['final_accuracy']:.4f} on {a.device}"
        + (f" ({a.distributed} processes)" if a.distributed > 1 else "")
    )
    plot(res["history"], a.output, a.delta)
    print(f"plot saved to {a.output}")
    if a.json:
        print(
            json.dumps(
                {k: res[k] for k in ("epsilon", "composition_epsilon", "final_accuracy", "analysis", "relation")}
            )
        )
    return res


if __name__ == "__main__":
    main()
