"""``calibrate_noise_multiplier`` when no analysis meets the target at its starting estimate.

The search then goes up with one analysis first. It took the *cheapest* one, which can be one that
does not apply to the run (epsilon infinite at every noise): a composition-only cyclic run, whose
estimate lands on the target's boundary, failed with "not reached with noise multipliers up to
4.978e+36" whenever its one applicable analysis took longer than ``CHEAP_SECONDS`` (20 ms: a loaded
machine). It must start with the most promising analysis, the one with the smallest epsilon there.
"""

import dataclasses
import time
import warnings

import pytest

from hidden_state_accountants import HiddenStateAccountant, TrainingRunDpEvent, calibrate_noise_multiplier
from hidden_state_accountants import calibration as cal
from hidden_state_accountants.analyses import registry


def test_search_starts_with_an_analysis_that_applies_when_it_is_slow(monkeypatch):
    run = TrainingRunDpEvent(
        dataset_size=60,
        batch_size=10,
        steps=18,
        noise_multiplier=1.0,
        clip_norm=1.0,
        learning_rate=0.5,
        sampling="cyclic",
    )  # no geometry: bok_thm4.4 alone applies
    target, delta = 4.0, 1e-5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        z0 = cal.noise_estimate(run, target, delta)
        assert HiddenStateAccountant().compose(run.replace(noise_multiplier=z0)).get_epsilon(delta) > target
        get = registry.get

        def slow_bok(name):  # the one applicable analysis costs more than CHEAP_SECONDS
            info = get(name)
            if name != "bok_thm4.4":
                return info

            def function(*args, **kwargs):
                time.sleep(2 * cal.CHEAP_SECONDS)
                return info.function(*args, **kwargs)

            return dataclasses.replace(info, function=function)

        monkeypatch.setattr(registry, "get", slow_bok)
        found = calibrate_noise_multiplier(run, target, delta)
        eps = HiddenStateAccountant().compose(run.replace(noise_multiplier=found.noise_multiplier)).get_epsilon(delta)
    assert found.analysis == "bok_thm4.4" and eps <= target
    assert found.noise_multiplier == pytest.approx(z0, rel=2e-3)
