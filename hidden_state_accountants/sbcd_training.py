"""What every DP-SBCD trainer shares, free of any framework: checks, schedule, seeds, accounting.

The PyTorch trainer (``hidden_state_accountants.pytorch.sbcd.DPSBCD``) and the Keras trainer
(``hidden_state_accountants.keras.sbcd.DPSBCD``) implement the updates of Algorithm 2 of
*Differentially Private Network Training under Hidden State Assumption* (ICLR 2025 submission,
arXiv:2407.08233) on their framework's tensors; everything their privacy rests on is decided
here, once:

* the options are checked (:meth:`SbcdTrainerBase._check_options`), the schedule by the core's
  rule (:func:`~hidden_state_accountants.analyses.sbcd.check_sbcd_schedule`);
* the batches come from a :class:`~hidden_state_accountants.schedules.BatchSchedule`: its
  :meth:`~hidden_state_accountants.schedules.BatchSchedule.partition` is the fixed partition
  the trainer visits in order every epoch;
* **seeds** follow the core's one rule (:mod:`hidden_state_accountants.schedules`):
  ``seed=None`` (the default) draws the partition's seed and the noise's seed from the
  operating system's cryptographic source, never from torch's, TensorFlow's or numpy's global
  generator; an integer seed is the caller's explicit choice. It fixes both the partition and
  the noise, so it must be kept as secret as the data: anyone who knows it can subtract the
  noise. :func:`noise_seed` derives the noise's seed as an independent stream of it;
* the run is turned into a :class:`~hidden_state_accountants.DpSbcdRunDpEvent` and accounted
  by :class:`~hidden_state_accountants.HiddenStateAccountant`.

>>> seed, secret = noise_seed(None)
>>> secret, 0 <= seed < 2**63
(True, True)
>>> noise_seed(7) == noise_seed(7), noise_seed(7)[1]
(True, False)
"""

from __future__ import annotations

import warnings
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from hidden_state_accountants import validation as v
from hidden_state_accountants.accountant import HiddenStateAccountant, PrivacyReport
from hidden_state_accountants.errors import HiddenStateWarning
from hidden_state_accountants.analyses.sbcd import (
    REGULARIZERS,
    VARIANTS,
    DpSbcdRunDpEvent,
    as_schedule,
    check_noise_value,
    check_sbcd_schedule,
    compress_noise,
)
from hidden_state_accountants.schedules import RANDOM, BatchSchedule, check_seed, draw_secret_seed

NOISE_STREAM = 1
"""Spawn key of the noise generator's seed within a caller's seed (the partition uses the seed
itself), so the two draws are independent."""

CALLER_SEED_NOTE = (
    "the trainer's seed was chosen by the caller: it fixes the batch partition and the noise, "
    "so this guarantee holds only while the seed stays as secret as the data"
)


def noise_seed(seed: Optional[int]) -> Tuple[int, bool]:
    """``(seed of the noise generator, whether it is secret)``.

    ``None`` draws a fresh secret seed (:func:`~hidden_state_accountants.schedules.draw_secret_seed`);
    an integer in ``[0, 2**63)`` is the caller's choice, from which an independent 63-bit stream
    is derived (``numpy.random.SeedSequence`` with spawn key :data:`NOISE_STREAM`).
    """
    if seed is None:
        return draw_secret_seed(), True
    s = check_seed(seed)
    state = np.random.SeedSequence(s, spawn_key=(NOISE_STREAM,)).generate_state(1, dtype=np.uint64)
    return int(state[0] >> np.uint64(1)), False


