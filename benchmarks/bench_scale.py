"""Time and peak memory at scale: long runs, huge n/b, calibration and audits (issue 10).

    python benchmarks/bench_scale.py [--out docs/benchmark_scale.md] [--only SUBSTRING ...]
    python benchmarks/bench_scale.py --case NAME     # one measurement, JSON on stdout

Every case runs in a fresh subprocess (``--case NAME``) so that its time and peak resident
memory (``ru_maxrss``) are its own; ``import`` alone takes about 105 MB resident, shown as the
``baseline`` row. With ``--traced`` a second subprocess measures the peak of the allocations
``tracemalloc`` sees (numpy's arrays included), which slows the code down and is therefore not
timed. The table gives the command for each row. Timings depend on the machine and its load:
run on an idle machine to compare.

Runs: n = 60000, b = 256, z = 1, C = 1, lr = 0.05, delta = 1e-5 for the sampled schedules;
shuffle_partition with b = 10, n = 10 n/b, one epoch, z = 2, m = 0.01, M = 1; calibration to
epsilon 8 at 10^7 steps with the same geometry (m = 0.01, M = 1); audits at 10^6 steps x 100
repetitions per dataset.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
import tracemalloc
from typing import Callable, Dict, Tuple

DELTA = 1e-5


def _geometry(diameter=None):
    from hidden_state_accountants import LossGeometry

    return LossGeometry(strong_convexity=0.01 if diameter is None else 0.0, smoothness=1.0, diameter=diameter)


def _sampled(steps, sampling, geometry=None, z=1.0):
    from hidden_state_accountants import TrainingRunDpEvent

    n, b = (60000, 60000) if sampling == "full" else (60000, 256)
    return TrainingRunDpEvent(
        dataset_size=n,
        batch_size=b,
        steps=steps,
        noise_multiplier=z,
        clip_norm=1.0,
        learning_rate=0.05,
        sampling=sampling,
        geometry=geometry,
    )


def _partition(l, n=None, steps=None):
    from hidden_state_accountants import TrainingRunDpEvent

    n = 10 * l if n is None else n
    return TrainingRunDpEvent(
        dataset_size=n,
        batch_size=10,
        steps=steps or n // 10,
        noise_multiplier=2.0,
        clip_norm=1.0,
        learning_rate=0.05,
        sampling="shuffle_partition",
        geometry=_geometry(),
    )


def _epsilon(run) -> str:
    from hidden_state_accountants import HiddenStateAccountant

    report = HiddenStateAccountant().compose(run).explain(DELTA)
    return f"epsilon {report.epsilon:.6g} ({report.analysis})"


def _calibrate(sampling) -> str:
    from hidden_state_accountants import calibrate_noise_multiplier

    result = calibrate_noise_multiplier(_sampled(10**7, sampling, _geometry()), 8.0, DELTA)
    return (
        f"z = {result.noise_multiplier:.5g}, epsilon {result.epsilon:.4g} ({result.analysis}), "
        f"{result.evaluations} noise values"
    )


def _audit(sampling, construction) -> str:
    from hidden_state_accountants.audit import audit

    geometry = _geometry() if construction == "strongly_convex" else _geometry(diameter=1.0)
    result = audit(
        _sampled(10**6, sampling, geometry), construction=construction, repetitions=100, seed=0, progress=False
    )
    return f"lower {result.epsilon_lower:.3g} <= reported {result.epsilon_reported:.4g}"


CASES: Dict[str, Tuple[str, Callable[[], str]]] = {
    "baseline": ("import hidden_state_accountants", lambda: "-"),
    "shuffle_partition_1e6": ("shuffle_partition epsilon, n/b = 10^6", lambda: _epsilon(_partition(10**6))),
    "shuffle_partition_1e7": ("shuffle_partition epsilon, n/b = 10^7", lambda: _epsilon(_partition(10**7))),
    "shuffle_partition_1e8": ("shuffle_partition epsilon, n/b = 10^8", lambda: _epsilon(_partition(10**8))),
    "shuffle_partition_2pow63": (
        "shuffle_partition epsilon, n = 2^63, b = 10, 1000 steps",
        lambda: _epsilon(_partition(None, n=2**63, steps=1000)),
    ),
    **{
        f"poisson_{k}": (f"poisson epsilon, 10^{k[-1]} steps", lambda k=k: _epsilon(_sampled(int(float(k)), "poisson")))
        for k in ("1e6", "1e7", "1e8")
    },
    **{
        f"without_replacement_{k}": (
            f"without_replacement epsilon, 10^{k[-1]} steps",
            lambda k=k: _epsilon(_sampled(int(float(k)), "without_replacement")),
        )
        for k in ("1e6", "1e7", "1e8")
    },
    **{
        f"calibrate_{s}": (f"calibrate {s}, 10^7 steps, m = 0.01", lambda s=s: _calibrate(s))
        for s in ("full", "cyclic", "shuffle_partition", "without_replacement", "poisson")
    },
    "audit_cyclic": ("audit cyclic strongly_convex, 10^6 steps x 100", lambda: _audit("cyclic", "strongly_convex")),
    "audit_poisson": ("audit poisson strongly_convex, 10^6 steps x 100", lambda: _audit("poisson", "strongly_convex")),
    "audit_poisson_constrained": (
        "audit poisson constrained (projected), 10^6 steps x 100",
        lambda: _audit("poisson", "constrained"),
    ),
}


def run_case(name: str, traced: bool = False) -> dict:
    """Runs one case in this process: seconds and peak RSS (or, traced, the tracemalloc peak)."""
    import warnings

    warnings.simplefilter("ignore")
    import hidden_state_accountants  # noqa: F401  (import cost is not part of the case)

    if traced:
        tracemalloc.start()
    start = time.perf_counter()
    result = CASES[name][1]()
    seconds = time.perf_counter() - start
    out = {
        "case": name,
        "seconds": seconds,
        "result": result,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
    }  # kB on Linux
    if traced:
        out["traced_peak_mb"] = tracemalloc.get_traced_memory()[1] / 1e6
    return out


def _child(here: str, name: str, traced: bool) -> dict:
    command = [sys.executable, os.path.join(here, "bench_scale.py"), "--case", name] + (["--traced"] if traced else [])
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", help="run one case in this process and print JSON")
    parser.add_argument("--only", nargs="*", default=None, help="cases whose name contains one of these")
    parser.add_argument("--out", default=None, help="write the markdown table here")
    parser.add_argument("--traced", action="store_true", help="also measure the tracemalloc peak (untimed run)")
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case, args.traced)))
        return 0
    here = os.path.dirname(os.path.abspath(__file__))
    rows = []
    for name, (what, _) in CASES.items():
        if args.only and not any(s in name for s in args.only):
            continue
        command = f"python benchmarks/bench_scale.py --case {name}"
        print(f"{command} ...", file=sys.stderr, flush=True)
        try:
            r = _child(here, name, False)
            traced = f"{_child(here, name, True)['traced_peak_mb']:.1f} MB" if args.traced else "-"
        except RuntimeError as err:
            rows.append((what, f"`{command}`", "failed", "", "", str(err)))
            continue
        rows.append((what, f"`{command}`", f"{r['seconds']:.2f} s", f"{r['peak_rss_mb']:.0f} MB", traced, r["result"]))
        print(f"  {rows[-1][2]}, {rows[-1][3]} resident, {traced} traced: {r['result']}", file=sys.stderr)
    lines = [
        f"Measured with `python benchmarks/bench_scale.py --traced --out docs/benchmark_scale.md` on "
        f"{platform.machine()} with {os.cpu_count()} cores, Python {platform.python_version()}.",
        "",
        "| case | command | time | peak resident | peak traced | result |",
        "|---|---|---|---|---|---|",
    ] + [f"| {' | '.join(row)} |" for row in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# Scale benchmark (issue 10)\n\n" + __doc__.split("\n\n", 2)[2].strip() + "\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
