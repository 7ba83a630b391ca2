"""Opacus' own tests, run against ``"hidden_state"`` (issue 9, item 7).

Their code is imported from the installed ``opacus.tests`` package and run with the accountant
swapped, not copied:

* ``accountants_test``: the registry tests as they are; every ``AccountingTest`` method with
  ``RDPAccountant``/``GaussianAccountant``/``PRVAccountant``, ``create_accountant`` and
  ``get_noise_multiplier`` pointed at ``"hidden_state"``.
* ``privacy_engine_test``: every test class with ``PrivacyEngine()``'s default accountant
  switched to ``"hidden_state"`` (torchvision is stubbed when it is missing).

The only assertions not run are those of a specific epsilon or noise multiplier of Opacus'
accountants (:data:`UPSTREAM_VALUES`): this accountant is under REPLACE_ONE adjacency (Opacus'
are add/remove-one) and reports the best valid bound, so its numbers differ by design. Each such
assertion is replaced by the check that holds here: the epsilon is the core's for the same run,
or the calibrated noise meets the target within Opacus' tolerance.
"""

import importlib
import importlib.util
import sys
import types
import unittest
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
pytestmark = pytest.mark.torch

from opacus import PrivacyEngine  # noqa: E402
from opacus.accountants import create_accountant  # noqa: E402
from opacus.accountants import utils as opacus_utils  # noqa: E402
from opacus.accountants.utils import get_noise_multiplier  # noqa: E402
from torch import nn  # noqa: E402

import hidden_state_accountants.opacus as hso  # noqa: E402
from hidden_state_accountants import HiddenStateAccountant, TrainingRunDpEvent  # noqa: E402
from hidden_state_accountants.recording import CompositionFallbackWarning  # noqa: E402
from hidden_state_accountants.schedules import POISSON  # noqa: E402

upstream = pytest.importorskip("opacus.tests.accountants_test")


def core_epsilon(history, delta):
    """The core's epsilon for Poisson steps ``[(z, q, steps)]`` at Opacus' exact rate."""
    ((z, q, steps),) = history
    run = TrainingRunDpEvent(
        dataset_size=round(1 / q),
        batch_size=1,
        steps=steps,
        noise_multiplier=z,
        clip_norm=1.0,
        learning_rate=1.0,
        sampling=POISSON,
        sampling_probability=q,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompositionFallbackWarning)
        # the adapter's default for Opacus' Poisson loader: Opacus' own relation (issue 12)
        return HiddenStateAccountant(neighboring_relation="ADD_OR_REMOVE_ONE").compose(run).get_epsilon(delta)


# ------------------------------------------------------------------------ accountants_test
UPSTREAM_VALUES = {
    "test_rdp_accountant": ("assertAlmostEqual", "epsilon == 7.32911 is RDPAccountant's add/remove-one RDP bound"),
    "test_gdp_accountant": (
        "assertLess",
        "6.59 < epsilon < 6.6 is GaussianAccountant's add/remove-one CLT approximation (not an upper bound)",
    ),
    "test_prv_accountant": ("assertAlmostEqual", "epsilon == 6.77740 is PRVAccountant's add/remove-one number"),
    "test_get_noise_multiplier_rdp_epochs": (
        "assertAlmostEqual",
        "sigma == 1.416 is calibrated with the RDP accountant",
    ),
    "test_get_noise_multiplier_rdp_steps": (
        "assertAlmostEqual",
        "sigma == 1.3562 is calibrated with the RDP accountant",
    ),
    "test_get_noise_multiplier_prv_epochs": (
        "assertAlmostEqual",
        "sigma == 1.34766 is calibrated with the PRV accountant",
    ),
    "test_get_noise_multiplier_prv_steps": (
        "assertAlmostEqual",
        "sigma == 1.2915 is calibrated with the PRV accountant",
    ),
    "test_get_noise_multiplier_gdp": ("assertAlmostEqual", "sigma == 1.32324 is calibrated with the GDP accountant"),
    "test_accountant_load_state_dict": ("assertAlmostEqual", "epsilon == 7.32911 after resuming is RDPAccountant's"),
}
GENERIC = ["test_accountant_state_dict"]
SLOW = ["test_get_noise_multiplier_overshoot"]  # hypothesis over runs of up to 10**6 steps (seconds each)
CORE_JUMP = (
    "the core's Poisson epsilon is not continuous in sigma: below a noise level the PLD bound is "
    "refused (grid too coarse) and the much looser RDP bound takes over (q = 1e-4, 130000 steps, "
    "delta = 1e-4: 5.04 at sigma 0.4917, 281.8 at 0.4916), so Opacus' bisection never ends for "
    "targets in between"
)
REASON = (
    "hidden_state reports the best valid bound (under Opacus' ADD_OR_REMOVE_ONE, as Opacus' accountants, "
    "but from dp_accounting's PLD / the hidden-state analyses, not Opacus' own numerics); replaced by: the "
    "epsilon is the core's for the same history, or the calibrated sigma meets the target within Opacus' "
    "0.01 tolerance"
)


