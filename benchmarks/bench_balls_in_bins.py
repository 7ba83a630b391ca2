"""Balls-in-bins accounted as random allocation (issue 28): the numbers and their cost.

    python benchmarks/bench_balls_in_bins.py [--epochs 1 5 20] [--reference] [--out FILE.md]

The MNIST-scale run: n = 60000, b = 256 (t = 234 steps per epoch), z = 1, C = 1, delta = 1e-5, no geometry.
For each number of epochs: ``composition_allocation_pld`` (ours) under ADD_OR_REMOVE_ONE and REPLACE_ONE, its best
known lower bound, the unamplified ``composition_balls_in_bins``, and Poisson sampling at ``q = b/n`` (the
package's PLD composition, equal to dp_accounting's and Opacus' under add/remove). Then the latency: one query at
20 epochs cold (the one-epoch PLD cache cleared) and warm, and noise calibration at 10^6 steps, under both
relations; CPU seconds of this process (``time.process_time``: a shared machine's load does not inflate them) and
wall seconds. ``--reference`` adds ``PLD_accounting.gaussian_allocation_epsilon_range`` (the authors' package;
slow without numba).
"""

from __future__ import annotations

import argparse
import time

from hidden_state_accountants import HiddenStateAccountant, TrainingRunDpEvent, calibrate_noise_multiplier
from hidden_state_accountants.analyses import random_allocation as ra

N, B, T, Z, DELTA = 60000, 256, 234, 1.0, 1e-5
RELATIONS = ("ADD_OR_REMOVE_ONE", "REPLACE_ONE")


def run(epochs: int, sampling: str = "balls_in_bins", z: float = Z) -> TrainingRunDpEvent:
    return TrainingRunDpEvent(
        dataset_size=N,
        batch_size=B,
        steps=epochs * T,
        noise_multiplier=z,
        clip_norm=1.0,
        learning_rate=0.5,
        sampling=sampling,
    )


def timed(fn):
    cpu, wall = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - cpu, time.perf_counter() - wall


def numbers(epochs_list, reference: bool):
    lines = [
        "| epochs | relation | balls-in-bins (ours) | lower bound | unamplified | Poisson PLD | ours / Poisson |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for e in epochs_list:
        for rel in RELATIONS:
            report = HiddenStateAccountant(neighboring_relation=rel).compose(run(e)).explain(DELTA)
            ours = report.epsilon
            unamplified = next(a.epsilon for a in report.analyses if a.name == "composition_balls_in_bins")
            lower = report.best_known_lower_bound.epsilon
            poisson = HiddenStateAccountant(neighboring_relation=rel).compose(run(e, "poisson")).get_epsilon(DELTA)
            lines.append(
                f"| {e} | {rel} | {ours:.4f} | {lower:.4f} | {unamplified:.2f} | {poisson:.4f} | {ours / poisson:.3f} |"
            )
    if reference:
        import importlib.util

        numba = importlib.util.find_spec("numba") is not None
        lines += ["", "| epochs | PLD_accounting upper | lower | seconds (CPU) | numba |", "|---:|---:|---:|---:|---|"]
        for e in epochs_list:
            (up, lo), cpu, _ = timed(lambda: ra.reference_epsilon_range(Z, T, e, DELTA))
            lines.append(f"| {e} | {up:.4f} | {lo:.4f} | {cpu:.1f} | {numba} |")
    return lines


def latency():
    lines = ["| what | relation | CPU s | wall s | value |", "|---|---|---:|---:|---:|"]
    for rel in RELATIONS:
        ra.epoch_pld.cache_clear()
        eps, cpu, wall = timed(
            lambda: HiddenStateAccountant(neighboring_relation=rel).compose(run(20)).get_epsilon(DELTA)
        )
        lines.append(f"| epsilon, 20 epochs, cold | {rel} | {cpu:.2f} | {wall:.2f} | {eps:.4f} |")
        eps, cpu, wall = timed(
            lambda: HiddenStateAccountant(neighboring_relation=rel).compose(run(20)).get_epsilon(DELTA)
        )
        lines.append(f"| epsilon, 20 epochs, warm | {rel} | {cpu:.2f} | {wall:.2f} | {eps:.4f} |")
    long = TrainingRunDpEvent(
        dataset_size=N, batch_size=B, steps=10**6, noise_multiplier=Z, clip_norm=1.0, learning_rate=0.5,
        sampling="balls_in_bins",
    )  # fmt: skip
    for rel in RELATIONS:
        ra.epoch_pld.cache_clear()
        found, cpu, wall = timed(lambda: calibrate_noise_multiplier(long, 8.0, DELTA, neighboring_relation=rel))
        lines.append(
            f"| calibration to epsilon 8 at 10^6 steps | {rel} | {cpu:.1f} | {wall:.1f} | "
            f"z = {found.noise_multiplier:.4f} ({found.analysis}, {found.evaluations} evaluations) |"
        )
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, nargs="+", default=[1, 5, 20])
    p.add_argument("--reference", action="store_true", help="also time PLD_accounting's epsilon range")
    p.add_argument("--out", help="write the tables to this markdown file too")
    args = p.parse_args(argv)
    lines = [f"n = {N}, b = {B} (t = {T}), z = {Z}, delta = {DELTA:g}, no geometry", ""]
    lines += numbers(args.epochs, args.reference) + [""] + latency()
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
