"""Epsilon against epochs for every analysis: the curve that shows what hidden state buys."""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from hidden_state_accountants import validation as v
from hidden_state_accountants.accountant import HiddenStateAccountant, accountant_with
from hidden_state_accountants.events import TrainingRunDpEvent


@dataclass
class EpsilonCurves:
    """``epsilon[name][i]`` at ``epochs[i]`` (``nan`` where the analysis does not apply)."""

    epochs: List[float]
    delta: float
    best: List[float]
    best_analysis: List[str]
    epsilon: Dict[str, List[float]]
    hidden_state: Dict[str, bool]
    neighboring_relation: str = "REPLACE_ONE"

    def table(self, names: Optional[Sequence[str]] = None) -> str:
        names = list(names or self.epsilon)
        width = max([12] + [len(n) for n in names])
        head = f"{'epochs':>8} {'best':>10}  " + " ".join(f"{n:>{width}}" for n in names)
        lines = [head, "-" * len(head)]
        for i, e in enumerate(self.epochs):
            cells = " ".join(f"{_fmt(self.epsilon[n][i]):>{width}}" for n in names)
            lines.append(f"{e:>8g} {_fmt(self.best[i]):>10}  {cells}")
        return "\n".join(lines)


def _fmt(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return "inf" if math.isinf(x) else f"{x:.3f}"


def epsilon_curves(
    run: TrainingRunDpEvent,
    epochs: Sequence[float],
    delta: float,
    **accountant_kwargs,
) -> EpsilonCurves:
    """Evaluates every analysis of ``run`` (its ``steps`` replaced) at each number of epochs."""
    accountant_with(accountant_kwargs)  # an unknown keyword is refused before the work
    spe = run.steps_per_epoch
    eps: Dict[str, List[float]] = {}
    hidden: Dict[str, bool] = {}
    best, best_name = [], []
    relation = "REPLACE_ONE"
    for i, e in enumerate(epochs):
        steps = int(round(e * spe))
        report = HiddenStateAccountant(**accountant_kwargs).compose(run.replace(steps=max(1, steps))).explain(delta)
        relation = report.neighboring_relation
        best.append(report.epsilon)
        best_name.append(report.analysis)
        for a in report.analyses:
            if a.name == "rdp_pointwise_min":
                continue
            eps.setdefault(a.name, [math.nan] * len(epochs))[i] = math.nan if a.epsilon is None else a.epsilon
            hidden[a.name] = a.hidden_state
    applicable = {n: v for n, v in eps.items() if any(not math.isnan(x) for x in v)}
    return EpsilonCurves(list(epochs), delta, best, best_name, applicable, {n: hidden[n] for n in applicable}, relation)


IMAGE_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")


def plot_path(path: str, default_name: str) -> str:
    """Where a plot will be written: ``path`` itself, or ``default_name`` inside ``path`` when
    it is an existing directory. Refuses (naming ``output``) a missing parent directory, a
    file type matplotlib cannot write, or a place where no file can be created (tried: a
    temporary file is created there and removed; ``/proc`` passes every permission check and
    still refuses files), before any work is done."""
    p = os.path.expanduser(str(path))
    if os.path.isdir(p):
        p = os.path.join(p, default_name)
    parent = os.path.dirname(os.path.abspath(p))
    if not os.path.isdir(parent):
        raise v.ParameterError("output", f"directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise v.ParameterError("output", f"directory {parent} is not writable")
    ext = os.path.splitext(p)[1].lower().lstrip(".")
    if ext not in IMAGE_FORMATS:
        raise v.ParameterError("output", f"must end in one of .{', .'.join(IMAGE_FORMATS)} (an image), got {path!r}")
    if os.path.isdir(p):
        raise v.ParameterError("output", f"{p} is a directory")
    if os.path.exists(p) and not os.access(p, os.W_OK):
        raise v.ParameterError("output", f"{p} exists and is not writable")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".hsa-", suffix="." + ext):
            pass
    except OSError as err:
        raise v.ParameterError("output", f"cannot create a file in {parent}: {err.strerror or err}") from None
    return p


def check_plottable(curves: EpsilonCurves) -> None:
    """Refuses (naming ``run``) curves a log-log plot cannot show: no finite epsilon at any
    length (e.g. no analysis holds), or epsilon 0 everywhere."""
    if not any(math.isfinite(x) for x in curves.best):
        raise v.ParameterError(
            "run",
            "nothing to plot: no analysis gives a finite epsilon at any plotted length "
            "(hsa epsilon lists each analysis with its reason)",
        )
    if not any(0 < x < math.inf for x in curves.best):
        raise v.ParameterError("run", "nothing to plot on a log scale: epsilon is 0 at every plotted length")


def plot_epsilon_curves(curves: EpsilonCurves, path: str, title: str = "") -> str:
    """Saves epsilon vs epochs (log-log) with the best valid bound in bold; returns ``path``
    (:func:`check_plottable` first)."""
    check_plottable(curves)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name, values in curves.epsilon.items():
        finite = [(e, x) for e, x in zip(curves.epochs, values) if 0 < x < math.inf]  # what a log scale shows
        if not finite:
            continue
        style = "-" if curves.hidden_state[name] else "--"
        label = name + ("" if curves.hidden_state[name] else " (composition)")
        ax.plot(*zip(*finite), style, lw=1.2, alpha=0.85, label=label)
    shown = [(e, x) for e, x in zip(curves.epochs, curves.best) if 0 < x < math.inf]
    ax.plot(*zip(*shown), "k-", lw=2.6, alpha=0.35, label="best valid bound")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("epochs")
    ax.set_ylabel(f"epsilon at delta = {curves.delta:g} ({curves.neighboring_relation})")
    ax.set_title(title or "Hidden-state vs composition accounting")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
