"""Accounting a ledger of many distinct noise values (an Opacus noise scheduler stepped per batch).

    python benchmarks/bench_noise_ledger.py [--values 1000] [--exact 30]

Every row is CPU seconds of this process (``time.process_time``, so that a shared machine's load does
not inflate it), with the package imported and every cache cleared before the row. The runs follow the
Opacus MNIST pattern: n = 60000, b = 256, C = 1, lr = 0.1, delta = 1e-5, no geometry (only the
composition analyses apply to a noise schedule), noise multipliers spread evenly over [1, 2] in the order
of a decaying schedule; the constant-noise row (z = 1) shows what one value costs.

A ledger of more than 16 distinct values is composed in at most 16 groups of consecutive values, each at
its smallest noise (pessimistic; :func:`hidden_state_accountants.analyses.long_composition.noise_groups`).
``--exact K`` also accounts a K-value ledger step by step (every value its own group) and prints the grouped
epsilon beside it.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
from dp_accounting import dp_event

from hidden_state_accountants import HiddenStateAccountant, TrainingRunDpEvent
from hidden_state_accountants import rdp as rdp_tools
from hidden_state_accountants.analyses import composition
from hidden_state_accountants.analyses import long_composition as lc
from hidden_state_accountants.analyses import poisson_hidden_state

N, B, DELTA = 60000, 256, 1e-5


def clear_caches() -> None:
    rdp_tools._sgm_rdp_cached.cache_clear()  # noqa: SLF001
    rdp_tools._wor_rdp_cached.cache_clear()  # noqa: SLF001
    poisson_hidden_state.clear_caches()


def noises(k: int):
    return tuple(float(z) for z in np.linspace(2.0, 1.0, k)) if k > 1 else 1.0


def run_ledger(sampling: str, steps: int, k: int, relation: str = "REPLACE_ONE") -> HiddenStateAccountant:
    """A run of ``steps`` steps with ``k`` distinct noise values (one per step), or a constant one (``k = 1``)."""
    run = TrainingRunDpEvent(
        dataset_size=N,
        batch_size=B,
        steps=steps,
        noise_multiplier=noises(k),
        clip_norm=1.0,
        learning_rate=0.1,
        sampling=sampling,
    )
    return HiddenStateAccountant(neighboring_relation=relation).compose(run)


def event_ledger(k: int, relation: str) -> HiddenStateAccountant:
    acc = HiddenStateAccountant(neighboring_relation=relation)
    for z in np.linspace(2.0, 1.0, k):
        acc.compose(dp_event.PoissonSampledDpEvent(B / N, dp_event.GaussianDpEvent(float(z))))
    return acc


def timed(label: str, make) -> float:
    clear_caches()
    start = time.process_time()
    report = make().explain(DELTA)
    seconds = time.process_time() - start
    print(f"| {label} | {report.epsilon:.4f} | {report.analysis} | {seconds:.2f} |", flush=True)
    return report.epsilon


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--values", type=int, default=1000, help="distinct noise values (one per step)")
    parser.add_argument("--exact", type=int, default=0, help="also compare a ledger of this many values step by step")
    args = parser.parse_args()
    k = args.values
    warnings.simplefilter("ignore")  # composition-only runs warn by design
    run_ledger("poisson", 2, 2).explain(DELTA)  # imports and first calls out of the timings
    print("| ledger | epsilon | analysis | CPU s |\n|---|---|---|---|")
    for relation in ("REPLACE_ONE", "ADD_OR_REMOVE_ONE"):
        timed(f"Poisson, {k} steps, constant z ({relation})", lambda: run_ledger("poisson", k, 1, relation))
        timed(f"Poisson, {k} distinct z ({relation})", lambda: run_ledger("poisson", k, k, relation))
        timed(f"{k} PoissonSampledDpEvents, distinct z ({relation})", lambda: event_ledger(k, relation))
    wor = "without_replacement"
    timed(f"without replacement, {k} steps, constant z", lambda: run_ledger(wor, k, 1))
    timed(f"without replacement, {k} distinct z", lambda: run_ledger(wor, k, k))
    timed(f"without replacement, {10 * k} distinct z", lambda: run_ledger(wor, 10 * k, 10 * k))
    e = args.exact
    if e:
        saved = lc.NOISE_GROUPS, composition.RDP_NOISE_GROUPS, composition.WOR_RDP_NOISE_GROUPS
        for sampling in ("poisson", wor):
            grouped = timed(f"{sampling}, {e} distinct z, grouped", lambda: run_ledger(sampling, e, e))
            lc.NOISE_GROUPS = composition.RDP_NOISE_GROUPS = composition.WOR_RDP_NOISE_GROUPS = e
            exact = timed(f"{sampling}, {e} distinct z, step by step", lambda: run_ledger(sampling, e, e))
            lc.NOISE_GROUPS, composition.RDP_NOISE_GROUPS, composition.WOR_RDP_NOISE_GROUPS = saved
            print(f"grouped / step by step - 1 = {grouped / exact - 1:.4f}")


if __name__ == "__main__":
    main()
