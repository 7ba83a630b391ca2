"""Time per epoch and peak memory: DP-SBCD vs Opacus DP-SGD (and plain SGD) on the same MLP.

    .venv/bin/python benchmarks/bench_sbcd_vs_opacus.py                      # CPU, defaults
    .venv/bin/python benchmarks/bench_sbcd_vs_opacus.py --device cuda        # on a GPU
    .venv/bin/python benchmarks/bench_sbcd_vs_opacus.py --output table.md    # the table to a file too
    .venv/bin/python benchmarks/bench_sbcd_vs_opacus.py --n 20000 --width 512 --depth 3 --batch 1000

Every method runs in its own fresh Python process (``--worker``) so that peak memory is its
own: on CPU the peak resident set size of the process (``ru_maxrss``) and its increase over the
state after data and model set-up (which includes DP-SBCD's per-example auxiliary variables,
created by the optimizer, so they count as training memory); on CUDA
``torch.cuda.max_memory_allocated``. Time per epoch is the median over the timed epochs after
one warm-up epoch. Data are random (``n`` records, ``features`` inputs, 10 classes).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings

from _tee import Tee  # benchmarks/ is on sys.path when a script runs


def _rss_mb() -> float:
    """Current resident set size (Linux /proc), MiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def worker(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    x = torch.randn(args.n, args.features)
    y = torch.randint(0, 10, (args.n,))
    mods, d_in = [], args.features
    for _ in range(args.depth):
        mods += [torch.nn.Linear(d_in, args.width), torch.nn.ReLU()]
        d_in = args.width
    mods.append(torch.nn.Linear(d_in, 10))
    model = torch.nn.Sequential(*mods).to(dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base_rss = _rss_mb()

    if args.method == "dp-sbcd":
        from hidden_state_accountants.pytorch.sbcd import DPSBCD

        opt = DPSBCD(
            model,
            x.to(dev),
            y.to(dev),
            batch_size=args.batch,
            step_size=0.5,
            noise=1e-4,
            rho=1.0,
            regularizer="l2",
            regularization=0.01,
            seed=0,
            device=dev,
        )

        def epoch():
            for _ in range(opt.steps_per_epoch):
                opt.step()
    else:
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, y), batch_size=args.batch, shuffle=args.method == "sgd"
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if args.method == "opacus":
            from opacus import PrivacyEngine

            engine = PrivacyEngine(accountant="rdp")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model, opt, loader = engine.make_private(
                    module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0
                )

        def epoch():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for xb, yb in loader:
                    if len(xb) == 0:
                        continue
                    xb, yb = xb.to(dev, non_blocking=True), yb.to(dev, non_blocking=True)
                    opt.zero_grad(set_to_none=True)
                    torch.nn.functional.cross_entropy(model(xb), yb).backward()
                    opt.step()

    setup_rss = _rss_mb()
    times = []
    for i in range(args.epochs + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        epoch()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i > 0:
            times.append(time.perf_counter() - t0)
    out = dict(
        method=args.method,
        sec_per_epoch=statistics.median(times),
        peak_rss_mb=_peak_rss_mb(),
        rss_over_base_mb=_peak_rss_mb() - base_rss,
        setup_rss_over_base_mb=setup_rss - base_rss,
    )
    if dev.type == "cuda":
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=20000)
    p.add_argument("--features", type=int, default=256)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=2, help="hidden layers")
    p.add_argument("--batch", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=3, help="timed epochs (after one warm-up)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--methods", default="dp-sbcd,opacus,sgd")
    p.add_argument("--output", default=None, metavar="FILE", help="also write the table to FILE")
    p.add_argument("--worker", dest="method", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.method:
        print(json.dumps(worker(args)))
        return
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available (torch {torch.__version__})")
    rows = []
    for m in args.methods.split(","):
        cmd = [sys.executable, __file__, "--worker", m] + _without(sys.argv[1:], ("--methods", "--output"))
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    out = Tee(args.output) if args.output else None
    if out is not None:
        sys.stdout = out
    print(
        f"MLP {args.features}-"
        + "-".join([str(args.width)] * args.depth)
        + f"-10, n = {args.n}, batch = {args.batch}, "
        f"device = {args.device}, threads = {args.threads}, median of {args.epochs} epochs after 1 warm-up"
    )
    cuda = args.device.startswith("cuda")
    head = "| method | s / epoch | peak RSS (MiB) | peak RSS over set-up start (MiB) |" + (
        " peak CUDA (MiB) |" if cuda else ""
    )
    print(head)
    print("|" + " --- |" * (5 if cuda else 4))
    names = {"dp-sbcd": "DP-SBCD (this package)", "opacus": "Opacus DP-SGD", "sgd": "SGD (non-private)"}
    for r in rows:
        line = (
            f"| {names.get(r['method'], r['method'])} | {r['sec_per_epoch']:.3f} | {r['peak_rss_mb']:.0f} "
            f"| {r['rss_over_base_mb']:.0f} |"
        )
        if cuda:
            line += f" {r['peak_cuda_mb']:.0f} |"
        print(line)
    if cuda:
        print(f"\nCUDA device: {torch.cuda.get_device_name(torch.device(args.device))}")
    if out is not None:
        sys.stdout = sys.__stdout__
        out.save()


def _without(argv, options):
    """``argv`` without ``options`` (as ``--opt value`` or ``--opt=value``)."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in options:
            skip = True
        elif not a.startswith(tuple(o + "=" for o in options)):
            kept.append(a)
    return kept


if __name__ == "__main__":
    main()
