"""DP-SBCD's privacy loss under adaptive noise (paper Section 4.3, Fig. 2), from the accountant.

    .venv/bin/python examples/sbcd_noise_schedules.py [--plot sbcd_schedules.png]

Fig. 2 settings: n = 2100, b = 100, eta = 0.01, rho = 1, one sub-problem, RDP order 10. The
paper's four schedules: constant 0.0005, decay 0.001 - 0.00003 k (the figure's caption prints
0.0003 k, which is negative from k = 4), increase 0.0001 + 0.00003 k (caption: 0.0003 k),
decay-then-constant 0.0005 - 0.00003 k up to k = 10, then 0.0002. The contraction that makes a
bound converge comes from L2 regularisation (``lambda``): with ``lambda = 0``, ``L_F L_T = 1``
and even the constant schedule grows linearly (see docs/dp_sbcd.md).

One sub-problem is a one-block run (a linear model), the case Thm 4.5 is proved for. A network
of two or more blocks is not (docs/dp_sbcd.md, "Audit"): the accountant gives it the composition
bound only (the last row for one block; it grows with the number of blocks).
"""

from __future__ import annotations

import argparse

from hidden_state_accountants.analyses import sbcd

N, B, ETA, ORDER = 2100, 100, 0.01, 10.0
SCHEDULES = {
    "constant": sbcd.constant(5e-4),
    "decay": sbcd.linear_decay(1e-3, 3e-5),
    "increase": sbcd.increase(1e-4, 3e-5),
    "decay-then-constant": sbcd.decay_then_constant(5e-4, 3e-5, 10),
}
EPOCHS = (1, 5, 10, 15, 20, 25, 30)


def rdp(schedule, epochs, lam):
    l = N // B
    vals = schedule.values(ETA, epochs * l, l)
    ev = sbcd.DpSbcdRunDpEvent.from_epochs(
        dataset_size=N,
        batch_size=B,
        epochs=epochs,
        num_layers=1,
        step_size=ETA,
        rho=1.0,
        noise=sbcd.compress_noise(vals, l),
        regularizer="l2",
        regularization=lam,
    )
    return sbcd.thm_4_5_rdp(ev, [ORDER])[0], sbcd.composition_rdp(ev, [ORDER])[0]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plot", default=None, help="write a figure (matplotlib) to this path")
    args = p.parse_args()
    table = {}
    for lam in (1.0, 0.0):
        for name, sched in SCHEDULES.items():
            table[(lam, name)] = [rdp(sched, k, lam) for k in EPOCHS]
    print(f"RDP eps at order {ORDER:g} after K epochs (Thm 4.5, one block; n={N}, b={B}, eta={ETA}, rho=1)")
    print("| schedule | lambda | " + " | ".join(f"K={k}" for k in EPOCHS) + " |")
    print("| --- | --- |" + " --- |" * len(EPOCHS))
    for (lam, name), vals in table.items():
        print(f"| {name} | {lam:g} | " + " | ".join(f"{h:.4f}" for h, _ in vals) + " |")
    print("| constant, composition | any | " + " | ".join(f"{c:.4f}" for _, c in table[(1.0, "constant")]) + " |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for (lam, name), vals in table.items():
            ax.plot(EPOCHS, [h for h, _ in vals], marker="o", ls="-" if lam else ":", label=f"{name}, lambda={lam:g}")
        ax.set_xlabel("epochs K")
        ax.set_ylabel(f"RDP epsilon at order {ORDER:g}")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
