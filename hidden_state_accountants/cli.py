"""``hsa``: what epsilon will this run cost, how much noise does it need, how long can it train.

    hsa epsilon --dataset-size N --batch-size B (--epochs E | --steps T) --noise-multiplier Z
                --clip-norm C --learning-rate LR --sampling {full,cyclic,shuffle_partition,reshuffle,without_replacement,poisson}
                [--last-batch {dropped,kept_own_size,kept_batch_size}] [--public-batches]
                [--strong-convexity M_LOW] [--smoothness M_HIGH] [--diameter D] [--l2-regularization M_REG]
                [--neighboring-relation {replace_one,add_or_remove_one}] --delta DELTA [--json]
    hsa noise   ... --target-epsilon EPS (no --noise-multiplier needed)
    hsa epochs  ... --target-epsilon EPS (no --epochs/--steps needed)
    hsa plot    ... --output FILE.png [--max-epochs E]
    hsa audit   ... [--construction strongly_convex|constrained] [--repetitions R]: an empirical
                lower bound on epsilon from simulated runs, next to the reported bound
    hsa demo    the embedded MNIST-scale logistic-regression run: table + plot

Bad input exits with status 2 and one line naming the offending flag.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from typing import List, Optional

import numpy as np

from hidden_state_accountants import __version__
from hidden_state_accountants import validation as v
from hidden_state_accountants.accountant import HiddenStateAccountant
from hidden_state_accountants.calibration import calibrate_noise_multiplier, max_epochs_within_budget
from hidden_state_accountants.events import LossGeometry, TrainingRunDpEvent
from hidden_state_accountants.schedules import DROPPED, LAST_BATCHES, SAMPLINGS, steps_per_epoch
from hidden_state_accountants.recording import HiddenStateWarning
from hidden_state_accountants.plotting import epsilon_curves, plot_epsilon_curves, plot_path

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
}

# The embedded default: MNIST-scale L2-regularised logistic regression, the setting of
# Bok et al. (2024) Table 1 (n = 60000, b = 1500, L/(b sigma) = 2/3, c = 0.9999).
DEMO = dict(
    dataset_size=60000, batch_size=1500, noise_multiplier=3.0, clip_norm=1.0,
    learning_rate=0.05, sampling="cyclic", feature_norm_bound=1.0, l2_regularization=0.002,
    delta=1e-5,
)


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
    p.add_argument("--last-batch", choices=LAST_BATCHES, default=DROPPED,
                   help="reshuffle: drop the short last batch of each epoch (DataLoader(drop_last=True)), or keep it "
                        "divided by its own size (Keras fit) or by the batch size (Opacus, expected_batch_size=B)")
    p.add_argument("--public-batches", action="store_true",
                   help="the batches' randomness is known to the adversary (e.g. a published seed)")
    p.add_argument("--strong-convexity", type=number, metavar="M_LOW",
                   help="strong convexity m of the per-example update (e.g. the L2 weight decay)")
    p.add_argument("--smoothness", type=number, metavar="M_HIGH",
                   help="smoothness M; declaring it makes hidden-state analyses possible")
    p.add_argument("--diameter", type=number, metavar="D",
                   help="diameter of the convex set the parameters are projected onto")
    p.add_argument("--lsi-constant", type=number, help="declared log-Sobolev constant (Chourasia Thm 2)")
    p.add_argument("--gaussian-init", action="store_true",
                   help="theta_0 ~ N(0, 2 sigma^2/m I) as Chourasia Cor. 1 requires")
    p.add_argument("--l2-regularization", type=number, metavar="M_REG",
                   help="L2 strength applied once per step outside clipping (weight decay); the Poisson "
                        "hidden-state analyses need it")
    p.add_argument("--neighboring-relation", choices=RELATION_CHOICES, default="replace_one",
                   help="replace_one (default, the papers') or add_or_remove_one (Opacus' convention)")
    p.add_argument("--delta", type=number, required=True)
    p.add_argument("--json", action="store_true", help="print one JSON object")


RELATION_CHOICES = ("replace_one", "add_or_remove_one")


def _relation(args) -> str:
    """The relation's name as reports print it (``REPLACE_ONE`` / ``ADD_OR_REMOVE_ONE``)."""
    return args.neighboring_relation.upper()


