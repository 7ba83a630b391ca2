"""Per-step training overhead of the Opacus adapter against plain Opacus.

Same model (multi-class logistic regression), same data, same batch size, same base
optimizer (SGD with the same weight_decay); what differs is only what the adapter adds:

  plain        Opacus, DataLoader(batch_size=b, shuffle=True, drop_last=True),
               poisson_sampling=False, Opacus' default accountant (prv)
  +sampler     the same, with ShufflePartitionBatchSampler as the batch sampler
  +hook        ... and ProjectionHook(radius, l2_regularization) on the DP optimizer
  adapter      ... and PrivacyEngine(accountant="hidden_state"), configured (full adapter)
  adapter-l2   the full adapter without projection (ProjectionHook(l2_regularization=...) only:
               enough for the strongly convex analyses, which need no diameter)
  plain-pre    plain, on features clipped beforehand (clip_features) and a model without FeatureClip
  adapter-check  the full adapter on the same model and data: no FeatureClip, so the accountant
               checks the trainable layer's inputs on every batch before its step (compared with
               plain-pre)

A step is fetching the batch, forward, backward, ``optimizer.step()`` and ``zero_grad()``
(the accountant's hook runs inside ``step``, the projection right after it). The variants are
interleaved step by step (one step of each, in turn, thousands of times), so drifting load on
a shared machine hits them alike; each step is timed with the thread's CPU clock
(single-threaded torch, no loader workers: the step's own work) or ``--clock wall``. Reported:
the median step time, the overhead of the medians with a bootstrap 95% interval, and, for
reference, each piece of the adapter timed alone in a tight loop (hot caches, so smaller than
its share of a real step). ``get_epsilon`` is not part of a step (it is called per epoch or at
the end); its cost is reported separately.

    python benchmarks/bench_opacus_overhead.py --dataset digits
    python benchmarks/bench_opacus_overhead.py --dataset synthetic
    python benchmarks/bench_opacus_overhead.py --device cuda --clock wall --output figures.txt
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from typing import Dict, List

import numpy as np
import torch
from _tee import Tee  # benchmarks/ is on sys.path when a script runs
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hidden_state_accountants.opacus as hso

VARIANTS = ("plain", "+sampler", "+hook", "adapter", "adapter-l2", "plain-pre", "adapter-check")
BASE = {"adapter-check": "plain-pre"}  # what a variant is compared with (default: plain)


def dataset(name: str):
    if name == "digits":
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x = x[:1500] / 8.0 - 1.0
        y = y[:1500]
    else:
        from sklearn.datasets import make_classification

        x, y = make_classification(n_samples=20000, n_features=256, n_informative=64, n_classes=10, random_state=0)
    return TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long))


def build(variant: str, ds: TensorDataset, batch_size: int, seed: int, device: torch.device):
    torch.manual_seed(seed)
    pre = variant in ("plain-pre", "adapter-check")
    if pre:  # the features clipped once, outside the model
        ds = TensorDataset(hso.clip_features(ds.tensors[0], 1.0), ds.tensors[1])
    n, d = ds.tensors[0].shape
    k = int(ds.tensors[1].max()) + 1
    sampler = hso.ShufflePartitionBatchSampler(n, batch_size, seed)
    if variant.startswith("plain"):
        loader = DataLoader(
            ds, batch_size=batch_size, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(seed)
        )
    else:
        loader = DataLoader(ds, batch_sampler=sampler)
    model = (nn.Sequential(nn.Linear(d, k)) if pre else nn.Sequential(hso.FeatureClip(1.0), nn.Linear(d, k))).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, weight_decay=0.01)
    engine = PrivacyEngine(accountant="hidden_state" if variant.startswith("adapter") else "prv")
    model, opt, loader = engine.make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=2.0, max_grad_norm=1.0, poisson_sampling=False
    )
    if not variant.startswith("plain") and variant != "+sampler":
        radius = None if variant == "adapter-l2" else 5.0
        hook = hso.ProjectionHook(opt, radius=radius, l2_regularization=0.01, check_loss_penalty=False)
        if variant.startswith("adapter"):
            engine.accountant.configure(
                geometry=hook.logistic_regression_geometry(1.0), sampler=sampler, model=model, optimizer=opt
            )
    return engine, model, opt, loader


class Stepper:
    """One training step at a time over a loader that restarts every epoch."""

    def __init__(self, setup, device: torch.device) -> None:
        self.engine, self.model, self.opt, self.loader = setup
        self.device = device
        self.it = iter(())

    def __call__(self) -> None:
        try:
            xb, yb = next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            xb, yb = next(self.it)
        loss = nn.functional.cross_entropy(self.model(xb.to(self.device)), yb.to(self.device))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()


def components(setups, device: torch.device, repeats: int = 7, number: int = 300) -> Dict[str, float]:
    """Best-of-``repeats`` seconds per call of each piece the adapter adds or replaces, alone
    in a tight loop (hot caches: a lower bound on its cost inside a real step)."""
    import timeit

    def best(fn) -> float:
        return min(timeit.repeat(fn, number=number, repeat=repeats)) / number

    _, model, opt, loader = setups["adapter"]
    _, pmodel, popt, ploader = setups["plain"]
    torch_batches = iter(())

    def torch_batch():  # the plain loader's BatchSampler(RandomSampler), one batch
        nonlocal torch_batches
        try:
            next(torch_batches)
        except StopIteration:
            torch_batches = iter(ploader.batch_sampler)

    sampler = setups["adapter"][0].accountant.sampler
    ours = {"step": 0}

    def our_batch():
        ours["step"] += 1
        sampler.local_batch(ours["step"])

    out = {"sampler_ours": best(our_batch), "sampler_torch": best(torch_batch)}
    for name, (m, o, l) in (("accountant_ours", (model, opt, loader)), ("accountant_prv", (pmodel, popt, ploader))):
        xb, yb = next(iter(l))
        nn.functional.cross_entropy(m(xb.to(device)), yb.to(device)).backward()  # grad_sample for the hook
        saved = sampler.position
        sampler.position = 10**15  # the position check counts batches handed out; lift it here only
        out[name] = best(lambda: o.step_hook(o))
        sampler.position = saved
        o.zero_grad()
    proj = getattr(opt, hso.PROJECTION_ATTR)
    out["projection"] = best(proj.project)
    monitor = setups["adapter-check"][0].accountant._features  # the per-batch input check, alone
    xb = next(iter(setups["adapter-check"][3]))[0].to(device)
    out["feature_check"] = best(lambda: (monitor._see(monitor.module, (xb,)), monitor.take()))
    out["added"] = (
        out["sampler_ours"] - out["sampler_torch"] + out["accountant_ours"] - out["accountant_prv"] + out["projection"]
    )
    return out


def main(argv=None) -> Dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", choices=["digits", "synthetic"], default="digits")
    p.add_argument("--batch-size", type=int, default=None, help="default: 100 (digits), 256 (synthetic)")
    p.add_argument("--steps", type=int, default=3000, help="timed steps per variant (interleaved)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1: less noise)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (CUDA needs --clock wall)")
    p.add_argument("--output", default=None, metavar="FILE", help="also write the printed figures to FILE")
    p.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="cpu: the thread's CPU time (robust to other load); wall: time.perf_counter",
    )
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    for notice in ("Secure RNG turned off", "Full backward hook is firing", ".*records at the end of the order"):
        warnings.filterwarnings("ignore", message=notice)  # Opacus' notices and the sampler's remainder note
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {a.device}: CUDA is not available (torch {torch.__version__})")
    b = a.batch_size or (100 if a.dataset == "digits" else 256)
    ds = dataset(a.dataset)

    clock = time.thread_time_ns if a.clock == "cpu" else time.perf_counter_ns
    if device.type == "cuda" and a.clock == "cpu":
        p.error("--clock cpu measures host work only; use --clock wall on CUDA")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    setups = {v: build(v, ds, b, seed=0, device=device) for v in VARIANTS}
    steppers = {v: Stepper(setups[v], device) for v in VARIANTS}
    for _ in range(50):  # warm-up: allocator, first-step checks, caches
        for v in VARIANTS:
            steppers[v]()
    times: Dict[str, List[int]] = {v: [] for v in VARIANTS}
    for i in range(a.steps):
        for v in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
            sync()
            t0 = clock()
            steppers[v]()
            sync()
            times[v].append(clock() - t0)
    us = {v: np.asarray(times[v], dtype=float) / 1e3 for v in VARIANTS}
    med = {v: float(np.median(us[v])) for v in VARIANTS}
    rng = np.random.default_rng(0)

    def ci(v):  # bootstrap the ratio of medians
        k, base = len(us[v]), us[BASE.get(v, "plain")]
        boots = [
            np.median(us[v][rng.integers(0, k, k)]) / np.median(base[rng.integers(0, len(base), len(base))])
            for _ in range(300)
        ]
        return [100 * (x - 1) for x in np.percentile(boots, [2.5, 97.5])]

    comp = components(setups, device)
    engine = setups["adapter"][0]
    t0 = time.perf_counter()
    eps = engine.get_epsilon(1e-5)
    t_eps = time.perf_counter() - t0

    tee = Tee(a.output) if a.output else None
    if tee is not None:
        sys.stdout = tee
    if device.type == "cuda":
        print(f"CUDA device: {torch.cuda.get_device_name(device)}")
    print(
        f"dataset={a.dataset} n={len(ds)} d={ds.tensors[0].shape[1]} batch_size={b} steps={a.steps} "
        f"threads={a.threads} device={a.device} clock={a.clock} torch={torch.__version__}"
    )
    print(f"{'variant':<13} {'median us/step':>15} {'vs base':>9}   (95% interval)")
    intervals = {}
    for v in VARIANTS:
        intervals[v] = ci(v)
        base = BASE.get(v, "plain")
        print(
            f"{v:<13} {med[v]:>15.1f} {100 * (med[v] / med[base] - 1):>+8.2f}%   "
            f"({intervals[v][0]:+.2f}% .. {intervals[v][1]:+.2f}%)" + ("" if base == "plain" else f" vs {base}")
        )
    print(
        "pieces alone, tight loop, best of 7 x 300 calls (us): "
        + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in comp.items() if k != "added")
    )
    print(
        f"net (ours minus what they replace, plus projection): {comp['added'] * 1e6:.1f} us = "
        f"{100 * comp['added'] * 1e6 / med['plain']:.2f}% of the median plain step"
    )
    print(
        f"get_epsilon after {len(engine.accountant)} steps: {t_eps * 1e3:.1f} ms (epsilon {eps:.4f}, "
        f"{engine.accountant.explain(1e-5).analysis})"
    )
    out = {
        "per_step_us": med,
        "overhead_pct": {v: 100 * (med[v] / med[BASE.get(v, "plain")] - 1) for v in VARIANTS},
        "overhead_95pct_interval": intervals,
        "components_us": {k: v * 1e6 for k, v in comp.items()},
        "get_epsilon_ms": t_eps * 1e3,
    }
    if a.json:
        print(json.dumps(out))
    if tee is not None:
        sys.stdout = sys.__stdout__
        tee.save()
    return out


if __name__ == "__main__":
    main()
