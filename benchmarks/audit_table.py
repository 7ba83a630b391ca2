"""The audit table of docs/verification.md: reported vs audited vs exact epsilon.

    python benchmarks/audit_table.py                      # 100k runs per dataset and configuration
    python benchmarks/audit_table.py --repetitions 1000000 # the longer audit (minutes)

Every schedule, both constructions (hidden_state_accountants.audit), delta = 1e-5, 95%
confidence. "exact" is the exact epsilon of the worst known neighbouring pair of the strongly
convex construction (hidden_state_accountants.exact; the pair the audit simulates); the
constrained construction has no closed form. See benchmarks/tightness.py for the wider grid.
"""

from __future__ import annotations

import argparse
import time

from hidden_state_accountants import LossGeometry, TrainingRunDpEvent
from hidden_state_accountants.audit import audit
from hidden_state_accountants.exact import exact_pair

DELTA = 1e-5


def configurations():
    for sampling in (
        "full",
        "cyclic",
        "shuffle_partition",
        "reshuffle",
        "without_replacement",
        "poisson",
        "balls_in_bins",
    ):
        n, b = 60, 6
        for construction in ("strongly_convex", "constrained"):
            for z in (0.5, 2.0):
                geometry = (
                    LossGeometry(strong_convexity=0.5, smoothness=0.5)
                    if construction == "strongly_convex"
                    else LossGeometry(strong_convexity=0.0, smoothness=0.5, diameter=0.3)
                )
                steps = 10 if sampling in ("without_replacement", "poisson", "balls_in_bins") else 40
                yield (
                    construction,
                    TrainingRunDpEvent(
                        dataset_size=n,
                        batch_size=n if sampling == "full" else b,
                        steps=steps,
                        noise_multiplier=z,
                        clip_norm=1.0,
                        learning_rate=0.5,
                        sampling=sampling,
                        geometry=geometry,
                    ),
                )


def _shown(bracket) -> str:
    if bracket is None:
        return "-"
    lo, hi = bracket
    return f"{lo:.3f}" if hi - lo < 5e-4 else f"[{lo:.3f}, {hi:.3f}]"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repetitions", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rows = [
        "| schedule | construction | z | steps | reported epsilon (analysis) | audited lower bound | exact |",
        "|---|---|---|---|---|---|---|",
    ]
    start = time.perf_counter()
    for construction, run in configurations():
        result = audit(run, construction=construction, repetitions=args.repetitions, delta=DELTA, seed=args.seed)
        exact = exact_pair(run).epsilon_bracket(DELTA) if construction == "strongly_convex" else None
        assert result.consistent, result
        rows.append(
            f"| {run.sampling} | {construction} | {run.noise_multiplier:g} | {run.steps} | "
            f"{result.epsilon_reported:.3f} ({result.analysis}) | {result.epsilon_lower:.3f} | " + _shown(exact) + " |"
        )
        print(rows[-1], flush=True)
    print("\n".join(rows))
    print(
        f"\n{args.repetitions} runs per dataset, delta = {DELTA:g}, 95% confidence; {time.perf_counter() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