def _accountant_kwargs(args) -> dict:
    return {"neighboring_relation": _relation(args)}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hsa", description="Hidden-state privacy accounting for DP-SGD "
                                             "(REPLACE_ONE by default; --neighboring-relation add_or_remove_one).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("epsilon", help="best valid epsilon of a run, with every analysis")
    _add_run_flags(p)
    p = sub.add_parser("noise", help="noise multiplier needed for a target epsilon")
    _add_run_flags(p, noise=False)
    p.add_argument("--target-epsilon", type=number, required=True)
    p = sub.add_parser("epochs", help="largest number of epochs within a budget")
    _add_run_flags(p, length=False)
    p.add_argument("--target-epsilon", type=number, required=True)
    p.add_argument("--max-epochs", type=integer, default=100_000)
    p = sub.add_parser("plot", help="epsilon against epochs per analysis, saved as an image")
    _add_run_flags(p, length=False)
    p.add_argument("--max-epochs", type=number, default=1000)
    p.add_argument("--output", default="hsa_epsilon_vs_epochs.png")
    p = sub.add_parser("audit", help="empirical lower bound on epsilon from simulated training runs")
    _add_run_flags(p)
    p.add_argument("--construction", choices=("strongly_convex", "constrained"), default=None,
                   help="default: constrained when --diameter is given, else strongly_convex")
    p.add_argument("--repetitions", type=integer, default=100_000)
    p.add_argument("--confidence", type=number, default=0.95)
    p.add_argument("--seed", type=integer, default=0)
    p = sub.add_parser("demo", help="the embedded MNIST-scale default: table and plot")
    p.add_argument("--output", default="hsa_demo.png")
    p.add_argument("--json", action="store_true")
    return parser


def _geometry(args) -> Optional[LossGeometry]:
    if args.smoothness is None:
        for flag, value in (("--strong-convexity", args.strong_convexity), ("--diameter", args.diameter),
                            ("--lsi-constant", args.lsi_constant)):
            if value is not None:
                raise v.ParameterError("smoothness", f"{flag} needs --smoothness as well")
        return None
    return LossGeometry(
        smoothness=args.smoothness,
        strong_convexity=0.0 if args.strong_convexity is None else args.strong_convexity,
        diameter=args.diameter,
        lsi_constant=args.lsi_constant,
    )


def _run(args, *, noise: Optional[float] = None, steps: Optional[int] = None) -> TrainingRunDpEvent:
    common = dict(
        dataset_size=args.dataset_size, batch_size=args.batch_size,
        noise_multiplier=args.noise_multiplier if noise is None else noise,
        clip_norm=args.clip_norm, learning_rate=args.learning_rate, sampling=args.sampling,
        geometry=_geometry(args), gaussian_initialization=args.gaussian_init,
        last_batch=args.last_batch, secret_batches=not args.public_batches,
        l2_regularization=args.l2_regularization,
    )
    if steps is not None:
        return TrainingRunDpEvent(steps=steps, **common)
    if getattr(args, "steps", None) is not None:
        return TrainingRunDpEvent(steps=args.steps, **common)
    return TrainingRunDpEvent.from_epochs(epochs=args.epochs, **common)


def _check_delta(args) -> float:
    return v.probability("target_delta", args.delta)


def cmd_epsilon(args) -> int:
    delta = _check_delta(args)
    report = HiddenStateAccountant(**_accountant_kwargs(args)).compose(_run(args)).explain(delta)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(report.to_table())
    return 0


def cmd_noise(args) -> int:
    delta = _check_delta(args)
    v.positive_float("target_epsilon", args.target_epsilon)
    result = calibrate_noise_multiplier(_run(args, noise=1.0), args.target_epsilon, delta, **_accountant_kwargs(args))
    out = {"noise_multiplier": result.noise_multiplier, "epsilon": result.epsilon, "delta": delta,
           "analysis": result.analysis, "evaluations": result.evaluations,
           "neighboring_relation": _relation(args)}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"noise multiplier {result.noise_multiplier:.4f} gives epsilon {result.epsilon:.4f} "
              f"at delta {delta:g} ({_relation(args)}), from {result.analysis} "
              f"[{result.evaluations} evaluations]")
    return 0


def cmd_epochs(args) -> int:
    delta = _check_delta(args)
    v.positive_float("target_epsilon", args.target_epsilon)
    run = _run(args, steps=steps_per_epoch(args.dataset_size, args.batch_size, args.sampling, args.last_batch))
    budget = max_epochs_within_budget(run, args.target_epsilon, delta, max_epochs=args.max_epochs,
                                      **_accountant_kwargs(args))
    out = {"epochs": budget.epochs, "unlimited": budget.unlimited, "epsilon": budget.epsilon,
           "limit_epsilon": _finite(budget.limit_epsilon), "delta": delta, "analysis": budget.analysis,
           "neighboring_relation": _relation(args)}
    if args.json:
        print(json.dumps(out))
    elif budget.unlimited:
        print(f"unlimited: {budget.analysis} stays at or below epsilon {budget.limit_epsilon:.4f} "
              f"(<= {args.target_epsilon:g}) at delta {delta:g} ({_relation(args)}) however long the run trains")
    else:
        print(f"{budget.epochs} epochs fit in epsilon {args.target_epsilon:g} at delta {delta:g} ({_relation(args)}) "
              f"(epsilon {budget.epsilon:.4f}, from {budget.analysis}); the bound tends to "
              f"{budget.limit_epsilon:.4f} for unbounded training")
    return 0


