"""Issue 19's Poisson rows: the reported bound, Opacus' PRV number and the best known lower bound.

The run is Opacus' default loader on MNIST: n = 60000, Poisson rate q = 1/235 (expected batch 255),
z = 1, C = 1, lr = 0.5, L2 (weight decay outside clipping) 0.01, logistic-regression geometry
M = 1.01, m = 0.01; delta = 1e-5. Per epoch it prints, under ADD_OR_REMOVE_ONE (Opacus' relation) and
REPLACE_ONE (the papers'):

* ours: the best valid bound (``HiddenStateAccountant(...).explain``) and the analysis that gives it;
* Opacus' PRV accountant on the same history (ADD_OR_REMOVE_ONE only; it has no REPLACE_ONE);
* the composition baseline (dp_accounting's PLD under add/remove: Opacus' number up to discretisation);
* the best known lower bound: the exact epsilon of the affine construction with the worst known pair
  (:func:`hidden_state_accountants.exact.poisson_lower_bound`), a value some run of the declared class
  reaches; never a guarantee.

    python benchmarks/poisson_table.py [--epochs 20] [--every 1] [--delta 1e-5]
"""

from __future__ import annotations

import argparse
import time
import warnings

from hidden_state_accountants import HiddenStateAccountant, LossGeometry, TrainingRunDpEvent, exact


def run_of(epochs: int, n: int = 60000, loader_len: int = 235, z: float = 1.0, lr: float = 0.5,
           weight_decay: float = 0.01) -> TrainingRunDpEvent:
    """Opacus' Poisson loader: q = 1/len(loader), divisor n // len(loader) (its expected batch size)."""
    return TrainingRunDpEvent(dataset_size=n, batch_size=n // loader_len, steps=epochs * loader_len,
                              noise_multiplier=z, clip_norm=1.0, learning_rate=lr, sampling="poisson",
                              sampling_probability=1.0 / loader_len, l2_regularization=weight_decay,
                              geometry=LossGeometry.logistic_regression(feature_norm_bound=1.0,
                                                                        l2_regularization=weight_decay))


def opacus_prv(run: TrainingRunDpEvent, delta: float) -> float:
    try:
        from opacus.accountants import PRVAccountant
    except ImportError:  # pragma: no cover - Opacus is optional
        return float("nan")
    acc = PRVAccountant()
    acc.history = [(float(run.noise_multiplier), float(run.sampling_rate), int(run.steps))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(acc.get_epsilon(delta))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--every", type=int, default=1, help="print every k-th epoch (and the last)")
    p.add_argument("--delta", type=float, default=1e-5)
    args = p.parse_args(argv)
    geometry = run_of(1).geometry
    print(f"n = 60000, q = 1/235 (b = 255), z = 1, C = 1, lr = 0.5, L2 0.01, geometry m = {geometry.strong_convexity:g}, "
          f"M = {geometry.smoothness:g}; delta = {args.delta:g}")
    print("| epoch | relation | ours | analysis | Opacus PRV | composition | lower bound | seconds |")
    print("|---:|---|---:|---|---:|---:|---:|---:|")
    below_from = None
    for epoch in range(1, args.epochs + 1):
        run = run_of(epoch)
        for relation in ("ADD_OR_REMOVE_ONE", "REPLACE_ONE"):
            t = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                report = HiddenStateAccountant(neighboring_relation=relation).compose(run).explain(args.delta)
            seconds = time.perf_counter() - t
            lower = exact.poisson_lower_bound(run, args.delta, relation)
            prv = opacus_prv(run, args.delta) if relation == "ADD_OR_REMOVE_ONE" else float("nan")
            if relation == "ADD_OR_REMOVE_ONE":
                # a hidden-state number, not si_poisson's composition candidate (tau = 0)
                hidden = any(a.name == report.analysis and a.hidden_state and not a.detail.startswith("tau = 0")
                             for a in report.analyses)
                wins = hidden and report.epsilon < prv and report.epsilon < report.composition_epsilon
                below_from = (below_from or epoch) if wins else None
            if epoch % args.every == 0 or epoch == args.epochs:
                prv_text = "-" if prv != prv else f"{prv:.3f}"
                print(f"| {epoch} | {relation} | {report.epsilon:.3f} | {report.analysis} | {prv_text} | "
                      f"{report.composition_epsilon:.3f} | {lower:.3f} | {seconds:.2f} |", flush=True)
    print()
    if below_from is None:
        print("under ADD_OR_REMOVE_ONE no hidden-state bound below both Opacus' PRV and the composition at the end")
    else:
        print(f"under ADD_OR_REMOVE_ONE a hidden-state bound is below Opacus' PRV and the composition from epoch "
              f"{below_from} on")


if __name__ == "__main__":
    main()
