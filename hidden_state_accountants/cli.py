"""``hsa``: what epsilon will this run cost, how much noise does it need, how long can it train.

    hsa epsilon --dataset-size N --batch-size B (--epochs E | --steps T) --noise-multiplier Z
                --clip-norm C --learning-rate LR --sampling {full,cyclic,shuffle_partition,reshuffle,without_replacement,poisson}
                [--last-batch {dropped,kept_own_size,kept_batch_size}] [--public-batches]
                [--strong-convexity M_LOW] [--smoothness M_HIGH] [--diameter D] [--l2-regularization M_REG]
                [--lsi-constant C_LSI] [--gaussian-init]
                [--neighboring-relation {replace_one,add_or_remove_one}] --delta DELTA [--json]
    hsa noise   ... --target-epsilon EPS (no --noise-multiplier needed)
    hsa epochs  ... --target-epsilon EPS [--max-epochs E] (no --epochs/--steps needed)
    hsa plot    ... --output FILE.png [--max-epochs E]
    hsa audit   ... [--construction strongly_convex|constrained] [--repetitions R]: an empirical
                lower bound on epsilon from simulated runs, next to the reported bound
    hsa demo    the embedded MNIST-scale logistic-regression run: table + plot

``--lsi-constant`` declares a log-Sobolev constant of the iterates' law (Chourasia et al. Thm 2) and
``--gaussian-init`` the initialisation of Chourasia et al. Cor. 1 (``theta_0 ~ N(0, 2 sigma^2/m I)``);
both are the user's claim.

``--l2-regularization R`` with ``--smoothness`` and no ``--strong-convexity`` takes ``R`` as the
strong convexity: a convex (clipped) per-example loss plus the L2 term applied outside clipping
is ``R``-strongly convex. That convexity is the user's claim, as the smoothness is; the report
says so in a note. Declare ``--strong-convexity`` to state another value.

``hsa epsilon``, ``hsa noise`` and ``hsa epochs`` with ``--json`` print one object with an
``analyses`` list (each ``name``, ``epsilon`` or null, ``reason`` or null, ``hidden_state``) and
``notes``: for ``noise`` at the calibrated noise multiplier, for ``epochs`` after the epochs that
fit (after one epoch when none does; of an unbounded run when the budget is never exhausted).

``hsa epsilon`` and ``hsa noise`` also show the best known LOWER bound beside the bound where it can be
computed in under a second (``lower_bound``, null otherwise, and ``lower_bound_note``: the construction
and its caveat, or why there is none; in the table a line "best known lower bound: ..."): the epsilon
some run of the declared class really reaches. It is labelled as a lower bound and never used as the
guarantee, for calibration or for budgets (:mod:`hidden_state_accountants.lower_bounds`).
``hsa epochs`` answers the largest ``E`` such that stopping after any number of epochs up to
``E`` stays within the budget; it prints ``unlimited`` with the limit when an analysis valid for
every length converges below the target, and otherwise what that limit is.

Bad input exits with status 2 and one line naming the offending flag as it was typed (also where
the condition is on a derived quantity: too many steps names ``--epochs``, ``--dataset-size`` or
``--max-epochs``), before any work is done (``--output`` is checked by creating a file there).
Floating-point warnings of intermediate results are not shown: every conversion treats a NaN as
"nothing known" (infinity), so they never lower a reported epsilon.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from typing import List, Optional

import numpy as np

from hidden_state_accountants import __version__
from hidden_state_accountants import validation as v
from hidden_state_accountants.accountant import HiddenStateAccountant, PrivacyReport
from hidden_state_accountants.audit import audit
from hidden_state_accountants.calibration import (
    calibrate_noise_multiplier,
    accountant_context,
    check_relation,
    max_epochs_within_budget,
)
from hidden_state_accountants.events import LossGeometry, TrainingRunDpEvent
from hidden_state_accountants.schedules import (
    DROPPED,
    LAST_BATCHES,
    MAX_STEPS,
    POISSON,
    SAMPLINGS,
    check_epoch_steps,
    check_schedule,
    steps_per_epoch,
)
from hidden_state_accountants.errors import HiddenStateWarning
from hidden_state_accountants.plotting import check_plottable, epsilon_curves, plot_epsilon_curves, plot_path

FLAG_FOR_PARAMETER = {
    "dataset_size": "--dataset-size",
    "batch_size": "--batch-size",
    "steps": "--steps",
    "epochs": "--epochs",
    "noise_multiplier": "--noise-multiplier",
    "clip_norm": "--clip-norm",
    "learning_rate": "--learning-rate",
    "sampling": "--sampling",
    "strong_convexity": "--strong-convexity",
    "smoothness": "--smoothness",
    "diameter": "--diameter",
    "lsi_constant": "--lsi-constant",
    "geometry": "--smoothness",
    "l2_regularization": "--l2-regularization",
    "neighboring_relation": "--neighboring-relation",
    "gaussian_initialization": "--gaussian-init",
    "target_delta": "--delta",
    "target_epsilon": "--target-epsilon",
    "max_epochs": "--max-epochs",
    "repetitions": "--repetitions",
    "confidence": "--confidence",
    "delta": "--delta",
    "construction": "--construction",
    "output": "--output",
    "seed": "--seed",
    "last_batch": "--last-batch",
    "secret_batches": "--public-batches",
    "steps_per_epoch": "--steps-per-epoch",
}

# The embedded default: MNIST-scale L2-regularised logistic regression, the setting of
# Bok et al. (2024) Table 1 (n = 60000, b = 1500, L/(b sigma) = 2/3, c = 0.9999), with ten classes.
# The paper clips at 1, where the ten-class geometry has no proof (docs/derivations.md section 18);
# the bounds depend on the clip only through z, so clip 2 = sqrt(2 (R^2 + 1)), which never binds,
# gives the paper's numbers for a run they hold for.
DEMO = dict(
    dataset_size=60000,
    batch_size=1500,
    noise_multiplier=3.0,
    clip_norm=2.0,
    learning_rate=0.05,
    sampling="cyclic",
    feature_norm_bound=1.0,
    l2_regularization=0.002,
    num_classes=10,
    delta=1e-5,
)
# What an Opacus user runs on MNIST (Opacus' examples/mnist.py pattern with a ten-class
# logistic-regression model): the default Poisson loader, weight decay outside clipping, a clip that
# never binds (2 plus Opacus' 1e-6 margin, rounded up); Opacus reports add/remove.
DEMO_OPACUS = dict(
    dataset_size=60000,
    batch_size=256,
    noise_multiplier=1.0,
    clip_norm=2.01,
    learning_rate=0.5,
    feature_norm_bound=1.0,
    l2_regularization=0.01,
    num_classes=10,
    delta=1e-5,
    epochs=(1, 2, 3, 5, 10, 20, 50),
)
# `hsa epochs` searches up to this many epochs unless --max-epochs says otherwise.
DEFAULT_MAX_EPOCHS = 100_000


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, naming the flag (argparse's messages do)
        self.exit(2, f"hsa: error: {message}\n")


def number(text: str) -> float:
    """A float flag; text beyond the floating-point range is refused quoting what was typed
    (``float('1.8e308')`` is ``inf``, and the message should not say "got inf")."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if math.isinf(x) and "inf" not in text.lower():
        raise argparse.ArgumentTypeError(f"{text} is beyond the floating-point range (largest about 1.797e308)")
    return x


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None