def _finite(x: float):
    return x if math.isfinite(x) else None


def _epoch_grid(max_epochs: float) -> List[float]:
    v.positive_float("max_epochs", max_epochs)
    grid = np.unique(np.round(np.geomspace(1, max(max_epochs, 1), 16)))
    return [float(e) for e in grid]


def cmd_plot(args) -> int:
    delta = _check_delta(args)
    run = _run(args, steps=steps_per_epoch(args.dataset_size, args.batch_size, args.sampling, args.last_batch))
    output = plot_path(args.output, "hsa_epsilon_vs_epochs.png")  # checked before the work
    curves = epsilon_curves(run, _epoch_grid(args.max_epochs), delta, **_accountant_kwargs(args))
    print(f"neighbouring relation: {_relation(args)}")
    print(curves.table())
    print(f"\nplot saved to {plot_epsilon_curves(curves, output)}")
    return 0


def cmd_audit(args) -> int:
    from hidden_state_accountants.audit import audit

    delta = _check_delta(args)
    run = _run(args)
    construction = args.construction or ("constrained" if args.diameter is not None else "strongly_convex")
    result = audit(run, construction=construction, repetitions=args.repetitions, delta=delta,
                   confidence=args.confidence, seed=args.seed, **_accountant_kwargs(args))
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        verdict = "consistent" if result.consistent else "INCONSISTENT: the reported bound is below the audit"
        print(f"audited lower bound {result.epsilon_lower:.4f} (confidence {result.confidence:g}, "
              f"{result.repetitions} runs per dataset, {construction} construction) <= reported "
              f"{result.epsilon_reported:.4f} from {result.analysis} at delta {delta:g}: {verdict}")
    return 0 if result.consistent else 1


def cmd_demo(args) -> int:
    d = DEMO
    geometry = LossGeometry.logistic_regression(d["feature_norm_bound"], d["l2_regularization"])
    run = TrainingRunDpEvent(
        dataset_size=d["dataset_size"], batch_size=d["batch_size"], steps=1,
        noise_multiplier=d["noise_multiplier"], clip_norm=d["clip_norm"],
        learning_rate=d["learning_rate"], sampling=d["sampling"], geometry=geometry)
    epochs = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    output = plot_path(args.output, "hsa_demo.png")
    curves = epsilon_curves(run, epochs, d["delta"])
    if args.json:
        print(json.dumps({"epochs": curves.epochs, "best": curves.best, "analyses": curves.epsilon,
                          "delta": curves.delta, "neighboring_relation": "REPLACE_ONE"}))
        plot_epsilon_curves(curves, output)
        return 0
    print("Embedded default: MNIST-scale L2-regularised logistic regression trained with DP-SGD")
    print(f"  n = {d['dataset_size']}, batch {d['batch_size']} in a fixed cyclic order, noise multiplier "
          f"{d['noise_multiplier']}, clip {d['clip_norm']}, lr {d['learning_rate']}, features clipped to "
          f"norm {d['feature_norm_bound']}, L2 {d['l2_regularization']}")
    print(f"  geometry (Ye & Shokri Prop. 5.2): m = {geometry.strong_convexity:g}, M = {geometry.smoothness:g}; "
          f"delta = {d['delta']:g}, REPLACE_ONE\n")
    print(curves.table())
    print("\nComposition (bok_thm4.4) charges every released iterate and keeps growing; the "
          "hidden-state bounds converge.")
    print(f"plot saved to {plot_epsilon_curves(curves, output, 'Embedded default: MNIST-scale logistic regression')}")
    return 0


COMMANDS = {"epsilon": cmd_epsilon, "noise": cmd_noise, "epochs": cmd_epochs, "plot": cmd_plot,
            "audit": cmd_audit, "demo": cmd_demo}


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """The package's warnings as one line on stderr (a command line has no source lines to show)."""
    if issubclass(category, HiddenStateWarning):
        print(f"hsa: warning: {message}", file=sys.stderr)
    else:
        _default_showwarning(message, category, filename, lineno, file, line)


_default_showwarning = warnings.showwarning


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return COMMANDS[args.command](args)
    except v.ParameterError as err:
        flag = FLAG_FOR_PARAMETER.get(err.parameter, err.parameter)
        message = str(err).split(": ", 1)[1] if ": " in str(err) else str(err)
        print(f"hsa: error: {flag}: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
