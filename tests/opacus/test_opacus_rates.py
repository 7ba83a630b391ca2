"""Opacus' Poisson sample rate reaches the core exactly (issue 9, item 2).

Opacus reports its rate as a float (``1 / len(data_loader)``); the adapter used to turn it
into a fraction rounded up, which doubled about a third of the rates ``1/k`` (0.04 became
2/25) and made ``make_private_with_epsilon`` calibrate far more noise than needed.
"""

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
pytestmark = pytest.mark.torch

from opacus import PrivacyEngine  # noqa: E402
from opacus.accountants.utils import get_noise_multiplier  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import hidden_state_accountants.opacus as hso  # noqa: E402
from hidden_state_accountants import HiddenStateAccountant, TrainingRunDpEvent  # noqa: E402
from hidden_state_accountants.recording import CompositionFallbackWarning  # noqa: E402
from hidden_state_accountants.schedules import POISSON  # noqa: E402

DELTA = 1e-5
# (n, b) of common setups: MNIST/CIFAR sizes with usual batch sizes, and Opacus' own test rate
TYPICAL = [(60000, 256), (50000, 64), (60000, 600), (60000, 128), (50000, 1024), (100, 4), (100, 1), (1000, 1)]


def core_epsilon(n, b, q, steps, z):
    """The core's epsilon for Poisson sampling at rate ``q``, built directly."""
    run = TrainingRunDpEvent(
        dataset_size=n,
        batch_size=b,
        steps=steps,
        noise_multiplier=z,
        clip_norm=1.0,
        learning_rate=1.0,
        sampling=POISSON,
        sampling_probability=q,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompositionFallbackWarning)
        # Opacus' convention, the adapter's default for its Poisson loader
        return HiddenStateAccountant(neighboring_relation="ADD_OR_REMOVE_ONE").compose(run).get_epsilon(DELTA)


def adapter_epsilon(q, steps, z):
    acc = hso.OpacusHiddenStateAccountant()
    acc.history = [(z, q, steps)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompositionFallbackWarning)
        return acc.get_epsilon(DELTA)


def test_opacus_reference_setup_is_not_doubled():
    """Opacus' accountant tests use z = 1.5, q = 0.04, 2250 steps."""
    eps = adapter_epsilon(0.04, 2250, 1.5)
    assert eps == core_epsilon(100, 4, 0.04, 2250, 1.5)
    # ADD_OR_REMOVE_ONE (Opacus' convention): Opacus' PRV says 6.78, RDP 7.33; 17.31 is the REPLACE_ONE number
    assert eps == pytest.approx(6.77, abs=0.01)


def test_every_rate_one_over_k_reaches_the_event_exactly():
    acc = hso.OpacusHiddenStateAccountant()
    for k in range(2, 201):
        q = 1 / k
        acc.history = [(1.0, q, 50)]
        run = acc.training_run()
        assert run.sampling == POISSON and run.sampling_rate == q, k
    for n, b in TYPICAL:
        acc.history = [(1.0, b / n, 50)]
        assert acc.training_run().sampling_rate == b / n, (n, b)


@pytest.mark.parametrize("k", [2, 3, 7, 25, 50, 100, 199, 200])
def test_epsilon_is_the_cores_at_one_over_k(k):
    assert adapter_epsilon(1 / k, 60, 1.2) == core_epsilon(k, 1, 1 / k, 60, 1.2)


@pytest.mark.parametrize("n, b", TYPICAL)
def test_epsilon_is_the_cores_at_typical_rates(n, b):
    assert adapter_epsilon(b / n, 200, 1.0) == core_epsilon(n, b, b / n, 200, 1.0)


@pytest.mark.slow
def test_epsilon_is_the_cores_at_every_one_over_k():
    for k in range(2, 201):
        assert adapter_epsilon(1 / k, 60, 1.2) == core_epsilon(k, 1, 1 / k, 60, 1.2), k


def test_make_private_with_epsilon_calibrates_for_the_true_rate():
    n, b, epochs, target = 100, 4, 2, 3.0  # Opacus' rate 1/len(loader) = 0.04
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g))
    model = nn.Linear(3, 2)
    engine = PrivacyEngine(accountant="hidden_state")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompositionFallbackWarning)
        model, opt, loader = engine.make_private_with_epsilon(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(ds, batch_size=b),
            target_epsilon=target,
            target_delta=DELTA,
            epochs=epochs,
            max_grad_norm=1.0,
        )
        z_opacus = get_noise_multiplier(
            target_epsilon=target, target_delta=DELTA, sample_rate=0.04, epochs=epochs, accountant="hidden_state"
        )
    z = opt.noise_multiplier
    assert z == z_opacus
    # Opacus' search stops within 0.01 below the target: at the true rate, not at 2/25
    assert target - 0.01 <= core_epsilon(n, b, 0.04, epochs * 25, z) <= target