RELATION_CHOICES = ("replace_one", "add_or_remove_one")


def _add_run_flags(p: argparse.ArgumentParser, *, noise: bool = True, length: bool = True) -> None:
    p.add_argument("--dataset-size", type=integer, required=True, metavar="N")
    p.add_argument("--batch-size", type=integer, required=True, metavar="B")
    if length:
        g = p.add_mutually_exclusive_group(required=True)
        g.add_argument("--epochs", type=number, metavar="E")
        g.add_argument("--steps", type=integer, metavar="T")
    if noise:
        p.add_argument("--noise-multiplier", type=number, required=True, metavar="Z")
    p.add_argument("--clip-norm", type=number, required=True, metavar="C")
    p.add_argument("--learning-rate", type=number, required=True, metavar="LR")
    p.add_argument("--sampling", choices=SAMPLINGS, required=True)
    p.add_argument(
        "--last-batch",
        choices=LAST_BATCHES,
        default=DROPPED,
        help="reshuffle: drop the short last batch of each epoch (DataLoader(drop_last=True)), or keep it "
        "divided by its own size (Keras fit) or by the batch size (Opacus, expected_batch_size=B)",
    )
    p.add_argument(
        "--public-batches",
        action="store_true",
        help="the batches' randomness is known to the adversary (e.g. a published seed)",
    )
    p.add_argument(
        "--steps-per-epoch",
        type=integer,
        metavar="T",
        help="balls_in_bins: the steps each epoch spreads the records over, a public constant given to the "
        "sampler (default N // B, the dataset size then treated as public)",
    )
    p.add_argument(
        "--strong-convexity",
        type=number,
        metavar="M_LOW",
        help="strong convexity m of the per-example update (default: --l2-regularization when given, "
        "a convex loss plus the L2 term outside clipping; else 0)",
    )
    p.add_argument(
        "--smoothness",
        type=number,
        metavar="M_HIGH",
        help="smoothness M; declaring it makes hidden-state analyses possible",
    )
    p.add_argument(
        "--diameter", type=number, metavar="D", help="diameter of the convex set the parameters are projected onto"
    )
    p.add_argument("--lsi-constant", type=number, help="declared log-Sobolev constant (Chourasia Thm 2)")
    p.add_argument(
        "--gaussian-init", action="store_true", help="theta_0 ~ N(0, 2 sigma^2/m I) as Chourasia Cor. 1 requires"
    )
    p.add_argument(
        "--l2-regularization",
        type=number,
        metavar="M_REG",
        help="L2 strength applied once per step outside clipping (weight decay); the Poisson "
        "hidden-state analyses need it. With --smoothness and no --strong-convexity it is also "
        "taken as the strong convexity",
    )
    p.add_argument(
        "--neighboring-relation",
        choices=RELATION_CHOICES,
        default="replace_one",
        help="replace_one (default, the papers') or add_or_remove_one (Opacus' convention)",
    )
    p.add_argument("--delta", type=number, required=True)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _relation(args) -> str:
    """The relation's name as reports print it (``REPLACE_ONE`` / ``ADD_OR_REMOVE_ONE``)."""
    return args.neighboring_relation.upper()