class SbcdTrainerBase:
    """What the PyTorch and Keras DP-SBCD trainers share: the checks, the batch schedule and
    the seeds, the training loop and the privacy methods.

    The trainer calls :meth:`_check_options` and :meth:`_set_layer_hyperparameters` in its
    constructor, visits ``batch_schedule.partition()`` (seeding its noise generator with
    ``noise_seed``), and supplies ``step()``, ``rho_eff``, the step counter ``_t`` and the noise
    actually used, ``_noise_history``.
    """

    _progress_label = "DP-SBCD"

    def _check_options(
        self, n: int, batch_size, sampling: str, regularizer: str, variant: str, gamma, seed: Optional[int]
    ) -> int:
        """Validates the choices that do not depend on the model, draws the batch schedule
        (:attr:`batch_schedule`) and the noise seed (:attr:`noise_seed`); returns the batch size."""
        n, b = check_sbcd_schedule(n, batch_size, sampling)
        for name, value, allowed in (("regularizer", regularizer, REGULARIZERS), ("variant", variant, VARIANTS)):
            if value not in allowed:
                raise v.ParameterError(name, f"must be one of {', '.join(allowed)}; got {value!r}")
        self.gamma = v.positive_float("gamma", gamma)
        self.regularizer, self.sampling, self.variant = regularizer, sampling, variant
        self.noise_seed, self.seed_is_secret = noise_seed(seed)
        # a fixed-order schedule takes no seed; the caller's seed then only seeds the noise
        self.batch_schedule = BatchSchedule(n, b, sampling, seed if sampling in RANDOM else None)
        self.batch_size, self.dataset_size = b, n
        self.steps_per_epoch = self.batch_schedule.steps_per_epoch
        return b

    def _set_layer_hyperparameters(
        self, num_layers: int, step_size, rho, regularization, radius, noise, paper_assumptions
    ) -> None:
        """Per-layer values (one for all, or one per layer) and the noise schedule."""
        self.num_layers = num_layers
        self.step_sizes = self._per_layer("step_size", step_size, v.positive_float)
        self.rho_x = self._per_layer("rho", rho, v.positive_float)
        self.lambdas = self._per_layer("regularization", regularization, v.nonnegative_float)
        self.radius = None if radius is None else self._per_layer("radius", radius, v.positive_float)
        if self.variant == "appendix_c" and self.radius is None:
            raise v.ParameterError("radius", "variant='appendix_c' needs a projection radius per block")
        self.schedule = as_schedule(noise)
        self.paper_assumptions = bool(paper_assumptions)

    def _per_layer(self, name, value, check) -> List[float]:
        if isinstance(value, (list, tuple)):
            vals = [check(name, x) for x in value]
            if len(vals) == 1:
                vals = vals * self.num_layers
            if len(vals) != self.num_layers:
                raise v.ParameterError(name, f"needs 1 or {self.num_layers} values (one per layer), got {len(vals)}")
            return vals
        return [check(name, value)] * self.num_layers

    def _warn_expansive_steps(self) -> None:
        """Warns for layers whose gradient step is expansive (needs ``rho_eff`` set)."""
        for d, (eta, r) in enumerate(zip(self.step_sizes, self.rho_eff)):
            beta = self.gamma * r * r
            if self.variant == "proximal_gradient" and eta * beta > 2.0 * (1.0 + 1e-9):
                warnings.warn(
                    f"layer {d}: step_size {eta:g} > 2/(gamma rho^2) = {2.0 / beta:.4g}: the gradient step "
                    "is expansive (L_F > 1): a one-block model's hidden-state bound grows exponentially",
                    HiddenStateWarning,
                    stacklevel=3,
                )

    def _noise_at(self, t: int) -> float:
        k, j = divmod(t, self.steps_per_epoch)
        return check_noise_value(self.schedule(self.step_sizes[0], k, j), k, j)

    def fit(self, epochs: int, progress: bool = True, callback: Optional[Callable] = None, desc: Optional[str] = None):
        """Runs ``epochs`` epochs with a progress bar (``callback(epoch, self)`` after each)."""
        epochs = v.positive_int("epochs", epochs)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=epochs * self.steps_per_epoch, desc=desc or self._progress_label, unit="step")
        for e in range(epochs):
            for _ in range(self.steps_per_epoch):
                self.step()
                if bar is not None:
                    bar.update(1)
            if callback is not None:
                callback(e, self)
        if bar is not None:
            bar.close()
        return self

    def privacy_event(self, steps: Optional[int] = None) -> DpSbcdRunDpEvent:
        """The run so far (``steps=None``) or a planned run of ``steps`` steps from the start."""
        if steps is None:
            if self._t == 0:
                raise ValueError("steps: no step has run yet; pass the planned number of steps")
            t, noise = self._t, list(self._noise_history)
        else:
            t = v.positive_int("steps", steps)
            noise = [self._noise_at(s) for s in range(t)]
        return DpSbcdRunDpEvent(
            dataset_size=self.dataset_size,
            batch_size=self.batch_size,
            steps=t,
            num_layers=self.num_layers,
            step_size=tuple(self.step_sizes),
            rho=tuple(self.rho_eff),
            noise=compress_noise(noise, self.steps_per_epoch),
            gamma=self.gamma,
            regularizer=self.regularizer,
            regularization=tuple(self.lambdas),
            sampling=self.sampling,
            variant=self.variant,
            radius=None if self.radius is None else tuple(self.radius),
            paper_assumptions=self.paper_assumptions,
        )

    def accountant(self, steps: Optional[int] = None) -> HiddenStateAccountant:
        return HiddenStateAccountant().compose(self.privacy_event(steps))

    def get_epsilon(self, delta: float, steps: Optional[int] = None) -> float:
        """Best valid epsilon for the run so far / planned: the composition bound, or for a
        one-block model the smaller of it and Thm 4.5."""
        return self.accountant(steps).get_epsilon(delta)

    def get_rdp(self, orders: Sequence[float], steps: Optional[int] = None):
        """RDP curve at ``orders`` (pointwise minimum of the applicable analyses)."""
        return HiddenStateAccountant(orders=orders).compose(self.privacy_event(steps)).get_rdp(orders)

    def explain(self, delta: float, steps: Optional[int] = None) -> PrivacyReport:
        """Every analysis with its epsilon; the notes say when the seed was the caller's."""
        report = self.accountant(steps).explain(delta)
        if not self.seed_is_secret:
            report.notes.append(CALLER_SEED_NOTE)
        return report


__all__ = ["SbcdTrainerBase", "noise_seed", "NOISE_STREAM", "CALLER_SEED_NOTE"]
