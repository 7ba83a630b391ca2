"""Issue 19's rows for fixed-size batches: reshuffle, shuffle_partition and cyclic.

The realistic run of issue 19 (MNIST-sized logistic regression: n = 60000, b = 256, z = 1, C = 1,
lr = 0.5, L2 0.01 outside clipping, features clipped to norm 1: M = 1.01, m = 0.01), REPLACE_ONE,
at ``delta``. Per schedule it prints:

* what Opacus prints for the same noise, batch size and steps: its accounting counts the batches as
  Poisson with q = b/n under ADD_OR_REMOVE_ONE (dp_accounting's PLD, as Opacus' PRV accountant);
  not valid for shuffled batches, shown because it is what a user compares with;
* ours before issue 19 (``si_reshuffle_average`` / ``si_position_average`` / ``bok_thm4.5``) and the
  package's reported epsilon now (the best valid analysis, named), with the time of one query;
* the best known lower bound (``exact.shuffled_lower_bound``: the affine construction with the
  curvature in [m, M], the worst known pair; docs/derivations.md 5a.6), never a guarantee.

    python benchmarks/shuffled_batches.py [--epochs 20] [--batch-size 256] [--delta 1e-5] [--output FILE]
"""

from __future__ import annotations

import argparse
import sys
import time

import dp_accounting

from hidden_state_accountants import HiddenStateAccountant, LossGeometry, TrainingRunDpEvent
from hidden_state_accountants.analyses import registry
from hidden_state_accountants.analyses._common import Context
from hidden_state_accountants.exact import shuffled_lower_bound

BEFORE = {"reshuffle": "si_reshuffle_average", "shuffle_partition": "si_position_average", "cyclic": "bok_thm4.5"}


def opacus_number(n, b, steps, z, delta):
    """Opacus' accounting of these batches as Poisson (q = b/n), ADD_OR_REMOVE_ONE, by PLD."""
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(b / n, dp_accounting.GaussianDpEvent(z)), steps)
    return acc.get_epsilon(delta)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--dataset-size", type=int, default=60000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--noise", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--output")
    args = p.parse_args(argv)
    if args.output:
        from _tee import Tee
        sys.stdout = Tee(args.output)
    n, b = args.dataset_size, args.batch_size
    steps = args.epochs * (n // b)
    geometry = LossGeometry.logistic_regression(feature_norm_bound=1.0, l2_regularization=args.weight_decay)
    print(f"n = {n}, b = {b}, {args.epochs} epochs ({steps} steps), z = {args.noise}, lr = {args.lr}, "
          f"m = {geometry.strong_convexity:g}, M = {geometry.smoothness:g}, delta = {args.delta:g}, REPLACE_ONE\n")
    opacus = opacus_number(n, b, steps, args.noise, args.delta)
    print(f"| run | Opacus prints | ours before | ours now | query | best known lower bound |")
    print(f"| --- | ---: | ---: | ---: | ---: | ---: |")
    for sampling in ("reshuffle", "shuffle_partition", "cyclic"):
        run = TrainingRunDpEvent(dataset_size=n, batch_size=b, steps=steps, noise_multiplier=args.noise, clip_norm=1.0,
                                 learning_rate=args.lr, sampling=sampling, geometry=geometry)
        before = registry.get(BEFORE[sampling]).function(run, Context()).epsilon(args.delta)
        start = time.perf_counter()
        report = HiddenStateAccountant().compose(run).explain(args.delta)
        seconds = time.perf_counter() - start
        lower = shuffled_lower_bound(run, args.delta)
        shown = f"{opacus:.3f} (Poisson, add/remove: not valid here)" if sampling != "cyclic" else "-"
        print(f"| {sampling} b = {b} | {shown} | {before:.3f} (`{BEFORE[sampling]}`) | "
              f"{report.epsilon:.3f} (`{report.analysis}`) | {seconds:.2f} s | {lower:.3f} |")
    if args.output:
        sys.stdout.save()
        sys.stdout = sys.__stdout__


if __name__ == "__main__":
    main()