def _accountant_kwargs(args) -> dict:
    return {"neighboring_relation": _relation(args)}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hsa",
        description="Hidden-state privacy accounting for DP-SGD "
        "(REPLACE_ONE by default; --neighboring-relation add_or_remove_one).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("epsilon", help="best valid epsilon of a run, with every analysis")
    _add_run_flags(p)
    p = sub.add_parser("noise", help="noise multiplier needed for a target epsilon")
    _add_run_flags(p, noise=False)
    p.add_argument("--target-epsilon", type=number, required=True)
    p = sub.add_parser("epochs", help="largest number of epochs within a budget (every shorter run fits too)")
    _add_run_flags(p, length=False)
    p.add_argument("--target-epsilon", type=number, required=True)
    p.add_argument(
        "--max-epochs",
        type=integer,
        default=None,
        help=f"search at most this many epochs (default {DEFAULT_MAX_EPOCHS}, fewer where that "
        f"would exceed {MAX_STEPS:.0e} steps)",
    )
    p = sub.add_parser("plot", help="epsilon against epochs per analysis, saved as an image")
    _add_run_flags(p, length=False)
    p.add_argument("--max-epochs", type=number, default=1000, help="the last epoch plotted (at least 1)")
    p.add_argument("--output", default="hsa_epsilon_vs_epochs.png")
    p = sub.add_parser("audit", help="empirical lower bound on epsilon from simulated training runs")
    _add_run_flags(p)
    p.add_argument(
        "--construction",
        choices=("strongly_convex", "constrained"),
        default=None,
        help="default: constrained when --diameter is given, else strongly_convex",
    )
    p.add_argument("--repetitions", type=integer, default=100_000)
    p.add_argument("--confidence", type=number, default=0.95)
    p.add_argument("--seed", type=integer, default=0)
    p = sub.add_parser("demo", help="the embedded MNIST-scale default: table and plot")
    p.add_argument("--output", default="hsa_demo.png")
    p.add_argument("--json", action="store_true")
    return parser


