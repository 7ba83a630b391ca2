"""Balls-in-bins against Poisson and reshuffling on the MNIST-scale run (issue 19, item 3).

    python benchmarks/balls_in_bins.py                  # epochs 1, 2, 5, 10, 20 (a few minutes: si_poisson)
    python benchmarks/balls_in_bins.py --epochs 1 20 --no-poisson

n = 60000, b = 256, z = 1, C = 1, lr = 0.5, L2 0.01, logistic geometry M = 1.01, delta = 1e-5. Columns:
``si_balls_in_bins`` under both relations (docs/derivations.md, "Balls-in-bins sampling"), the exact
value of the linear construction with curvature 0.01 (a lower bound on the truth for the declared
class), the balls-in-bins composition baseline; Poisson at q = 1/235 (b = 255, Opacus' default
loader for this n): dp_accounting's PLD composition (what Opacus' PRV accountant reports, to
discretisation) and ``si_poisson``; reshuffling (``DataLoader(shuffle=True)``) under REPLACE_ONE, the
only relation it has.
"""

from __future__ import annotations

import argparse
import sys
import time

from hidden_state_accountants import HiddenStateAccountant, LossGeometry, TrainingRunDpEvent
from hidden_state_accountants.exact import exact_pair

N, B, Z, LR, L2, DELTA = 60000, 256, 1.0, 0.5, 0.01, 1e-5
GEOMETRY = LossGeometry.logistic_regression(1.0, L2)


def run(sampling: str, epochs: int, **kw) -> TrainingRunDpEvent:
    return TrainingRunDpEvent.from_epochs(dataset_size=kw.pop("n", N), batch_size=kw.pop("b", B), epochs=epochs,
                                          noise_multiplier=Z, clip_norm=1.0, learning_rate=LR, sampling=sampling,
                                          geometry=kw.pop("geometry", GEOMETRY), l2_regularization=L2, **kw)


def explain(event: TrainingRunDpEvent, relation: str):
    return HiddenStateAccountant(neighboring_relation=relation).compose(event).explain(DELTA)


def row(epochs: int, poisson: bool) -> str:
    out = [str(epochs)]
    bib = run("balls_in_bins", epochs)
    linear = run("balls_in_bins", epochs, geometry=LossGeometry(strong_convexity=L2, smoothness=L2))
    for relation in ("ADD_OR_REMOVE_ONE", "REPLACE_ONE"):
        start = time.perf_counter()
        report = explain(bib, relation)
        seconds = time.perf_counter() - start
        truth = exact_pair(linear, relation=relation, grid_points=1 << 14).epsilon(DELTA)
        out += [f"{report.epsilon:.3f}", f"{truth:.3f}", f"{report.composition_epsilon:.2f}", f"{seconds:.2f}"]
    if poisson:  # Opacus' default loader for this n and b: q = 1/235, b = 255
        p = explain(run("poisson", epochs, n=N, b=255, sampling_probability=1 / 235), "ADD_OR_REMOVE_ONE")
        si = next(a.epsilon for a in p.analyses if a.name == "si_poisson")
        out += [f"{p.composition_epsilon:.3f}", f"{si:.3f}" if si is not None else "-"]
    reshuffle = explain(run("reshuffle", epochs), "REPLACE_ONE")
    out.append(f"{reshuffle.epsilon:.2f}")
    return "| " + " | ".join(out) + " |"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, nargs="+", default=[1, 2, 5, 10, 20])
    p.add_argument("--no-poisson", action="store_true", help="skip the Poisson columns (si_poisson is the slow one)")
    args = p.parse_args(argv)
    head = ["epochs", "BiB add/remove", "exact (linear)", "BiB composition", "s",
            "BiB replace-one", "exact (linear)", "BiB composition", "s"]
    if not args.no_poisson:
        head += ["Poisson PLD add/remove (Opacus)", "si_poisson add/remove"]
    head.append("reshuffle replace-one")
    print("| " + " | ".join(head) + " |")
    print("|" + "---:|" * len(head))
    for e in args.epochs:
        print(row(e, not args.no_poisson), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
