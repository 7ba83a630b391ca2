"""Latency of ``get_epsilon`` per analysis family, against Opacus' and dp_accounting's accountants.

    python benchmarks/bench_accountant_latency.py [--steps 1000 10000 100000] [--out FILE.md]

Each hidden-state family is timed cold (fresh analysis, caches cleared) on the same run:
n = 60000, b = 600, z = 2, C = 1, lr = 0.05, m = 0.01, M = 1.01, D = 1, delta = 1e-5; the
constrained NoisySGD rows use z = 8, D = 0.1, where those bounds are competitive (at z = 2 they
are skipped as hopeless, which takes no time).
Opacus (RDP, PRV) and dp_accounting (PLD) account the Poisson-sampled version of the same
run under add/remove, as they do in practice. Also reports noise calibration. Every time is CPU seconds of
this process (``time.process_time``), so that a shared machine's load does not inflate it.

Poisson hidden-state rows (issue 12) use the Opacus MNIST pattern instead: n = 60000, expected
batch b = 256 (q = b/n), z = 1, C = 1, lr = 0.5, weight decay m_reg = 0.01 applied once per step,
M = 1.01, no diameter, under both neighbouring relations. The shuffled and balls-in-bins rows (issue 19)
use the same pattern with b = 256 fixed-size batches, and the "best known lower bound" rows time
``report.lower_bound`` (:mod:`hidden_state_accountants.lower_bounds`; ``None`` when the run is too large
for its one-second budget, decided before any work).

Issue 18's limits are timed at the end on the same Poisson pattern under ADD_OR_REMOVE_ONE: noise
calibration at 10^7 steps (under 10 s) and one epsilon query at 10^8 steps (under 5 s), each in CPU seconds
of this process (the machine may be shared) and wall seconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, List

import dp_accounting as dpa

from hidden_state_accountants import HiddenStateAccountant, LossGeometry, TrainingRunDpEvent, calibrate_noise_multiplier
from hidden_state_accountants import rdp as rdp_tools
from hidden_state_accountants.analyses import (
    altschuler_talwar,
    balls_in_bins,
    bok,
    chourasia,
    composition,
    poisson_hidden_state,
    shuffle_amplification,
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


SHUFFLED_FAMILIES = [
    # (family, sampling, analysis, relations)
    ("reshuffle hidden-state f-DP", "reshuffle", shuffle_amplification.reshuffle_amplified, (REPLACE_ONE,)),
    (
        "shuffle_partition hidden-state f-DP",
        "shuffle_partition",
        shuffle_amplification.position_amplified,
        (REPLACE_ONE,),
    ),
    (
        "balls-in-bins hidden-state f-DP",
        "balls_in_bins",
        balls_in_bins.si_balls_in_bins,
        (ADD_OR_REMOVE_ONE, REPLACE_ONE),
    ),
]
LOWER_BOUND_ROWS = [
    ("poisson", ADD_OR_REMOVE_ONE),
    ("poisson", REPLACE_ONE),
    ("reshuffle", REPLACE_ONE),
    ("balls_in_bins", ADD_OR_REMOVE_ONE),
    ("balls_in_bins", REPLACE_ONE),
]


def make_poisson_run(steps: int, z: float = 1.0, sampling: str = "poisson") -> TrainingRunDpEvent:
    """The MNIST pattern: Poisson at q = 256/n, or fixed-size batches of 256 with ``sampling``."""
    return TrainingRunDpEvent(
        dataset_size=60000,
        batch_size=256,
        steps=steps,
        noise_multiplier=z,
        clip_norm=1.0,
        learning_rate=0.5,
        sampling=sampling,
        geometry=POISSON_GEOM,
        l2_regularization=0.01,
    )


def make_run(sampling: str, steps: int, z: float = 2.0, geometry: LossGeometry = GEOM) -> TrainingRunDpEvent:
    n, b = 60000, 600
    return TrainingRunDpEvent(
        dataset_size=n,
        batch_size=n if sampling == "full" else b,
        steps=steps,
        noise_multiplier=z,
        clip_norm=1.0,
        learning_rate=0.05,
        sampling=sampling,
        geometry=geometry,
        gaussian_initialization=True,
    )


def clear_caches() -> None:
    rdp_tools._sgm_rdp_cached.cache_clear()
    rdp_tools._wor_rdp_cached.cache_clear()
    poisson_hidden_state.clear_caches()
    shuffle_amplification._CACHE.clear()


def timed(fn: Callable[[], float], repeat: int = 3) -> tuple:
    times, value = [], None
    for _ in range(repeat):
        clear_caches()
        t = time.process_time()  # CPU seconds: a shared machine's load does not count (numpy uses one thread)
        value = fn()
        times.append(time.process_time() - t)
    return statistics.median(times), value


def ours(analysis, run, relation=REPLACE_ONE) -> Callable[[], float]:
    return lambda: analysis(run, Context(neighboring_relation=relation)).epsilon(DELTA)


def lower_bound(run, relation) -> tuple:
    """``(seconds, value)`` of the first ``report.lower_bound`` (the report itself is not timed)."""
    report = HiddenStateAccountant(neighboring_relation=relation).compose(run).explain(DELTA)
    t = time.process_time()
    value = report.lower_bound
    return time.process_time() - t, float("nan") if value is None else value


def issue_18_limits() -> List[str]:
    """Noise calibration at 10^7 steps and one query at 10^8 steps, Poisson, ADD_OR_REMOVE_ONE."""
    rows = []
    for steps, what in ((10**7, "calibrate"), (10**8, "epsilon")):
        clear_caches()
        run = make_poisson_run(steps)
        wall, cpu = time.perf_counter(), time.process_time()
        if what == "calibrate":
            result = calibrate_noise_multiplier(run, 8.0, DELTA, neighboring_relation=ADD_OR_REMOVE_ONE)
            text = (
                f"target eps 8.0 -> z = {result.noise_multiplier:.4f} ({result.analysis}, ADD_OR_REMOVE_ONE, "
                f"limit 10 s)"
            )
            eps, extra = result.epsilon, f", {result.evaluations} evaluations"
        else:
            report = HiddenStateAccountant(neighboring_relation=ADD_OR_REMOVE_ONE).compose(run).explain(DELTA)
            text, eps, extra = f"epsilon ({report.analysis}, ADD_OR_REMOVE_ONE, limit 5 s)", report.epsilon, ""
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        rows.append(
            f"| issue 18 limit | {text} | poisson | {steps:.0e} | {eps:.4g} | {cpu:.2f} s CPU, "
            f"{wall:.2f} s wall{extra} |"
        )
        print(rows[-1], flush=True)
    return rows


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
    p.add_argument("--skip-limits", action="store_true", help="skip issue 18's 10^7 / 10^8-step timings")
    args = p.parse_args(argv)
    rows = ["| family | analysis | sampling | steps | epsilon | latency (CPU) |", "|---|---|---|---|---|---|"]
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
                rows.append(
                    f"| {family} | {name} ({relation.name}; b = 256, z = 1, lr = 0.5, m_reg = 0.01) | "
                    f"poisson | {steps} | {eps:.4g} | {t * 1e3:.1f} ms |"
                )
                print(rows[-1], flush=True)
        for family, sampling, analysis, relations in SHUFFLED_FAMILIES:
            run = make_poisson_run(steps, sampling=sampling)
            for relation in relations:
                t, eps = timed(ours(analysis, run, relation), args.repeat)
                name = analysis(make_poisson_run(2, sampling=sampling), Context()).name
                rows.append(
                    f"| {family} | {name} ({relation.name}; b = 256, z = 1, lr = 0.5, m_reg = 0.01) | "
                    f"{sampling} | {steps} | {eps:.4g} | {t * 1e3:.1f} ms |"
                )
                print(rows[-1], flush=True)
        for sampling, relation in LOWER_BOUND_ROWS:
            run = make_poisson_run(steps, sampling=sampling)
            t, eps = lower_bound(run, relation)
            rows.append(
                f"| best known lower bound | report.lower_bound ({relation.name}; b = 256, z = 1, lr = 0.5, "
                f"m_reg = 0.01) | {sampling} | {steps} | {eps:.4g} | {t * 1e3:.1f} ms |"
            )
            print(rows[-1], flush=True)
        poisson = make_run("poisson", steps)
        try:
            import opacus  # noqa: F401

            for name in ("rdp", "prv"):
                t, eps = timed(opacus_accountant(name, poisson), args.repeat)
                rows.append(
                    f"| Opacus {name.upper()} (add/remove) | {name} | poisson | {steps} | {eps:.4g} | {t * 1e3:.1f} ms |"
                )
                print(rows[-1], flush=True)
        except ImportError:
            pass
        t, eps = timed(dp_accounting_pld(poisson), args.repeat)
        rows.append(f"| dp_accounting PLD (add/remove) | pld | poisson | {steps} | {eps:.4g} | {t * 1e3:.1f} ms |")
        print(rows[-1], flush=True)
    for sampling in ("cyclic", "without_replacement"):
        run = make_run(sampling, 10000, z=1.0)
        t = time.process_time()
        result = calibrate_noise_multiplier(run, 2.0, DELTA)
        t = time.process_time() - t
        rows.append(
            f"| calibration | target eps 2.0 -> z = {result.noise_multiplier:.4f} ({result.analysis}) | "
            f"{sampling} | 10000 | {result.epsilon:.4g} | {t:.2f} s CPU, {result.evaluations} evaluations |"
        )
        print(rows[-1], flush=True)
    for relation in (ADD_OR_REMOVE_ONE, REPLACE_ONE):
        run = make_poisson_run(10 * 234)
        t = time.process_time()
        result = calibrate_noise_multiplier(run, 1.0, DELTA, neighboring_relation=relation)
        t = time.process_time() - t
        rows.append(
            f"| calibration | target eps 1.0 -> z = {result.noise_multiplier:.4f} ({result.analysis}, "
            f"{relation.name}) | poisson | {10 * 234} | {result.epsilon:.4g} | {t:.2f} s CPU, "
            f"{result.evaluations} evaluations |"
        )
        print(rows[-1], flush=True)
    if not args.skip_limits:
        rows += issue_18_limits()
    table = "\n".join(rows)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(table + "\n")
    print("\n" + table)


if __name__ == "__main__":
    main()