def _strong_convexity_from_l2(args) -> bool:
    """Whether the strong convexity is the L2 strength (declared L2, smoothness, no m)."""
    return args.smoothness is not None and args.strong_convexity is None and args.l2_regularization is not None


def _geometry(args) -> Optional[LossGeometry]:
    if args.smoothness is None:
        for flag, value in (
            ("--strong-convexity", args.strong_convexity),
            ("--diameter", args.diameter),
            ("--lsi-constant", args.lsi_constant),
        ):
            if value is not None:
                raise v.ParameterError("smoothness", f"{flag} needs --smoothness as well")
        return None
    m = args.strong_convexity
    if _strong_convexity_from_l2(args):
        m = v.nonnegative_float("l2_regularization", args.l2_regularization)
        smoothness = v.positive_float("smoothness", args.smoothness)
        if m > smoothness:
            raise v.ParameterError(
                "l2_regularization",
                f"taken as the strong convexity (no --strong-convexity), "
                f"must be <= --smoothness {smoothness:g}, got {m:g}",
            )
    return LossGeometry(
        smoothness=args.smoothness,
        strong_convexity=0.0 if m is None else m,
        diameter=args.diameter,
        lsi_constant=args.lsi_constant,
    )


def _notes(args) -> List[str]:
    """What the command line assumed on the user's behalf, said in every report."""
    if _strong_convexity_from_l2(args):
        return [
            f"strong convexity taken from --l2-regularization: m = {args.l2_regularization:g}, assuming the clipped "
            "per-example loss is convex (the L2 term applied outside clipping adds m); pass --strong-convexity "
            "to declare another value"
        ]
    return []


def _steps_per_epoch(args) -> int:
    """Steps per epoch, after the schedule's own checks (a zero batch size is refused first)."""
    n, b = check_schedule(args.dataset_size, args.batch_size, args.sampling)
    return steps_per_epoch(n, b, args.sampling, args.last_batch, check_epoch_steps(args.steps_per_epoch, args.sampling))


def _checked_length(args, epochs: float, flag_parameter: str) -> int:
    """``epochs`` epochs in steps, refused naming the flag the user typed when it is more
    steps than any run takes: the dataset size when one epoch already is, else ``flag_parameter``."""
    spe = _steps_per_epoch(args)
    if spe > MAX_STEPS:
        raise v.ParameterError(
            "dataset_size",
            f"one epoch of {v.count_text(args.dataset_size)} records in batches of "
            f"{args.batch_size} is {spe:.3g} steps, more than any training run takes "
            f"(at most {MAX_STEPS:.0e})",
        )
    if epochs * spe > MAX_STEPS:
        raise v.ParameterError(
            flag_parameter,
            f"{epochs:g} epochs of {spe} steps is {epochs * spe:.3g} steps, more "
            f"than any training run takes (at most {MAX_STEPS:.0e})",
        )
    return spe


