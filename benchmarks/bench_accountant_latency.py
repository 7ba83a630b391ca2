"""Latency of ``get_epsilon`` per analysis family, against Opacus' and dp_accounting's accountants.

    python benchmarks/bench_accountant_latency.py [--steps 1000 10000 100000] [--out FILE.md]

Each hidden-state family is timed cold (fresh analysis, caches cleared) on the same run:
n = 60000, b = 600, z = 2, C = 1, lr = 0.05, m = 0.01, M = 1.01, D = 1, delta = 1e-5; the
constrained NoisySGD rows use z = 8, D = 0.1, where those bounds are competitive (at z = 2 they
are skipped as hopeless, which takes no time).
Opacus (RDP, PRV) and dp_accounting (PLD) account the Poisson-sampled version of the same
run under add/remove, as they do in practice. Also reports noise calibration.

Poisson hidden-state rows (issue 12) use the Opacus MNIST pattern instead: n = 60000, expected
batch b = 256 (q = b/n), z = 1, C = 1, lr = 0.5, weight decay m_reg = 0.01 applied once per step,
M = 1.01, no diameter, under both neighbouring relations.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, List

import dp_accounting as dpa

from hidden_state_accountants import LossGeometry, TrainingRunDpEvent, calibrate_noise_multiplier
from hidden_state_accountants import rdp as rdp_tools
from hidden_state_accountants.analyses import (
    altschuler_talwar,
    bok,
    chourasia,
    composition,
    poisson_hidden_state,
    ye_shokri,
)
from hidden_state_accountants.analyses._common import Context
from hidden_state_accountants.relations import ADD_OR_REMOVE_ONE, REPLACE_ONE

DELTA = 1e-5
GEOM = LossGeometry(strong_convexity=0.01, smoothness=1.01, diameter=1.0)

CONSTRAINED = dict(z=8.0, geometry=LossGeometry(strong_convexity=0.01, smoothness=1.01, diameter=0.1))
FAMILIES = [
    # (family, sampling, analysis, run overrides)
    ("closed form", "full", bok.thm_4_2, {}),
    ("closed form", "full", chourasia.cor_1, {}),
    ("closed form", "cyclic", bok.thm_4_5, {}),
    ("closed form", "cyclic", ye_shokri.thm_3_3, {}),
    ("closed form", "shuffle_partition", ye_shokri.thm_4_2, {}),
    ("recursion", "without_replacement", ye_shokri.thm_4_3, {}),
    ("RDP optimisation", "without_replacement", altschuler_talwar.eq_3_3, {}),
    ("RDP optimisation", "without_replacement", altschuler_talwar.eq_3_3, CONSTRAINED),
    ("NoisySGD f-DP", "without_replacement", bok.thm_4_8, {}),
    ("NoisySGD f-DP", "without_replacement", bok.thm_4_9, {}),
    ("NoisySGD f-DP", "without_replacement", bok.thm_4_10, CONSTRAINED),
    ("composition RDP", "without_replacement", composition.without_replacement_rdp, {}),
    ("composition f-DP", "poisson", composition.poisson_pld, {}),
]


POISSON_GEOM = LossGeometry(strong_convexity=0.01, smoothness=1.01)
POISSON_FAMILIES = [
    ("Poisson hidden-state f-DP", poisson_hidden_state.si_poisson),
    ("Poisson hidden-state RDP", altschuler_talwar.eq_3_3_poisson),
    ("Poisson hidden-state recursion", ye_shokri.thm_4_3_poisson),
    ("composition f-DP", composition.poisson_pld),
]


def make_poisson_run(steps: int, z: float = 1.0) -> TrainingRunDpEvent:
    return TrainingRunDpEvent(dataset_size=60000, batch_size=256, steps=steps, noise_multiplier=z, clip_norm=1.0,
                              learning_rate=0.5, sampling="poisson", geometry=POISSON_GEOM, l2_regularization=0.01)


def make_run(sampling: str, steps: int, z: float = 2.0, geometry: LossGeometry = GEOM) -> TrainingRunDpEvent:
    n, b = 60000, 600
    return TrainingRunDpEvent(dataset_size=n, batch_size=n if sampling == "full" else b, steps=steps,
                              noise_multiplier=z, clip_norm=1.0, learning_rate=0.05, sampling=sampling,
                              geometry=geometry, gaussian_initialization=True)


def clear_caches() -> None:
    rdp_tools._sgm_rdp_cached.cache_clear()
    rdp_tools._wor_rdp_cached.cache_clear()
    poisson_hidden_state.clear_caches()


def timed(fn: Callable[[], float], repeat: int = 3) -> tuple:
    times, value = [], None
    for _ in range(repeat):
        clear_caches()
        t = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), value


def ours(analysis, run, relation=REPLACE_ONE) -> Callable[[], float]:
    return lambda: analysis(run, Context(neighboring_relation=relation)).epsilon(DELTA)


def opacus_accountant(name: str, run) -> Callable[[], float]:
    from opacus.accountants import PRVAccountant, RDPAccountant

    cls = {"rdp": RDPAccountant, "prv": PRVAccountant}[name]

    def go():
        acc = cls()
        acc.history = [(run.noise_multiplier, run.batch_size / run.dataset_size, run.steps)]
        return acc.get_epsilon(DELTA)

    return go


def dp_accounting_pld(run) -> Callable[[], float]:
    def go():
        event = dpa.PoissonSampledDpEvent(run.batch_size / run.dataset_size, dpa.GaussianDpEvent(run.noise_multiplier))
        return dpa.pld.PLDAccountant().compose(event, run.steps).get_epsilon(DELTA)

    return go


def main(argv: List[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, nargs="+", default=[1000, 10000, 100000])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = ["| family | analysis | sampling | steps | epsilon | latency |", "|---|---|---|---|---|---|"]
    for steps in args.steps:
        for family, sampling, analysis, overrides in FAMILIES:
            t, eps = timed(ours(analysis, make_run(sampling, steps, **overrides)), args.repeat)
            name = analysis(make_run(sampling, 2), Context()).name
            setting = " (z = 8, D = 0.1)" if overrides else ""
            rows.append(f"| {family} | {name}{setting} | {sampling} | {steps} | {eps:.4g} | {t * 1e3:.1f} ms |")
            print(rows[-1], flush=True)
        for family, analysis in POISSON_FAMILIES:
            for relation in (ADD_OR_REMOVE_ONE, REPLACE_ONE):
                t, eps = timed(ours(analysis, make_poisson_run(steps), relation), args.repeat)
                name = analysis(make_poisson_run(2), Context()).name
                rows.append(f"| {family} | {name} ({relation.name}; b = 256, z = 1, lr = 0.5, m_reg = 0.01) | "
                            f"poisson | {steps} | {eps:.4g} | {t * 1e3:.1f} ms |")
                print(rows[-1], flush=True)
        poisson = make_run("poisson", steps)
        try:
            import opacus  # noqa: F401

            for name in ("rdp", "prv"):
                t, eps = timed(opacus_accountant(name, poisson), args.repeat)
                rows.append(f"| Opacus {name.upper()} (add/remove) | {name} | poisson | {steps} | {eps:.4g} | {t * 1e3:.1f} ms |")
                print(rows[-1], flush=True)
        except ImportError:
            pass
        t, eps = timed(dp_accounting_pld(poisson), args.repeat)
        rows.append(f"| dp_accounting PLD (add/remove) | pld | poisson | {steps} | {eps:.4g} | {t * 1e3:.1f} ms |")
        print(rows[-1], flush=True)
    for sampling in ("cyclic", "without_replacement"):
        run = make_run(sampling, 10000, z=1.0)
        t = time.perf_counter()
        result = calibrate_noise_multiplier(run, 2.0, DELTA)
        t = time.perf_counter() - t
        rows.append(f"| calibration | target eps 2.0 -> z = {result.noise_multiplier:.4f} ({result.analysis}) | "
                    f"{sampling} | 10000 | {result.epsilon:.4g} | {t:.2f} s, {result.evaluations} evaluations |")
        print(rows[-1], flush=True)
    for relation in (ADD_OR_REMOVE_ONE, REPLACE_ONE):
        run = make_poisson_run(10 * 234)
        t = time.perf_counter()
        result = calibrate_noise_multiplier(run, 1.0, DELTA, neighboring_relation=relation)
        t = time.perf_counter() - t
        rows.append(f"| calibration | target eps 1.0 -> z = {result.noise_multiplier:.4f} ({result.analysis}, "
                    f"{relation.name}) | poisson | {10 * 234} | {result.epsilon:.4g} | {t:.2f} s, "
                    f"{result.evaluations} evaluations |")
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(table + "\n")
    print("\n" + table)


if __name__ == "__main__":
    main()