def test_every_upstream_accounting_test_is_covered():
    names = {n for n in dir(upstream.AccountingTest) if n.startswith("test_")}
    assert names == set(UPSTREAM_VALUES) | set(GENERIC) | set(SLOW)


@pytest.mark.parametrize("name", sorted(n for n in dir(upstream.AccountantRegistryTest) if n.startswith("test_")))
def test_upstream_registry(name):
    case = upstream.AccountantRegistryTest(name)
    getattr(case, name)()
    assert type(create_accountant("hidden_state")) is hso.OpacusHiddenStateAccountant  # still registered


class _Guarded(hso.OpacusHiddenStateAccountant):
    """Opacus' ``get_noise_multiplier`` bisects with no iteration limit, so it never returns if
    epsilon jumps across the target as sigma grows: fail instead of hanging (it needs < 60 calls)."""

    def get_epsilon(self, delta, *args, **kwargs):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls > 200:
            raise AssertionError(
                f"get_noise_multiplier does not converge: epsilon jumps across the target at history {self.history}"
            )
        return super().get_epsilon(delta, *args, **kwargs)


def _hidden_state_everywhere(monkeypatch, keep=()):
    monkeypatch.setattr(opacus_utils, "create_accountant", lambda mechanism: _Guarded())
    for cls in ("RDPAccountant", "GaussianAccountant", "PRVAccountant"):
        if cls not in keep:
            monkeypatch.setattr(upstream, cls, hso.OpacusHiddenStateAccountant)
    monkeypatch.setattr(upstream, "create_accountant", lambda mechanism: create_accountant("hidden_state"))

    def calibrate(**kwargs):
        kwargs["accountant"] = "hidden_state"
        return get_noise_multiplier(**kwargs)

    monkeypatch.setattr(upstream, "get_noise_multiplier", calibrate)


def _run(monkeypatch, name, intercept=None):
    """Runs one upstream test; ``intercept`` names the assertion method whose calls are
    collected instead of checked (the value assertions of UPSTREAM_VALUES)."""
    # the load test checks that GaussianAccountant refuses our state: keep that one real
    _hidden_state_everywhere(monkeypatch, keep=("GaussianAccountant",) if "load" in name else ())
    case = upstream.AccountingTest(name)
    calls = []
    if intercept:
        monkeypatch.setattr(case, intercept, lambda *args, **kwargs: calls.append(args))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompositionFallbackWarning)
        getattr(case, name)()
    return calls


@pytest.mark.parametrize(
    "name",
    GENERIC
    + [
        pytest.param(
            n,
            marks=[
                pytest.mark.slow,
                pytest.mark.xfail(reason=f"hypothesis may draw a target where {CORE_JUMP}", strict=False),
            ],
        )
        for n in SLOW
    ],
)
def test_upstream_accounting_generic(monkeypatch, name):
    assert _run(monkeypatch, name) == []


@pytest.mark.parametrize(
    "name", ["test_rdp_accountant", "test_gdp_accountant", "test_prv_accountant", "test_accountant_load_state_dict"]
)
def test_upstream_steps_to_epsilon(monkeypatch, name):
    method, _ = UPSTREAM_VALUES[name]
    calls = _run(monkeypatch, name, intercept=method)
    steps = int(90 // 0.04) if name in ("test_gdp_accountant", "test_prv_accountant") else int(90 / 0.04)  # as theirs
    expected = core_epsilon([(1.5, 0.04, steps)], 1e-5)
    # their epsilon (first argument, second for assertLess(6.59, eps)) is the core's for the same steps
    got = [args[1] if method == "assertLess" and i == 0 else args[0] for i, args in enumerate(calls)]
    assert got and all(eps == expected for eps in got)


@pytest.mark.parametrize("name", sorted(n for n in UPSTREAM_VALUES if "noise_multiplier" in n))
def test_upstream_get_noise_multiplier(monkeypatch, name):
    ((sigma, _expected_by_opacus, *_),) = _run(monkeypatch, name, intercept="assertAlmostEqual")
    steps = int(90 / 0.04) if "epochs" in name or "gdp" in name else 2000
    eps = core_epsilon([(sigma, 0.04, steps)], 1e-5)
    assert 8 - 0.01 <= eps <= 8  # Opacus' search: within epsilon_tolerance below the target


def test_calibration_converges_where_the_poisson_pld_gives_way(monkeypatch):
    """Opacus' get_noise_multiplier terminates at a target the overshoot test can draw. Under
    REPLACE_ONE it did not (CORE_JUMP); the adapter now accounts Opacus' Poisson loader under
    ADD_OR_REMOVE_ONE, whose PLD (dp_accounting's) has no such jump here (issue 12)."""
    monkeypatch.setattr(opacus_utils, "create_accountant", lambda mechanism: _Guarded())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompositionFallbackWarning)
        sigma = get_noise_multiplier(
            target_epsilon=9.11, target_delta=1e-4, sample_rate=1e-4, epochs=13, accountant="hidden_state"
        )
    assert 9.11 - 0.01 <= core_epsilon([(sigma, 1e-4, 130000)], 1e-4) <= 9.11