def _run(args, *, noise: Optional[float] = None, steps: Optional[int] = None) -> TrainingRunDpEvent:
    common = dict(
        dataset_size=args.dataset_size,
        batch_size=args.batch_size,
        noise_multiplier=args.noise_multiplier if noise is None else noise,
        clip_norm=args.clip_norm,
        learning_rate=args.learning_rate,
        sampling=args.sampling,
        geometry=_geometry(args),
        gaussian_initialization=args.gaussian_init,
        last_batch=args.last_batch,
        secret_batches=not args.public_batches,
        l2_regularization=args.l2_regularization,
        epoch_steps=args.steps_per_epoch,
    )
    if steps is not None:
        return TrainingRunDpEvent(steps=steps, **common)
    if getattr(args, "steps", None) is not None:
        return TrainingRunDpEvent(steps=args.steps, **common)
    v.positive_float("epochs", args.epochs)
    _checked_length(args, args.epochs, "epochs")
    return TrainingRunDpEvent.from_epochs(epochs=args.epochs, **common)


def _check_delta(args) -> float:
    return v.probability("target_delta", args.delta)


def _analyses(report: PrivacyReport) -> List[dict]:
    """The ``analyses`` list of ``hsa epsilon --json``: each name, epsilon or null, reason or null, ..."""
    return [a.to_dict() for a in report.analyses]


def _print_report(args, report: PrivacyReport) -> None:
    report.notes.extend(_notes(args))
    print(json.dumps(report.to_dict()) if args.json else report.to_table())


def cmd_epsilon(args) -> int:
    delta = _check_delta(args)
    report = HiddenStateAccountant(**_accountant_kwargs(args)).compose(_run(args)).explain(delta)
    _print_report(args, report)
    return 0


def cmd_noise(args) -> int:
    delta = _check_delta(args)
    v.positive_float("target_epsilon", args.target_epsilon)
    run = _run(args, noise=1.0)
    result = calibrate_noise_multiplier(run, args.target_epsilon, delta, **_accountant_kwargs(args))
    report = (
        HiddenStateAccountant(**_accountant_kwargs(args))
        .compose(run.replace(noise_multiplier=result.noise_multiplier))
        .explain(delta)
    )
    notes = report.notes + _notes(args)
    if args.json:
        print(
            json.dumps(
                {
                    "noise_multiplier": result.noise_multiplier,
                    "epsilon": result.epsilon,
                    "delta": delta,
                    "analysis": result.analysis,
                    "evaluations": result.evaluations,
                    "converged": result.converged,
                    "neighboring_relation": _relation(args),
                    "analyses": _analyses(report),
                    "notes": notes,
                    "lower_bound": _finite(report.lower_bound) if report.lower_bound is not None else None,
                    "lower_bound_note": report.lower_bound_note,
                }
            )
        )
    else:
        print(
            f"noise multiplier {result.noise_multiplier:.4f} gives epsilon {result.epsilon:.4f} "
            f"at delta {delta:g} ({_relation(args)}), from {result.analysis} "
            f"[{result.evaluations} evaluations]"
        )
        print("\nat that noise multiplier:\n" + report.to_table())
        for note in _notes(args):
            print(f"note: {note}")
    return 0


def cmd_epochs(args) -> int:
    delta = _check_delta(args)
    v.positive_float("target_epsilon", args.target_epsilon)
    spe = _steps_per_epoch(args)
    if args.max_epochs is None:
        max_epochs = max(1, min(DEFAULT_MAX_EPOCHS, MAX_STEPS // spe))
    else:
        max_epochs = v.positive_int("max_epochs", args.max_epochs)
        _checked_length(args, max_epochs, "max_epochs")
    run = _run(args, steps=spe)
    budget = max_epochs_within_budget(
        run, args.target_epsilon, delta, max_epochs=max_epochs, **_accountant_kwargs(args)
    )
    report = budget.report
    notes = report.notes + _notes(args)
    if args.json:
        print(
            json.dumps(
                {
                    "epochs": budget.epochs,
                    "unlimited": budget.unlimited,
                    "epsilon": budget.epsilon,
                    "next_epsilon": budget.next_epsilon,
                    "limit_epsilon": _finite(budget.limit_epsilon),
                    "limit_analysis": budget.limit_analysis,
                    "max_epochs": max_epochs,
                    "complete": budget.complete,
                    "delta": delta,
                    "analysis": budget.analysis,
                    "neighboring_relation": _relation(args),
                    "analyses": _analyses(report),
                    "notes": notes,
                }
            )
        )
        return 0
    rel = f"at delta {delta:g} ({_relation(args)})"
    if budget.unlimited:
        print(
            f"unlimited: {budget.analysis} stays at or below epsilon {budget.limit_epsilon:.4f} "
            f"(<= {args.target_epsilon:g}) {rel} however long the run trains"
        )
    else:
        if budget.epochs == 0:
            print(
                f"no whole epoch fits in epsilon {args.target_epsilon:g} {rel}: one epoch costs "
                f"{report.epsilon:.4f} (from {report.analysis})"
            )
        elif budget.epochs == max_epochs or not budget.complete:
            why = "the --max-epochs searched" if budget.epochs == max_epochs else "checked epoch by epoch"
            print(
                f"at least {budget.epochs} epochs ({why}) fit in epsilon {args.target_epsilon:g} {rel} "
                f"(epsilon {budget.epsilon:.4f}, from {budget.analysis})"
            )
        else:
            print(
                f"{budget.epochs} epochs fit in epsilon {args.target_epsilon:g} {rel} "
                f"(epsilon {budget.epsilon:.4f}, from {budget.analysis}; "
                f"{budget.epochs + 1} epochs would cost {_fmt(budget.next_epsilon)})"
            )
        print(_limit_sentence(budget, report))
    for note in _notes(args):
        print(f"note: {note}")
    return 0


def _limit_sentence(budget, report: PrivacyReport) -> str:
    """What a run of unbounded length costs, in the words that fit the limit."""
    lim = budget.limit_epsilon
    hidden = {a.name: a.hidden_state for a in report.analyses}
    if math.isinf(lim):
        return "no analysis valid for every length bounds an unbounded run"
    if hidden.get(budget.limit_analysis, True) and budget.limit_analysis != "none":
        return (
            f"for unbounded training {budget.limit_analysis} converges to epsilon {lim:.4f}, above the target "
            "(an analysis valid for every length)"
        )
    return (
        f"no hidden-state analysis valid for every length converges below the target; "
        f"the best for an unbounded run is {budget.limit_analysis} at {lim:.4g}, which grows without limit"
    )


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else ("inf" if math.isinf(x) else f"{x:.4f}")


def _finite(x: float):
    return x if math.isfinite(x) else None


def _epoch_grid(max_epochs: float) -> List[float]:
    v.positive_float("max_epochs", max_epochs)
    if max_epochs < 1:
        raise v.ParameterError("max_epochs", f"must be at least 1 (the plot starts at one epoch), got {max_epochs:g}")
    grid = np.unique(np.round(np.geomspace(1, max_epochs, 16)))
    return [float(e) for e in grid]


def cmd_plot(args) -> int:
    delta = _check_delta(args)
    output = plot_path(args.output, "hsa_epsilon_vs_epochs.png")  # checked before the work
    epochs = _epoch_grid(args.max_epochs)
    spe = _checked_length(args, max(epochs), "max_epochs")
    run = _run(args, steps=spe)
    try:
        check_relation(run, accountant_context(_accountant_kwargs(args)))
    except v.ParameterError as err:  # every curve would be infinite
        raise v.ParameterError(err.parameter, f"nothing to plot: {str(err).split(': ', 1)[1]}") from None
    curves = epsilon_curves(run, epochs, delta, **_accountant_kwargs(args))
    check_plottable(curves)
    print(f"neighbouring relation: {_relation(args)}")
    print(curves.table())
    print(f"\nplot saved to {plot_epsilon_curves(curves, output)}")
    for note in _notes(args):
        print(f"note: {note}")
    return 0


def cmd_audit(args) -> int:
    delta = _check_delta(args)
    run = _run(args)
    construction = args.construction or ("constrained" if args.diameter is not None else "strongly_convex")
    result = audit(
        run,
        construction=construction,
        repetitions=args.repetitions,
        delta=delta,
        confidence=args.confidence,
        seed=args.seed,
        **_accountant_kwargs(args),
    )
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        verdict = "consistent" if result.consistent else "INCONSISTENT: the reported bound is below the audit"
        print(
            f"audited lower bound {result.epsilon_lower:.4f} (confidence {result.confidence:g}, "
            f"{result.repetitions} runs per dataset, {construction} construction) <= reported "
            f"{result.epsilon_reported:.4f} from {result.analysis} at delta {delta:g}: {verdict}"
        )
    return 0 if result.consistent else 1


def _demo_opacus_rows() -> List[dict]:
    """Per epoch: the composition number Opacus prints (add/remove) and the hidden-state bounds."""
    d = DEMO_OPACUS
    geometry = LossGeometry.logistic_regression(
        d["feature_norm_bound"], d["l2_regularization"], num_classes=d["num_classes"]
    )
    rows = []
    for epochs in d["epochs"]:
        run = TrainingRunDpEvent.from_epochs(
            dataset_size=d["dataset_size"],
            batch_size=d["batch_size"],
            epochs=epochs,
            noise_multiplier=d["noise_multiplier"],
            clip_norm=d["clip_norm"],
            learning_rate=d["learning_rate"],
            sampling=POISSON,
            geometry=geometry,
            l2_regularization=d["l2_regularization"],
        )
        add_remove = HiddenStateAccountant(neighboring_relation="ADD_OR_REMOVE_ONE").compose(run).explain(d["delta"])
        replace_one = HiddenStateAccountant(neighboring_relation="REPLACE_ONE").compose(run).explain(d["delta"])
        rows.append(
            {
                "epochs": epochs,
                "steps": run.steps,
                "composition_add_or_remove": add_remove.composition_epsilon,
                "epsilon_add_or_remove": add_remove.epsilon,
                "analysis_add_or_remove": add_remove.analysis,
                "epsilon_replace_one": replace_one.epsilon,
                "analysis_replace_one": replace_one.analysis,
            }
        )
    return rows


def _print_demo_opacus(rows: List[dict]) -> None:
    d = DEMO_OPACUS
    print(
        f"What an Opacus user sees: MNIST-scale logistic regression ({d['num_classes']} classes) with Opacus' "
        "default Poisson loader"
    )
    print(
        f"  n = {d['dataset_size']}, expected batch {d['batch_size']}, noise multiplier {d['noise_multiplier']}, "
        f"clip {d['clip_norm']} (never binds: >= sqrt(2 (R^2 + 1)) plus Opacus' 1e-6), lr {d['learning_rate']}, "
        f"weight decay {d['l2_regularization']} outside clipping, features clipped to norm "
        f"{d['feature_norm_bound']}, delta = {d['delta']:g}\n"
    )
    print(
        f"{'epochs':>6}  {'composition (add/remove)':>24}  {'hidden state (add/remove)':>25}  "
        f"{'hidden state (replace-one)':>26}"
    )
    for r in rows:
        print(
            f"{r['epochs']:>6}  {r['composition_add_or_remove']:>24.3f}  {r['epsilon_add_or_remove']:>25.3f}  "
            f"{r['epsilon_replace_one']:>26.3f}"
        )
    first = next((r["epochs"] for r in rows if r["epsilon_add_or_remove"] < r["composition_add_or_remove"]), None)
    print(
        "\nThe composition column is what Opacus' PRV accountant prints for this run (equal within its "
        "discretisation, about 0.01)."
    )
    if first is not None:
        print(
            f"The hidden-state bound (the same relation) is smaller from epoch {first} on and stays at "
            f"{rows[-1]['epsilon_add_or_remove']:.3f}; before that the two are equal.\n"
        )


def cmd_demo(args) -> int:
    d = DEMO
    output = plot_path(args.output, "hsa_demo.png")  # checked before the work
    opacus_rows = _demo_opacus_rows()
    geometry = LossGeometry.logistic_regression(
        d["feature_norm_bound"], d["l2_regularization"], num_classes=d["num_classes"]
    )
    run = TrainingRunDpEvent(
        dataset_size=d["dataset_size"],
        batch_size=d["batch_size"],
        steps=1,
        noise_multiplier=d["noise_multiplier"],
        clip_norm=d["clip_norm"],
        learning_rate=d["learning_rate"],
        sampling=d["sampling"],
        geometry=geometry,
    )
    epochs = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    curves = epsilon_curves(run, epochs, d["delta"])
    if args.json:
        print(
            json.dumps(
                {
                    "epochs": curves.epochs,
                    "best": curves.best,
                    "analyses": curves.epsilon,
                    "delta": curves.delta,
                    "neighboring_relation": "REPLACE_ONE",
                    "opacus_poisson": opacus_rows,
                }
            )
        )
        plot_epsilon_curves(curves, output)
        return 0
    _print_demo_opacus(opacus_rows)
    print(
        "Bok, Su & Altschuler (ICML 2024), Table 1: MNIST-scale L2-regularised logistic regression trained with DP-SGD"
    )
    print(
        f"  n = {d['dataset_size']}, {d['num_classes']} classes, batch {d['batch_size']} in a fixed cyclic order, "
        f"noise multiplier {d['noise_multiplier']}, clip {d['clip_norm']} (the paper's 1 can bind, where a "
        f"{d['num_classes']}-class geometry has no proof; the bounds depend on the clip only through the noise "
        f"multiplier, so these are the paper's numbers), lr {d['learning_rate']}, features clipped to "
        f"norm {d['feature_norm_bound']}, L2 {d['l2_regularization']}"
    )
    print(
        f"  geometry (Ye & Shokri Prop. 5.1, a clip that never binds): m = {geometry.strong_convexity:g}, "
        f"M = {geometry.smoothness:g}; delta = {d['delta']:g}, REPLACE_ONE\n"
    )
    print(curves.table())
    print(
        "\nComposition (bok_thm4.4) charges every released iterate and keeps growing; the hidden-state bounds converge."
    )
    print(f"plot saved to {plot_epsilon_curves(curves, output, 'Embedded default: MNIST-scale logistic regression')}")
    return 0


COMMANDS = {
    "epsilon": cmd_epsilon,
    "noise": cmd_noise,
    "epochs": cmd_epochs,
    "plot": cmd_plot,
    "audit": cmd_audit,
    "demo": cmd_demo,
}


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """Every warning as one line on stderr: a command line has no source lines to show."""
    if issubclass(category, HiddenStateWarning):
        print(f"hsa: warning: {message}", file=sys.stderr)
    else:
        print(f"hsa: warning: {category.__name__}: {message}", file=sys.stderr)


def _flag(parameter: str, args) -> Optional[str]:
    """The flag the user typed for ``parameter`` (``steps`` came from ``--epochs`` when that was
    given); ``None`` for a condition on the whole run (``run``), which no single flag sets."""
    if parameter == "steps" and getattr(args, "steps", None) is None and getattr(args, "epochs", None) is not None:
        return "--epochs"
    if parameter == "run":
        return None
    return FLAG_FOR_PARAMETER.get(parameter, parameter)


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        # numpy's floating-point warnings of intermediate results (overflow at z = 1e-308) are
        # not the user's concern: a NaN never reaches a conversion (it counts as infinity there)
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.showwarning = _show_warning
            return COMMANDS[args.command](args)
    except v.ParameterError as err:
        message = str(err).split(": ", 1)[1] if ": " in str(err) else str(err)
        flag = _flag(err.parameter, args)
        print(f"hsa: error: {flag + ': ' if flag else ''}{message}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader closed early (`hsa epsilon ... | head`): not an error; silence the flush at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