@pytest.mark.parametrize("name", sorted(UPSTREAM_VALUES))
def test_upstream_value_assertions_not_run(name):
    method, what = UPSTREAM_VALUES[name]
    pytest.skip(f"{name}: {method}({what}) cannot hold: {REASON}")


# --------------------------------------------------------------------- privacy_engine_test
class _FakeData(torch.utils.data.Dataset):
    """torchvision's ``FakeData``: random images (as tensors) and labels, the same for an index."""

    def __init__(self, size=1000, image_size=(3, 224, 224), num_classes=10, transform=None, random_offset=0):
        self.size, self.image_size, self.num_classes = size, image_size, num_classes
        self.transform, self.offset = transform, random_offset

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i + self.offset)
        x = torch.rand(self.image_size, generator=g)
        y = int(torch.randint(0, self.num_classes, (1,), generator=g))
        return (self.transform(x) if self.transform else x), y


class _Compose:
    def __init__(self, steps):
        self.steps = steps

    def __call__(self, x):
        for f in self.steps:
            x = f(x)
        return x


class _Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = torch.tensor(mean).view(-1, 1, 1), torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x):
        return (x - self.mean) / self.std


class _SmallBatchNormNet(nn.Module):
    """Stands in for ``resnet18``/``densenet121``: what the validator tests need is BatchNorm and a
    ``classifier``."""

    def __init__(self, weights=None):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
        )
        self.classifier = nn.Linear(32, 10)

    def forward(self, x):
        return self.classifier(self.features(x))


def _torchvision_stub():
    """The parts of torchvision that ``privacy_engine_test`` uses."""
    tv = types.ModuleType("torchvision")
    models, transforms, datasets = (types.ModuleType(f"torchvision.{m}") for m in ("models", "transforms", "datasets"))
    datasets.FakeData = _FakeData
    transforms.Compose, transforms.Normalize, transforms.ToTensor = _Compose, _Normalize, lambda: lambda x: x
    models.resnet18 = models.densenet121 = _SmallBatchNormNet
    tv.models, tv.transforms, tv.datasets = models, transforms, datasets
    return {
        "torchvision": tv,
        "torchvision.models": models,
        "torchvision.transforms": transforms,
        "torchvision.datasets": datasets,
    }


def _import_privacy_engine_test():
    if importlib.util.find_spec("torchvision") is not None:
        return importlib.import_module("opacus.tests.privacy_engine_test")
    stub = _torchvision_stub()
    saved = {k: sys.modules.get(k) for k in stub}
    sys.modules.update(stub)
    try:  # the stub is only seen by that import: the test module keeps its own references
        return importlib.import_module("opacus.tests.privacy_engine_test")
    finally:
        for k, mod in saved.items():
            if mod is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = mod


engine_tests = _import_privacy_engine_test()
ENGINE_CLASSES = sorted(
    name
    for name, obj in vars(engine_tests).items()
    if isinstance(obj, type)
    and issubclass(obj, unittest.TestCase)
    and issubclass(obj, engine_tests.BasePrivacyEngineTest)
)
FAST_CLASS = "PrivacyEngineCustomLayerTest"  # the cheapest model: run by default, the other classes are slow
SLOW_METHODS = {"test_compare_to_vanilla", "test_noise_level"}  # long hypothesis searches that never read epsilon


@pytest.fixture
def hidden_state_default(monkeypatch):
    """``PrivacyEngine()`` builds the hidden_state accountant."""
    monkeypatch.setitem(PrivacyEngine.__init__.__kwdefaults__, "accountant", "hidden_state")
    assert isinstance(PrivacyEngine().accountant, hso.OpacusHiddenStateAccountant)


def _engine_cases():
    for cls in ENGINE_CLASSES:
        for name in unittest.defaultTestLoader.getTestCaseNames(getattr(engine_tests, cls)):
            yield pytest.param(
                cls,
                name,
                id=f"{cls}.{name}",
                marks=() if cls == FAST_CLASS and name not in SLOW_METHODS else pytest.mark.slow,
            )


@pytest.mark.parametrize("cls, name", list(_engine_cases()))
def test_upstream_privacy_engine(hidden_state_default, cls, name):
    result = unittest.TestResult()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompositionFallbackWarning)  # unconfigured: composition by design
        getattr(engine_tests, cls)(name).run(result)
    if result.skipped:
        pytest.skip(f"skipped upstream: {result.skipped[0][1]}")
    problems = [text for _, text in result.errors + result.failures]
    assert result.testsRun == 1 and not problems, "\n".join(problems)
